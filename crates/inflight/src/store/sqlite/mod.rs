//! The embedded default: SQLite through rusqlite (bundled), in WAL mode.
//!
//! One writer thread per process owns the connection. Commands that arrive
//! while a transaction is being written are grouped into the next one (group
//! commit), and each is acknowledged only once that transaction committed.
//! Every transaction is `BEGIN IMMEDIATE`, so several processes sharing one
//! file serialize their writes through SQLite's own lock: a reap pass or an
//! admission decision sees every other process's committed work.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rusqlite::{params, Connection, OptionalExtension, Row, TransactionBehavior};
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::domain::admission::LanePosition;
use crate::domain::counters::{AggregateKey, Totals};
use crate::domain::labels::{ActivityLabels, Label, LabelSet};
use crate::domain::owner::{Owner, OwnerId};
use crate::domain::query::{self, LaneQuery, Retention, Window};
use crate::domain::record::{ActivityId, ActivityRecord, Admission, LaneKey, Priority};
use crate::domain::snapshot::LaneLoad;
use crate::domain::timestamp::Millis;
use crate::domain::transition::Effect;
use crate::domain::ParseError;
use crate::error::{ErrorKind, LedgerError};

use super::engine::{self, Txn};
use super::{Command, Reply, Store, StoreFuture};

mod sql;

use sql::{Backfill, MIGRATIONS};

/// How long a writer waits for another process's transaction to finish.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The pragmas every connection sets, in this order. WAL lets readers in
/// other processes proceed during a write; FULL makes every acknowledged
/// transition durable, even across a power loss, and group commit pays one
/// sync for every command grouped into a transaction. Public so that a
/// benchmark's baseline runs with exactly the same settings.
pub const PRAGMAS: &[(&str, &str)] = &[("journal_mode", "WAL"), ("synchronous", "FULL")];
/// The most commands grouped into one transaction.
const MAX_GROUP: usize = 256;
/// The longest a group waits for the callers of the previous one.
const GROUP_WAIT: Duration = Duration::from_micros(300);

fn owner_from_row(row: &Row<'_>) -> rusqlite::Result<Owner> {
    Ok(Owner {
        owner_id: OwnerId::trusted(row.get(0)?),
        name: Label::trusted(row.get(1)?),
        ttl_ms: row.get(2)?,
        registered_at: row.get(3)?,
        renewed_at: row.get(4)?,
        expires_at: row.get(5)?,
        state: parse_column(row, 6)?,
        ended_at: row.get(7)?,
        reaped_records: row.get(8)?,
        cancelled_records: row.get(9)?,
    })
}

/// What the writer thread is asked to do.
enum Job {
    /// Run a command and answer it.
    Run(Command, oneshot::Sender<Result<Reply, LedgerError>>),
    /// Stop, once every job queued before this one has been answered;
    /// answered once the connection is closed.
    Close(oneshot::Sender<()>),
}

