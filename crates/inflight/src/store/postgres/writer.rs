//! The writer threads: a few per process (the pool), each owning one
//! connection. Commands that arrive while a writer's transaction is being
//! written are grouped into its next one (group commit), and each is
//! acknowledged only once that transaction committed.
//!
//! A group first reads and locks every record its commands name, in one
//! statement; its commands then read those from memory. It runs without
//! savepoints, its record writes deferred to one statement before any read
//! of `activities` and before the commit. One that meets a storage failure
//! is rolled back and run again with a savepoint per command, each write
//! sent at once; one whose deferred writes did not land as expected (an id
//! taken) is run again with each write sent at once, so that the command
//! at fault is told. One that meets
//! a deadlock (lane locks taken in different orders by two groups) or a
//! serialization failure is rolled back and run again whole. A connection
//! lost mid-transaction fails its group as `unavailable` and is opened
//! again for the next one, so the store recovers by itself when the server
//! returns; one found lost by the group's `BEGIN` is replaced at once.

use std::collections::BTreeSet;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::domain::record::LaneKey;
use crate::domain::timestamp::Timestamp;
use crate::error::{ErrorKind, LedgerError};
use crate::store::engine;
use crate::store::sql::counts::PendingCounts;
use crate::store::sql::group::Landed;
use crate::store::sql::group::{
    self, Batch, Committed, Failed, GroupTxn, Isolation, Published, Ran, Savepoint, MAX_GROUP,
};
use crate::store::{Command, Reply};
use crate::store_url::PostgresUrl;

use super::order::{Done, Order, Turn, EARLIER_WAIT};
use super::txn::{self, Conn, Fault, PgTxn, Records, Unflushed};
use super::{listen, sql};

/// The most commands a group takes when several writers share the turn:
/// enough to share a commit, few enough to leave the next writer a group
/// whose writes run beside this one's.
const SHARED_GROUP: usize = 32;
/// What the writer threads are asked to do.
pub(super) enum Job {
    /// Run a command and answer it.
    Run(Command, oneshot::Sender<Result<Reply, LedgerError>>),
}

/// One writer: its connection (opened again when lost) and where it takes
/// jobs from.
pub(super) struct Writer {
    pub(super) settings: Arc<PostgresUrl>,
    pub(super) conn: Option<Conn>,
    pub(super) config: Arc<LedgerConfig>,
    pub(super) clock: Arc<dyn Clock>,
    /// The call histograms and the capacity watchers, published to after
    /// each commit.
    pub(super) published: Arc<Published>,
    /// The turn the writers of this store take to run their groups.
    pub(super) order: Arc<Order>,
    /// Which counter rows this writer adds to: its index in the pool.
    pub(super) shard: i16,
}

pub(super) fn write_loop(mut writer: Writer, queue: &Mutex<mpsc::Receiver<Job>>) {
    let mut last_group = 1;
    let order = Arc::clone(&writer.order);
    let most = if order.shared { SHARED_GROUP } else { MAX_GROUP };
    loop {
        let mut turn = Turn::take(&order);
        let batch = {
            // One writer gathers a group at a time; the others run theirs.
            let Ok(queue) = queue.lock() else { return };
            let Ok(first) = queue.recv() else { return };
            let mut batch = Batch::default();
            take(&mut batch, first);
            drain(&queue, &mut batch, most);
            batch.wait_for_callers(last_group, |batch, left| match queue.recv_timeout(left) {
                Ok(job) => {
                    take(batch, job);
                    drain(&queue, batch, most);
                    true
                }
                Err(_) => false,
            });
            batch
        };
        last_group = batch.len().max(1);
        batch.run(|commands| writer.run_group_in(commands, &mut turn));
        drop(turn);
    }
}

fn take(batch: &mut Batch, job: Job) {
    let Job::Run(command, reply) = job;
    batch.push(command, reply);
}

fn drain(queue: &mpsc::Receiver<Job>, batch: &mut Batch, most: usize) {
    while batch.len() < most {
        match queue.try_recv() {
            Ok(job) => take(batch, job),
            Err(_) => return,
        }
    }
}

impl Writer {
    /// The connection, opened (again) when there is none or it was lost.
    fn connection(&mut self) -> Result<&mut Conn, LedgerError> {
        if self.conn.as_ref().is_none_or(|conn| conn.client.is_closed()) {
            self.conn = None;
            self.conn = Some(self.settings.connect()?);
        }
        let conn = self.conn.as_mut().expect("connected above");
        conn.shard = self.shard;
        Ok(conn)
    }

    /// Runs `commands` in one transaction and answers each, as the only
    /// group of its own order.
    #[cfg(test)]
    pub(super) fn run_group(&mut self, commands: Vec<Command>) -> Vec<Result<Reply, LedgerError>> {
        let order = Order::default();
        let mut turn = Turn::take(&order);
        self.run_group_in(commands, &mut turn)
    }

