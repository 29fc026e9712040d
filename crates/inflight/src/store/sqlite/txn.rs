//! The transaction: [`SqliteTxn`] implements the engine's `Txn` over one
//! connection, with one statement of `sql.rs` per primitive and question,
//! and adds up the counter changes of a group to write them once.

use std::sync::Arc;

use rusqlite::{params, OptionalExtension};

use crate::domain::admission::LanePosition;
use crate::domain::counters::{AggregateKey, Totals};
use crate::domain::labels::{ActivityLabels, Label, LabelSet};
use crate::domain::owner::{Owner, OwnerId};
use crate::domain::query::{LaneQuery, Retention, Window};
use crate::domain::record::{ActivityId, ActivityRecord, Admission, LaneKey, Priority};
use crate::domain::snapshot::LaneLoad;
use crate::domain::timestamp::Timestamp;
use crate::domain::transition::Effect;
use crate::error::{ErrorKind, LedgerError};
use crate::stats::Landed;
use crate::store::engine::Txn;
use crate::store::AggregateSlot;

use super::journal::{self, Ahead};
use super::rows::{
    at_opt, bind_record, bind_totals, ms, ms_opt, owner_from_row, parse_column, query_records, query_rows,
    record_from_row, shared, totals_from_row, Statements,
};
use super::{sql, sql_error};

pub(super) struct SqliteTxn<'t, 'c> {
    st: &'t mut Statements<'c>,
    /// The counter changes of this command, for its group to write, once it
    /// writes to the tables directly.
    pub(super) counts: PendingCounts,
    /// What this command did, to publish once its group is committed.
    pub(super) landed: Vec<Landed>,
    /// The records this command changed, while it writes ahead
    /// (`journal.rs`); appended by [`SqliteTxn::finish`].
    ahead: Vec<Ahead>,
    /// Whether this command writes to the tables: once it asked something
    /// the rows written ahead must be applied for.
    direct: bool,
}

impl<'t, 'c> SqliteTxn<'t, 'c> {
    pub(super) fn new(st: &'t mut Statements<'c>) -> Self {
        Self {
            st,
            counts: PendingCounts::default(),
            landed: Vec::new(),
            ahead: Vec::new(),
            direct: false,
        }
    }

    /// Ends the command: what it changed is written ahead, unless it went
    /// to the tables.
    pub(super) fn finish(&mut self) -> Result<(), LedgerError> {
        for entry in std::mem::take(&mut self.ahead) {
            journal::append(self.st, &entry)?;
        }
        Ok(())
    }

    /// Applies the rows written ahead and writes this command's changes to
    /// the tables, before a question the tables answer; the rest of the
    /// command writes to them too.
    fn go_direct(&mut self) -> Result<(), LedgerError> {
        if self.direct {
            return Ok(());
        }
        self.direct = true;
        // Older rows first: this command's changes are the later ones.
        journal::apply(self.st)?;
        for entry in std::mem::take(&mut self.ahead) {
            store_record(self.st, &entry.record)?;
            self.st.records.stored(&entry.record);
            self.counts.add_ahead(&entry);
        }
        Ok(())
    }

    /// Makes sure what memory holds of the journal is the table's: after a
    /// rollback or another connection's commit, the rows are applied first.
    fn journal_known(&mut self) -> Result<(), LedgerError> {
        if self.direct || self.st.journal.is_known() {
            return Ok(());
        }
        self.go_direct()
    }

    /// `record`, changed by this command, written ahead.
    fn write_ahead(&mut self, record: &Arc<ActivityRecord>) {
        self.st.journal.put(Arc::clone(record));
        match self.position(record.activity_id) {
            Some(index) => self.ahead[index].record = Arc::clone(record),
            None => self.ahead.push(Ahead {
                record: Arc::clone(record),
                totals: Totals::default(),
                completion_minute: None,
            }),
        }
    }

    /// This command's entry for `record`; written ahead as it is if the
    /// command has not changed it, so that what it counts travels with it.
    fn entry(&mut self, record: &ActivityRecord) -> &mut Ahead {
        let index = match self.position(record.activity_id) {
            Some(index) => index,
            None => {
                self.write_ahead(&Arc::new(record.clone()));
                self.ahead.len() - 1
            }
        };
        &mut self.ahead[index]
    }

    fn position(&self, id: ActivityId) -> Option<usize> {
        self.ahead.iter().position(|entry| entry.record.activity_id == id)
    }
}