/// A ledger store in one SQLite file, safe to share between processes on one
/// host.
pub struct SqliteStore {
    path: PathBuf,
    jobs: mpsc::Sender<Job>,
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
    /// [`ErrorKind::Storage`] when the file cannot be opened or migrated.
    pub fn open(
        path: impl AsRef<Path>,
        config: Arc<LedgerConfig>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LedgerError> {
        let path = path.as_ref().to_path_buf();
        let mut conn = connect(&path)?;
        migrate(&mut conn)?;
        rebound_in_flight(&mut conn, &config)?;
        let (jobs, queue) = mpsc::channel::<Job>();
        thread::Builder::new()
            .name("inflight-sqlite".into())
            .spawn(move || write_loop(conn, &config, clock.as_ref(), &queue))
            .map_err(|err| LedgerError::storage("cannot start the SQLite writer thread", err))?;
        Ok(Self { path, jobs })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Store for SqliteStore {
    fn execute(&self, command: Command) -> StoreFuture {
        let (reply, answer) = oneshot::channel();
        let sent = self.jobs.send(Job::Run(command, reply));
        StoreFuture::pending(async move {
            sent.map_err(|_| LedgerError::closed())?;
            answer.await.map_err(|_| LedgerError::closed())?
        })
    }

    fn close(&self) -> StoreFuture {
        let (done, closed) = oneshot::channel();
        // Already closed when the writer is gone: nothing left to flush.
        let _ = self.jobs.send(Job::Close(done));
        StoreFuture::pending(async move {
            let _ = closed.await;
            Ok(Reply::Closed)
        })
    }
}

fn sql_error(context: &str) -> impl FnOnce(rusqlite::Error) -> LedgerError + '_ {
    move |err| LedgerError::storage(context, err)
}

fn connect(path: &Path) -> Result<Connection, LedgerError> {
    let conn = Connection::open(path).map_err(sql_error("cannot open the SQLite store"))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(sql_error("cannot set busy_timeout"))?;
    for (name, value) in PRAGMAS {
        conn.pragma_update(None, name, value)
            .map_err(|err| LedgerError::storage(&format!("cannot set PRAGMA {name} = {value}"), err))?;
    }
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

fn migrate(conn: &mut Connection) -> Result<(), LedgerError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(sql_error("cannot begin the migration"))?;
    let version: usize = tx
        .query_row("PRAGMA user_version", [], |row| row.get::<_, i64>(0))
        .map_err(sql_error("cannot read the schema version"))? as usize;
    if version > MIGRATIONS.len() {
        return Err(LedgerError::new(
            ErrorKind::Storage,
            format!(
                "the store's schema version {version} is newer than this build knows ({}); upgrade inflight",
                MIGRATIONS.len()
            ),
        ));
    }
    for (index, migration) in MIGRATIONS.iter().enumerate().skip(version) {
        tx.execute_batch(migration.sql)
            .map_err(sql_error("cannot apply a migration"))?;
        if let Some(backfill) = migration.backfill {
            run_backfill(&tx, backfill)?;
        }
        tx.pragma_update(None, "user_version", (index + 1) as i64)
            .map_err(sql_error("cannot record the schema version"))?;
    }
    tx.commit().map_err(sql_error("cannot commit the migration"))
}

/// Runs what a migration needs done in Rust after its schema change.
fn run_backfill(conn: &Connection, backfill: Backfill) -> Result<(), LedgerError> {
    match backfill {
        Backfill::CompletionMinutes => {
            // Counted by the domain's minute, not restated in SQL.
            let mut counts = PendingCounts::default();
            let completed: Vec<Millis> = query_rows(conn, sql::COMPLETED_AT_ALL, [], |row| row.get(0))?;
            for at in completed {
                *counts
                    .completions
                    .entry(query::completion_minute(at))
                    .or_default() += 1;
            }
            counts.write(conn)
        }
    }
}

/// Recomputes the bounds of in-flight records under `config`
/// ([`engine::rebound`]), so that a configuration change (a longer deadline,
/// a new factor) applies to work already in flight.
fn rebound_in_flight(conn: &mut Connection, config: &LedgerConfig) -> Result<(), LedgerError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(sql_error("cannot begin"))?;
    engine::rebound(&mut SqliteTxn::new(&tx), config.policy())?;
    tx.commit().map_err(sql_error("cannot commit"))
}

fn write_loop(mut conn: Connection, config: &LedgerConfig, clock: &dyn Clock, queue: &mpsc::Receiver<Job>) {
    let mut last_group = 1;
    let mut closing = None;
    while let Ok(first) = queue.recv() {
        let mut group = Group::default();
        group.push(first, &mut closing);
        drain(queue, &mut group, &mut closing);
        // Callers answered by the last commit resubmit within microseconds,
        // while a commit costs a sync: when the last group was larger, wait
        // briefly for them so that one sync serves them all. A lone caller
        // (last group of one) never waits.
        if group.commands.len() < last_group && closing.is_none() {
            let until = Instant::now() + GROUP_WAIT;
            while group.commands.len() < last_group && closing.is_none() {
                let Some(left) = until.checked_duration_since(Instant::now()) else {
                    break;
                };
                match queue.recv_timeout(left) {
                    Ok(job) => {
                        group.push(job, &mut closing);
                        drain(queue, &mut group, &mut closing);
                    }
                    Err(_) => break,
                }
            }
        }
        last_group = group.commands.len().max(1);
        if !group.commands.is_empty() {
            let results = run_group(&mut conn, config, clock, group.commands);
            for (reply, result) in group.replies.into_iter().zip(results) {
                // A caller that went away still had its command committed.
                let _ = reply.send(result);
            }
        }
        if closing.is_some() {
            break;
        }
    }
    // Closed before the caller of `close` hears of it; commands queued
    // after the close are dropped, and their callers told the store closed.
    drop(conn);
    if let Some(done) = closing {
        let _ = done.send(());
    }
}

/// The commands of one transaction and their callers.
#[derive(Default)]
struct Group {
    commands: Vec<Command>,
    replies: Vec<oneshot::Sender<Result<Reply, LedgerError>>>,
}

impl Group {
    /// Adds `job`; a close ends the group and is kept in `closing`.
    fn push(&mut self, job: Job, closing: &mut Option<oneshot::Sender<()>>) {
        match job {
            Job::Run(command, reply) => {
                self.commands.push(command);
                self.replies.push(reply);
            }
            Job::Close(done) => *closing = Some(done),
        }
    }
}

/// Moves jobs already queued into `group`, up to [`MAX_GROUP`] commands,
/// stopping at a close.
fn drain(queue: &mpsc::Receiver<Job>, group: &mut Group, closing: &mut Option<oneshot::Sender<()>>) {
    while group.commands.len() < MAX_GROUP && closing.is_none() {
        match queue.try_recv() {
            Ok(job) => group.push(job, closing),
            Err(_) => return,
        }
    }
}

/// Runs `commands` in one transaction, each inside its own savepoint so that
/// a storage failure in one leaves the others intact.
fn run_group(
    conn: &mut Connection,
    config: &LedgerConfig,
    clock: &dyn Clock,
    commands: Vec<Command>,
) -> Vec<Result<Reply, LedgerError>> {
    let count = commands.len();
    let failed_all = |err: LedgerError| -> Vec<Result<Reply, LedgerError>> {
        tracing::error!(error = %err, "SQLite transaction failed");
        (0..count)
            .map(|_| Err(LedgerError::new(ErrorKind::Storage, err.message().to_owned())))
            .collect()
    };
    let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(err) => return failed_all(LedgerError::storage("cannot begin a transaction", err)),
    };
    let mut results = Vec::with_capacity(count);
    // Counter changes of the commands kept so far, written once per counter
    // row: before a command that reads the counters, and before the commit.
    let mut counts = PendingCounts::default();
    for command in commands {
        if matches!(command, Command::Snapshot { .. }) {
            if let Err(err) = counts.write(&tx) {
                drop(tx);
                return failed_all(err);
            }
        }
        // A savepoint per command, by prepared statements: rusqlite's
        // `Savepoint` formats and parses its statements every time.
        if let Err(err) = savepoint(&tx, sql::SAVEPOINT) {
            results.push(Err(LedgerError::storage("cannot open a savepoint", err)));
            continue;
        }
        // Read once the write lock is held: timestamps follow commit order.
        let now = clock.now();
        let mut txn = SqliteTxn::new(&tx);
        let result = engine::execute(&mut txn, config, command, now);
        let pending = std::mem::take(&mut txn.counts);
        // A refusal keeps what time forced (a reap); a storage failure keeps
        // nothing, its counts included.
        let keep = !matches!(&result, Err(err) if err.kind() == ErrorKind::Storage);
        let released = if keep {
            savepoint(&tx, sql::RELEASE)
        } else {
            savepoint(&tx, sql::ROLLBACK_TO).and_then(|()| savepoint(&tx, sql::RELEASE))
        };
        results.push(match released {
            Ok(()) => {
                if keep {
                    counts.merge(pending);
                }
                result
            }
            Err(err) => Err(LedgerError::storage("cannot release a savepoint", err)),
        });
    }
    if let Err(err) = counts.write(&tx) {
        drop(tx);
        return failed_all(err);
    }
    match tx.commit() {
        Ok(()) => results,
        Err(err) => failed_all(LedgerError::storage("cannot commit", err)),
    }
}

