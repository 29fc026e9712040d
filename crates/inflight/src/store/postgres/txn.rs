//! The transaction: [`PgTxn`] implements the engine's `Txn` over one
//! connection, with one statement of `sql.rs` per primitive and question,
//! and adds up the counter changes of a group to write them once.
//!
//! [`Records`] keeps what a group's transaction knows of the records it
//! holds locked: those its commands name, read and locked in one round trip
//! before the first runs ([`Records::lock`]), and those it wrote since.
//! Reads of them are served from it; without savepoints, writes to records
//! wait in it and go out in one statement ([`Records::flush`]) before any
//! statement that reads `activities`, and before the commit.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use postgres::types::ToSql;
use postgres::{Row, Statement};
use smallvec::SmallVec;

use crate::domain::capacity::Capacity;
use crate::domain::counters::AggregateKey;
use crate::domain::idempotency::Idempotency;
use crate::domain::labels::{ActivityLabels, Label};
use crate::domain::record::{ActivityId, ActivityRecord, Admission, LaneKey, Priority};
use crate::domain::transition::Effect;
use crate::error::{ErrorKind, LedgerError};
use crate::store::engine::Txn;
use crate::store::sql::codec::{self, Columns, Value};
use crate::store::sql::columns::{LABEL_COLUMNS, RECORD_COLUMNS, TOTALS_COLUMNS};
use crate::store::sql::counts::PendingCounts;
use crate::store::sql::group::Landed;
use crate::store::sql::questions::{Driver, Reads};

use super::order::{Done, EARLIER_WAIT};
use super::session::Session;
use super::sql;

/// What a failed statement means for the transaction it ran in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    /// A deadlock or serialization failure: run the group again.
    Retry,
    /// The connection is gone or the server refuses work: `unavailable`.
    Unavailable,
    /// Anything else: a storage failure of this command.
    Other,
    /// A deferred write did not land as its command expected (an id taken
    /// by a record this transaction had not read): the group runs again
    /// writing each record at once, so that the command that meets it is
    /// told, as without deferral.
    Redo,
    /// An earlier group of this process did not end within
    /// [`EARLIER_WAIT`] while this one waited for it holding
    /// locks: the group rolls back, waits for it without them, and runs
    /// again (the earlier group may be waiting on one of those locks).
    Yield,
}

impl Fault {
    pub(super) fn of(err: &postgres::Error) -> Self {
        use postgres::error::SqlState;
        if err.is_closed() {
            return Self::Unavailable;
        }
        match err.code() {
            Some(code)
                if *code == SqlState::T_R_DEADLOCK_DETECTED
                    || *code == SqlState::T_R_SERIALIZATION_FAILURE =>
            {
                Self::Retry
            }
            Some(code)
                if code.code().starts_with("08")
                    || code.code().starts_with("57P")
                    || *code == SqlState::LOCK_NOT_AVAILABLE
                    || *code == SqlState::QUERY_CANCELED =>
            {
                Self::Unavailable
            }
            Some(_) => Self::Other,
            // No code: the client's side failed, an I/O error on the socket
            // unless it is a conversion of a value.
            None => {
                let io = std::error::Error::source(err).is_some_and(|source| source.is::<std::io::Error>());
                if io {
                    Self::Unavailable
                } else {
                    Self::Other
                }
            }
        }
    }

    /// `err` as a ledger error of the kind this fault says.
    pub(super) fn error(self, context: &str, err: postgres::Error) -> LedgerError {
        let kind = match self {
            Self::Unavailable => ErrorKind::Unavailable,
            Self::Retry | Self::Other | Self::Redo | Self::Yield => ErrorKind::Storage,
        };
        LedgerError::caused(kind, context, err)
    }
}

/// One connection and the statements prepared on it, each once, found again
/// by the address of its text.
pub(super) struct Conn {
    pub(super) client: Session,
    /// The channel this store's notifications go to.
    pub(super) channel: String,
    prepared: HashMap<(usize, usize), Statement>,
    /// Aggregates this connection saw stored.
    known_aggregates: crate::store::sql::counts::SeenAggregates<()>,
    /// Which of the counter rows this connection adds to (`shard` in
    /// `aggregates` and `completion_minutes`): its writer's index.
    pub(super) shard: i16,
    /// Whether a `COMMIT` was sent since the last `BEGIN`: the transaction
    /// has ended (committed, or rolled back behind a failed statement), and
    /// a `ROLLBACK` would only draw a warning from the server.
    pub(super) ended: bool,
}

