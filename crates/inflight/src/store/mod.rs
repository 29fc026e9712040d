//! Stores: where records and counters live.
//!
//! [`Store`] is the seam. Every store runs the same engine (the private
//! `store::engine`, which sequences the domain's rules) inside its own
//! transactions, so the memory, SQLite and later PostgreSQL stores cannot
//! disagree about a rule: they differ only in how they persist and index.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::domain::capacity::Capacity;
use crate::domain::counters::ReapedCounts;
use crate::domain::effect::Effect;
use crate::domain::labels::Label;
use crate::domain::owner::{Owner, OwnerId};
use crate::domain::record::{ActivityId, ActivityRecord, LaneKey};
use crate::domain::snapshot::{Snapshot, SnapshotOptions};
use crate::domain::transition::{NewActivity, Transition};
use crate::error::{ErrorKind, LedgerError};
use crate::stats::CallSnapshot;
use crate::store_url::{read_url, StoreUrl};

pub(crate) mod engine;
pub mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
mod slow;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) mod sql;
#[cfg(feature = "sqlite")]
pub mod sqlite;

// What a store URL says, apart from the stores so that `config` can check a
// URL without depending on them; public here, where it always was.
#[cfg(feature = "postgres")]
pub use crate::store_url::client_tls;
pub use crate::store_url::{check_url, redacted_url, Synchronous, DEFAULT_URL};

pub use memory::MemoryStore;
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
pub use slow::{GroupsRun, SlowWork, SLOW_WORK};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;

/// What a store calls when capacity may have come back on a lane
/// ([`Store::watch_capacity`]): with the lane whose slot or place in line
/// came free, or `None` when any lane's may have.
pub type Wake = Arc<dyn Fn(Option<&LaneKey>) + Send + Sync>;

/// What a store shows each end it committed ([`Store::watch_ends`]): the
/// record as the command left it, and the effect, one that
/// [`Effect::marks_end`] names.
pub type EndWatch = Arc<dyn Fn(&Arc<ActivityRecord>, &Effect) + Send + Sync>;

/// Those watching a store's capacity ([`Store::watch_capacity`]), and what
/// they are told: one wake-up for each slot or place in line that a
/// committed command freed ([`Capacity::Freed`]), whatever the store.
/// A grant wakes no one here: the waiter admitted passes its wake-up on.
/// And those watching its records' ends ([`Store::watch_ends`]).
#[derive(Default)]
pub(crate) struct Watchers {
    wakes: RwLock<Vec<Wake>>,
    ends: RwLock<Vec<EndWatch>>,
    /// Whether `ends` has any: checked on every command, without a lock.
    watching_ends: AtomicBool,
}

impl Watchers {
    pub(crate) fn add(&self, wake: Wake) {
        self.wakes
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push(wake);
    }

    pub(crate) fn add_end_watch(&self, watch: EndWatch) {
        self.ends
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push(watch);
        self.watching_ends.store(true, Ordering::Release);
    }

    /// Whether anyone watches ends: a store keeps them for
    /// [`Watchers::ended`] only then.
    pub(crate) fn watching_ends(&self) -> bool {
        self.watching_ends.load(Ordering::Acquire)
    }

    /// A committed command did `effect` to `record`; shown to the watchers
    /// of ends when the effect [marks an end](Effect::marks_end).
    pub(crate) fn ended(&self, record: &Arc<ActivityRecord>, effect: &Effect) {
        if effect.marks_end() && self.watching_ends() {
            for watch in self.ends.read().unwrap_or_else(PoisonError::into_inner).iter() {
                watch(record, effect);
            }
        }
    }

    /// Capacity may have come back on `lane`, or on any lane (`None`).
    pub(crate) fn wake(&self, lane: Option<&LaneKey>) {
        for wake in self.wakes.read().unwrap_or_else(PoisonError::into_inner).iter() {
            wake(lane);
        }
    }