/// Runs one of the statements that open, release or roll back a command's
/// savepoint, prepared once per connection.
fn savepoint(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

struct SqliteTxn<'c> {
    conn: &'c Connection,
    /// The record the last `peek` read, until anything writes.
    peeked: Option<Arc<ActivityRecord>>,
    /// The counter changes of this command, for its group to write.
    counts: PendingCounts,
}

impl<'c> SqliteTxn<'c> {
    fn new(conn: &'c Connection) -> Self {
        Self {
            conn,
            peeked: None,
            counts: PendingCounts::default(),
        }
    }
}

/// Counter changes not yet written: the totals of each aggregate and the
/// completions of each minute. A group of commands that count into the same
/// rows (most groups: concurrent calls on one lane) writes each row once
/// instead of once per command.
#[derive(Default)]
struct PendingCounts {
    totals: std::collections::HashMap<(ActivityLabels, Priority, Admission), Totals>,
    completions: std::collections::BTreeMap<i64, i64>,
}

impl PendingCounts {
    fn merge(&mut self, other: Self) {
        for (key, totals) in other.totals {
            self.totals.entry(key).or_default().add(&totals);
        }
        for (minute, completions) in other.completions {
            *self.completions.entry(minute).or_default() += completions;
        }
    }

    /// Writes them all and forgets them.
    fn write(&mut self, conn: &Connection) -> Result<(), LedgerError> {
        for ((labels, priority, admission), totals) in self.totals.drain() {
            add_to_aggregate(conn, &AggregateKey::new(&labels, priority, admission), &totals)?;
        }
        let mut statement = conn
            .prepare_cached(sql::COUNT_COMPLETIONS)
            .map_err(sql_error("cannot prepare"))?;
        for (minute, completions) in std::mem::take(&mut self.completions) {
            statement
                .execute([minute, completions])
                .map_err(sql_error("cannot count completions"))?;
        }
        Ok(())
    }
}

