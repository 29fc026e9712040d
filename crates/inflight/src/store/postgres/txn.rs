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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use postgres::types::ToSql;
use postgres::{Row, Statement};

use crate::config::LedgerConfig;
use crate::domain::admission::LanePosition;
use crate::domain::counters::{AggregateKey, Totals};
use crate::domain::labels::{ActivityLabels, Label, LabelSet};
use crate::domain::owner::{Owner, OwnerId};
use crate::domain::query::{LaneQuery, Retention, Window};
use crate::domain::record::{ActivityId, ActivityRecord, Admission, LaneKey, Priority, State};
use crate::domain::snapshot::LaneLoad;
use crate::domain::timestamp::Timestamp;
use crate::domain::transition::Effect;
use crate::domain::ParseError;
use crate::error::{ErrorKind, LedgerError};
use crate::stats::Landed;
use crate::store::engine::Txn;

use super::session::Session;
use super::sql;
use super::writer::Done;

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
    /// [`super::writer::EARLIER_WAIT`] while this one waited for it holding
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
    known_aggregates: crate::store::SeenAggregates<()>,
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
            known_aggregates: crate::store::SeenAggregates::default(),
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
            if let Ok(record) = record_from_row(row) {
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
    let records: Vec<&ActivityRecord> = pending.values().map(|(record, _)| &**record).collect();
    let fresh: Vec<bool> = pending.values().map(|(_, fresh)| *fresh).collect();
    let new = fresh.iter().filter(|fresh| **fresh).count();
    let text = |f: fn(&ActivityRecord) -> &str| records.iter().map(|r| f(r)).collect::<Vec<&str>>();
    let text_opt =
        |f: fn(&ActivityRecord) -> Option<&str>| records.iter().map(|r| f(r)).collect::<Vec<Option<&str>>>();
    let ms =
        |f: fn(&ActivityRecord) -> Option<i64>| records.iter().map(|r| f(r)).collect::<Vec<Option<i64>>>();
    let ids: Vec<String> = records.iter().map(|r| r.activity_id.to_string()).collect();
    let (service, provider, class, stage, model) = (
        text(|r| r.labels.service.as_str()),
        text(|r| r.labels.provider.as_str()),
        text(|r| r.labels.class.as_str()),
        text(|r| r.labels.operation_stage.as_str()),
        text(|r| &r.labels.model),
    );
    let (priority, admission, state) = (
        text(|r| r.priority.as_str()),
        text(|r| r.admission.as_str()),
        text(|r| r.state.as_str()),
    );
    let (disposition, reap_reason, owner) = (
        text_opt(|r| r.disposition.map(|d| d.as_str())),
        text_opt(|r| r.reap_reason.map(|r| r.as_str())),
        text_opt(|r| r.owner_id.as_deref()),
    );
    let enqueued: Vec<i64> = records.iter().map(|r| r.enqueued_at.as_millis()).collect();
    let (started, completed, reaped, declared) = (
        ms(|r| ms_opt(r.started_at)),
        ms(|r| ms_opt(r.completed_at)),
        ms(|r| ms_opt(r.reaped_at)),
        ms(|r| r.declared_deadline_ms),
    );
    let deadline: Vec<i64> = records.iter().map(|r| r.deadline_ms).collect();
    let reapable = ms(|r| ms_opt(r.reapable_at));
    let success: Vec<Option<bool>> = records.iter().map(|r| r.success).collect();
    let failure_stage = text_opt(|r| r.failure_stage.map(|s| s.as_str()));
    let late: Vec<bool> = records.iter().map(|r| r.late_settle).collect();
    let cancel = text_opt(|r| r.cancel_reason.as_deref());

    let mut totals: Vec<(AggregateKey, Totals)> = counts
        .totals
        .drain()
        .map(|((labels, priority, admission), totals)| {
            (AggregateKey::new(&labels, priority, admission), totals)
        })
        .collect();
    totals.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let key = |f: fn(&AggregateKey) -> &str| totals.iter().map(|(k, _)| f(k)).collect::<Vec<&str>>();
    let sum = |f: fn(&Totals) -> i64| totals.iter().map(|(_, d)| f(d)).collect::<Vec<i64>>();
    let (g_service, g_stage, g_class, g_provider, g_model) = (
        key(|k| &k.service),
        key(|k| &k.operation_stage),
        key(|k| &k.class),
        key(|k| &k.provider),
        key(|k| &k.model),
    );
    let (g_priority, g_admission) = (key(|k| k.priority.as_str()), key(|k| k.admission.as_str()));
    let last_seen: Vec<Option<i64>> = totals.iter().map(|(_, d)| ms_opt(d.last_seen_at)).collect();
    let (minutes, completions): (Vec<i64>, Vec<i64>) =
        std::mem::take(&mut counts.completions).into_iter().unzip();

    let shard = conn.shard;
    let statement = conn.prepare(sql::WRITE_GROUP).map_err(Unflushed::Failed)?;
    // Every overwrite must find its row (it holds its lock), every new
    // record its id free, and every counter its row: the statement checks
    // it, and fails otherwise ($53 to $56).
    let params: &[&(dyn ToSql + Sync)] = &[
        &ids,
        &service,
        &provider,
        &class,
        &stage,
        &model,
        &priority,
        &admission,
        &state,
        &disposition,
        &reap_reason,
        &owner,
        &enqueued,
        &started,
        &completed,
        &reaped,
        &declared,
        &deadline,
        &reapable,
        &success,
        &failure_stage,
        &late,
        &cancel,
        &fresh,
        &g_service,
        &g_stage,
        &g_class,
        &g_provider,
        &g_model,
        &g_priority,
        &g_admission,
        &sum(|d| d.calls),
        &sum(|d| d.succeeded),
        &sum(|d| d.failed),
        &sum(|d| d.cancelled),
        &sum(|d| d.reaped_abandoned),
        &sum(|d| d.reaped_unsettled),
        &sum(|d| d.reaped_owner_lost),
        &sum(|d| d.late_settles),
        &sum(|d| d.resurrections),
        &sum(|d| d.in_flight),
        &sum(|d| d.queue_wait_count),
        &sum(|d| d.queue_wait_sum_ms),
        &sum(|d| d.queue_wait_max_ms),
        &sum(|d| d.execution_count),
        &sum(|d| d.execution_sum_ms),
        &sum(|d| d.execution_max_ms),
        &last_seen,
        &sum(|d| d.reaped_owner_lost_abandoned),
        &minutes,
        &completions,
        &shard,
        &((records.len() - new) as i64),
        &(new as i64),
        &(totals.len() as i64),
        &(minutes.len() as i64),
    ];
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
    /// Which lanes have caps: only theirs wake other instances.
    config: &'c LedgerConfig,
    /// The group's records: what it locked, and its deferred writes.
    records: &'c mut Records,
    /// The counter changes of this command, for its group to write.
    pub(super) counts: PendingCounts,
    /// What the last failed statement means, if one failed.
    pub(super) fault: Option<Fault>,
    /// The lanes a slot of which was granted or freed: the group then
    /// notifies the other instances, naming them.
    pub(super) capacity_changed: BTreeSet<LaneKey>,
    /// Whether reads of records in flight lock them (the rebound at open).
    pub(super) lock_in_flight: bool,
    /// What this command did, to publish once its group is committed.
    pub(super) landed: Vec<Landed>,
    /// The end of the groups this process ran before this one, which every
    /// read beyond the group's own records waits for
    /// ([`super::writer::Order`]).
    pub(super) previous: Option<&'c Done>,
}