    /// A committed command changed `lane`'s capacity by `change`.
    pub(crate) fn changed(&self, lane: &LaneKey, change: Capacity) {
        if change == Capacity::Freed {
            self.wake(Some(lane));
        }
    }
}

/// A request to a store. Each runs atomically, at the time the store reads
/// from its clock once the transaction holds the write lock, so that the
/// order of timestamps is the order in which commands took effect.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Command {
    /// Create a record.
    Begin {
        /// The validated request.
        new: NewActivity,
    },
    /// Start, settle or cancel a record.
    Transition {
        /// The record.
        id: ActivityId,
        /// What to do.
        transition: Transition,
    },
    /// Refine the model of a record in flight
    /// ([`refined_model`](crate::domain::transition::refined_model)).
    Refine {
        /// The record.
        id: ActivityId,
        /// The model it was dispatched to, as the caller spelled it.
        model: String,
    },
    /// Read one record (reaping it if it is past its bound).
    Get {
        /// The record.
        id: ActivityId,
    },
    /// Reap every record past its bound.
    Reap,
    /// Reap, then report.
    Snapshot {
        /// What to report.
        options: SnapshotOptions,
    },
    /// Delete at most `limit` records settled or reaped longer ago than the
    /// retention period.
    Prune {
        /// The most records to delete in this transaction.
        limit: usize,
    },
    /// Report what the store holds.
    Stats,
    /// Register an owner with a lease.
    RegisterOwner {
        /// What it calls itself.
        name: Label,
        /// Its lease's time-to-live.
        ttl_ms: i64,
    },
    /// Renew an owner's lease.
    RenewOwner {
        /// The owner.
        id: OwnerId,
    },
    /// Release an owner's lease and cancel its in-flight records.
    ReleaseOwner {
        /// The owner.
        id: OwnerId,
    },
}

/// A store's answer to a [`Command`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Reply {
    /// The record after a begin, transition or get, shared: it travels to
    /// the caller through several layers, and a pointer moves for free.
    Record(Arc<ActivityRecord>),
    /// What a reap pass reaped.
    Reaped(ReapedCounts),
    /// A snapshot.
    Snapshot(Box<Snapshot>),
    /// An owner after a register, renew or release.
    Owner(Box<Owner>),
    /// How many records a prune deleted.
    Pruned(usize),
    /// What the store holds.
    Stats(StoreStats),
    /// The store is closed: every command submitted before landed.
    Closed,
}

/// What a store holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreStats {
    /// Records stored, in flight or not.
    pub stored_records: i64,
}

/// Generates `Reply::into_*`, one accessor per variant the ledger expects.
macro_rules! reply_accessors {
    ($($name:ident => $variant:ident($value:ident) -> $ty:ty = $unwrap:expr),+ $(,)?) => {
        impl Reply {
            $(
                pub(crate) fn $name(self) -> Result<$ty, LedgerError> {
                    match self {
                        Self::$variant($value) => Ok($unwrap),
                        other => Err(unexpected(&other)),
                    }
                }
            )+
        }
    };
}

reply_accessors! {
    into_record => Record(record) -> Arc<ActivityRecord> = record,
    into_reaped => Reaped(counts) -> ReapedCounts = counts,
    into_owner => Owner(owner) -> Owner = *owner,
    into_pruned => Pruned(count) -> usize = count,
    into_stats => Stats(stats) -> StoreStats = stats,
    into_snapshot => Snapshot(snapshot) -> Snapshot = *snapshot,
}

fn unexpected(reply: &Reply) -> LedgerError {
    LedgerError::new(
        ErrorKind::Storage,
        format!("store answered with an unexpected reply: {reply:?}"),
    )
}

/// The future a store returns for a command: already resolved when the
/// store answered on the spot (the memory store), so the hot path allocates
/// no future, or waiting on the store's own machinery (SQLite's writer).
#[must_use = "the reply is lost unless the future is awaited (the command itself is submitted)"]
pub struct StoreFuture(Answer);