fn parse_column<T: std::str::FromStr<Err = ParseError>>(row: &Row<'_>, index: usize) -> rusqlite::Result<T> {
    let text: String = row.get(index)?;
    text.parse().map_err(|err: ParseError| {
        rusqlite::Error::FromSqlConversionFailure(index, rusqlite::types::Type::Text, Box::new(err))
    })
}

fn parse_optional<T: std::str::FromStr<Err = ParseError>>(
    row: &Row<'_>,
    index: usize,
) -> rusqlite::Result<Option<T>> {
    match row.get::<_, Option<String>>(index)? {
        None => Ok(None),
        Some(text) => text.parse().map(Some).map_err(|err: ParseError| {
            rusqlite::Error::FromSqlConversionFailure(index, rusqlite::types::Type::Text, Box::new(err))
        }),
    }
}

fn record_from_row(row: &Row<'_>) -> rusqlite::Result<ActivityRecord> {
    let id: String = row.get(0)?;
    let activity_id = id.parse().map_err(|err: uuid::Error| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(err))
    })?;
    let mut record = ActivityRecord {
        activity_id,
        labels: ActivityLabels::new(LabelSet {
            service: Label::trusted(row.get(1)?),
            provider: Label::trusted(row.get(2)?),
            class: Label::trusted(row.get(3)?),
            operation_stage: Label::trusted(row.get(4)?),
            model: row.get(5)?,
        }),
        priority: parse_column(row, 6)?,
        admission: parse_column(row, 7)?,
        state: parse_column(row, 8)?,
        disposition: parse_optional(row, 9)?,
        reap_reason: parse_optional(row, 10)?,
        owner_id: row.get(11)?,
        enqueued_at: row.get(12)?,
        started_at: row.get(13)?,
        completed_at: row.get(14)?,
        reaped_at: row.get(15)?,
        declared_deadline_ms: row.get(16)?,
        deadline_ms: row.get(17)?,
        reapable_at: row.get(18)?,
        queue_wait_ms: None,
        execution_ms: None,
        success: row.get(19)?,
        failure_stage: parse_optional(row, 20)?,
        late_settle: row.get(21)?,
        cancel_reason: row.get(22)?,
    };
    // Not stored: implied by the instants.
    record.derive_durations();
    Ok(record)
}