    /// Runs `commands` in one transaction, in `turn`, and answers each.
    fn run_group_in(
        &mut self,
        commands: Vec<Command>,
        turn: &mut Turn<'_>,
    ) -> Vec<Result<Reply, LedgerError>> {
        let published = Arc::clone(&self.published);
        group::run_group("PostgreSQL", commands, true, &published, |commands, attempt| {
            if attempt.yielded {
                // Rolled back: no lock of this group is held while it waits.
                if let Some(previous) = turn.previous() {
                    previous.wait();
                }
            }
            self.run_transaction(commands, attempt.isolation, attempt.defer, turn)
        })
    }

    /// Runs `commands` in one transaction and commits it; rolled back when
    /// it fails.
    fn run_transaction(
        &mut self,
        commands: Vec<Command>,
        isolation: Isolation,
        defer: bool,
        turn: &mut Turn<'_>,
    ) -> Result<Committed, Failed> {
        let override_now = (!self.clock.is_system()).then(|| self.clock.now());
        let config = Arc::clone(&self.config);
        let ids = Records::lock_ids(commands.iter().filter_map(|command| match command {
            Command::Transition { id, .. } | Command::Refine { id, .. } | Command::Get { id } => Some(*id),
            _ => None,
        }));
        // A connection lost while it idled (the server restarted, a proxy
        // cut it) is found out by the first request sent on it. Nothing was
        // done yet: the group begins once more on a new connection rather
        // than fail, so that after an outage each writer does not fail one
        // group of its own.
        let mut opened = self.conn.as_ref().is_none_or(|conn| conn.client.is_closed());
        let begun = loop {
            let conn = self.connection().map_err(Failed::Transaction)?;
            match begin(conn, override_now, &ids) {
                Err((Fault::Unavailable, _)) if !opened && conn.client.is_closed() => opened = true,
                begun => break begun,
            }
        };
        let conn = self.conn.as_mut().expect("connected above");
        // A failed lock (a record held past `lock_timeout` elsewhere) leaves
        // the transaction open and aborted: it is rolled back below, as a
        // failure of any later statement is.
        let run = begun
            .map_err(transaction_failure)
            .and_then(|begun| run_commands(conn, &config, commands, isolation, defer, &begun, turn));
        if run.is_err() {
            conn.forget_uncommitted();
        }
        if run.is_err() && !conn.client.is_closed() && !conn.ended {
            if let Err(err) = conn.client.batch_execute(sql::ROLLBACK) {
                tracing::error!(error = %err, "PostgreSQL rollback failed");
            }
        }
        run
    }
}

/// A transaction just opened.
pub(super) struct Begun {
    /// Its "now", from the one clock.
    pub(super) now: Timestamp,
    /// The rows `LOCK_RECORDS` read and locked.
    locked: Vec<postgres::Row>,
}

/// Opens a transaction and reads its "now" from the one clock
/// (`inflight_now()`), overridden by `at` when the ledger runs on a clock
/// of its own (a test's); reads and locks the records `ids`
/// ([`Records::lock_ids`]) with `LOCK_RECORDS` in the same round trip.
pub(super) fn begin(
    conn: &mut Conn,
    at: Option<Timestamp>,
    ids: &[String],
) -> Result<Begun, (Fault, LedgerError)> {
    let text = match at {
        None => std::borrow::Cow::Borrowed(sql::BEGIN_NOW),
        Some(at) => std::borrow::Cow::Owned(sql::BEGIN_AT.replace("{}", &at.as_millis().to_string())),
    };
    let failed = |context: &'static str| {
        move |err: postgres::Error| {
            let fault = Fault::of(&err);
            (fault, fault.error(context, err))
        }
    };
    let (messages, locked) = if ids.is_empty() {
        (conn.client.simple_query(&text), Ok(Vec::new()))
    } else {
        let statement = conn
            .prepare(sql::LOCK_RECORDS)
            .map_err(failed("cannot read records"))?;
        // Sent together: if the BEGIN failed, the lock ran alone as a
        // read, and its answer is not used.
        conn.client.pipeline(&text, &statement, &[&ids])
    };
    conn.ended = false;
    let messages = messages.map_err(failed("cannot begin a transaction"))?;
    let locked = locked.map_err(failed("cannot read records"))?;
    messages
        .iter()
        .find_map(|message| match message {
            postgres::SimpleQueryMessage::Row(row) => row
                .get(0)
                .and_then(|now| now.parse().ok())
                .map(Timestamp::from_millis),
            _ => None,
        })
        .map(|now| Begun { now, locked })
        .ok_or_else(|| {
            (
                Fault::Other,
                LedgerError::new(ErrorKind::Storage, "inflight_now() returned no time"),
            )
        })
}

fn control(conn: &mut Conn, sql: &'static str) -> Result<(), (Fault, LedgerError)> {
    conn.client.batch_execute(sql).map_err(|err| {
        let fault = Fault::of(&err);
        (fault, fault.error(sql, err))
    })
}

fn transaction_failure((fault, err): (Fault, LedgerError)) -> Failed {
    match fault {
        Fault::Retry => Failed::Retry(err),
        _ => Failed::Transaction(err),
    }
}

