//! The embedded default: SQLite through rusqlite (bundled), in WAL mode.
//!
//! One connection per process writes, one transaction at a time: on the
//! writer thread, which groups the commands that arrive while a transaction
//! is being written into the next one (group commit), or, for a lone caller
//! under `normal`, on the caller's own thread (`handoff.rs`). Each command is
//! acknowledged only once its transaction committed. Begins, starts and
//! settles are written ahead of the tables and applied in batches
//! (`journal.rs`).
//! Every transaction is `BEGIN IMMEDIATE`, so several processes sharing one
//! file serialize their writes through SQLite's own lock: a reap pass or an
//! admission decision sees every other process's committed work.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use rusqlite::params;
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::domain::query;
use crate::domain::record::ActivityId;
use crate::domain::timestamp::Timestamp;
use crate::error::LedgerError;
use crate::store::sql::group::Published;

use super::{Command, Reply, Store, StoreFuture};

mod cache;
mod checkpoint;
mod handoff;
mod journal;
mod rows;
mod schema;
mod sql;
mod tables;
mod txn;
mod writer;

use crate::store::sql::counts::PendingCounts;
use checkpoint::Checkpointer;
use handoff::{Core, Handoff};
use schema::{connect, migrate, rebound_in_flight};

/// How long a writer waits for another process's transaction to finish.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

pub use super::Synchronous;

/// The pragmas every connection sets under `synchronous`, in this order.
/// WAL lets readers in other processes proceed during a write. Public so
/// that a benchmark's baseline runs with exactly the same settings.
pub fn pragmas(synchronous: Synchronous) -> [(&'static str, &'static str); 2] {
    [("journal_mode", "WAL"), ("synchronous", synchronous.as_str())]
}