/// Runs a query and maps every row with `from_row`.
fn query_rows<T>(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
    from_row: fn(&Row<'_>) -> rusqlite::Result<T>,
) -> Result<Vec<T>, LedgerError> {
    let mut statement = conn.prepare_cached(sql).map_err(sql_error("cannot prepare"))?;
    let rows = statement
        .query_map(params, from_row)
        .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
        .map_err(sql_error("cannot read rows"))?;
    Ok(rows)
}

/// Records read for the engine, which shares what it reads.
fn shared(
    records: Result<Vec<ActivityRecord>, LedgerError>,
) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
    records.map(|records| records.into_iter().map(Arc::new).collect())
}

fn query_records(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<ActivityRecord>, LedgerError> {
    query_rows(conn, sql, params, record_from_row)
}

/// Adds `d` to the totals of `key`.
fn add_to_aggregate(conn: &Connection, key: &AggregateKey, d: &Totals) -> Result<(), LedgerError> {
    let mut statement = conn
        .prepare_cached(sql::ADD_TO_AGGREGATE)
        .map_err(sql_error("cannot prepare"))?;
    statement
        .execute(params![
            key.service,
            key.operation_stage,
            key.class,
            key.provider,
            key.model,
            key.priority.as_str(),
            key.admission.as_str(),
            d.calls,
            d.succeeded,
            d.failed,
            d.cancelled,
            d.reaped_abandoned,
            d.reaped_unsettled,
            d.reaped_owner_lost,
            d.late_settles,
            d.resurrections,
            d.in_flight,
            d.queue_wait_count,
            d.queue_wait_sum_ms,
            d.queue_wait_max_ms,
            d.execution_count,
            d.execution_sum_ms,
            d.execution_max_ms,
            d.last_seen_at,
        ])
        .map_err(sql_error("cannot update counters"))?;
    Ok(())
}

impl SqliteTxn<'_> {
    /// Overwrites the stored row of `record`.
    fn overwrite(&self, record: &ActivityRecord) -> Result<(), LedgerError> {
        self.write(sql::UPDATE_RECORD, record)
    }

    fn write(&self, sql: &str, record: &ActivityRecord) -> Result<(), LedgerError> {
        let mut statement = self
            .conn
            .prepare_cached(sql)
            .map_err(sql_error("cannot prepare"))?;
        statement
            .execute(params![
                record.activity_id.to_string(),
                record.labels.service.as_str(),
                record.labels.provider.as_str(),
                record.labels.class.as_str(),
                record.labels.operation_stage.as_str(),
                record.labels.model,
                record.priority.as_str(),
                record.admission.as_str(),
                record.state.as_str(),
                record.disposition.map(|d| d.as_str()),
                record.reap_reason.map(|r| r.as_str()),
                record.owner_id,
                record.enqueued_at,
                record.started_at,
                record.completed_at,
                record.reaped_at,
                record.declared_deadline_ms,
                record.deadline_ms,
                record.reapable_at,
                record.success,
                record.failure_stage.map(|s| s.as_str()),
                record.late_settle,
                record.cancel_reason,
            ])
            .map_err(|err| match err {
                // The primary key: the id is taken. Stores agree on the kind.
                rusqlite::Error::SqliteFailure(failure, _)
                    if failure.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY =>
                {
                    LedgerError::new(
                        ErrorKind::Conflict,
                        format!("activity {} already exists", record.activity_id),
                    )
                }
                other => LedgerError::storage("cannot write a record", other),
            })?;
        Ok(())
    }
}