/// The body of a transaction, from its first command to its commit.
fn run_commands(
    conn: &mut Conn,
    config: &LedgerConfig,
    commands: Vec<Command>,
    isolation: Isolation,
    defer: bool,
    begun: &Begun,
    turn: &mut Turn<'_>,
) -> Result<Committed, Failed> {
    // Deferred only without savepoints: a command undone alone must not
    // leave writes behind in memory, nor take others' with it.
    let mut records = Records::new(defer && isolation == Isolation::Whole);
    records.locked(&begun.locked);
    let mut outcome = {
        let mut group = PgGroup {
            conn: &mut *conn,
            records: &mut records,
            config,
            now: begun.now,
            previous: turn.previous(),
        };
        group::run_commands(&mut group, commands, isolation)?
    };
    // The lanes whose capacity the group changed, for other instances.
    let changed: BTreeSet<LaneKey> = outcome
        .landed
        .iter()
        .flatten()
        .filter_map(Landed::capacity)
        .map(|(lane, _)| lane)
        .collect();
    // The group's deferred writes and its counters, in one round trip,
    // behind its notification (if a slot was granted or freed). A failure
    // of its records names no command, so the group runs again with a
    // savepoint per command to find it. The COMMIT goes in the same round
    // trip (the statement fails, and the COMMIT rolls back, when a write
    // missed), unless an earlier group has not ended yet: then it waits
    // for that end (see `Order`) and for the writes' answer. The turn is
    // handed on as the writes are sent.
    let had_records = records.has_pending();
    // With the earlier groups ended (always, with one writer), nothing
    // holds the COMMIT back: it goes in the writes' round trip.
    let committing = turn.previous().is_none_or(Done::has_ended);
    turn.hand_on();
    let notice = (!changed.is_empty()).then(|| listen::notice(&changed));
    let last = txn::Last {
        notify: notice.as_deref(),
        commit: committing,
    };
    let written = txn::write_group(conn, &mut records, &mut outcome.counts, last);
    written.map_err(|unflushed| match unflushed {
        Unflushed::Unexpected if had_records => Failed::Redo,
        Unflushed::Failed(err) if had_records && Fault::of(&err) == Fault::Other => {
            Failed::Command(Fault::Other.error("cannot write records", err))
        }
        unflushed => unwritten(unflushed, "cannot write records and counters"),
    })?;
    if !committing {
        if let Some(previous) = turn.previous() {
            if !previous.wait_for(EARLIER_WAIT) {
                return Err(Failed::Yield);
            }
        }
        conn.ended = true;
        control(conn, sql::COMMIT).map_err(transaction_failure)?;
    }
    Ok((outcome.results, outcome.landed))
}

/// A group's transaction on a writer's connection.
struct PgGroup<'g> {
    conn: &'g mut Conn,
    records: &'g mut Records,
    config: &'g LedgerConfig,
    now: Timestamp,
    /// The end of the earlier groups, which reads wait for.
    previous: Option<&'g Done>,
}

impl GroupTxn for PgGroup<'_> {
    fn command(&mut self, command: Command) -> Ran {
        let mut txn = PgTxn::new(self.conn, self.records);
        txn.previous = self.previous;
        let result = engine::execute(&mut txn, self.config, command, self.now);
        let fault = txn.fault;
        let ran = Ran {
            counts: std::mem::take(&mut txn.counts),
            landed: std::mem::take(&mut txn.landed),
            faulted: fault.is_some(),
            ..Ran::of(Ok(Reply::Closed))
        };
        match fault {
            Some(Fault::Retry) => Ran::aborted(Failed::Retry(result.err().unwrap_or_else(deadlock))),
            Some(Fault::Unavailable) => {
                Ran::aborted(Failed::Transaction(result.err().unwrap_or_else(unavailable)))
            }
            Some(Fault::Redo) => Ran::aborted(Failed::Redo),
            Some(Fault::Yield) => Ran::aborted(Failed::Yield),
            _ => Ran { result, ..ran },
        }
    }

    fn savepoint(&mut self, step: Savepoint) -> Result<(), Failed> {
        let sql = match step {
            Savepoint::Open => sql::SAVEPOINT,
            Savepoint::Release => sql::RELEASE,
            Savepoint::RollBack => sql::ROLLBACK_TO,
        };
        control(self.conn, sql).map_err(transaction_failure)
    }

    fn forget(&mut self) {
        // What it changed is undone; the rows stay locked.
        self.records.forget();
        self.conn.forget_uncommitted();
    }

    fn write_counts(&mut self, counts: &mut PendingCounts) -> Result<(), Failed> {
        txn::write_counts(self.conn, counts)
            .map_err(|unflushed| unwritten(unflushed, "cannot update counters"))
    }
}