/// Counter changes not yet written: the totals of each aggregate and the
/// completions of each minute. A group of commands that count into the same
/// rows (most groups: concurrent calls on one lane) writes each row once
/// instead of once per command.
#[derive(Default)]
pub(super) struct PendingCounts {
    pub(super) totals: std::collections::HashMap<(ActivityLabels, Priority, Admission), Totals>,
    pub(super) completions: std::collections::BTreeMap<i64, i64>,
}

impl PendingCounts {
    /// The aggregate `record` counts in.
    pub(super) fn slot(record: &ActivityRecord) -> (ActivityLabels, Priority, Admission) {
        (record.labels.clone(), record.priority, record.admission)
    }

    /// Adds what a record written ahead counted: its totals, and its
    /// completion.
    pub(super) fn add_ahead(&mut self, entry: &Ahead) {
        if entry.totals != Totals::default() {
            self.totals
                .entry(Self::slot(&entry.record))
                .or_default()
                .add(&entry.totals);
        }
        if let Some(minute) = entry.completion_minute {
            *self.completions.entry(minute).or_default() += 1;
        }
    }

    pub(super) fn merge(&mut self, other: Self) {
        for (key, totals) in other.totals {
            self.totals.entry(key).or_default().add(&totals);
        }
        for (minute, completions) in other.completions {
            *self.completions.entry(minute).or_default() += completions;
        }
    }

    /// Writes them all and forgets them.
    pub(super) fn write(&mut self, st: &mut Statements<'_>) -> Result<(), LedgerError> {
        for (slot, totals) in self.totals.drain() {
            add_to_aggregate(st, slot, &totals)?;
        }
        if self.completions.is_empty() {
            return Ok(());
        }
        let statement = st
            .prepare(sql::COUNT_COMPLETIONS)
            .map_err(sql_error("cannot prepare"))?;
        for (minute, completions) in std::mem::take(&mut self.completions) {
            statement
                .execute([minute, completions])
                .map_err(sql_error("cannot count completions"))?;
        }
        Ok(())
    }
}

/// Adds `d` to the totals of the aggregate `slot`, by its id, which the
/// writer keeps once it has seen it; a new aggregate is stored.
pub(super) fn add_to_aggregate(
    st: &mut Statements<'_>,
    slot: AggregateSlot,
    d: &Totals,
) -> Result<(), LedgerError> {
    let key = AggregateKey::new(&slot.0, slot.1, slot.2);
    let labels = params![
        key.service,
        key.operation_stage,
        key.class,
        key.provider,
        key.model,
        key.priority.as_str(),
        key.admission.as_str(),
    ];
    let id = match st.aggregate_ids.get(&slot) {
        Some(id) => Some(id),
        None => st
            .prepare(sql::AGGREGATE_ID)
            .and_then(|statement| statement.query_row(labels, |row| row.get(0)).optional())
            .map_err(sql_error("cannot read counters"))?,
    };
    // Both statements take the totals as one run of parameters from `first`.
    let bind_totals = |statement: &mut rusqlite::Statement<'_>, first: usize| {
        bind_totals(statement, first, d).map_err(sql_error("cannot bind"))
    };
    let id = match id {
        Some(id) => {
            let statement = st
                .prepare(sql::ADD_TO_AGGREGATE)
                .map_err(sql_error("cannot prepare"))?;
            statement
                .raw_bind_parameter(1, id)
                .map_err(sql_error("cannot bind"))?;
            bind_totals(statement, 2)?;
            let added = statement
                .raw_execute()
                .map_err(sql_error("cannot update counters"))?;
            if added != 1 {
                // Aggregates are never deleted, and an id kept by a
                // transaction rolled back is forgotten with it.
                return Err(LedgerError::new(
                    ErrorKind::Storage,
                    format!("aggregate {id} is not stored"),
                ));
            }
            id
        }
        None => {
            let statement = st
                .prepare(sql::INSERT_AGGREGATE)
                .map_err(sql_error("cannot prepare"))?;
            for (index, label) in labels.iter().enumerate() {
                statement
                    .raw_bind_parameter(index + 1, label)
                    .map_err(sql_error("cannot bind"))?;
            }
            bind_totals(statement, 8)?;
            statement
                .raw_execute()
                .map_err(sql_error("cannot update counters"))?;
            st.conn().last_insert_rowid()
        }
    };
    st.aggregate_ids.insert(slot, id);
    Ok(())
}