impl SqliteTxn<'_> {
    /// Runs `sql` with `params` and reads one value.
    fn value<T: rusqlite::types::FromSql>(
        &self,
        sql: &str,
        params: impl rusqlite::Params,
    ) -> Result<T, LedgerError> {
        self.conn
            .prepare_cached(sql)
            .and_then(|mut statement| statement.query_row(params, |row| row.get(0)))
            .map_err(sql_error("cannot read"))
    }

    /// Runs `sql` with `params` for its changes.
    fn run(&self, sql: &str, params: impl rusqlite::Params) -> Result<usize, LedgerError> {
        self.conn
            .prepare_cached(sql)
            .and_then(|mut statement| statement.execute(params))
            .map_err(sql_error("cannot write"))
    }
}

impl Txn for SqliteTxn<'_> {
    fn get(&mut self, id: ActivityId) -> Result<Option<Arc<ActivityRecord>>, LedgerError> {
        let mut statement = self
            .conn
            .prepare_cached(sql::GET_RECORD)
            .map_err(sql_error("cannot prepare"))?;
        statement
            .query_row([id.to_string()], record_from_row)
            .optional()
            .map(|record| record.map(Arc::new))
            .map_err(sql_error("cannot read a record"))
    }

    fn insert(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        self.peeked = None;
        self.write(sql::INSERT_RECORD, record)
    }

    fn update(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        self.peeked = None;
        self.overwrite(record)
    }

    fn peek(&mut self, id: ActivityId, look: &mut dyn FnMut(&ActivityRecord)) -> Result<bool, LedgerError> {
        let Some(record) = self.get(id)? else {
            return Ok(false);
        };
        look(&record);
        // Kept for a modify that follows, which then reads no row again.
        self.peeked = Some(record);
        Ok(true)
    }

    fn modify(
        &mut self,
        id: ActivityId,
        change: &mut dyn FnMut(&mut ActivityRecord) -> bool,
    ) -> Result<Option<Arc<ActivityRecord>>, LedgerError> {
        let peeked = self.peeked.take().filter(|record| record.activity_id == id);
        let Some(mut record) = peeked.map_or_else(|| self.get(id), |record| Ok(Some(record)))? else {
            return Ok(None);
        };
        if change(Arc::make_mut(&mut record)) {
            self.overwrite(&record)?;
        }
        Ok(Some(record))
    }

    fn delete(&mut self, ids: &[ActivityId]) -> Result<usize, LedgerError> {
        self.peeked = None;
        let mut deleted = 0;
        for id in ids {
            deleted += self.run(sql::DELETE_RECORD, [id.to_string()])?;
        }
        Ok(deleted)
    }

    fn add_totals(&mut self, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError> {
        let key = (record.labels.clone(), record.priority, record.admission);
        let totals = self.counts.totals.entry(key).or_default();
        for effect in effects {
            totals.count(effect);
        }
        Ok(())
    }

    fn count_completion(&mut self, minute: i64) -> Result<(), LedgerError> {
        *self.counts.completions.entry(minute).or_default() += 1;
        Ok(())
    }

    fn aggregates(&mut self) -> Result<Vec<(AggregateKey, Totals)>, LedgerError> {
        // What this command counted (a reap on read) is part of what it reads.
        self.counts.write(self.conn)?;
        query_rows(self.conn, sql::AGGREGATES, [], |row| {
            Ok((
                AggregateKey {
                    service: row.get(0)?,
                    operation_stage: row.get(1)?,
                    class: row.get(2)?,
                    provider: row.get(3)?,
                    model: row.get(4)?,
                    priority: parse_column(row, 5)?,
                    admission: parse_column(row, 6)?,
                },
                Totals {
                    calls: row.get(7)?,
                    succeeded: row.get(8)?,
                    failed: row.get(9)?,
                    cancelled: row.get(10)?,
                    reaped_abandoned: row.get(11)?,
                    reaped_unsettled: row.get(12)?,
                    reaped_owner_lost: row.get(13)?,
                    late_settles: row.get(14)?,
                    resurrections: row.get(15)?,
                    in_flight: row.get(16)?,
                    queue_wait_count: row.get(17)?,
                    queue_wait_sum_ms: row.get(18)?,
                    queue_wait_max_ms: row.get(19)?,
                    execution_count: row.get(20)?,
                    execution_sum_ms: row.get(21)?,
                    execution_max_ms: row.get(22)?,
                    last_seen_at: row.get(23)?,
                },
            ))
        })
    }

    fn completion_minutes_from(&mut self, minute: i64) -> Result<i64, LedgerError> {
        self.counts.write(self.conn)?;
        self.value(sql::COMPLETION_MINUTES_FROM, [minute])
    }

    fn delete_minutes_before(&mut self, minute: i64) -> Result<(), LedgerError> {
        self.counts.write(self.conn)?;
        self.run(sql::DELETE_MINUTES_BEFORE, [minute]).map(|_| ())
    }

    fn stored_records(&mut self) -> Result<i64, LedgerError> {
        self.value(sql::STORED_RECORDS, [])
    }

    fn get_owner(&mut self, id: &OwnerId) -> Result<Option<Owner>, LedgerError> {
        Ok(query_rows(self.conn, sql::GET_OWNER, [id.as_str()], owner_from_row)?.pop())
    }

    fn put_owner(&mut self, owner: &Owner) -> Result<(), LedgerError> {
        self.run(
            sql::PUT_OWNER,
            params![
                owner.owner_id.as_str(),
                owner.name.as_str(),
                owner.ttl_ms,
                owner.registered_at,
                owner.renewed_at,
                owner.expires_at,
                owner.state.as_str(),
                owner.ended_at,
                owner.reaped_records,
                owner.cancelled_records,
            ],
        )
        .map(|_| ())
    }

    fn due(&mut self, now: Millis, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        shared(query_records(self.conn, sql::DUE, params![now, limit as i64]))
    }

    fn lane_position(&mut self, query: &LaneQuery) -> Result<LanePosition, LedgerError> {
        let mut statement = self
            .conn
            .prepare_cached(sql::LANE_POSITION)
            .map_err(sql_error("cannot prepare"))?;
        statement
            .query_row(
                params![
                    query.lane.service.as_str(),
                    query.lane.provider.as_str(),
                    query.activity_id.to_string(),
                    query.enqueued_at,
                    query.newcomer
                ],
                |row| {
                    Ok(LanePosition {
                        executing: row.get(0)?,
                        waiting_ahead: row.get(1)?,
                    })
                },
            )
            .map_err(sql_error("cannot read the lane"))
    }

    fn in_flight(&mut self, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        shared(query_records(self.conn, sql::IN_FLIGHT, [limit]))
    }

    fn in_flight_count(&mut self) -> Result<i64, LedgerError> {
        self.value(sql::IN_FLIGHT_COUNT, [])
    }

    fn lane_loads(&mut self) -> Result<Vec<LaneLoad>, LedgerError> {
        query_rows(self.conn, sql::LANE_LOADS, [], |row| {
            Ok(LaneLoad {
                lane: LaneKey {
                    service: Label::trusted(row.get(0)?),
                    provider: Label::trusted(row.get(1)?),
                },
                executing: row.get(2)?,
                waiting: row.get(3)?,
                oldest_waiting_since: row.get(4)?,
            })
        })
    }

    fn completed(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        query_records(self.conn, sql::COMPLETED, params![window.since, limit])
    }

    fn completed_between(&mut self, from: Millis, to: Millis) -> Result<i64, LedgerError> {
        self.value(sql::COMPLETED_BETWEEN, [from, to])
    }

    fn reaped(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        query_records(self.conn, sql::REAPED, params![window.since, limit])
    }

    fn listed_owners(&mut self, window: Window) -> Result<Vec<Owner>, LedgerError> {
        query_rows(self.conn, sql::LISTED_OWNERS, [window.since], owner_from_row)
    }

    fn expired_owners(&mut self, now: Millis) -> Result<Vec<Owner>, LedgerError> {
        query_rows(self.conn, sql::EXPIRED_OWNERS, [now], owner_from_row)
    }

    fn owner_in_flight(&mut self, id: &OwnerId) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        shared(query_records(self.conn, sql::OWNER_IN_FLIGHT, [id.as_str()]))
    }

    fn prunable(&mut self, retention: Retention, limit: usize) -> Result<Vec<ActivityId>, LedgerError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        query_rows(
            self.conn,
            sql::PRUNABLE,
            params![retention.before, limit],
            |row| {
                let id: String = row.get(0)?;
                id.parse().map_err(|err: uuid::Error| {
                    rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(err))
                })
            },
        )
    }

    fn prune_owners(&mut self, retention: Retention) -> Result<(), LedgerError> {
        self.run(sql::PRUNE_OWNERS, [retention.before]).map(|_| ())
    }
}