/// A failed write of counters alone: the whole transaction fails.
fn unwritten(unflushed: Unflushed, context: &str) -> Failed {
    match unflushed {
        Unflushed::Failed(err) => transaction_failure((Fault::of(&err), Fault::of(&err).error(context, err))),
        Unflushed::Unexpected => Failed::Transaction(LedgerError::new(
            ErrorKind::Storage,
            format!("{context}: a write did not land"),
        )),
        Unflushed::Uncommitted(err) => {
            transaction_failure((Fault::of(&err), Fault::of(&err).error("cannot commit", err)))
        }
        Unflushed::Unnotified(err) => {
            transaction_failure((Fault::of(&err), Fault::of(&err).error("cannot notify", err)))
        }
    }
}

fn deadlock() -> LedgerError {
    LedgerError::new(ErrorKind::Storage, "deadlock")
}

fn unavailable() -> LedgerError {
    LedgerError::new(ErrorKind::Unavailable, "PostgreSQL is unavailable")
}

#[cfg(test)]
mod tests {
    use super::super::testing::{
        TestDatabase, BACKEND_PID, BEGIN_WITH_KEY_ELSEWHERE, BREAK_CLASS, HELD_COMMIT, HELD_COMMITS,
        HOLD_RECORD, INSERT_RECORD, LOCK_WAITS, RELEASE_COMMIT_LOCK, TAKE_COMMIT_LOCK, TERMINATE_BACKEND,
    };
    use super::super::PostgresStore;
    use super::*;
    use crate::clock::FakeClock;
    use crate::domain::idempotency::Idempotency;
    use crate::domain::record::{ActivityId, ActivityRecord, State};
    use crate::domain::transition::{BeginExtras, NewActivity, Transition};
    use postgres::types::ToSql;
    use std::thread;
    use std::time::{Duration, Instant};

    const NOW: Timestamp = Timestamp::from_millis(1_786_000_000_000);

    /// A writer on a fresh, migrated schema, run by hand: each call of
    /// `run_group` is one group, as the write loop would form it.
    fn writer(database: &TestDatabase) -> Writer {
        let url = database.store_url("listen=false");
        let config = Arc::new(LedgerConfig::default());
        let clock: Arc<dyn Clock> = Arc::new(FakeClock::at(NOW));
        drop(PostgresStore::open(&url, Arc::clone(&config), Arc::clone(&clock)).unwrap());
        Writer {
            settings: Arc::new(PostgresUrl::parse(&url).unwrap()),
            conn: None,
            config,
            clock,
            published: Arc::default(),
            order: Arc::default(),
            shard: 0,
        }
    }

    /// A writer that has begun one record, connected by that group.
    fn writer_with_record(database: &TestDatabase) -> (Writer, NewActivity) {
        let mut writer = writer(database);
        let new = NewActivity::fixture("chat");
        assert!(writer.run_group(vec![begin(&new)])[0].is_ok());
        (writer, new)
    }

    /// A store with `pool` writers on the schema, on a fake clock, and a
    /// runtime to await its answers on.
    fn store_of_writers(database: &TestDatabase, pool: usize) -> (PostgresStore, tokio::runtime::Runtime) {
        let config = Arc::new(LedgerConfig::default());
        let clock: Arc<dyn Clock> = Arc::new(FakeClock::at(NOW));
        let url = database.store_url(&format!("pool={pool}&listen=false"));
        let store = PostgresStore::open(&url, config, clock).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        (store, runtime)
    }

    fn begin(new: &NewActivity) -> Command {
        Command::Begin { new: new.clone() }
    }

    fn transition(id: ActivityId, transition: Transition) -> Command {
        Command::Transition { id, transition }
    }

    fn start() -> Transition {
        Transition::Start { at: None }
    }

    fn settle() -> Transition {
        Transition::Settle {
            success: true,
            failure_stage: None,
            at: None,
            retry_after_ms: None,
            usage: Default::default(),
        }
    }

    fn record(result: &Result<Reply, LedgerError>) -> Arc<ActivityRecord> {
        match result {
            Ok(Reply::Record(record)) => Arc::clone(record),
            other => panic!("not a record: {other:?}"),
        }
    }

    /// The state stored for `id`, read outside the writer.
    fn stored_state(database: &TestDatabase, id: ActivityId) -> Option<String> {
        database
            .client()
            .query(sql::GET_RECORD, &[&id.to_string()])
            .unwrap()
            .first()
            .map(|row| row.get(8))
    }

    #[test]
    fn a_turn_comes_when_the_one_before_is_handed_on_and_ends_after_it() {
        let order = Order::default();
        let mut first = Turn::take(&order);
        std::thread::scope(|scope| {
            let (took, taken) = mpsc::channel();
            let (waited, ended) = mpsc::channel();
            let order = &order;
            scope.spawn(move || {
                let second = Turn::take(order);
                took.send(()).unwrap();
                second.previous().expect("a turn before").wait();
                waited.send(()).unwrap();
            });
            let a_while = Duration::from_millis(50);
            assert!(taken.recv_timeout(a_while).is_err(), "taken while held");
            first.hand_on();
            taken.recv_timeout(Duration::from_secs(10)).unwrap();
            // Its reads wait until the first group has ended.
            assert!(ended.recv_timeout(a_while).is_err(), "read before the end");
            drop(first);
            ended.recv_timeout(Duration::from_secs(10)).unwrap();
        });
    }