/// A ledger store in one SQLite file, safe to share between processes on one
/// host.
///
/// Under [`Synchronous::Normal`], a caller alone with the store runs its
/// command on its own thread, as one small transaction without a sync,
/// instead of waking the writer thread; an async caller's worker is busy for
/// that long. Under [`Synchronous::Full`] every command runs on the writer
/// thread.
pub struct SqliteStore {
    path: PathBuf,
    handoff: Arc<Handoff>,
    /// The call histograms and the capacity watchers, which whoever runs a
    /// group publishes to after each commit.
    published: Arc<Published>,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore").field("path", &self.path).finish()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path`, migrates it, and
    /// recomputes the bounds of in-flight records under `config`.
    ///
    /// # Errors
    /// [`ErrorKind::Storage`](crate::ErrorKind::Storage) when the file cannot be opened or migrated.
    pub fn open(
        path: impl AsRef<Path>,
        config: Arc<LedgerConfig>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LedgerError> {
        Self::open_with(path, Synchronous::default(), config, clock)
    }

    /// Like [`SqliteStore::open`], with the durability `synchronous`.
    ///
    /// # Errors
    /// [`ErrorKind::Storage`](crate::ErrorKind::Storage) when the file
    /// cannot be opened or migrated.
    pub fn open_with(
        path: impl AsRef<Path>,
        synchronous: Synchronous,
        config: Arc<LedgerConfig>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LedgerError> {
        let path = path.as_ref().to_path_buf();
        let mut conn = connect(&path, synchronous)?;
        migrate(&mut conn)?;
        rebound_in_flight(&mut conn, &config)?;
        // Checkpoints run on their own thread; the writer's connection
        // checkpoints only once the log is long (see `checkpoint`).
        conn.pragma_update(None, "wal_autocheckpoint", checkpoint::WRITER_PAGES)
            .map_err(sql_error("cannot set PRAGMA wal_autocheckpoint"))?;
        let published = Arc::new(Published::default());
        let checkpointer = Checkpointer::start(&path, synchronous, Arc::clone(&published))?;
        let inline = synchronous == Synchronous::Normal;
        let core = Core::new(conn, checkpointer);
        let handoff = Arc::new(Handoff::new(core, inline, config, clock, Arc::clone(&published)));
        let writer = Arc::clone(&handoff);
        thread::Builder::new()
            .name("inflight-sqlite".into())
            .spawn(move || writer.write_loop())
            .map_err(|err| LedgerError::storage("cannot start the SQLite writer thread", err))?;
        Ok(Self {
            path,
            handoff,
            published,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Store for SqliteStore {
    crate::store::sql::group::answered_from_published!();

    fn execute(&self, command: Command) -> StoreFuture {
        self.handoff.submit(command)
    }

    fn close(&self) -> StoreFuture {
        let (done, closed) = oneshot::channel();
        self.handoff.close(done);
        StoreFuture::pending(async move {
            let _ = closed.await;
            Ok(Reply::Closed)
        })
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        // The writer thread ends once what is queued is answered, and
        // closes the connection; no one waits for it.
        let (done, _) = oneshot::channel();
        self.handoff.close(done);
    }
}

fn sql_error(context: &str) -> impl FnOnce(rusqlite::Error) -> LedgerError + '_ {
    move |err| LedgerError::storage(context, err)
}

/// Bulk-loads `count` settled records, completed over the hour before
/// `completed_at`, with their counters, straight into the database at
/// `path`: for benchmarks that need a large history fast. Not for
/// production use.
///
/// # Errors
/// `Storage` when the database cannot be opened or written.
#[doc(hidden)]
pub fn seed_history(path: &Path, count: usize, completed_at: Timestamp) -> Result<(), LedgerError> {
    let mut conn = connect(path, Synchronous::default())?;
    migrate(&mut conn)?;
    let tx = conn.transaction().map_err(sql_error("cannot begin"))?;
    let mut counts = PendingCounts::default();
    {
        let mut insert = tx
            .prepare(sql::SEED_RECORD)
            .map_err(sql_error("cannot prepare"))?;
        for i in 0..count {
            let done = completed_at.as_millis() - (i as i64 % 3_600_000);
            insert
                .execute(params![ActivityId::new().to_string(), done - 20, done - 10, done])
                .map_err(sql_error("cannot seed history"))?;
            counts.complete(query::completion_minute(Timestamp::from_millis(done)));
        }
        let (aggregate, totals) = super::seeded_history_totals(count, completed_at)?;
        counts.totals.insert(aggregate, totals);
        tables::write_counts(&mut rows::Statements::new(&tx), &mut counts)?;
    }
    tx.commit().map_err(sql_error("cannot commit"))
}

/// A connection to a migrated database at `path`, for tests of the
/// shared statements.
#[cfg(test)]
pub(crate) fn test_connection(path: &Path) -> rusqlite::Connection {
    let mut conn = connect(path, Synchronous::Full).unwrap();
    migrate(&mut conn).unwrap();
    conn
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;
    use crate::domain::snapshot::{Snapshot, SnapshotOptions};
    use crate::domain::transition::{NewActivity, Transition};
    use crate::error::ErrorKind;
    use crate::store::Reply;
    use rusqlite::Connection;
    use writer::run_group;

    const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);

    fn begin(id: ActivityId) -> Command {
        Command::Begin {
            new: NewActivity {
                activity_id: id,
                ..NewActivity::fixture("embedding")
            },
        }
    }

    /// A migrated database in a directory that lives as long as it is used.
    fn database() -> (tempfile::TempDir, Connection) {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = connect(&dir.path().join("counts.db"), Synchronous::Full).unwrap();
        migrate(&mut conn).unwrap();
        (dir, conn)
    }

    /// What a writer runs its groups with in these tests: the default
    /// configuration, a fake clock at `T0`, its call statistics.
    struct Writer {
        config: LedgerConfig,
        clock: FakeClock,
        published: Published,
    }

    impl Writer {
        fn new() -> Self {
            Self {
                config: LedgerConfig::default(),
                clock: FakeClock::at(T0),
                published: Published::default(),
            }
        }

        /// Runs `commands` as one group on `statements`.
        fn run(
            &self,
            statements: &mut rows::Statements<'_>,
            commands: Vec<Command>,
        ) -> Vec<Result<Reply, LedgerError>> {
            run_group(
                statements,
                &self.config,
                &self.clock,
                &self.published,
                commands,
                writer::Begun::No,
            )
        }
    }

    /// A migrated database and a second connection to it, as another
    /// process would hold.
    fn database_and_another() -> (tempfile::TempDir, Connection, Connection) {
        let (dir, conn) = database();
        let other = connect(&dir.path().join("counts.db"), Synchronous::Full).unwrap();
        (dir, conn, other)
    }

    fn snapshot() -> Command {
        Command::Snapshot {
            options: SnapshotOptions::default(),
        }
    }

    fn snapshot_of(result: &Result<Reply, LedgerError>) -> &Snapshot {
        match result {
            Ok(Reply::Snapshot(snapshot)) => snapshot,
            other => panic!("not a snapshot: {other:?}"),
        }
    }

    #[test]
    fn migration_4_splits_owner_lost_reaps_by_disposition_from_the_records_kept() {
        use crate::domain::labels::Label;
        use crate::domain::record::{Disposition, ReapReason};

        let (_dir, mut conn) = database();
        let writer = Writer::new();
        let run = |conn: &Connection, command: Command| {
            let mut results = writer.run(&mut rows::Statements::new(conn), vec![command]);
            results.pop().unwrap().unwrap()
        };
        let Reply::Owner(owner) = run(
            &conn,
            Command::RegisterOwner {
                name: Label::new("name", "worker").unwrap(),
                ttl_ms: 1000,
            },
        ) else {
            panic!("not an owner")
        };
        // One waiting record and one executing, both of the owner.
        for started_at in [None, Some(T0)] {
            let new = NewActivity {
                activity_id: ActivityId::new(),
                started_at,
                owner_id: Some(owner.owner_id.to_string()),
                ..NewActivity::fixture("embedding")
            };
            run(&conn, Command::Begin { new });
        }
        writer.clock.advance(std::time::Duration::from_secs(2));
        run(&conn, Command::Reap);
        let totals = |conn: &Connection| {
            let reply = run(conn, snapshot());
            let snapshot = snapshot_of(&Ok(reply)).clone();
            assert_eq!(snapshot.aggregates.len(), 1);
            let totals = snapshot.aggregates[0].totals;
            [Disposition::Abandoned, Disposition::Unsettled]
                .map(|disposition| totals.reaps_ever(disposition, ReapReason::OwnerLost))
        };
        assert_eq!(totals(&conn), [1, 1]);

        // A store written before the split: migrated, it is counted from the
        // records it still holds.
        conn.execute_batch(
            "ALTER TABLE aggregates DROP COLUMN reaped_owner_lost_abandoned; DROP TABLE journal; \
             ALTER TABLE aggregates ADD COLUMN calls INTEGER NOT NULL DEFAULT 0; \
             ALTER TABLE activities DROP COLUMN refined; DROP TABLE idempotency_keys; \
             ALTER TABLE aggregates DROP COLUMN succeeded_unstarted; DROP TABLE lane_states; \
             ALTER TABLE activities DROP COLUMN input_tokens; ALTER TABLE activities DROP COLUMN output_tokens; \
             DROP INDEX activities_lane; CREATE INDEX activities_lane ON activities \
             (service, provider, admission, state, enqueued_at, activity_id) \
             WHERE state IN ('waiting', 'executing'); \
             ALTER TABLE activities DROP COLUMN max_tokens; \
             ALTER TABLE activities DROP COLUMN trace_parent; \
             ALTER TABLE aggregates DROP COLUMN input_tokens_sum; \
             ALTER TABLE aggregates DROP COLUMN output_tokens_sum; DROP TABLE token_seconds; \
             PRAGMA user_version = 3;",
        )
        .unwrap();
        migrate(&mut conn).unwrap();
        assert_eq!(totals(&conn), [1, 1]);
    }

    #[test]
    fn a_group_writes_its_counts_once_and_a_snapshot_in_it_sees_them() {
        let (_dir, conn) = database();
        let writer = Writer::new();
        let (a, b) = (ActivityId::new(), ActivityId::new());

        let results = writer.run(
            &mut rows::Statements::new(&conn),
            vec![begin(a), begin(b), snapshot()],
        );
        assert_eq!(
            snapshot_of(&results[2]).total_activities,
            2,
            "counted before the snapshot read them"
        );
        assert_eq!(snapshot_of(&results[2]).total_in_flight, 2);

        let settle = Command::Transition {
            id: a,
            transition: Transition::Settle {
                success: true,
                failure_stage: None,
                at: None,
                retry_after_ms: None,
                usage: Default::default(),
            },
        };
        let results = writer.run(&mut rows::Statements::new(&conn), vec![settle, snapshot()]);
        assert!(results[0].is_ok());
        assert_eq!(snapshot_of(&results[1]).total_recent_completions, 1);

        // Written at the commit: a later group reads them from the file.
        let results = writer.run(&mut rows::Statements::new(&conn), vec![snapshot()]);
        let after = snapshot_of(&results[0]);
        assert_eq!((after.total_activities, after.total_in_flight), (2, 1));
        assert_eq!(after.total_recent_completions, 1);
    }

    fn transition(id: ActivityId, transition: Transition) -> Command {
        Command::Transition { id, transition }
    }

    fn start(id: ActivityId) -> Command {
        transition(id, Transition::Start { at: None })
    }

    fn cancel(id: ActivityId, reason: &str) -> Command {
        let reason = Some(reason.to_owned());
        transition(id, Transition::Cancel { reason, at: None })
    }

    fn record_of(result: &Result<Reply, LedgerError>) -> &crate::domain::record::ActivityRecord {
        match result {
            Ok(Reply::Record(record)) => record,
            other => panic!("not a record: {other:?}"),
        }
    }

    fn settle(id: ActivityId) -> Command {
        let settle = Transition::Settle {
            success: true,
            failure_stage: None,
            at: None,
            retry_after_ms: None,
            usage: Default::default(),
        };
        transition(id, settle)
    }

    /// Rows in `journal` and in `activities`, read behind the writer.
    fn rows_ahead_and_stored(conn: &Connection) -> (i64, i64) {
        conn.query_row(sql::ROWS_AHEAD_AND_STORED, [], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })
        .unwrap()
    }

    #[test]
    fn a_lifecycle_is_written_ahead_and_applied_before_a_snapshot_reads() {
        let (_dir, conn) = database();
        let writer = Writer::new();
        let mut ours = rows::Statements::new(&conn);
        // The first call of an aggregate goes to the tables: a new aggregate
        // is checked against the label limits there.
        writer.run(&mut ours, vec![begin(ActivityId::new())]);
        assert_eq!(rows_ahead_and_stored(&conn), (0, 1));
        let id = ActivityId::new();
        for command in [begin(id), start(id), settle(id)] {
            assert!(writer.run(&mut ours, vec![command])[0].is_ok());
        }
        assert_eq!(rows_ahead_and_stored(&conn), (3, 1));

        let results = writer.run(&mut ours, vec![snapshot()]);
        let snapshot = snapshot_of(&results[0]);
        assert_eq!(rows_ahead_and_stored(&conn), (0, 2));
        assert_eq!(snapshot.recent_completions.len(), 1);
        assert_eq!(snapshot.aggregates[0].totals.calls(), 2);
        assert_eq!(snapshot.aggregates[0].totals.succeeded, 1);
        assert_eq!(snapshot.aggregates[0].totals.in_flight, 1);
        let minutes: i64 = conn
            .query_row(sql::COMPLETION_MINUTES_FROM, [0], |row| row.get(0))
            .unwrap();
        assert_eq!(minutes, 1);
    }

    #[test]
    fn rows_written_ahead_by_a_writer_that_died_are_applied_by_the_next() {
        use crate::domain::record::State;

        let (dir, conn) = database();
        let writer = Writer::new();
        let (a, b) = (ActivityId::new(), ActivityId::new());
        let mut dead = rows::Statements::new(&conn);
        writer.run(&mut dead, vec![begin(a), begin(b)]);
        writer.run(&mut dead, vec![start(a)]);
        writer.run(&mut dead, vec![settle(b)]);
        // Gone without applying them: only the rows say what happened.
        drop(dead);
        drop(conn);

        let store = store_at(&dir.path().join("counts.db"));
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let reply = runtime.block_on(store.execute(snapshot())).unwrap();
        let snapshot = snapshot_of(&Ok(reply)).clone();
        assert_eq!(snapshot.in_flight.len(), 1);
        assert_eq!(snapshot.in_flight[0].record.activity_id, a);
        assert_eq!(snapshot.in_flight[0].record.state, State::Executing);
        assert_eq!(snapshot.recent_completions.len(), 1);
        assert_eq!(snapshot.aggregates[0].totals.calls(), 2);
        assert_eq!(snapshot.aggregates[0].totals.in_flight, 1);
        runtime.block_on(store.close()).unwrap();
    }

    #[test]
    fn a_journal_grown_to_its_batch_is_applied_before_its_commit() {
        let (_dir, conn) = database();
        let writer = Writer::new();
        let mut ours = rows::Statements::new(&conn);
        writer.run(&mut ours, vec![begin(ActivityId::new())]);
        let mut rows = Vec::new();
        for _ in 0..journal::Journal::APPLY_AT + 10 {
            writer.run(&mut ours, vec![begin(ActivityId::new())]);
            rows.push(rows_ahead_and_stored(&conn));
        }
        let applied = rows
            .iter()
            .position(|(ahead, _)| *ahead == 0)
            .expect("applied once");
        assert_eq!(applied + 1, journal::Journal::APPLY_AT);
        let stored = 1 + journal::Journal::APPLY_AT as i64;
        assert_eq!(rows[applied], (0, stored));
        assert_eq!(rows.last(), Some(&(10, stored)));
    }

    #[tokio::test]
    async fn two_processes_writing_ahead_on_one_file_count_each_transition_once() {
        use crate::domain::record::State;

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.db");
        let (a, b) = (store_at(&path), store_at(&path));
        let record = |reply: Reply| match reply {
            Reply::Record(record) => record,
            other => panic!("{other:?}"),
        };
        // Warm both: a new aggregate goes to the tables, and is known to both.
        a.execute(begin(ActivityId::new())).await.unwrap();
        b.execute(begin(ActivityId::new())).await.unwrap();
        for _ in 0..3 {
            let id = ActivityId::new();
            // Each step is written ahead by one process and read by the
            // other, which applies the rows first.
            a.execute(begin(id)).await.unwrap();
            assert_eq!(
                record(b.execute(start(id)).await.unwrap()).state,
                State::Executing
            );
            assert_eq!(
                record(a.execute(settle(id)).await.unwrap()).state,
                State::Succeeded
            );
            assert_eq!(
                record(b.execute(Command::Get { id }).await.unwrap()).state,
                State::Succeeded
            );
        }
        for store in [&a, &b] {
            let snapshot = snapshot_of(&store.execute(snapshot()).await).clone();
            let totals = snapshot.aggregates[0].totals;
            assert_eq!((totals.calls(), totals.succeeded, totals.in_flight), (5, 3, 2));
            assert_eq!(snapshot.recent_completions.len(), 3);
        }
        a.close().await.unwrap();
        b.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_store_closed_cleanly_holds_every_record_in_its_tables() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("closed.db");
        let store = store_at(&path);
        for _ in 0..3 {
            store.execute(begin(ActivityId::new())).await.unwrap();
        }
        store.close().await.unwrap();
        let conn = Connection::open(&path).unwrap();
        assert_eq!(rows_ahead_and_stored(&conn), (0, 3));
    }

    #[test]
    fn a_writer_reads_again_what_another_connection_changed() {
        use crate::domain::record::State;

        let (_dir, conn, other) = database_and_another();
        let writer = Writer::new();
        // One writer's statements, and so its cached records, across groups.
        let mut ours = rows::Statements::new(&conn);
        let id = ActivityId::new();
        writer.run(&mut ours, vec![begin(id)]);

        // Another process cancels it; our writer's copy still says waiting.
        let results = writer.run(&mut rows::Statements::new(&other), vec![cancel(id, "elsewhere")]);
        assert_eq!(record_of(&results[0]).state, State::Cancelled);

        let results = writer.run(&mut ours, vec![start(id)]);
        assert_eq!(results[0].as_ref().unwrap_err().kind(), ErrorKind::Conflict);
        let results = writer.run(&mut rows::Statements::new(&other), vec![Command::Get { id }]);
        assert_eq!(record_of(&results[0]).state, State::Cancelled);
    }

    /// A storage failure on demand: writing the cancel reason `boom` fails,
    /// to the tables or ahead of them.
    fn refuse_cancel_reason_boom(conn: &rusqlite::Connection) {
        conn.execute_batch(
            "CREATE TRIGGER refuse_boom BEFORE UPDATE ON activities WHEN NEW.cancel_reason = 'boom' \
             BEGIN SELECT RAISE(ABORT, 'boom'); END; \
             CREATE TRIGGER refuse_boom_ahead BEFORE INSERT ON journal WHEN NEW.cancel_reason = 'boom' \
             BEGIN SELECT RAISE(ABORT, 'boom'); END;",
        )
        .unwrap();
    }

    #[test]
    fn a_group_rolled_back_for_a_storage_failure_leaves_no_cached_record_behind() {
        use crate::domain::record::State;

        let (_dir, conn) = database();
        refuse_cancel_reason_boom(&conn);
        let writer = Writer::new();
        let mut ours = rows::Statements::new(&conn);
        let (a, b) = (ActivityId::new(), ActivityId::new());
        writer.run(&mut ours, vec![begin(a), begin(b)]);

        // Run whole, the start of `a` lands, then the cancel of `b` fails and
        // the whole group is rolled back and run again command by command:
        // the start must then find `a` waiting, as the file has it.
        let results = writer.run(&mut ours, vec![start(a), cancel(b, "boom")]);
        assert_eq!(record_of(&results[0]).state, State::Executing);
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Storage);
        let results = writer.run(
            &mut rows::Statements::new(&conn),
            vec![Command::Get { id: a }, Command::Get { id: b }],
        );
        assert_eq!(record_of(&results[0]).state, State::Executing);
        assert_eq!(record_of(&results[1]).state, State::Waiting);
    }

    #[test]
    fn an_aggregate_stored_by_a_group_rolled_back_is_stored_again() {
        let (_dir, conn) = database();
        refuse_cancel_reason_boom(&conn);
        let writer = Writer::new();
        let mut ours = rows::Statements::new(&conn);
        let b = ActivityId::new();
        writer.run(&mut ours, vec![begin(b)]);

        // The snapshot writes the new aggregate's row, the cancel then
        // fails: the group is rolled back, row and all, and run again.
        let new = NewActivity {
            activity_id: ActivityId::new(),
            ..NewActivity::fixture("chat")
        };
        let results = writer.run(
            &mut ours,
            vec![Command::Begin { new }, snapshot(), cancel(b, "boom")],
        );
        assert!(results[0].is_ok(), "{results:?}");
        assert_eq!(snapshot_of(&results[1]).aggregates.len(), 2);
        assert_eq!(results[2].as_ref().unwrap_err().kind(), ErrorKind::Storage);
        let results = writer.run(&mut ours, vec![snapshot()]);
        let totals: Vec<i64> = snapshot_of(&results[0])
            .aggregates
            .iter()
            .map(|aggregate| aggregate.totals.calls())
            .collect();
        assert_eq!(totals, [1, 1]);
    }

    #[test]
    fn a_refused_begin_in_a_group_counts_nothing() {
        let (_dir, conn) = database();
        let writer = Writer::new();
        let (a, b) = (ActivityId::new(), ActivityId::new());
        let duplicate = begin(a);
        let results = writer.run(
            &mut rows::Statements::new(&conn),
            vec![begin(a), duplicate, begin(b), snapshot()],
        );
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Conflict);
        assert_eq!(snapshot_of(&results[3]).total_activities, 2);
    }

    #[test]
    fn a_checkpoint_by_another_connection_keeps_the_writers_records() {
        let (_dir, conn, checkpointer) = database_and_another();
        let writer = Writer::new();
        let mut ours = rows::Statements::new(&conn);
        let id = ActivityId::new();
        writer.run(&mut ours, vec![begin(id)]);

        let (log, copied): (i64, i64) = checkpointer
            .query_row(sql::CHECKPOINT, [], |row| Ok((row.get(1)?, row.get(2)?)))
            .unwrap();
        assert!(log > 0 && copied == log, "{copied} of {log} pages copied");

        // The next transaction's `data_version` check keeps the record: a
        // checkpoint moves pages, not data.
        writer.run(&mut ours, vec![snapshot()]);
        assert!(
            ours.records.get(id).is_some(),
            "the checkpoint made the writer forget its records"
        );
    }

    /// The records committed to the database file alone, without its log,
    /// as far as checkpoints copied them, in the tables or written ahead;
    /// `None` while the copy is torn or has no schema yet.
    fn records_in_database_file(path: &Path) -> Option<i64> {
        let copy = tempfile::tempdir().unwrap();
        let copied = copy.path().join("copy.db");
        std::fs::copy(path, &copied).ok()?;
        let conn = Connection::open(&copied).ok()?;
        conn.query_row(sql::RECORDS_ANYWHERE, [], |row| row.get(0)).ok()
    }

    fn store_at(path: &Path) -> SqliteStore {
        store_with(path, Synchronous::Normal)
    }

    fn store_with(path: &Path, synchronous: Synchronous) -> SqliteStore {
        let config = Arc::new(LedgerConfig::default());
        SqliteStore::open_with(path, synchronous, config, Arc::new(FakeClock::at(T0))).unwrap()
    }

    /// Whether `future` was answered before it was returned: its command ran
    /// on the caller's thread.
    fn ran_inline(future: &StoreFuture) -> bool {
        format!("{future:?}").contains("ready")
    }

    /// Runs `commands` one after another, each of which must be answered
    /// by the writer thread and succeed, then closes `store`.
    async fn run_on_the_writer_thread(store: &SqliteStore, commands: impl IntoIterator<Item = Command>) {
        for command in commands {
            let future = store.execute(command);
            assert!(!ran_inline(&future), "{future:?}");
            future.await.unwrap();
        }
        store.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_lone_caller_under_normal_runs_its_commands_on_its_own_thread() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_at(&dir.path().join("inline.db"));
        let id = ActivityId::new();
        let begun = store.execute(begin(id));
        assert!(ran_inline(&begun), "{begun:?}");
        begun.await.unwrap();
        let got = store.execute(Command::Get { id });
        assert!(ran_inline(&got), "{got:?}");
        match got.await.unwrap() {
            Reply::Record(record) => assert_eq!(record.activity_id, id),
            other => panic!("{other:?}"),
        }
        store.close().await.unwrap();
        let after = store.execute(Command::Get { id });
        assert_eq!(after.await.unwrap_err().kind(), ErrorKind::Closed);
    }

    /// A handoff with no writer thread, so that what a test queues stays
    /// queued until a caller takes it.
    fn handoff_alone(path: &Path) -> Handoff {
        handoff_publishing(path, Arc::new(Published::default()))
    }

    /// [`handoff_alone`], showing what lands to `published`.
    fn handoff_publishing(path: &Path, published: Arc<Published>) -> Handoff {
        let mut conn = connect(path, Synchronous::Normal).unwrap();
        migrate(&mut conn).unwrap();
        let checkpointer = Checkpointer::start(path, Synchronous::Normal, Arc::clone(&published)).unwrap();
        let config = Arc::new(LedgerConfig::default());
        Handoff::new(
            Core::new(conn, checkpointer),
            true,
            config,
            Arc::new(FakeClock::at(T0)),
            published,
        )
    }

    /// Checks that the queued begin and start were answered, by the caller
    /// of `got` since no writer thread runs, and ran before its `Get`.
    async fn begun_then_started(begun: StoreFuture, started: StoreFuture, got: StoreFuture) {
        for queued in [begun, started] {
            let answer = tokio::time::timeout(Duration::from_secs(5), queued).await;
            answer.expect("answered by the caller").unwrap();
        }
        assert_eq!(
            record_of(&got.await).state,
            crate::domain::record::State::Executing
        );
    }

    #[tokio::test]
    async fn a_caller_runs_the_small_commands_queued_before_its_own_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let handoff = handoff_alone(&dir.path().join("queued.db"));
        let id = ActivityId::new();
        let begun = handoff.queue_quietly(begin(id));
        let started = handoff.queue_quietly(start(id));
        let got = handoff.submit(Command::Get { id });
        assert!(ran_inline(&got), "{got:?}");
        // Answered by the caller's group, which ran them before its own:
        // no writer thread would.
        begun_then_started(begun, started, got).await;
    }