enum Answer {
    Ready(Option<Result<Reply, LedgerError>>),
    Pending(Pin<Box<dyn Future<Output = Result<Reply, LedgerError>> + Send + 'static>>),
}

impl StoreFuture {
    /// A reply that is already known.
    pub fn ready(reply: Result<Reply, LedgerError>) -> Self {
        Self(Answer::Ready(Some(reply)))
    }

    /// A reply that `future` will produce.
    pub fn pending(future: impl Future<Output = Result<Reply, LedgerError>> + Send + 'static) -> Self {
        Self(Answer::Pending(Box::pin(future)))
    }
}

impl Future for StoreFuture {
    type Output = Result<Reply, LedgerError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            Answer::Ready(reply) => Poll::Ready(reply.take().expect("StoreFuture polled after it resolved")),
            Answer::Pending(future) => future.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for StoreFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.0 {
            Answer::Ready(_) => "ready",
            Answer::Pending(_) => "pending",
        };
        f.debug_tuple("StoreFuture").field(&state).finish()
    }
}

/// Where a ledger keeps its records.
///
/// Sealed: only the stores of this crate implement it. A store runs the one
/// engine (`store::engine`) over its own transactions and answers the
/// engine's questions exactly as [`crate::domain::query`] defines them,
/// which `tests/differential.rs` checks against a reference model. That
/// inner seam is private while it settles, and a store outside the crate
/// could only reimplement the rules, which is what this design forbids.
/// New stores (PostgreSQL next) join behind a feature.
///
/// # Contract
/// - A command is submitted when `execute` is called, not when the future is
///   first polled, and dropping the future does not withdraw it. This is what
///   lets a dropped handle record its cancel from `Drop`.
/// - The future resolves only once the command's effects are durable (for a
///   persistent store).
/// - Each command runs atomically, even against other processes sharing the
///   same database.
pub trait Store: sealed::Sealed + Send + Sync + fmt::Debug + 'static {
    /// Submits `command`; the future resolves with its reply.
    fn execute(&self, command: Command) -> StoreFuture;

    /// Closes the store once every command submitted before this call has
    /// landed, and releases what it holds (a writer thread, a connection);
    /// the future resolves with [`Reply::Closed`] then. Commands submitted
    /// later fail with [`ErrorKind::Closed`]. A store with nothing to flush
    /// or release (the memory store) answers at once and keeps serving.
    fn close(&self) -> StoreFuture {
        StoreFuture::ready(Ok(Reply::Closed))
    }

    /// The queue-wait and execution histograms of the starts and settles
    /// this store committed for this process, by lane and class. A store
    /// keeps them beside its commands, so that observing one costs no lock
    /// of its own.
    fn call_stats(&self) -> CallSnapshot {
        CallSnapshot::default()
    }

    /// Asks the store to call `wake` whenever capacity may have come back
    /// on a lane: for each slot or place in line that a command it
    /// committed freed and, on PostgreSQL, when another instance sharing
    /// the database granted or freed one (its notifications), so that this
    /// process's waiters ask again at once rather than at their next poll.
    fn watch_capacity(&self, wake: Wake);

    /// Asks the store to call `watch` after each command it commits, for
    /// each record that command ended (settled, cancelled, reaped) or
    /// brought back (a resurrection), with the record as it left it. Never
    /// for a command undone. Called on the store's writer (or the caller's
    /// task, for the memory store), in commit order: `watch` must not
    /// block. Only this process's commands are shown.
    fn watch_ends(&self, watch: EndWatch);

    /// The longest a start waiting in line goes without asking again when
    /// nothing woke it: the net for capacity freed where this process does
    /// not hear of it. [`RECHECK_UNHEARD`] by default, for a store that
    /// other processes may change unheard (a SQLite file several processes
    /// share); a store that hears them ([`Store::watch_capacity`]) needs it
    /// only for a notification lost while its listener reconnects.
    fn recheck_within(&self) -> Duration {
        RECHECK_UNHEARD
    }

    /// The store's work past [`SLOW_WORK`] (a group of commands, a
    /// checkpoint) that ran at some time between `from` and `to`, among the
    /// latest it kept: what a slow request may have waited on. None for a
    /// store whose commands run on the caller's task (the memory store).
    fn slow_work(&self, _from: Instant, _to: Instant) -> Vec<SlowWork> {
        Vec::new()
    }

    /// The groups of commands this store ran since it opened, with their
    /// time in all; zero for a store without groups (the memory store).
    fn groups_run(&self) -> GroupsRun {
        GroupsRun::default()
    }
}