    #[test]
    fn several_writers_land_commands_in_the_order_they_were_submitted() {
        // Four writers, kept busy: every command must still see each one
        // submitted before it, as with one writer (a dropped handle's
        // cancel, not awaited, lands before the read asked for next).
        use crate::store::Store;
        let database = TestDatabase::new();
        let (store, runtime) = store_of_writers(&database, 4);
        runtime.block_on(async {
            for round in 0..40_i64 {
                let new = NewActivity::fixture("chat");
                let id = new.activity_id;
                store.execute(begin(&new)).await.unwrap();
                let cancel = Transition::Cancel {
                    reason: None,
                    at: None,
                };
                let cancelled = store.execute(transition(id, cancel));
                let others: Vec<_> = (0..6)
                    .map(|_| store.execute(begin(&NewActivity::fixture("chat"))))
                    .collect();
                let snapshot = store
                    .execute(Command::Snapshot {
                        options: crate::domain::snapshot::SnapshotOptions::default(),
                    })
                    .await;
                let Ok(Reply::Snapshot(snapshot)) = snapshot else {
                    panic!("not a snapshot: {snapshot:?}");
                };
                // Every begin submitted so far, but the cancelled ones.
                assert_eq!(snapshot.total_in_flight, 6 * (round + 1), "round {round}");
                let cancel = Transition::Cancel {
                    reason: None,
                    at: None,
                };
                let next = NewActivity::fixture("chat");
                store.execute(begin(&next)).await.unwrap();
                let cancelled_next = store.execute(transition(next.activity_id, cancel));
                let got = store.execute(Command::Get { id: next.activity_id }).await;
                assert_eq!(record(&got).state, State::Cancelled, "round {round}");
                cancelled_next.await.unwrap();
                cancelled.await.unwrap();
                for other in others {
                    other.await.unwrap();
                }
            }
        });
    }

    /// Holds the commits of groups that add to the counters until the
    /// returned session runs `RELEASE_COMMIT_LOCK`.
    fn hold_commits(database: &TestDatabase) -> postgres::Client {
        let mut client = database.client();
        client.batch_execute(HELD_COMMIT).unwrap();
        client.batch_execute(TAKE_COMMIT_LOCK).unwrap();
        client
    }

    /// A store of two writers whose first group, a begin, waits at its
    /// commit for a lock `holder` holds.
    struct HeldBegin {
        store: PostgresStore,
        runtime: tokio::runtime::Runtime,
        holder: postgres::Client,
        new: NewActivity,
        begun: crate::store::StoreFuture,
    }

    fn held_begin(database: &TestDatabase) -> HeldBegin {
        use crate::store::Store;
        let (store, runtime) = store_of_writers(database, 2);
        let mut holder = hold_commits(database);
        let new = NewActivity::fixture("chat");
        let begun = store.execute(begin(&new));
        await_count(&mut holder, HELD_COMMITS, &[], 1);
        HeldBegin {
            store,
            runtime,
            holder,
            new,
            begun,
        }
    }

    /// Waits until `count` (a query of one count) says at least `least`.
    fn await_count(client: &mut postgres::Client, count: &str, params: &[&(dyn ToSql + Sync)], least: i64) {
        let give_up = Instant::now() + Duration::from_secs(30);
        while client.query_one(count, params).unwrap().get::<_, i64>(0) < least {
            assert!(Instant::now() < give_up, "never {least}: {count}");
            thread::sleep(Duration::from_millis(2));
        }
    }

    /// The backend of `writer`'s connection.
    fn backend_pid(writer: &mut Writer) -> i32 {
        let conn = writer.conn.as_mut().expect("connected");
        conn.client.query_one(BACKEND_PID, &[]).unwrap().get(0)
    }

    #[test]
    fn a_read_beyond_its_records_waits_for_an_earlier_group_still_committing() {
        // Two writers. The first group's commit is held (a deferred
        // trigger on the counter row it adds to waits for a lock the test
        // holds); a `Get` of the record it begins, submitted meanwhile, is
        // the other writer's group. The record is not among those it could
        // lock (uncommitted, it is invisible), so its read must wait for
        // that commit, and see the record rather than answer "not found".
        use crate::store::Store;
        let database = TestDatabase::new();
        let HeldBegin {
            store,
            runtime,
            mut holder,
            new,
            begun,
        } = held_begin(&database);
        let mut got = Box::pin(store.execute(Command::Get { id: new.activity_id }));
        // Held past EARLIER_WAIT: the read's group, waiting for this one,
        // yields and runs again once it has committed; it never answers
        // before that.
        let early = runtime.block_on(async { tokio::time::timeout(2 * EARLIER_WAIT, got.as_mut()).await });
        assert!(
            early.is_err(),
            "answered before the earlier group committed: {early:?}"
        );
        holder.batch_execute(RELEASE_COMMIT_LOCK).unwrap();
        let got = runtime.block_on(got);
        assert_eq!(record(&got).state, State::Waiting);
        runtime.block_on(begun).unwrap();
    }