impl Conn {
    pub(super) fn new(client: Session, channel: String) -> Self {
        Self {
            client,
            channel,
            prepared: HashMap::with_capacity(48),
            known_aggregates: crate::store::sql::counts::SeenAggregates::default(),
            shard: 0,
            ended: false,
        }
    }

    /// Forgets the aggregates it saw, once a transaction or a savepoint is
    /// rolled back: one seen inside it (counted by an earlier command of
    /// the group) may be gone.
    pub(super) fn forget_uncommitted(&mut self) {
        self.known_aggregates.clear();
    }

    /// `sql`, prepared the first time it is asked for.
    pub(super) fn prepare(&mut self, sql: &'static str) -> Result<Statement, postgres::Error> {
        let key = (sql.as_ptr() as usize, sql.len());
        if let Some(statement) = self.prepared.get(&key) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare(sql)?;
        self.prepared.insert(key, statement.clone());
        Ok(statement)
    }
}

/// What a group's transaction knows of the records it holds locked, and
/// its record writes not sent yet.
///
/// Every record here is locked by the transaction (read `FOR UPDATE`,
/// written, or inserted by it), so no other transaction can change it
/// before the commit: its version here is the one stored, once the
/// deferred writes are sent.
#[derive(Default)]
pub(super) struct Records {
    /// The records, as this transaction left them.
    cached: HashMap<ActivityId, Arc<ActivityRecord>>,
    /// Writes not sent yet, by id: the record, and whether it is new.
    pending: BTreeMap<ActivityId, (Arc<ActivityRecord>, bool)>,
    /// Whether writes wait for [`Records::flush`]; each is sent at once
    /// otherwise (a group run with a savepoint per command).
    defer: bool,
}

/// Why deferred writes were not all sent.
pub(super) enum Unflushed {
    /// The statement failed.
    Failed(postgres::Error),
    /// It ran, but not as written: an id taken (see [`Fault::Redo`]), or a
    /// record to overwrite gone.
    Unexpected,
    /// The writes landed and the `COMMIT` sent with them failed.
    Uncommitted(postgres::Error),
    /// The notification sent before them failed (and so did they).
    Unnotified(postgres::Error),
}

/// What a group's last [`write_group`] also sends in its round trip.
#[derive(Clone, Copy, Default)]
pub(super) struct Last<'a> {
    /// `pg_notify` with this payload (`listen::notice`), before the writes: a
    /// slot of a capped lane was granted or freed, and the other instances
    /// are told.
    pub(super) notify: Option<&'a str>,
    /// `COMMIT`, behind the writes.
    pub(super) commit: bool,
}

impl Records {
    /// Nothing known; writes deferred when `defer`.
    pub(super) fn new(defer: bool) -> Self {
        Self {
            defer,
            ..Self::default()
        }
    }

    /// Keeps the records `LOCK_RECORDS` read and locked (see
    /// [`super::writer::begin`]). An id with no record is simply not kept:
    /// its command reads it again, and finds nothing.
    pub(super) fn locked(&mut self, rows: &[Row]) {
        for row in rows {
            // A row that cannot be read is left to its command's own read,
            // which fails that command alone.
            if let Ok(record) = codec::record_from(row) {
                self.cached.insert(record.activity_id, Arc::new(record));
            }
        }
    }