/// How soon a start waiting in line asks again, unwoken, on a store that
/// other processes may change without this one hearing of it.
pub const RECHECK_UNHEARD: Duration = Duration::from_millis(50);
/// How soon it asks again on a store that hears of other processes'
/// grants and freed slots: at most a second late after a lost
/// notification, without every waiter asking the database 20 times a
/// second.
pub const RECHECK_HEARD: Duration = Duration::from_secs(1);

mod sealed {
    /// Implemented by this crate's stores only.
    pub trait Sealed {}
    impl Sealed for super::MemoryStore {}
    #[cfg(feature = "sqlite")]
    impl Sealed for super::SqliteStore {}
    #[cfg(feature = "postgres")]
    impl Sealed for super::PostgresStore {}
}

/// Opens the store named by `url` under `config`.
///
/// - `memory:` keeps everything in this process.
/// - `sqlite://PATH` (relative to the working directory) or
///   `sqlite:///ABSOLUTE/PATH` is the embedded default; the file is created
///   when missing. `?synchronous=normal` (or `full`, the default) sets its
///   durability ([`Synchronous`]).
///
/// - `postgres://user@host:port/db` (or `postgresql://`) is a database
///   that several hosts share; it needs the `postgres` feature. Its
///   parameters are described in the `store::postgres` module docs.
///
/// # Errors
/// An unknown scheme, query parameter or value is
/// [`ErrorKind::InvalidInput`], named; a database that cannot be opened or
/// migrated is [`ErrorKind::Storage`]; a database server that cannot be
/// reached is [`ErrorKind::Unavailable`].
pub fn open(
    url: &str,
    config: Arc<LedgerConfig>,
    clock: Arc<dyn Clock>,
) -> Result<Arc<dyn Store>, LedgerError> {
    match read_url(url)? {
        StoreUrl::Memory => Ok(Arc::new(MemoryStore::new(config, clock))),
        #[cfg(feature = "sqlite")]
        StoreUrl::Sqlite { path, synchronous } => Ok(Arc::new(SqliteStore::open_with(
            path,
            synchronous,
            config,
            clock,
        )?)),
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres => Ok(Arc::new(PostgresStore::open(url, config, clock)?)),
        // Refused by `read_url` without the feature.
        #[allow(unreachable_patterns)]
        _ => Err(LedgerError::invalid(format!(
            "store URL {:?} needs a store this build lacks",
            redacted_url(url)
        ))),
    }
}

/// Asserts that a SQL store keeps every statement in its `sql.rs`: none of
/// `files` (name, text) holds a string that starts with one of `keywords`,
/// and every statement `sql_rs` declares is among the `listed` its plan
/// check reads. Shared by the SQLite and PostgreSQL stores' tests.
#[cfg(all(test, any(feature = "sqlite", feature = "postgres")))]
pub(crate) fn assert_sql_only_in_sql_rs(
    store: &str,
    files: &[(&str, &str)],
    keywords: &[&str],
    sql_rs: &str,
    listed: usize,
) {
    for (file, text) in files {
        for keyword in keywords {
            assert!(
                !text.contains(&format!("\"{keyword}")),
                "src/store/{store}/{file} holds SQL ({keyword}); move it to sql.rs"
            );
        }
    }
    let declared = sql_rs
        .lines()
        .filter(|line| line.starts_with("pub(super) const ") && line.contains(": &str"))
        .count();
    assert_eq!(
        listed, declared,
        "a statement of {store}/sql.rs is missing from STATEMENTS"
    );
}