    #[test]
    fn a_second_close_waits_for_the_commands_queued_before_it_like_the_first() {
        // A group's commit is held: its writer cannot end. A close made
        // while the first still waits must wait too, not answer at once
        // because the first took the writers to join.
        use crate::store::Store;
        let database = TestDatabase::new();
        let HeldBegin {
            store,
            runtime,
            mut holder,
            begun,
            ..
        } = held_begin(&database);
        let first = store.close();
        let mut second = Box::pin(store.close());
        let early = runtime
            .block_on(async { tokio::time::timeout(Duration::from_millis(300), second.as_mut()).await });
        assert!(
            early.is_err(),
            "the second close answered before the held commit: {early:?}"
        );
        holder.batch_execute(RELEASE_COMMIT_LOCK).unwrap();
        runtime.block_on(async {
            assert!(matches!(second.await, Ok(Reply::Closed)));
            assert!(matches!(first.await, Ok(Reply::Closed)));
            assert_eq!(
                record(&begun.await).state,
                State::Waiting,
                "landed before either close answered"
            );
            // And once closed, a close answers at once.
            assert!(matches!(store.close().await, Ok(Reply::Closed)));
        });
    }

    #[test]
    fn a_later_group_holding_a_record_an_earlier_group_runs_again_for_yields_it() {
        // Two writers share the turn. The first group starts `record` and
        // begins an id that another connection is inserting, uncommitted:
        // its writes wait for that transaction. The second group, handed
        // the turn meanwhile, cancels `record` and waits for the first
        // group's lock on it. Then the insert commits: the first group's
        // writes missed, it rolls back and runs again, and must lock
        // `record`, which the second group now holds while it waits for the
        // first to end before it commits. Unless that wait is bounded, the
        // first group fails once its wait for the lock times out
        // (`lock_timeout`), and the start it was asked for is lost.
        let database = TestDatabase::new();
        let order = Arc::new(Order::of(2));
        let mut first = writer(&database);
        first.order = Arc::clone(&order);
        let mut second = writer(&database);
        second.order = Arc::clone(&order);
        second.shard = 1;
        let new = NewActivity::fixture("chat");
        let id = new.activity_id;
        assert!(first.run_group(vec![begin(&new)])[0].is_ok());
        // Connected, so that the test can tell when each waits.
        assert!(second.run_group(vec![Command::Get { id }])[0].is_ok());
        let backends = [backend_pid(&mut first), backend_pid(&mut second)];
        let taken = NewActivity::fixture("chat");
        let mut other = database.client();
        let mut inserting = other.transaction().unwrap();
        inserting
            .execute(INSERT_RECORD, &[&taken.activity_id.to_string()])
            .unwrap();
        let (answered, answers) = mpsc::channel();
        let (has_turn, first_has_turn) = mpsc::channel();
        let first_answered = answered.clone();
        let first_order = Arc::clone(&order);
        thread::spawn(move || {
            let mut turn = Turn::take(&first_order);
            has_turn.send(()).unwrap();
            let results = first.run_group_in(vec![transition(id, start()), begin(&taken)], &mut turn);
            drop(turn);
            first_answered.send((1, results)).unwrap();
        });
        first_has_turn.recv().unwrap();
        thread::spawn(move || {
            let mut turn = Turn::take(&order);
            let cancel = Transition::Cancel {
                reason: None,
                at: None,
            };
            let results = second.run_group_in(vec![transition(id, cancel)], &mut turn);
            drop(turn);
            answered.send((2, results)).unwrap();
        });
        // Both wait: the first for the insert, the second for the record.
        await_count(&mut database.client(), LOCK_WAITS, &[&backends.as_slice()], 2);
        inserting.commit().unwrap();
        let mut results = [None, None];
        for _ in 0..2 {
            let (group, got) = answers
                .recv_timeout(Duration::from_secs(10))
                .expect("both groups end");
            results[group - 1] = Some(got);
        }
        let [Some(first), Some(second)] = results else {
            unreachable!()
        };
        assert_eq!(record(&first[0]).state, State::Executing);
        assert_eq!(first[1].as_ref().unwrap_err().kind(), ErrorKind::Conflict);
        // The cancel landed after the start, as submitted.
        let cancelled = record(&second[0]);
        assert_eq!(cancelled.state, State::Cancelled);
        assert!(cancelled.started_at.is_some(), "{cancelled:?}");
        assert_eq!(stored_state(&database, id).as_deref(), Some("cancelled"));
    }

