//! The store for several hosts: one PostgreSQL database that every
//! instance shares, with the same guarantees as one process.
//!
//! # Driver
//! `tokio-postgres`. The engine is one sync implementation of every command
//! over a `Txn` (`store::engine`); this store runs that same engine,
//! unchanged, on a writer thread per connection, exactly as the SQLite store
//! does, instead of a second, async engine. A writer's connection is a
//! `session::Session`: the async client, driven by a small runtime that
//! the writer thread blocks on, so that requests known in advance (`BEGIN`
//! and the lock of the group's records; the group's writes and its
//! `COMMIT`) leave in one flush. Migrations and the `LISTEN` connection use
//! the blocking `postgres` client, the same driver's synchronous face.
//! Statements are prepared once per connection and cached; every
//! transaction groups the commands that waited for the writer (group
//! commit), so one round trip to commit serves them all.
//!
//! # Guarantees across instances
//! - **Caps, first come first served**: before an admission decision the
//!   engine locks the lane's row (`SELECT ... FROM lanes ... FOR UPDATE`,
//!   `LOCK_LANE` in `sql.rs`), then reaps, counts and decides in separate
//!   READ COMMITTED statements that each see every decision committed
//!   before the lock was granted. No `SKIP LOCKED`, no SERIALIZABLE.
//! - **Exactly-once reaps**: every read that leads to a write locks its
//!   rows; a second reaper waits, re-reads, and no longer finds a record
//!   the first one reaped.
//! - **One clock**: each transaction reads its "now" from the SQL function
//!   `inflight_now()`, the database's `clock_timestamp()`; hosts' clocks
//!   never decide a reap. A ledger built on another clock than the system's
//!   (a test's `FakeClock`) overrides it per transaction with
//!   `SET LOCAL inflight.now_ms`.
//! - **Waking waiters elsewhere**: a transaction that grants or frees a slot
//!   sends `pg_notify` before it commits; each instance keeps one `LISTEN`
//!   connection (reconnected when lost) and wakes its waiters, who also
//!   poll. `listen=false` turns the listener off (PgBouncer in transaction
//!   mode).
//! - **Migrations** are versioned (`inflight_schema`), run under
//!   `pg_advisory_lock`, and an instance refuses a schema newer than it.
//!
//! # URL
//! `postgres://user@host:port/db` (or `postgresql://`), with any parameter
//! the `postgres` client takes (`connect_timeout`, `application_name`, ...)
//! and these of the store's own:
//! - `schema=NAME`: the schema the tables live in (created if missing);
//!   the connection's default otherwise;
//! - `pool=N`: writer connections, 1 to 64. Each group commit shares one
//!   commit between every command waiting. With several writers, a group
//!   takes at most 32 commands and runs while the one before writes and
//!   commits, on another backend (`order::Order`), each writer
//!   counting into counter rows of its own, and the commands of this
//!   process still land in the order they were submitted, as the SQLite
//!   store lands them (a dropped handle's cancel lands before the snapshot
//!   asked for next);
//! - `listen=false`: no `LISTEN` connection; waiters poll.
//!
//! - `sslmode=require` (or `verify-ca`, `verify-full`): TLS, with the
//!   server's certificate verified, chain and host name, against the
//!   system's roots or the PEM file `sslrootcert=PATH` names. This is
//!   stricter than libpq's `require`, which does not verify: a ledger's
//!   connection is not one to give to whoever answers. `disable` and
//!   `prefer` (the default) connect without TLS.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::thread;
use std::time::Duration;

use tokio::sync::{oneshot, watch};

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::error::LedgerError;
use crate::store::sql::group::Published;
use crate::store_url::{PostgresUrl, Tls};

use super::sql::counts::PendingCounts;
use super::{Command, Reply, Store, StoreFuture};
use session::Session;

mod listen;
mod order;
mod schema;
mod session;
mod sql;
#[cfg(test)]
mod testing;
mod txn;
mod writer;

use txn::{Conn, Fault};
use writer::{write_loop, Job, Writer};

// Read from the URL, apart from the store so that `config` can check a URL
// without depending on it; public here, where they always were.
pub use crate::store_url::{CONNECT_TIMEOUT, DEFAULT_POOL};