/// Bulk-loads `count` settled records, completed over the hour before
/// `completed_at`, with their counters, straight into the database at
/// `path`: for benchmarks that need a large history fast. Not for
/// production use.
///
/// # Errors
/// `Storage` when the database cannot be opened or written.
#[doc(hidden)]
pub fn seed_history(path: &Path, count: usize, completed_at: Millis) -> Result<(), LedgerError> {
    let mut conn = connect(path)?;
    migrate(&mut conn)?;
    let tx = conn.transaction().map_err(sql_error("cannot begin"))?;
    let mut counts = PendingCounts::default();
    {
        let mut insert = tx
            .prepare(sql::SEED_RECORD)
            .map_err(sql_error("cannot prepare"))?;
        for i in 0..count {
            let done = completed_at - (i as i64 % 3_600_000);
            insert
                .execute(params![ActivityId::new().to_string(), done - 20, done - 10, done])
                .map_err(sql_error("cannot seed history"))?;
            *counts
                .completions
                .entry(query::completion_minute(done))
                .or_default() += 1;
        }
        let n = count as i64;
        let labels = ActivityLabels::validate(&crate::domain::labels::RawLabels {
            service: "bench-history",
            provider: "ollama",
            class: Some("embedding"),
            operation_stage: Some("history"),
            model: Some("nomic-embed-text"),
        })?;
        counts.totals.insert(
            (labels, Priority::Batch, Admission::Queued),
            Totals {
                calls: n,
                succeeded: n,
                queue_wait_count: n,
                queue_wait_sum_ms: 10 * n,
                queue_wait_max_ms: 10,
                execution_count: n,
                execution_sum_ms: 10 * n,
                execution_max_ms: 10,
                last_seen_at: Some(completed_at),
                ..Totals::default()
            },
        );
        counts.write(&tx)?;
    }
    tx.commit().map_err(sql_error("cannot commit"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;
    use crate::domain::snapshot::{Snapshot, SnapshotOptions};
    use crate::domain::transition::{NewActivity, Transition};

    const T0: Millis = 1_700_000_000_000;

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
        let mut conn = connect(&dir.path().join("counts.db")).unwrap();
        migrate(&mut conn).unwrap();
        (dir, conn)
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
    fn a_group_writes_its_counts_once_and_a_snapshot_in_it_sees_them() {
        let (_dir, mut conn) = database();
        let config = LedgerConfig::default();
        let clock = FakeClock::at(T0);
        let (a, b) = (ActivityId::new(), ActivityId::new());

        let results = run_group(&mut conn, &config, &clock, vec![begin(a), begin(b), snapshot()]);
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
            },
        };
        let results = run_group(&mut conn, &config, &clock, vec![settle, snapshot()]);
        assert!(results[0].is_ok());
        assert_eq!(snapshot_of(&results[1]).total_recent_completions, 1);

        // Written at the commit: a later group reads them from the file.
        let results = run_group(&mut conn, &config, &clock, vec![snapshot()]);
        let after = snapshot_of(&results[0]);
        assert_eq!((after.total_activities, after.total_in_flight), (2, 1));
        assert_eq!(after.total_recent_completions, 1);
    }

    #[test]
    fn a_refused_begin_in_a_group_counts_nothing() {
        let (_dir, mut conn) = database();
        let config = LedgerConfig::default();
        let clock = FakeClock::at(T0);
        let (a, b) = (ActivityId::new(), ActivityId::new());
        let duplicate = begin(a);
        let results = run_group(
            &mut conn,
            &config,
            &clock,
            vec![begin(a), duplicate, begin(b), snapshot()],
        );
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Conflict);
        assert_eq!(snapshot_of(&results[3]).total_activities, 2);
    }
}