    #[test]
    fn a_group_on_a_connection_lost_while_idle_begins_again_on_a_new_one() {
        let database = TestDatabase::new();
        let (mut writer, new) = writer_with_record(&database);
        let conn = writer.conn.as_ref().expect("connected by the first group");
        let pid: i32 = conn.client.query(BACKEND_PID, &[]).unwrap()[0].get(0);
        database.client().execute(TERMINATE_BACKEND, &[&pid]).unwrap();
        // Nothing was begun on the lost connection: no caller is told of it.
        let got = writer.run_group(vec![Command::Get { id: new.activity_id }]);
        assert_eq!(record(&got[0]).state, State::Waiting);
    }

    #[test]
    fn a_group_whose_records_stay_locked_elsewhere_fails_and_the_next_runs() {
        let database = TestDatabase::new();
        let (mut writer, new) = writer_with_record(&database);
        // Waits a short while for a lock, not the store's 4 s.
        let conn = writer.conn.as_mut().expect("connected by the first group");
        conn.client.batch_execute("SET lock_timeout = '200ms'").unwrap();
        let mut other = database.client();
        let mut held = other.transaction().unwrap();
        held.execute(HOLD_RECORD, &[&new.activity_id.to_string()])
            .unwrap();
        let results = writer.run_group(vec![transition(new.activity_id, start())]);
        assert_eq!(results[0].as_ref().unwrap_err().kind(), ErrorKind::Unavailable);
        held.rollback().unwrap();
        // The failed group's transaction was rolled back: the connection
        // serves the next group.
        let results = writer.run_group(vec![transition(new.activity_id, start())]);
        assert_eq!(record(&results[0]).state, State::Executing);
    }