/// The aggregate and the totals that `count` records of a benchmark's bulk
/// loader (`seed_history` of the SQLite and PostgreSQL stores) count in:
/// settled with success after a 10 ms wait and 10 ms of execution, the last
/// at `completed_at`. One definition, so that both loaders agree.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn seeded_history_totals(
    count: usize,
    completed_at: crate::domain::Timestamp,
) -> Result<
    (
        (
            crate::domain::labels::ActivityLabels,
            crate::domain::Priority,
            crate::domain::Admission,
        ),
        crate::domain::Totals,
    ),
    LedgerError,
> {
    let n = i64::try_from(count).unwrap_or(i64::MAX);
    let labels = crate::domain::labels::ActivityLabels::validate(&crate::domain::labels::RawLabels {
        service: "bench-history",
        provider: "ollama",
        class: Some("embedding"),
        operation_stage: Some("history"),
        model: Some("nomic-embed-text"),
    })?;
    let totals = crate::domain::Totals {
        succeeded: n,
        queue_wait_count: n,
        queue_wait_sum_ms: 10 * n,
        queue_wait_max_ms: 10,
        execution_count: n,
        execution_sum_ms: 10 * n,
        execution_max_ms: 10,
        last_seen_at: Some(completed_at),
        ..crate::domain::Totals::default()
    };
    Ok((
        (
            labels,
            crate::domain::Priority::Batch,
            crate::domain::Admission::Queued,
        ),
        totals,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;

    fn opened(url: &str) -> Result<Arc<dyn Store>, LedgerError> {
        open(
            url,
            Arc::new(LedgerConfig::default()),
            Arc::new(FakeClock::at(crate::Timestamp::MIN)),
        )
    }

    #[test]
    fn a_store_url_shows_no_password() {
        for (url, shown) in [
            (
                "postgres://app:s3cret@db:5432/ledger",
                "postgres://app:***@db:5432/ledger",
            ),
            ("postgresql://app:s3cret@db", "postgresql://app:***@db"),
            (
                "postgres://app@db/ledger?password=s3cret&sslmode=disable",
                "postgres://app@db/ledger?password=***&sslmode=disable",
            ),
            ("postgres://app@db/ledger", "postgres://app@db/ledger"),
            (
                "sqlite://inflight.db?synchronous=normal",
                "sqlite://inflight.db?synchronous=normal",
            ),
            ("memory:", "memory:"),
        ] {
            assert_eq!(redacted_url(url), shown, "{url}");
        }
        let err = opened("postgress://app:s3cret@db/ledger").unwrap_err();
        assert!(!err.message().contains("s3cret"), "{err}");
    }

    #[test]
    fn a_store_url_names_what_is_wrong_with_it() {
        let message = |url: &str| opened(url).unwrap_err().to_string();
        assert!(message("mysql://x").contains("unsupported store URL"));
        #[cfg(not(feature = "postgres"))]
        assert!(message("postgres://x").contains("needs the PostgreSQL store"));
        #[cfg(feature = "postgres")]
        assert!(message("postgres://h/db?pool=x").contains("pool \"x\""));
        assert!(message("sqlite://").contains("needs a file path"));
        assert!(message("sqlite://x.db?journal=wal").contains("unknown parameter \"journal=wal\""));
        #[cfg(feature = "sqlite")]
        assert!(message("sqlite://x.db?synchronous=off")
            .contains("synchronous: \"off\" is not one of full, normal"));
        #[cfg(not(feature = "sqlite"))]
        assert!(message("sqlite://x.db").contains("needs the SQLite store"));
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn a_sqlite_url_takes_its_durability() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!(
            "sqlite://{}?synchronous=normal",
            dir.path().join("x.db").display()
        );
        opened(&url).unwrap();
        assert!(dir.path().join("x.db").exists());
    }
}