// Connecting needs the store's sessions and statements, so it lives here,
// beside them, while reading the URL lives in `store_url`.
impl PostgresUrl {
    /// A new connection, set up for the store.
    fn connect(&self) -> Result<Conn, LedgerError> {
        let connected = match &self.tls {
            Tls::Off => Session::connect(&self.config, tokio_postgres::NoTls)?,
            Tls::On(tls) => Session::connect(&self.config, tls.clone())?,
        };
        let client = connected.map_err(connect_failed)?;
        let mut setup = vec![sql::SESSION.to_owned()];
        if let Some(schema) = &self.schema {
            setup.push(sql::use_schema(schema));
        }
        client
            .batch_execute(&setup.join("; "))
            .map_err(|err| Fault::of(&err).error("cannot set up a PostgreSQL connection", err))?;
        Ok(Conn::new(client, self.channel.clone()))
    }

    /// A new connection, as the server gives it.
    fn client(&self) -> Result<postgres::Client, LedgerError> {
        let config = postgres::Config::from(self.config.clone());
        let connected = match &self.tls {
            Tls::Off => config.connect(postgres::NoTls),
            Tls::On(tls) => config.connect(tls.clone()),
        };
        connected.map_err(connect_failed)
    }

    /// The key the migration lock is taken on.
    fn lock_key(&self) -> String {
        format!("inflight.migrate:{}", self.schema.as_deref().unwrap_or(""))
    }
}

/// A failed connection attempt as a ledger error: `unavailable` unless the
/// server itself refused (bad credentials, no such database).
fn connect_failed(err: postgres::Error) -> LedgerError {
    let fault = Fault::of(&err);
    let fault = if fault == Fault::Other && err.as_db_error().is_none() {
        Fault::Unavailable
    } else {
        fault
    };
    fault.error("cannot connect to PostgreSQL", err)
}