    #[tokio::test]
    async fn commands_given_back_for_another_process_keep_their_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("queued.db");
        let handoff = handoff_alone(&path);
        let other = connect(&path, Synchronous::Normal).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let id = ActivityId::new();
        let begun = handoff.queue_quietly(begin(id));
        // The write lock is held: the caller queues both again, in order.
        let started = handoff.submit(start(id));
        assert!(!ran_inline(&started), "{started:?}");
        other.execute_batch("COMMIT").unwrap();
        let got = handoff.submit(Command::Get { id });
        assert!(ran_inline(&got), "{got:?}");
        begun_then_started(begun, started, got).await;
    }

    #[test]
    fn a_caller_gives_back_a_later_group_when_another_process_took_the_lock_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("queued.db");
        let published = Arc::new(Published::default());
        let handoff = Arc::new(handoff_publishing(&path, Arc::clone(&published)));
        let id = ActivityId::new();
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(handoff.submit(begin(id))).unwrap();
        runtime.block_on(handoff.submit(start(id))).unwrap();
        // Once the settle has committed and its end is shown, before its
        // caller looks at the queue again: another command queues, and
        // another process takes the write lock.
        let other = Arc::new(std::sync::Mutex::new(
            connect(&path, Synchronous::Normal).unwrap(),
        ));
        let queued = Arc::new(std::sync::Mutex::new(None));
        let (weak, lock, slot) = (Arc::downgrade(&handoff), Arc::clone(&other), Arc::clone(&queued));
        published.watchers.add_end_watch(Arc::new(move |_, _| {
            if let Some(handoff) = weak.upgrade() {
                lock.lock().unwrap().execute_batch("BEGIN IMMEDIATE").unwrap();
                *slot.lock().unwrap() = Some(handoff.queue_quietly(Command::Get { id }));
            }
        }));
        // The caller gives the later group back and answers its own: on a
        // thread of its own, so that a caller that never returns fails the
        // test instead of hanging it.
        let (answered, answer) = std::sync::mpsc::channel();
        let caller = Arc::clone(&handoff);
        std::thread::spawn(move || {
            let settled = caller.submit(settle(id));
            answered.send(ran_inline(&settled)).unwrap();
        });
        let inline = answer.recv_timeout(Duration::from_secs(10));
        assert_eq!(inline, Ok(true), "the settle's caller never returned");
        other.lock().unwrap().execute_batch("COMMIT").unwrap();
        let queued = queued.lock().unwrap().take().expect("the end was shown");
        // Queued again, in order: the next caller runs it before its own.
        let got = handoff.submit(Command::Get { id });
        assert!(ran_inline(&got), "{got:?}");
        for answer in [queued, got] {
            assert_eq!(
                record_of(&runtime.block_on(answer)).state,
                crate::domain::record::State::Succeeded
            );
        }
    }

    /// A clock that panics once it is told to.
    #[derive(Debug, Default)]
    struct FailingClock(std::sync::atomic::AtomicBool);

    impl Clock for FailingClock {
        fn now(&self) -> Timestamp {
            assert!(
                !self.0.load(std::sync::atomic::Ordering::SeqCst),
                "the clock fails"
            );
            T0
        }
    }

    #[tokio::test]
    async fn a_writer_that_panics_mid_group_releases_the_write_lock_and_closes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("panics.db");
        let clock = Arc::new(FailingClock::default());
        let config = Arc::new(LedgerConfig::default());
        // Under `full` every command goes to the writer thread.
        let store = SqliteStore::open_with(
            &path,
            Synchronous::Full,
            config,
            Arc::clone(&clock) as Arc<dyn Clock>,
        )
        .unwrap();
        let id = ActivityId::new();
        store.execute(begin(id)).await.unwrap();
        // The clock is read once the group holds the write lock: the panic
        // comes mid-transaction.
        clock.0.store(true, std::sync::atomic::Ordering::SeqCst);
        let failed = store.execute(start(id)).await.unwrap_err();
        assert_eq!(failed.kind(), ErrorKind::Closed, "{failed}");
        let err = store.execute(Command::Get { id }).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
        // Another process takes the write lock at once, and finds the
        // record as it was before the failed group.
        let other = connect(&path, Synchronous::Normal).unwrap();
        other.busy_timeout(Duration::ZERO).unwrap();
        other.execute_batch("BEGIN IMMEDIATE; ROLLBACK").unwrap();
        drop(other);
        let reopened = store_at(&path);
        assert_eq!(
            record_of(&reopened.execute(Command::Get { id }).await).state,
            crate::domain::record::State::Waiting
        );
    }

    #[tokio::test]
    async fn a_caller_queues_behind_a_command_about_any_number_of_records() {
        let dir = tempfile::tempdir().unwrap();
        let handoff = handoff_alone(&dir.path().join("queued.db"));
        let reap = handoff.queue_quietly(Command::Reap);
        let got = handoff.submit(Command::Get {
            id: ActivityId::new(),
        });
        assert!(!ran_inline(&got), "{got:?}");
        drop(reap);
    }

    #[tokio::test]
    async fn a_caller_leaves_a_group_larger_than_its_share_to_the_writer_thread() {
        let dir = tempfile::tempdir().unwrap();
        let handoff = handoff_alone(&dir.path().join("queued.db"));
        let queued: Vec<_> = (0..handoff::INLINE_MAX)
            .map(|_| handoff.queue_quietly(begin(ActivityId::new())))
            .collect();
        let got = handoff.submit(Command::Get {
            id: ActivityId::new(),
        });
        assert!(!ran_inline(&got), "{got:?}");
        drop(queued);
    }

    #[test]
    fn callers_on_two_threads_and_the_writer_answer_every_command_once() {
        // Callers on two workers queue while one of them runs a group, so
        // groups pass between callers and the writer thread.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(store_at(&dir.path().join("callers.db")));
        let (callers, each) = (16, 100);
        runtime.block_on(async {
            let tasks: Vec<_> = (0..callers)
                .map(|_| {
                    let store = Arc::clone(&store);
                    tokio::spawn(async move {
                        for _ in 0..each {
                            let id = ActivityId::new();
                            for command in [begin(id), start(id), settle(id)] {
                                store.execute(command).await.unwrap();
                            }
                        }
                    })
                })
                .collect();
            for task in tasks {
                // A command whose answer was lost would hang its caller.
                tokio::time::timeout(Duration::from_secs(60), task)
                    .await
                    .expect("every command answered")
                    .unwrap();
            }
            let result = store.execute(snapshot()).await;
            let snapshot = snapshot_of(&result);
            let lifecycles = callers * each;
            assert_eq!(snapshot.total_activities, lifecycles);
            assert_eq!(snapshot.total_succeeded, lifecycles);
            assert_eq!(snapshot.total_in_flight, 0);
            store.close().await.unwrap();
        });
    }

    #[tokio::test]
    async fn commands_about_any_number_of_records_go_to_the_writer_thread() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_at(&dir.path().join("inline.db"));
        store.execute(begin(ActivityId::new())).await.unwrap();
        let commands = [
            Command::Reap,
            snapshot(),
            Command::Prune { limit: 10 },
            Command::Stats,
        ];
        run_on_the_writer_thread(&store, commands).await;
    }

    #[tokio::test]
    async fn under_full_every_command_goes_to_the_writer_thread() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(&dir.path().join("full.db"), Synchronous::Full);
        let begins = (0..3).map(|_| begin(ActivityId::new()));
        run_on_the_writer_thread(&store, begins).await;
    }

    #[tokio::test]
    async fn a_lone_caller_does_not_wait_for_another_process_holding_the_write_lock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.db");
        let store = store_at(&path);
        store.execute(begin(ActivityId::new())).await.unwrap();
        let other = connect(&path, Synchronous::Normal).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        // Returned at once, to be answered by the writer thread, which
        // waits for the lock in the caller's stead.
        let started = std::time::Instant::now();
        let id = ActivityId::new();
        let begun = store.execute(begin(id));
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        assert!(!ran_inline(&begun), "{begun:?}");
        // A later command queues behind it rather than running first.
        let got = store.execute(Command::Get { id });
        assert!(!ran_inline(&got), "{got:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        other.execute_batch("COMMIT").unwrap();
        begun.await.unwrap();
        match got.await.unwrap() {
            Reply::Record(record) => assert_eq!(record.activity_id, id),
            other => panic!("{other:?}"),
        }
        store.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_group_held_up_by_the_write_lock_is_kept_as_slow_work() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slow.db");
        let store = store_at(&path);
        store.execute(begin(ActivityId::new())).await.unwrap();
        let from = std::time::Instant::now();
        assert!(store.slow_work(from, std::time::Instant::now()).is_empty());
        let other = connect(&path, Synchronous::Normal).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let begun = store.execute(begin(ActivityId::new()));
        tokio::time::sleep(crate::store::SLOW_WORK + Duration::from_millis(50)).await;
        other.execute_batch("COMMIT").unwrap();
        begun.await.unwrap();
        let to = std::time::Instant::now();
        let slow = store.slow_work(from, to);
        assert_eq!(slow.len(), 1, "{slow:?}");
        assert_eq!(slow[0].what, "a group of 1 command (1 begin)");
        assert!(slow[0].took >= crate::store::SLOW_WORK, "{slow:?}");
        // Found by when it ran, not by when it is asked about.
        assert!(store
            .slow_work(from - Duration::from_secs(5), from - Duration::from_secs(4))
            .is_empty());
        store.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_second_close_waits_for_the_first_to_finish() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("closing.db");
        let store = store_at(&path);
        store.execute(begin(ActivityId::new())).await.unwrap();
        // The writer thread waits for another process's lock with a command
        // queued, so the first close cannot finish yet.
        let other = connect(&path, Synchronous::Normal).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let begun = store.execute(begin(ActivityId::new()));
        let first = store.close();
        let mut second = std::pin::pin!(store.close());
        let early = tokio::time::timeout(Duration::from_millis(200), &mut second).await;
        assert!(
            early.is_err(),
            "the second close answered before the first finished"
        );
        other.execute_batch("COMMIT").unwrap();
        begun.await.unwrap();
        first.await.unwrap();
        second.await.unwrap();
        let after = store.execute(begin(ActivityId::new()));
        assert_eq!(after.await.unwrap_err().kind(), ErrorKind::Closed);
    }

    #[tokio::test]
    async fn a_store_dropped_without_close_closes_its_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dropped.db");
        let log = dir.path().join("dropped.db-wal");
        let store = store_at(&path);
        store.execute(begin(ActivityId::new())).await.unwrap();
        assert!(log.exists());
        drop(store);
        // The last connection to close copies the log and deletes it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while log.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the log is still there after 10 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(records_in_database_file(&path), Some(1));
    }

    #[tokio::test]
    async fn the_checkpointer_copies_the_log_into_the_database_file_without_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpointed.db");
        let store = store_at(&path);
        // A few pages of log: far below what makes the writer checkpoint.
        for _ in 0..5 {
            store.execute(begin(ActivityId::new())).await.unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while records_in_database_file(&path) != Some(5) {
            assert!(
                std::time::Instant::now() < deadline,
                "the database file alone holds {:?} records after 10 s",
                records_in_database_file(&path)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        store.close().await.unwrap();
    }

    /// The `-wal` file's checkpoint sequence (bytes 12 to 16 of its
    /// header): it moves each time the log restarts from its beginning.
    fn log_restarts(path: &Path) -> u32 {
        let header = std::fs::read(path).unwrap();
        u32::from_be_bytes(header[12..16].try_into().unwrap())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_log_restarts_while_writes_never_pause() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("busy.db");
        let log = dir.path().join("busy.db-wal");
        let store = Arc::new(store_at(&path));
        store.execute(begin(ActivityId::new())).await.unwrap();
        let first = log_restarts(&log);
        // Callers that always have a command queued: a commit follows the
        // last with no pause, so a checkpoint beside them never finds the
        // whole log copied.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let callers: Vec<_> = (0..8)
            .map(|_| {
                let (store, stop) = (Arc::clone(&store), Arc::clone(&stop));
                tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        store.execute(begin(ActivityId::new())).await.unwrap();
                    }
                })
            })
            .collect();
        // A frame is a page and a 24-byte header. The writer lets the log
        // grow to `WRITER_PAGES` frames, and a group of 8 adds a few dozen.
        let bound = 2 * u64::from(checkpoint::WRITER_PAGES) * (4096 + 24);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut largest = 0;
        while log_restarts(&log) < first + 2 {
            largest = largest.max(std::fs::metadata(&log).unwrap().len());
            assert!(largest <= bound, "the log grew to {largest} bytes");
            assert!(
                std::time::Instant::now() < deadline,
                "the log restarted less than twice in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for caller in callers {
            caller.await.unwrap();
        }
        assert!(largest > 0);
    }
}