impl<'c> PgTxn<'c> {
    pub(super) fn new(conn: &'c mut Conn, config: &'c LedgerConfig, records: &'c mut Records) -> Self {
        Self {
            conn,
            config,
            records,
            counts: PendingCounts::default(),
            fault: None,
            capacity_changed: BTreeSet::new(),
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
            if !previous.wait_for(super::writer::EARLIER_WAIT) {
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

    /// `sql`, a statement that reads or writes `activities`, after the
    /// deferred writes.
    fn query(&mut self, sql: &'static str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, LedgerError> {
        self.flush()?;
        self.query_other(sql, params)
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

    /// Like [`PgTxn::query`], for a statement that returns no rows.
    fn execute(&mut self, sql: &'static str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, LedgerError> {
        self.flush()?;
        self.execute_other(sql, params)
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

    fn count(&mut self, sql: &'static str, params: &[&(dyn ToSql + Sync)]) -> Result<i64, LedgerError> {
        let rows = self.query(sql, params)?;
        let row = rows
            .first()
            .ok_or_else(|| LedgerError::new(ErrorKind::Storage, "a count returned no row"))?;
        column(row, 0)
    }

    fn records(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<ActivityRecord>, LedgerError> {
        self.query(sql, params)?.iter().map(record_from_row).collect()
    }

    fn shared(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        Ok(self.records(sql, params)?.into_iter().map(Arc::new).collect())
    }

    fn owners(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Owner>, LedgerError> {
        self.query_other(sql, params)?
            .iter()
            .map(owner_from_row)
            .collect()
    }

    /// Stores `record`, new when `fresh`: deferred, or at once; kept as
    /// this transaction's version of it either way.
    fn store(&mut self, record: &Arc<ActivityRecord>, fresh: bool) -> Result<(), LedgerError> {
        if record.admission == Admission::Queued
            && record.state != State::Waiting
            && self.config.cap_of(&record.labels).is_some()
        {
            self.capacity_changed.insert(record.lane());
        }
        let id = record.activity_id;
        if self.records.defer {
            if fresh && self.records.cached.contains_key(&id) {
                return Err(taken(id));
            }
            // A record inserted then changed in one group is still new.
            let fresh = fresh || self.records.pending.get(&id).is_some_and(|(_, fresh)| *fresh);
            self.records.pending.insert(id, (Arc::clone(record), fresh));
        } else if fresh {
            if self.write(sql::INSERT_RECORD, record)? == 0 {
                return Err(taken(id));
            }
        } else {
            self.write(sql::UPDATE_RECORD, record)?;
        }
        self.records.cached.insert(id, Arc::clone(record));
        Ok(())
    }

    fn write(&mut self, sql: &'static str, record: &ActivityRecord) -> Result<u64, LedgerError> {
        let id = record.activity_id.to_string();
        let (enqueued, started, completed, reaped, reapable) = (
            record.enqueued_at.as_millis(),
            ms_opt(record.started_at),
            ms_opt(record.completed_at),
            ms_opt(record.reaped_at),
            ms_opt(record.reapable_at),
        );
        self.execute(
            sql,
            &[
                &id,
                &record.labels.service.as_str(),
                &record.labels.provider.as_str(),
                &record.labels.class.as_str(),
                &record.labels.operation_stage.as_str(),
                &&*record.labels.model,
                &record.priority.as_str(),
                &record.admission.as_str(),
                &record.state.as_str(),
                &record.disposition.map(|d| d.as_str()),
                &record.reap_reason.map(|r| r.as_str()),
                &record.owner_id,
                &enqueued,
                &started,
                &completed,
                &reaped,
                &record.declared_deadline_ms,
                &record.deadline_ms,
                &reapable,
                &record.success,
                &record.failure_stage.map(|s| s.as_str()),
                &record.late_settle,
                &record.cancel_reason,
            ],
        )
    }

    /// Writes the counter changes so far; before a read of the counters.
    fn flush_counts(&mut self) -> Result<(), LedgerError> {
        let mut counts = std::mem::take(&mut self.counts);
        match counts.write(self.conn) {
            Ok(()) => Ok(()),
            Err(Unflushed::Failed(err) | Unflushed::Uncommitted(err) | Unflushed::Unnotified(err)) => {
                Err(self.failed("cannot update counters", err))
            }
            Err(Unflushed::Unexpected) => Err(LedgerError::new(
                ErrorKind::Storage,
                "a counter write did not land",
            )),
        }
    }
}

/// Counter changes not yet written: the totals of each aggregate and the
/// completions of each minute. Written in key order, so that two groups
/// that count into the same rows lock them in the same order.
#[derive(Default)]
pub(super) struct PendingCounts {
    pub(super) totals: HashMap<(ActivityLabels, Priority, Admission), Totals>,
    pub(super) completions: BTreeMap<i64, i64>,
}

impl PendingCounts {
    pub(super) fn merge(&mut self, other: Self) {
        for (key, totals) in other.totals {
            self.totals.entry(key).or_default().add(&totals);
        }
        for (minute, completions) in other.completions {
            *self.completions.entry(minute).or_default() += completions;
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.totals.is_empty() && self.completions.is_empty()
    }

    /// Writes them all, in one statement, and forgets them.
    pub(super) fn write(&mut self, conn: &mut Conn) -> Result<(), Unflushed> {
        write_group(conn, &mut Records::default(), self, Last::default())
    }
}

fn column<'a, T: postgres::types::FromSql<'a>>(row: &'a Row, index: usize) -> Result<T, LedgerError> {
    row.try_get(index)
        .map_err(|err| LedgerError::storage("cannot read a column", err))
}

/// An instant from its column (epoch milliseconds).
fn at(row: &Row, index: usize) -> Result<Timestamp, LedgerError> {
    column::<i64>(row, index).map(Timestamp::from_millis)
}

/// An optional instant, NULL for none.
fn at_opt(row: &Row, index: usize) -> Result<Option<Timestamp>, LedgerError> {
    Ok(column::<Option<i64>>(row, index)?.map(Timestamp::from_millis))
}

/// An optional instant as a column value.
fn ms_opt(at: Option<Timestamp>) -> Option<i64> {
    at.map(Timestamp::as_millis)
}

fn parsed<T: std::str::FromStr<Err = ParseError>>(row: &Row, index: usize) -> Result<T, LedgerError> {
    let text: &str = column(row, index)?;
    text.parse()
        .map_err(|err: ParseError| LedgerError::storage("cannot read a column", err))
}

fn parsed_optional<T: std::str::FromStr<Err = ParseError>>(
    row: &Row,
    index: usize,
) -> Result<Option<T>, LedgerError> {
    let text: Option<&str> = column(row, index)?;
    text.map(|text| text.parse())
        .transpose()
        .map_err(|err: ParseError| LedgerError::storage("cannot read a column", err))
}

fn id_from(text: &str) -> Result<ActivityId, LedgerError> {
    text.parse()
        .map_err(|err: uuid::Error| LedgerError::storage("cannot read an activity id", err))
}

pub(super) fn record_from_row(row: &Row) -> Result<ActivityRecord, LedgerError> {
    let mut record = ActivityRecord {
        activity_id: id_from(column(row, 0)?)?,
        labels: ActivityLabels::new(LabelSet {
            service: Label::trusted(column::<String>(row, 1)?),
            provider: Label::trusted(column::<String>(row, 2)?),
            class: Label::trusted(column::<String>(row, 3)?),
            operation_stage: Label::trusted(column::<String>(row, 4)?),
            model: column::<String>(row, 5)?.into(),
        }),
        priority: parsed(row, 6)?,
        admission: parsed(row, 7)?,
        state: parsed(row, 8)?,
        disposition: parsed_optional(row, 9)?,
        reap_reason: parsed_optional(row, 10)?,
        owner_id: column(row, 11)?,
        enqueued_at: at(row, 12)?,
        started_at: at_opt(row, 13)?,
        completed_at: at_opt(row, 14)?,
        reaped_at: at_opt(row, 15)?,
        declared_deadline_ms: column(row, 16)?,
        deadline_ms: column(row, 17)?,
        reapable_at: at_opt(row, 18)?,
        queue_wait_ms: None,
        execution_ms: None,
        success: column(row, 19)?,
        failure_stage: parsed_optional(row, 20)?,
        late_settle: column(row, 21)?,
        cancel_reason: column(row, 22)?,
    };
    // Not stored: implied by the instants.
    record.derive_durations();
    Ok(record)
}

pub(super) fn owner_from_row(row: &Row) -> Result<Owner, LedgerError> {
    Ok(Owner {
        owner_id: OwnerId::trusted(column::<String>(row, 0)?),
        name: Label::trusted(column::<String>(row, 1)?),
        ttl_ms: column(row, 2)?,
        registered_at: at(row, 3)?,
        renewed_at: at(row, 4)?,
        expires_at: at(row, 5)?,
        state: parsed(row, 6)?,
        ended_at: at_opt(row, 7)?,
        reaped_records: column(row, 8)?,
        cancelled_records: column(row, 9)?,
    })
}

fn limit_of(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
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
        let rows = self.query_other(sql::GET_RECORD, &[&text])?;
        let record = rows
            .first()
            .map(|row| record_from_row(row).map(Arc::new))
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

    fn peek(&mut self, id: ActivityId, look: &mut dyn FnMut(&ActivityRecord)) -> Result<bool, LedgerError> {
        let Some(record) = self.get(id)? else {
            return Ok(false);
        };
        look(&record);
        Ok(true)
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
        let deleted = self.execute(sql::DELETE_RECORDS, &[&texts])?;
        for id in ids {
            self.records.cached.remove(id);
        }
        Ok(usize::try_from(deleted).unwrap_or(usize::MAX))
    }

    fn add_totals(&mut self, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError> {
        let key = (record.labels.clone(), record.priority, record.admission);
        let totals = self.counts.totals.entry(key).or_default();
        for effect in effects {
            totals.count(effect);
        }
        Ok(())
    }

    fn count_completion(&mut self, _record: &ActivityRecord, minute: i64) -> Result<(), LedgerError> {
        *self.counts.completions.entry(minute).or_default() += 1;
        Ok(())
    }

    fn aggregates(&mut self) -> Result<Vec<(AggregateKey, Totals)>, LedgerError> {
        // What this command counted (a reap on read) is part of what it reads.
        self.flush_counts()?;
        let rows = self.query_other(sql::AGGREGATES, &[])?;
        rows.iter()
            .map(|row| {
                Ok((
                    AggregateKey {
                        service: column::<&str>(row, 0)?.into(),
                        operation_stage: column::<&str>(row, 1)?.into(),
                        class: column::<&str>(row, 2)?.into(),
                        provider: column::<&str>(row, 3)?.into(),
                        model: column::<&str>(row, 4)?.into(),
                        priority: parsed(row, 5)?,
                        admission: parsed(row, 6)?,
                    },
                    Totals {
                        calls: column(row, 7)?,
                        succeeded: column(row, 8)?,
                        failed: column(row, 9)?,
                        cancelled: column(row, 10)?,
                        reaped_abandoned: column(row, 11)?,
                        reaped_unsettled: column(row, 12)?,
                        reaped_owner_lost: column(row, 13)?,
                        late_settles: column(row, 14)?,
                        resurrections: column(row, 15)?,
                        in_flight: column(row, 16)?,
                        queue_wait_count: column(row, 17)?,
                        queue_wait_sum_ms: column(row, 18)?,
                        queue_wait_max_ms: column(row, 19)?,
                        execution_count: column(row, 20)?,
                        execution_sum_ms: column(row, 21)?,
                        execution_max_ms: column(row, 22)?,
                        last_seen_at: at_opt(row, 23)?,
                        reaped_owner_lost_abandoned: column(row, 24)?,
                    },
                ))
            })
            .collect()
    }

    fn completion_minutes_from(&mut self, minute: i64) -> Result<i64, LedgerError> {
        self.flush_counts()?;
        self.count(sql::COMPLETION_MINUTES_FROM, &[&minute])
    }

    fn delete_minutes_before(&mut self, minute: i64) -> Result<(), LedgerError> {
        self.flush_counts()?;
        self.execute_other(sql::DELETE_MINUTES_BEFORE, &[&minute])
            .map(|_| ())
    }

    fn stored_records(&mut self) -> Result<i64, LedgerError> {
        self.count(sql::STORED_RECORDS, &[])
    }

    fn get_owner(&mut self, id: &OwnerId) -> Result<Option<Owner>, LedgerError> {
        Ok(self.owners(sql::GET_OWNER, &[&id.as_str()])?.pop())
    }

    fn landed(&mut self, record: &ActivityRecord, effect: &Effect) {
        if let Some(landed) = Landed::of(record, effect) {
            self.landed.push(landed);
        }
    }

    fn put_owner(&mut self, owner: &Owner) -> Result<(), LedgerError> {
        let (registered, renewed, expires, ended) = (
            owner.registered_at.as_millis(),
            owner.renewed_at.as_millis(),
            owner.expires_at.as_millis(),
            ms_opt(owner.ended_at),
        );
        self.execute_other(
            sql::PUT_OWNER,
            &[
                &owner.owner_id.as_str(),
                &owner.name.as_str(),
                &owner.ttl_ms,
                &registered,
                &renewed,
                &expires,
                &owner.state.as_str(),
                &ended,
                &owner.reaped_records,
                &owner.cancelled_records,
            ],
        )
        .map(|_| ())
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
        if self.conn.known_aggregates.contains(&slot) || self.counts.totals.contains_key(&slot) {
            return Ok(true);
        }
        let rows = self.query_other(
            sql::AGGREGATE_KNOWN,
            &[
                &labels.service.as_str(),
                &labels.operation_stage.as_str(),
                &labels.class.as_str(),
                &labels.provider.as_str(),
                &&*labels.model,
                &priority.as_str(),
                &admission.as_str(),
            ],
        )?;
        let known = rows.first().map_or(Ok(false), |row| column(row, 0))?;
        if known {
            self.conn.known_aggregates.insert(slot, ());
        }
        Ok(known)
    }

    fn lane_known(&mut self, labels: &LabelSet) -> Result<bool, LedgerError> {
        let rows = self.query_other(
            sql::LANE_KNOWN,
            &[&labels.service.as_str(), &labels.provider.as_str()],
        )?;
        rows.first().map_or(Ok(false), |row| column(row, 0))
    }

    fn label_census(&mut self) -> Result<(i64, i64), LedgerError> {
        let rows = self.query_other(sql::LABEL_CENSUS, &[])?;
        let row = rows
            .first()
            .ok_or_else(|| LedgerError::new(ErrorKind::Storage, "the label census returned no row"))?;
        Ok((column(row, 0)?, column(row, 1)?))
    }

    fn lock_lane(&mut self, lane: &LaneKey) -> Result<(), LedgerError> {
        let (service, provider) = (lane.service.as_str(), lane.provider.as_str());
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

    fn due(&mut self, now: Timestamp, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        self.shared(sql::DUE, &[&now.as_millis(), &limit_of(limit)])
    }

    fn lane_position(&mut self, query: &LaneQuery) -> Result<LanePosition, LedgerError> {
        let id = query.activity_id.to_string();
        let rows = self.query(
            sql::LANE_POSITION,
            &[
                &query.lane.service.as_str(),
                &query.lane.provider.as_str(),
                &id,
                &query.enqueued_at.as_millis(),
                &query.newcomer,
            ],
        )?;
        let row = rows
            .first()
            .ok_or_else(|| LedgerError::new(ErrorKind::Storage, "the lane count returned no row"))?;
        Ok(LanePosition {
            executing: column(row, 0)?,
            waiting_ahead: column(row, 1)?,
        })
    }

    fn in_flight(&mut self, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        let sql = if self.lock_in_flight {
            sql::IN_FLIGHT_LOCKED
        } else {
            sql::IN_FLIGHT
        };
        self.shared(sql, &[&limit_of(limit)])
    }

    fn in_flight_count(&mut self) -> Result<i64, LedgerError> {
        self.count(sql::IN_FLIGHT_COUNT, &[])
    }

    fn lane_loads(&mut self) -> Result<Vec<LaneLoad>, LedgerError> {
        let rows = self.query(sql::LANE_LOADS, &[])?;
        rows.iter()
            .map(|row| {
                Ok(LaneLoad {
                    lane: LaneKey {
                        service: Label::trusted(column::<String>(row, 0)?),
                        provider: Label::trusted(column::<String>(row, 1)?),
                    },
                    executing: column(row, 2)?,
                    waiting: column(row, 3)?,
                    oldest_waiting_since: at_opt(row, 4)?,
                    next_waiting_reapable_at: at_opt(row, 5)?,
                })
            })
            .collect()
    }

    fn completed(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        self.records(sql::COMPLETED, &[&window.since.as_millis(), &limit_of(limit)])
    }

    fn completed_between(&mut self, from: Timestamp, to: Timestamp) -> Result<i64, LedgerError> {
        self.count(sql::COMPLETED_BETWEEN, &[&from.as_millis(), &to.as_millis()])
    }

    fn reaped(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        self.records(sql::REAPED, &[&window.since.as_millis(), &limit_of(limit)])
    }

    fn listed_owners(&mut self, window: Window) -> Result<Vec<Owner>, LedgerError> {
        self.owners(sql::LISTED_OWNERS, &[&window.since.as_millis()])
    }

    fn expired_owners(&mut self, now: Timestamp) -> Result<Vec<Owner>, LedgerError> {
        self.owners(sql::EXPIRED_OWNERS, &[&now.as_millis()])
    }

    fn owner_in_flight(&mut self, id: &OwnerId) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        self.shared(sql::OWNER_IN_FLIGHT, &[&id.as_str()])
    }

    fn prunable(&mut self, retention: Retention, limit: usize) -> Result<Vec<ActivityId>, LedgerError> {
        let rows = self.query(sql::PRUNABLE, &[&retention.before.as_millis(), &limit_of(limit)])?;
        rows.iter().map(|row| id_from(column(row, 0)?)).collect()
    }

    fn prune_owners(&mut self, retention: Retention) -> Result<(), LedgerError> {
        self.execute_other(sql::PRUNE_OWNERS, &[&retention.before.as_millis()])
            .map(|_| ())
    }
}