/// A ledger store in a PostgreSQL database, shared by every instance that
/// opens it.
pub struct PostgresStore {
    settings: Arc<PostgresUrl>,
    jobs: RwLock<Option<mpsc::Sender<Job>>>,
    writers: Mutex<Vec<thread::JoinHandle<()>>>,
    /// `true` once the writers have ended: what every close waits for, the
    /// first (which takes the writers to join) and any made meanwhile.
    closed: Arc<watch::Sender<bool>>,
    stop: Arc<AtomicBool>,
    /// The call histograms and the capacity watchers, which the writers
    /// publish to after each commit and the listener wakes.
    published: Arc<Published>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Connects to the database at `url`, migrates it (under an advisory
    /// lock, so that instances starting together take turns), recomputes
    /// the bounds of in-flight records under `config`, and starts the
    /// writers and the listener.
    ///
    /// # Errors
    /// `InvalidInput` for a bad URL; `Unavailable` when the server cannot
    /// be reached; `Storage` when the schema is newer than this build or
    /// cannot be migrated.
    pub fn open(url: &str, config: Arc<LedgerConfig>, clock: Arc<dyn Clock>) -> Result<Self, LedgerError> {
        let settings = Arc::new(PostgresUrl::parse(url)?);
        let first = off_runtime(|| schema::migrate(&settings, &config, clock.as_ref()))?;
        let (jobs, queue) = mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        let mut writers = Vec::with_capacity(settings.pool);
        let mut first = Some(first);
        let published = Arc::new(Published::default());
        let order = Arc::new(order::Order::of(settings.pool));
        for index in 0..settings.pool {
            let writer = Writer {
                settings: Arc::clone(&settings),
                conn: first.take(),
                config: Arc::clone(&config),
                clock: Arc::clone(&clock),
                published: Arc::clone(&published),
                order: Arc::clone(&order),
                // At most 64 writers (`pool`).
                shard: index as i16,
            };
            let queue = Arc::clone(&queue);
            let handle = thread::Builder::new()
                .name(format!("inflight-pg-{index}"))
                .spawn(move || write_loop(writer, &queue))
                .map_err(|err| LedgerError::storage("cannot start a PostgreSQL writer thread", err))?;
            writers.push(handle);
        }
        let stop = Arc::new(AtomicBool::new(false));
        if settings.listen {
            let (settings, published, stop) =
                (Arc::clone(&settings), Arc::clone(&published), Arc::clone(&stop));
            thread::Builder::new()
                .name("inflight-pg-listen".into())
                .spawn(move || listen::listen_loop(&settings, &published.watchers, &stop))
                .map_err(|err| LedgerError::storage("cannot start the PostgreSQL listener", err))?;
        }
        Ok(Self {
            settings,
            jobs: RwLock::new(Some(jobs)),
            writers: Mutex::new(writers),
            closed: Arc::new(watch::Sender::new(false)),
            stop,
            published,
        })
    }

    /// How many writer connections it keeps.
    pub fn pool(&self) -> usize {
        self.settings.pool
    }

    /// Whether it keeps a `LISTEN` connection.
    pub fn listens(&self) -> bool {
        self.settings.listen
    }
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Store for PostgresStore {
    crate::store::sql::group::answered_from_published!();

    fn execute(&self, command: Command) -> StoreFuture {
        let (reply, answer) = oneshot::channel();
        let sent = match &*self
            .jobs
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(jobs) => jobs.send(Job::Run(command, reply)).is_ok(),
            None => false,
        };
        StoreFuture::pending(async move {
            if !sent {
                return Err(LedgerError::closed());
            }
            answer.await.map_err(|_| LedgerError::closed())?
        })
    }

    fn close(&self) -> StoreFuture {
        self.stop.store(true, Ordering::SeqCst);
        // The writers answer what is queued, then find the queue closed.
        drop(
            self.jobs
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(),
        );
        let writers = std::mem::take(
            &mut *self
                .writers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let mut closed = self.closed.subscribe();
        if !writers.is_empty() {
            let done = Arc::clone(&self.closed);
            let joined = thread::Builder::new()
                .name("inflight-pg-close".into())
                .spawn(move || {
                    for writer in writers {
                        let _ = writer.join();
                    }
                    done.send_replace(true);
                });
            if joined.is_err() {
                self.closed.send_replace(true);
            }
        }
        StoreFuture::pending(async move {
            // The sender lives in the store and its joining thread: never
            // dropped before it says `true`.
            let _ = closed.wait_for(|closed| *closed).await;
            Ok(Reply::Closed)
        })
    }

    fn recheck_within(&self) -> Duration {
        // With its listener, another instance's grant or freed slot wakes
        // the waiters at once; without it (PgBouncer in transaction mode)
        // polling is all they have.
        if self.settings.listen {
            super::RECHECK_HEARD
        } else {
            super::RECHECK_UNHEARD
        }
    }
}

/// Bulk-loads `count` settled records, completed over the hour before
/// `completed_at`, with their counters, straight into the database at
/// `url` (migrated first): for benchmarks that need a large history fast.
/// Not for production use.
///
/// # Errors
/// As [`PostgresStore::open`], and `Storage` when a write fails.
#[doc(hidden)]
pub fn seed_history(
    url: &str,
    count: usize,
    completed_at: crate::domain::Timestamp,
) -> Result<(), LedgerError> {
    use crate::domain::query;
    use crate::domain::record::ActivityId;

    let settings = PostgresUrl::parse(url)?;
    let config = LedgerConfig::default();
    off_runtime(|| {
        let mut conn = schema::migrate(&settings, &config, &crate::clock::SystemClock)?;
        let failed = |err: postgres::Error| LedgerError::storage("cannot seed history", err);
        let mut counts = PendingCounts::default();
        conn.client.batch_execute(sql::BEGIN).map_err(failed)?;
        let mut done = 0;
        while done < count {
            let batch = (count - done).min(10_000);
            let (mut ids, mut enqueued, mut started, mut completed) = (
                Vec::with_capacity(batch),
                Vec::with_capacity(batch),
                Vec::with_capacity(batch),
                Vec::with_capacity(batch),
            );
            for i in done..done + batch {
                let at = completed_at.sub_millis(i as i64 % 3_600_000);
                ids.push(ActivityId::new().to_string());
                enqueued.push(at.as_millis() - 20);
                started.push(at.as_millis() - 10);
                completed.push(at.as_millis());
                counts.complete(query::completion_minute(at));
            }
            conn.client
                .execute(sql::SEED_RECORDS, &[&ids, &enqueued, &started, &completed])
                .map_err(failed)?;
            done += batch;
        }
        conn.client.batch_execute(sql::COMMIT).map_err(failed)?;
        let (aggregate, totals) = super::seeded_history_totals(count, completed_at)?;
        counts.totals.insert(aggregate, totals);
        txn::write_counts(&mut conn, &mut counts)
            .map_err(|unflushed| unflushed.into_error("cannot update counters"))?;
        conn.client.batch_execute(sql::ANALYZE).map_err(failed)
    })
}

/// Runs `work` on a thread of its own: the blocking client runs a runtime
/// of its own for each call, which must not be nested in the caller's
/// (opening a store from async code).
pub(crate) fn off_runtime<T: Send>(work: impl FnOnce() -> T + Send) -> T {
    thread::scope(|scope| match scope.spawn(work).join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}