    /// The ids `LOCK_RECORDS` takes for a group naming `ids`: sorted, so
    /// that groups naming the same records lock them in the same order.
    pub(super) fn lock_ids(ids: impl Iterator<Item = ActivityId>) -> Vec<String> {
        let mut ids: Vec<String> = ids.map(|id| id.to_string()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Forgets everything: after a command's savepoint was rolled back, the
    /// records it changed are no longer as kept here.
    pub(super) fn forget(&mut self) {
        self.cached.clear();
        self.pending.clear();
    }

    /// Whether writes wait to be sent.
    pub(super) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Sends the deferred writes, in one statement.
    pub(super) fn flush(&mut self, conn: &mut Conn) -> Result<(), Unflushed> {
        write_group(conn, self, &mut PendingCounts::default(), Last::default())
    }
}

impl Unflushed {
    /// What it means for the command, in `context`.
    pub(super) fn into_error(self, context: &str) -> LedgerError {
        match self {
            Self::Failed(err) | Self::Uncommitted(err) | Self::Unnotified(err) => {
                LedgerError::storage(context, err)
            }
            Self::Unexpected => {
                LedgerError::new(ErrorKind::Storage, format!("{context}: a write did not land"))
            }
        }
    }
}

/// Writes `counts`, in one statement, and forgets them.
pub(super) fn write_counts(conn: &mut Conn, counts: &mut PendingCounts) -> Result<(), Unflushed> {
    write_group(conn, &mut Records::default(), counts, Last::default())
}

/// Sends `records`' deferred writes and `counts` in one statement
/// ([`sql::WRITE_GROUP`]), and forgets both: a group's last round trip
/// before its commit carries all it wrote. What `last` asks for goes in
/// the same round trip; each request still runs when one before it
/// failed, and a `COMMIT` then rolls back.
pub(super) fn write_group(
    conn: &mut Conn,
    records: &mut Records,
    counts: &mut PendingCounts,
    last: Last<'_>,
) -> Result<(), Unflushed> {
    if records.pending.is_empty() && counts.is_empty() && last.notify.is_none() {
        // Nothing to write: a read-only group ends with a plain COMMIT.
        if last.commit {
            conn.ended = true;
            conn.client
                .batch_execute(sql::COMMIT)
                .map_err(Unflushed::Uncommitted)?;
        }
        return Ok(());
    }
    let notify = match last.notify {
        Some(_) => Some(conn.prepare(sql::NOTIFY).map_err(Unflushed::Unnotified)?),
        None => None,
    };
    let pending = std::mem::take(&mut records.pending);
    let ids: Vec<String> = pending.keys().map(ToString::to_string).collect();
    // The records, one array per column (`record_columns!`).
    let mut columns: [Vec<Value<'_>>; RECORD_COLUMNS] =
        std::array::from_fn(|_| Vec::with_capacity(ids.len()));
    for ((record, _), id) in pending.values().zip(&ids) {
        for (column, value) in columns.iter_mut().zip(codec::record_values(record, id)) {
            column.push(value);
        }
    }
    let fresh: Vec<bool> = pending.values().map(|(_, fresh)| *fresh).collect();
    let new = fresh.iter().filter(|fresh| **fresh).count();

    let mut totals: Vec<(AggregateKey, _)> = counts
        .totals
        .drain()
        .map(|((labels, priority, admission), totals)| {
            (AggregateKey::new(&labels, priority, admission), totals)
        })
        .collect();
    totals.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    // The counters, one array per column (`aggregate_labels!`, then
    // `totals_columns!`).
    let mut sums: [Vec<Value<'_>>; LABEL_COLUMNS + TOTALS_COLUMNS] =
        std::array::from_fn(|_| Vec::with_capacity(totals.len()));
    for (key, d) in &totals {
        let values = codec::aggregate_key_values(key)
            .into_iter()
            .chain(codec::totals_values(d));
        for (column, value) in sums.iter_mut().zip(values) {
            column.push(value);
        }
    }
    let (minutes, completions): (Vec<i64>, Vec<i64>) =
        std::mem::take(&mut counts.completions).into_iter().unzip();

    let shard = conn.shard;
    let statement = conn.prepare(sql::WRITE_GROUP).map_err(Unflushed::Failed)?;
    // Every overwrite must find its row (it holds its lock), every new
    // record its id free, and every counter its row: the statement checks
    // it, and fails otherwise ($60 to $63).
    let expected = [
        (ids.len() - new) as i64,
        new as i64,
        totals.len() as i64,
        minutes.len() as i64,
    ];
    let mut params: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(63);
    params.extend(columns.iter().map(|column| column as &(dyn ToSql + Sync)));
    params.push(&fresh);
    params.extend(sums.iter().map(|column| column as &(dyn ToSql + Sync)));
    params.extend([&minutes as &(dyn ToSql + Sync), &completions, &shard]);
    params.extend(expected.iter().map(|count| count as &(dyn ToSql + Sync)));
    let params = &params[..];
    conn.ended |= last.commit;
    let payload = last.notify.unwrap_or_default();
    let channel: [&(dyn ToSql + Sync); 2] = [&conn.channel, &payload];
    let before = notify.as_ref().map(|notify| (notify, &channel[..]));
    let then = last.commit.then_some(sql::COMMIT);
    let (notified, written, committed) = conn.client.pipeline_then(before, &statement, params, then);
    // A failed notification failed the writes behind it.
    notified.map_err(Unflushed::Unnotified)?;
    match written {
        Err(err) if err.code().is_some_and(|code| code.code() == sql::WRITE_MISSED) => {
            return Err(Unflushed::Unexpected)
        }
        // A COMMIT sent behind a failed statement rolled back.
        Err(err) => return Err(Unflushed::Failed(err)),
        Ok(_) => {}
    }
    if let Some(Err(err)) = committed {
        return Err(Unflushed::Uncommitted(err));
    }
    Ok(())
}

pub(super) struct PgTxn<'c> {
    conn: &'c mut Conn,
    /// The group's records: what it locked, and its deferred writes.
    records: &'c mut Records,
    /// The counter changes of this command, for its group to write.
    pub(super) counts: PendingCounts,
    /// What the last failed statement means, if one failed.
    pub(super) fault: Option<Fault>,
    /// Whether reads of records in flight lock them (the rebound at open).
    pub(super) lock_in_flight: bool,
    /// What this command did, to publish once its group is committed.
    pub(super) landed: Vec<Landed>,
    /// The end of the groups this process ran before this one, which every
    /// read beyond the group's own records waits for
    /// ([`super::order::Order`]).
    pub(super) previous: Option<&'c Done>,
}

impl<'c> PgTxn<'c> {
    pub(super) fn new(conn: &'c mut Conn, records: &'c mut Records) -> Self {
        Self {
            conn,
            records,
            counts: PendingCounts::default(),
            fault: None,
            lock_in_flight: false,
            landed: Vec::new(),
            previous: None,
        }
    }

    /// Waits until every group this process ran before has ended, so that a
    /// read sees what commands submitted earlier did; fails with
    /// [`Fault::Yield`] when they take too long.
    fn after_earlier_groups(&mut self) -> Result<(), LedgerError> {
        if let Some(previous) = self.previous.take() {
            if !previous.wait_for(EARLIER_WAIT) {
                self.fault = Some(Fault::Yield);
                return Err(LedgerError::new(
                    ErrorKind::Storage,
                    "an earlier group did not end: this one runs again",
                ));
            }
        }
        Ok(())
    }

    fn failed(&mut self, context: &str, err: postgres::Error) -> LedgerError {
        let fault = Fault::of(&err);
        self.fault = Some(fault);
        fault.error(context, err)
    }

    /// Sends the deferred record writes: before any statement that reads
    /// `activities`, so that it sees them.
    fn flush(&mut self) -> Result<(), LedgerError> {
        match self.records.flush(self.conn) {
            Ok(()) => Ok(()),
            Err(Unflushed::Failed(err) | Unflushed::Uncommitted(err) | Unflushed::Unnotified(err)) => {
                Err(self.failed("cannot write records", err))
            }
            Err(Unflushed::Unexpected) => {
                self.fault = Some(Fault::Redo);
                Err(LedgerError::new(
                    ErrorKind::Storage,
                    "a deferred record write did not land",
                ))
            }
        }
    }

    /// `sql`, a statement that touches no record: deferred writes may wait.
    fn query_other(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, LedgerError> {
        self.after_earlier_groups()?;
        let result = self
            .conn
            .prepare(sql)
            .and_then(|statement| self.conn.client.query(&statement, params));
        result.map_err(|err| self.failed("cannot read", err))
    }

    /// Locks the `lanes` row `service::provider` until the transaction
    /// ends, adding it the first time.
    fn lock_lanes_row(&mut self, service: &str, provider: &str) -> Result<(), LedgerError> {
        if self
            .query_other(sql::LOCK_LANE, &[&service, &provider])?
            .is_empty()
        {
            // The lane's first decision: its row, then its lock.
            self.execute_other(sql::ADD_LANE, &[&service, &provider])?;
            self.query_other(sql::LOCK_LANE, &[&service, &provider])?;
        }
        Ok(())
    }

    /// Like [`PgTxn::query_other`], for a statement that returns no rows.
    fn execute_other(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, LedgerError> {
        self.after_earlier_groups()?;
        let result = self
            .conn
            .prepare(sql)
            .and_then(|statement| self.conn.client.execute(&statement, params));
        result.map_err(|err| self.failed("cannot write", err))
    }

    /// Stores `record`, new when `fresh`: deferred, or at once; kept as
    /// this transaction's version of it either way.
    fn store(&mut self, record: &Arc<ActivityRecord>, fresh: bool) -> Result<(), LedgerError> {
        let id = record.activity_id;
        if self.records.defer {
            if fresh && self.records.cached.contains_key(&id) {
                return Err(taken(id));
            }
            // A record inserted then changed in one group is still new.
            let fresh = fresh || self.records.pending.get(&id).is_some_and(|(_, fresh)| *fresh);
            self.records.pending.insert(id, (Arc::clone(record), fresh));
        } else if self.write(record, fresh)? == 0 && fresh {
            return Err(taken(id));
        }
        self.records.cached.insert(id, Arc::clone(record));
        Ok(())
    }

    /// Writes `record` at once: a new one with `INSERT_RECORD`, a changed
    /// one with `UPDATE_RECORD`; returns how many rows it wrote.
    fn write(&mut self, record: &ActivityRecord, fresh: bool) -> Result<u64, LedgerError> {
        self.flush()?;
        let id = record.activity_id.to_string();
        if fresh {
            self.execute_other(sql::INSERT_RECORD, &refs(&codec::record_values(record, &id)))
        } else {
            self.execute_other(sql::UPDATE_RECORD, &refs(&codec::record_changes(record, &id)))
        }
    }

    /// Writes the counter changes so far; before a read of the counters.
    fn flush_counts(&mut self) -> Result<(), LedgerError> {
        let mut counts = std::mem::take(&mut self.counts);
        match write_counts(self.conn, &mut counts) {
            Ok(()) => Ok(()),
            Err(Unflushed::Failed(err) | Unflushed::Uncommitted(err) | Unflushed::Unnotified(err)) => {
                Err(self.failed("cannot update counters", err))
            }
            Err(unexpected @ Unflushed::Unexpected) => Err(unexpected.into_error("cannot update counters")),
        }
    }
}

/// The conflict of an insert whose id is taken. Stores agree on the kind.
fn taken(id: ActivityId) -> LedgerError {
    LedgerError::new(ErrorKind::Conflict, format!("activity {id} already exists"))
}

impl Txn for PgTxn<'_> {
    fn get(&mut self, id: ActivityId) -> Result<Option<Arc<ActivityRecord>>, LedgerError> {
        if let Some(record) = self.records.cached.get(&id) {
            return Ok(Some(Arc::clone(record)));
        }
        // Not kept, so not written by this transaction: nothing deferred
        // concerns it.
        let text = id.to_string();
        let rows = self.query_other(sql::GET_RECORD_LOCKED, &[&text])?;
        let record = rows
            .first()
            .map(|row| codec::record_from(row).map(Arc::new))
            .transpose()?;
        if let Some(record) = &record {
            // Locked by the read: kept for the rest of the transaction.
            self.records.cached.insert(id, Arc::clone(record));
        }
        Ok(record)
    }

    fn insert(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        self.store(record, true)
    }

    fn update(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        self.store(record, false)
    }

    fn modify(
        &mut self,
        id: ActivityId,
        change: &mut dyn FnMut(&mut ActivityRecord) -> bool,
    ) -> Result<Option<Arc<ActivityRecord>>, LedgerError> {
        if self.get(id)?.is_none() {
            return Ok(None);
        }
        // Taken out, so that the change copies nothing when no reply holds
        // the record; put back by `store`, or as it was.
        let mut record = self.records.cached.remove(&id).expect("kept by get");
        if change(Arc::make_mut(&mut record)) {
            // A failed write leaves it out: the command is undone, and the
            // record read again if asked for.
            self.store(&record, false)?;
        } else {
            self.records.cached.insert(id, Arc::clone(&record));
        }
        Ok(Some(record))
    }

    fn delete(&mut self, ids: &[ActivityId]) -> Result<usize, LedgerError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let texts: Vec<String> = ids.iter().map(ToString::to_string).collect();
        self.flush()?;
        let deleted = self.execute_other(sql::DELETE_RECORDS, &[&texts])?;
        self.execute_other(sql::DELETE_KEYS, &[&texts])?;
        for id in ids {
            self.records.cached.remove(id);
        }
        Ok(usize::try_from(deleted).unwrap_or(usize::MAX))
    }

    fn claim_key(&mut self, key: &Idempotency, record: &ActivityRecord) -> Result<(), LedgerError> {
        let id = record.activity_id.to_string();
        let claimed = self.execute_other(sql::CLAIM_KEY, &[&key.key, &id, &key.fingerprint])?;
        if claimed == 0 {
            // Another instance's begin with this key committed after this
            // transaction looked (the insert waited for it): run again, and
            // the repeat finds it and answers its record.
            self.fault = Some(Fault::Yield);
            return Err(LedgerError::new(
                ErrorKind::Storage,
                "another begin with this idempotency key committed meanwhile: this one runs again",
            ));
        }
        Ok(())
    }

    fn add_totals(&mut self, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError> {
        self.counts.count(record, effects);
        Ok(())
    }

    fn spend(&mut self, lane: &LaneKey, second: i64, tokens: i64) -> Result<(), LedgerError> {
        let (service, provider, shard) = (lane.service.as_str(), lane.provider.as_str(), self.conn.shard);
        self.execute_other(sql::SPEND, &[&second, &service, &provider, &shard, &tokens])
            .map(drop)
    }

    fn count_completion(&mut self, _record: &ActivityRecord, minute: i64) -> Result<(), LedgerError> {
        self.counts.complete(minute);
        Ok(())
    }

    fn landed(&mut self, record: &Arc<ActivityRecord>, effect: &Effect, capacity: Option<Capacity>) {
        self.landed.extend(Landed::of(record, effect, capacity));
    }

    fn aggregate_known(
        &mut self,
        labels: &ActivityLabels,
        priority: Priority,
        admission: Admission,
    ) -> Result<bool, LedgerError> {
        let slot = (labels.clone(), priority, admission);
        // As in the SQLite store: what earlier commands of the group counted
        // is not written yet, and they decide against what was committed.
        if self.conn.known_aggregates.contains(&slot) || self.counts.counts_into(&slot) {
            return Ok(true);
        }
        let key = AggregateKey::new(labels, priority, admission);
        let rows = self.query_other(sql::AGGREGATE_KNOWN, &refs(&codec::aggregate_key_values(&key)))?;
        let known = rows
            .first()
            .map_or(Ok(None), |row| row.boolean(0))?
            .unwrap_or(false);
        if known {
            self.conn.known_aggregates.insert(slot, ());
        }
        Ok(known)
    }

    fn lock_lane(&mut self, lane: &LaneKey) -> Result<(), LedgerError> {
        self.lock_lanes_row(lane.service.as_str(), lane.provider.as_str())
    }

    fn lock_provider(&mut self, provider: &Label) -> Result<(), LedgerError> {
        // The provider's lock is the `lanes` row of no service: no label is
        // empty, so it is no lane's.
        self.lock_lanes_row("", provider.as_str())
    }
}

impl Driver for PgTxn<'_> {
    const LOCKS: bool = true;

    fn query(
        &mut self,
        reads: Reads,
        sql: &'static str,
        params: &[Value<'_>],
        row: &mut dyn FnMut(&dyn Columns) -> Result<(), LedgerError>,
    ) -> Result<(), LedgerError> {
        self.before(reads)?;
        for columns in &self.query_other(sql, &refs(params))? {
            row(columns)?;
        }
        Ok(())
    }

    fn execute(&mut self, reads: Reads, sql: &'static str, params: &[Value<'_>]) -> Result<u64, LedgerError> {
        self.before(reads)?;
        self.execute_other(sql, &refs(params))
    }

    fn lock_in_flight(&self) -> bool {
        self.lock_in_flight
    }
}

impl PgTxn<'_> {
    /// Sends what a statement reads and this transaction holds back: the
    /// deferred record writes before a read of records, the counter
    /// changes before a read of the counters.
    fn before(&mut self, reads: Reads) -> Result<(), LedgerError> {
        match reads {
            Reads::Records => self.flush(),
            Reads::Counters => self.flush_counts(),
            Reads::Aggregates | Reads::Owners => Ok(()),
        }
    }
}

/// `params` as the client binds them.
fn refs<'v>(params: &'v [Value<'_>]) -> SmallVec<[&'v (dyn ToSql + Sync); 24]> {
    params.iter().map(|value| value as &(dyn ToSql + Sync)).collect()
}