    #[test]
    fn a_group_that_notifies_and_whose_write_missed_runs_again_and_notifies() {
        // On a capped lane a start notifies, in the round trip of the
        // writes and the COMMIT. A begin of a taken id in the same group
        // makes the writes fail: the COMMIT rolls back, and the group runs
        // again writing each record at once; the start lands, and the
        // notification with it.
        let database = TestDatabase::new();
        let mut writer = writer(&database);
        writer.config = Arc::new(LedgerConfig::default().with_lane_cap("kb::ollama", 2).unwrap());
        let (waiting, taken) = (NewActivity::fixture("chat"), NewActivity::fixture("chat"));
        writer.run_group(vec![begin(&waiting), begin(&taken)]);
        let mut listener = database.client();
        listener
            .batch_execute(&sql::listen(&writer.settings.channel))
            .unwrap();
        let results = writer.run_group(vec![transition(waiting.activity_id, start()), begin(&taken)]);
        assert_eq!(record(&results[0]).state, State::Executing);
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Conflict);
        assert_eq!(
            stored_state(&database, waiting.activity_id).as_deref(),
            Some("executing")
        );
        let heard = postgres::fallible_iterator::FallibleIterator::next(
            &mut listener.notifications().timeout_iter(Duration::from_secs(5)),
        )
        .unwrap();
        assert!(heard.is_some(), "the start's notification was not delivered");
    }

    #[test]
    fn a_group_that_changes_one_record_twice_stores_the_last() {
        let database = TestDatabase::new();
        let mut writer = writer(&database);
        let new = NewActivity::fixture("chat");
        let id = new.activity_id;
        let results = writer.run_group(vec![begin(&new)]);
        assert_eq!(record(&results[0]).state, State::Waiting);
        // Start and settle in one group: the settle sees the start.
        let results = writer.run_group(vec![transition(id, start()), transition(id, settle())]);
        assert_eq!(record(&results[0]).state, State::Executing);
        assert_eq!(record(&results[1]).state, State::Succeeded);
        assert_eq!(stored_state(&database, id).as_deref(), Some("succeeded"));
        // Begun, started and settled in one group.
        let new = NewActivity::fixture("chat");
        let id = new.activity_id;
        let results = writer.run_group(vec![
            begin(&new),
            transition(id, start()),
            transition(id, settle()),
        ]);
        assert_eq!(record(&results[2]).state, State::Succeeded);
        assert_eq!(stored_state(&database, id).as_deref(), Some("succeeded"));
    }

    #[test]
    fn a_read_after_a_deferred_write_sees_it() {
        let database = TestDatabase::new();
        let mut writer = writer(&database);
        let (a, b) = (NewActivity::fixture("chat"), NewActivity::fixture("chat"));
        let results = writer.run_group(vec![begin(&a), begin(&b), Command::Stats]);
        match &results[2] {
            Ok(Reply::Stats(stats)) => assert_eq!(stats.stored_records, 2),
            other => panic!("not stats: {other:?}"),
        }
    }

    #[test]
    fn a_snapshot_sees_the_changes_of_the_commands_before_it_in_its_group() {
        let database = TestDatabase::new();
        let mut writer = writer(&database);
        let (a, b) = (NewActivity::fixture("chat"), NewActivity::fixture("chat"));
        writer.run_group(vec![begin(&a), begin(&b)]);
        let results = writer.run_group(vec![
            transition(a.activity_id, start()),
            transition(b.activity_id, start()),
            transition(b.activity_id, settle()),
            Command::Snapshot {
                options: crate::domain::snapshot::SnapshotOptions::default(),
            },
        ]);
        let Ok(Reply::Snapshot(snapshot)) = &results[3] else {
            panic!("not a snapshot: {:?}", results[3]);
        };
        let in_flight: Vec<_> = snapshot
            .in_flight
            .iter()
            .map(|entry| (entry.record.activity_id, entry.record.state))
            .collect();
        assert_eq!(in_flight, vec![(a.activity_id, State::Executing)]);
        let completed: Vec<_> = snapshot
            .recent_completions
            .iter()
            .map(|record| record.activity_id)
            .collect();
        assert_eq!(completed, vec![b.activity_id]);
        assert_eq!((snapshot.total_activities, snapshot.total_succeeded), (2, 1));
    }

    #[test]
    fn a_storage_failure_undoes_only_its_own_command() {
        let database = TestDatabase::new();
        let mut writer = writer(&database);
        database.client().batch_execute(BREAK_CLASS).unwrap();
        let (a, broken, b) = (
            NewActivity::fixture("chat"),
            NewActivity::fixture("broken"),
            NewActivity::fixture("chat"),
        );
        let results = writer.run_group(vec![begin(&a), begin(&broken), begin(&b)]);
        assert!(results[0].is_ok(), "{:?}", results[0]);
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Storage);
        assert!(results[2].is_ok(), "{:?}", results[2]);
        assert_eq!(stored_state(&database, a.activity_id).as_deref(), Some("waiting"));
        assert_eq!(stored_state(&database, broken.activity_id), None);
        assert_eq!(stored_state(&database, b.activity_id).as_deref(), Some("waiting"));
        // A record changed by the commands around a failing one: each of
        // theirs lands, the failing one's does not.
        let results = writer.run_group(vec![
            transition(a.activity_id, start()),
            begin(&NewActivity::fixture("broken")),
            transition(a.activity_id, settle()),
            transition(b.activity_id, start()),
        ]);
        assert_eq!(record(&results[0]).state, State::Executing);
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Storage);
        assert_eq!(record(&results[2]).state, State::Succeeded);
        assert_eq!(record(&results[3]).state, State::Executing);
        assert_eq!(
            stored_state(&database, a.activity_id).as_deref(),
            Some("succeeded")
        );
        assert_eq!(
            stored_state(&database, b.activity_id).as_deref(),
            Some("executing")
        );
        let stats = writer.run_group(vec![Command::Stats]);
        match &stats[0] {
            Ok(Reply::Stats(stats)) => assert_eq!(stats.stored_records, 2),
            other => panic!("not stats: {other:?}"),
        }
    }

    #[test]
    fn an_id_taken_by_a_record_the_group_did_not_read_is_a_conflict() {
        let database = TestDatabase::new();
        let mut writer = writer(&database);
        let taken = NewActivity::fixture("chat");
        writer.run_group(vec![begin(&taken)]);
        let other = NewActivity::fixture("chat");
        // The deferred insert meets the taken id only when it is sent: the
        // group runs again, and the begin that asked for it is told.
        let results = writer.run_group(vec![begin(&other), begin(&taken)]);
        assert!(results[0].is_ok(), "{:?}", results[0]);
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Conflict);
        assert_eq!(
            stored_state(&database, other.activity_id).as_deref(),
            Some("waiting")
        );
        // And within one group: the second begin of an id is refused.
        let twice = NewActivity::fixture("chat");
        let results = writer.run_group(vec![begin(&twice), begin(&twice)]);
        assert!(results[0].is_ok(), "{:?}", results[0]);
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Conflict);
    }

    #[test]
    fn a_begin_whose_key_another_instance_claims_meanwhile_answers_that_record() {
        let database = TestDatabase::new();
        let mut writer = writer(&database);
        writer.run_group(vec![begin(&NewActivity::fixture("chat"))]);
        let pid = backend_pid(&mut writer);
        let key = Idempotency::new("raced".to_owned(), 7).unwrap();
        let theirs = ActivityId::new();
        let ours = NewActivity {
            extras: Some(Box::new(BeginExtras {
                idempotency: Some(key.clone()),
                trace_parent: None,
            })),
            ..NewActivity::fixture("chat")
        };
        // Another instance has begun with the key, not yet committed: this
        // begin does not see it, and its claim waits for that transaction.
        let mut other = database.client();
        let mut elsewhere = other.transaction().unwrap();
        elsewhere
            .execute(
                BEGIN_WITH_KEY_ELSEWHERE,
                &[&theirs.to_string(), &key.key, &key.fingerprint],
            )
            .unwrap();
        let results = thread::scope(|scope| {
            let run = scope.spawn(|| writer.run_group(vec![begin(&ours)]));
            await_count(&mut database.client(), LOCK_WAITS, &[&vec![pid]], 1);
            elsewhere.commit().unwrap();
            run.join().unwrap()
        });
        // The claim found the key taken: the group ran again, found it, and
        // answered the other instance's record, recording nothing.
        assert_eq!(record(&results[0]).activity_id, theirs);
        assert_eq!(stored_state(&database, ours.activity_id), None);
    }
}