/// Stores `record`, whether or not a row of it is stored already (rows
/// written ahead, applied).
pub(super) fn store_record(st: &mut Statements<'_>, record: &ActivityRecord) -> Result<(), LedgerError> {
    if overwrite(st, record)? == 0 {
        write_new(st, record)?;
    }
    Ok(())
}

/// Overwrites the stored row of `record`: the columns that can change
/// after a begin (`UPDATE_RECORD`); returns how many rows it changed.
fn overwrite(st: &mut Statements<'_>, record: &ActivityRecord) -> Result<usize, LedgerError> {
    let statement = st
        .prepare(sql::UPDATE_RECORD)
        .map_err(sql_error("cannot prepare"))?;
    statement
        .execute(params![
            record.activity_id.to_string(),
            record.state.as_str(),
            record.disposition.map(|d| d.as_str()),
            record.reap_reason.map(|r| r.as_str()),
            ms_opt(record.started_at),
            ms_opt(record.completed_at),
            ms_opt(record.reaped_at),
            record.deadline_ms,
            ms_opt(record.reapable_at),
            record.success,
            record.failure_stage.map(|s| s.as_str()),
            record.late_settle,
            record.cancel_reason,
        ])
        .map_err(sql_error("cannot write a record"))
}

/// Stores the new record `record`.
fn write_new(st: &mut Statements<'_>, record: &ActivityRecord) -> Result<(), LedgerError> {
    let statement = st
        .prepare(sql::INSERT_RECORD)
        .map_err(sql_error("cannot prepare"))?;
    bind_record(statement, 1, record).map_err(sql_error("cannot bind"))?;
    statement.raw_execute().map_err(|err| match err {
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

impl SqliteTxn<'_, '_> {
    /// Runs `sql` with `params` and reads one value.
    fn value<T: rusqlite::types::FromSql>(
        &mut self,
        sql: &'static str,
        params: impl rusqlite::Params,
    ) -> Result<T, LedgerError> {
        self.st
            .prepare(sql)
            .and_then(|statement| statement.query_row(params, |row| row.get(0)))
            .map_err(sql_error("cannot read"))
    }

    /// Runs `sql` with `params` for its changes.
    fn run(&mut self, sql: &'static str, params: impl rusqlite::Params) -> Result<usize, LedgerError> {
        self.st
            .prepare(sql)
            .and_then(|statement| statement.execute(params))
            .map_err(sql_error("cannot write"))
    }
}

impl Txn for SqliteTxn<'_, '_> {
    fn get(&mut self, id: ActivityId) -> Result<Option<Arc<ActivityRecord>>, LedgerError> {
        self.journal_known()?;
        if let Some(record) = self.st.journal.get(id) {
            return Ok(Some(Arc::clone(record)));
        }
        if let Some(record) = self.st.records.get(id) {
            return Ok(Some(Arc::clone(record)));
        }
        let statement = self
            .st
            .prepare(sql::GET_RECORD)
            .map_err(sql_error("cannot prepare"))?;
        let record = statement
            .query_row([id.to_string()], record_from_row)
            .optional()
            .map_err(sql_error("cannot read a record"))?
            .map(Arc::new);
        if let Some(record) = &record {
            self.st.records.stored(record);
        }
        Ok(record)
    }

    fn insert(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        self.journal_known()?;
        if self.direct {
            write_new(self.st, record)?;
            self.st.records.stored(record);
            return Ok(());
        }
        let id = record.activity_id;
        let taken =
            self.st.journal.get(id).is_some() || self.value::<bool>(sql::RECORD_EXISTS, [id.to_string()])?;
        if taken {
            // As the primary key would say.
            return Err(LedgerError::new(
                ErrorKind::Conflict,
                format!("activity {id} already exists"),
            ));
        }
        self.write_ahead(record);
        Ok(())
    }

    fn update(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        self.journal_known()?;
        if self.direct {
            overwrite(self.st, record)?;
            self.st.records.stored(record);
        } else {
            self.write_ahead(record);
        }
        Ok(())
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
        self.journal_known()?;
        // Taken out, so that it is changed in place unless a reply still
        // holds it, and kept again only once written.
        let ahead = self.st.journal.take(id);
        let was_ahead = ahead.is_some();
        let taken = ahead.or_else(|| self.st.records.take(id));
        let Some(mut record) = taken.map_or_else(|| self.get(id), |record| Ok(Some(record)))? else {
            return Ok(None);
        };
        if change(Arc::make_mut(&mut record)) {
            if self.direct {
                overwrite(self.st, &record)?;
                self.st.records.stored(&record);
            } else {
                self.write_ahead(&record);
            }
        } else if was_ahead {
            // Unchanged, but `change` may have touched it without saying
            // so: the journal's rows, not memory, say what was written.
            self.st.journal.forget();
        } else {
            // Unchanged, it is stored as it was; forgotten all the same, in
            // case `change` touched it without saying so.
            self.st.records.deleted(id);
        }
        Ok(Some(record))
    }

    fn delete(&mut self, ids: &[ActivityId]) -> Result<usize, LedgerError> {
        self.go_direct()?;
        let mut deleted = 0;
        for id in ids {
            self.st.records.deleted(*id);
            deleted += self.run(sql::DELETE_RECORD, [id.to_string()])?;
        }
        Ok(deleted)
    }

    fn add_totals(&mut self, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError> {
        let totals = if self.direct {
            self.counts.totals.entry(PendingCounts::slot(record)).or_default()
        } else {
            &mut self.entry(record).totals
        };
        for effect in effects {
            totals.count(effect);
        }
        Ok(())
    }

    fn count_completion(&mut self, record: &ActivityRecord, minute: i64) -> Result<(), LedgerError> {
        if self.direct {
            *self.counts.completions.entry(minute).or_default() += 1;
        } else {
            // A record completes once: its row holds the minute.
            self.entry(record).completion_minute = Some(minute);
        }
        Ok(())
    }

    fn aggregate_known(
        &mut self,
        labels: &ActivityLabels,
        priority: Priority,
        admission: Admission,
    ) -> Result<bool, LedgerError> {
        let slot = (labels.clone(), priority, admission);
        // Commands earlier in this group count into rows not written yet;
        // those decide against what was committed, so a group of new
        // aggregates can pass a limit by at most its own size.
        if self.st.aggregate_ids.contains(&slot) || self.counts.totals.contains_key(&slot) {
            return Ok(true);
        }
        // An aggregate counted only ahead is stored once the rows are
        // applied: a new one is rare, so they are.
        self.go_direct()?;
        let id: Option<i64> = self
            .st
            .prepare(sql::AGGREGATE_ID)
            .and_then(|statement| {
                statement
                    .query_row(
                        params![
                            labels.service.as_str(),
                            labels.operation_stage.as_str(),
                            labels.class.as_str(),
                            labels.provider.as_str(),
                            &*labels.model,
                            priority.as_str(),
                            admission.as_str(),
                        ],
                        |row| row.get(0),
                    )
                    .optional()
            })
            .map_err(sql_error("cannot read counters"))?;
        if let Some(id) = id {
            self.st.aggregate_ids.insert(slot, id);
        }
        Ok(id.is_some())
    }

    fn lane_known(&mut self, labels: &LabelSet) -> Result<bool, LedgerError> {
        self.go_direct()?;
        self.value(
            sql::LANE_KNOWN,
            params![labels.service.as_str(), labels.provider.as_str()],
        )
    }

    fn label_census(&mut self) -> Result<(i64, i64), LedgerError> {
        self.go_direct()?;
        self.st
            .prepare(sql::LABEL_CENSUS)
            .and_then(|statement| statement.query_row([], |row| Ok((row.get(0)?, row.get(1)?))))
            .map_err(sql_error("cannot read"))
    }

    fn aggregates(&mut self) -> Result<Vec<(AggregateKey, Totals)>, LedgerError> {
        self.go_direct()?;
        // What this command counted (a reap on read) is part of what it reads.
        self.counts.write(self.st)?;
        query_rows(self.st, sql::AGGREGATES, [], |row| {
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
                totals_from_row(row, 7)?,
            ))
        })
    }

    fn completion_minutes_from(&mut self, minute: i64) -> Result<i64, LedgerError> {
        self.go_direct()?;
        self.counts.write(self.st)?;
        self.value(sql::COMPLETION_MINUTES_FROM, [minute])
    }

    fn delete_minutes_before(&mut self, minute: i64) -> Result<(), LedgerError> {
        self.go_direct()?;
        self.counts.write(self.st)?;
        self.run(sql::DELETE_MINUTES_BEFORE, [minute]).map(|_| ())
    }

    fn stored_records(&mut self) -> Result<i64, LedgerError> {
        self.go_direct()?;
        self.value(sql::STORED_RECORDS, [])
    }

    fn get_owner(&mut self, id: &OwnerId) -> Result<Option<Owner>, LedgerError> {
        Ok(query_rows(self.st, sql::GET_OWNER, [id.as_str()], owner_from_row)?.pop())
    }

    fn landed(&mut self, record: &ActivityRecord, effect: &Effect) {
        if let Some(landed) = Landed::of(record, effect) {
            self.landed.push(landed);
        }
    }

    fn put_owner(&mut self, owner: &Owner) -> Result<(), LedgerError> {
        self.run(
            sql::PUT_OWNER,
            params![
                owner.owner_id.as_str(),
                owner.name.as_str(),
                owner.ttl_ms,
                ms(owner.registered_at),
                ms(owner.renewed_at),
                ms(owner.expires_at),
                owner.state.as_str(),
                ms_opt(owner.ended_at),
                owner.reaped_records,
                owner.cancelled_records,
            ],
        )
        .map(|_| ())
    }

    fn due(&mut self, now: Timestamp, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        self.go_direct()?;
        shared(query_records(self.st, sql::DUE, params![ms(now), limit as i64]))
    }

    fn lane_position(&mut self, query: &LaneQuery) -> Result<LanePosition, LedgerError> {
        self.go_direct()?;
        let statement = self
            .st
            .prepare(sql::LANE_POSITION)
            .map_err(sql_error("cannot prepare"))?;
        statement
            .query_row(
                params![
                    query.lane.service.as_str(),
                    query.lane.provider.as_str(),
                    query.activity_id.to_string(),
                    ms(query.enqueued_at),
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
        self.go_direct()?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        shared(query_records(self.st, sql::IN_FLIGHT, [limit]))
    }

    fn in_flight_count(&mut self) -> Result<i64, LedgerError> {
        self.go_direct()?;
        self.value(sql::IN_FLIGHT_COUNT, [])
    }

    fn lane_loads(&mut self) -> Result<Vec<LaneLoad>, LedgerError> {
        self.go_direct()?;
        query_rows(self.st, sql::LANE_LOADS, [], |row| {
            Ok(LaneLoad {
                lane: LaneKey {
                    service: Label::trusted(row.get(0)?),
                    provider: Label::trusted(row.get(1)?),
                },
                executing: row.get(2)?,
                waiting: row.get(3)?,
                oldest_waiting_since: at_opt(row, 4)?,
                next_waiting_reapable_at: at_opt(row, 5)?,
            })
        })
    }

    fn completed(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        self.go_direct()?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        query_records(self.st, sql::COMPLETED, params![ms(window.since), limit])
    }

    fn completed_between(&mut self, from: Timestamp, to: Timestamp) -> Result<i64, LedgerError> {
        self.go_direct()?;
        self.value(sql::COMPLETED_BETWEEN, [ms(from), ms(to)])
    }

    fn reaped(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        self.go_direct()?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        query_records(self.st, sql::REAPED, params![ms(window.since), limit])
    }

    fn listed_owners(&mut self, window: Window) -> Result<Vec<Owner>, LedgerError> {
        query_rows(self.st, sql::LISTED_OWNERS, [ms(window.since)], owner_from_row)
    }

    fn expired_owners(&mut self, now: Timestamp) -> Result<Vec<Owner>, LedgerError> {
        query_rows(self.st, sql::EXPIRED_OWNERS, [ms(now)], owner_from_row)
    }

    fn owner_in_flight(&mut self, id: &OwnerId) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        self.go_direct()?;
        shared(query_records(self.st, sql::OWNER_IN_FLIGHT, [id.as_str()]))
    }

    fn prunable(&mut self, retention: Retention, limit: usize) -> Result<Vec<ActivityId>, LedgerError> {
        self.go_direct()?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        query_rows(
            self.st,
            sql::PRUNABLE,
            params![ms(retention.before), limit],
            |row| {
                let id: String = row.get(0)?;
                id.parse().map_err(|err: uuid::Error| {
                    rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(err))
                })
            },
        )
    }

    fn prune_owners(&mut self, retention: Retention) -> Result<(), LedgerError> {
        self.run(sql::PRUNE_OWNERS, [ms(retention.before)]).map(|_| ())
    }
}
