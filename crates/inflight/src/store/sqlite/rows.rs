//! Rows: records and owners read back from their columns (in the order
//! `sql.rs` lists them), and the helpers that run a query for rows.

use std::sync::Arc;

use rusqlite::types::ToSql;
use rusqlite::{Connection, Row, Statement};

use crate::domain::counters::Totals;
use crate::domain::labels::{ActivityLabels, Label, LabelSet};
use crate::domain::owner::{Owner, OwnerId};
use crate::domain::record::ActivityRecord;
use crate::domain::{ParseError, Timestamp};
use crate::error::LedgerError;

use super::cache::RecordCache;
use super::journal::Journal;
use super::{sql, sql_error};

pub(super) fn owner_from_row(row: &Row<'_>) -> rusqlite::Result<Owner> {
    Ok(Owner {
        owner_id: OwnerId::trusted(row.get(0)?),
        name: Label::trusted(row.get(1)?),
        ttl_ms: row.get(2)?,
        registered_at: at(row, 3)?,
        renewed_at: at(row, 4)?,
        expires_at: at(row, 5)?,
        state: parse_column(row, 6)?,
        ended_at: at_opt(row, 7)?,
        reaped_records: row.get(8)?,
        cancelled_records: row.get(9)?,
    })
}

/// An instant as SQLite keeps it: an INTEGER of epoch milliseconds.
pub(super) fn at(row: &Row<'_>, index: usize) -> rusqlite::Result<Timestamp> {
    row.get(index).map(Timestamp::from_millis)
}

/// An optional instant, NULL for none.
pub(super) fn at_opt(row: &Row<'_>, index: usize) -> rusqlite::Result<Option<Timestamp>> {
    Ok(row.get::<_, Option<i64>>(index)?.map(Timestamp::from_millis))
}

/// An instant as a column value.
pub(super) fn ms(at: Timestamp) -> i64 {
    at.as_millis()
}

/// An optional instant as a column value.
pub(super) fn ms_opt(at: Option<Timestamp>) -> Option<i64> {
    at.map(Timestamp::as_millis)
}

pub(super) fn parse_column<T: std::str::FromStr<Err = ParseError>>(
    row: &Row<'_>,
    index: usize,
) -> rusqlite::Result<T> {
    let text: String = row.get(index)?;
    text.parse().map_err(|err: ParseError| {
        rusqlite::Error::FromSqlConversionFailure(index, rusqlite::types::Type::Text, Box::new(err))
    })
}

pub(super) fn parse_optional<T: std::str::FromStr<Err = ParseError>>(
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

pub(super) fn record_from_row(row: &Row<'_>) -> rusqlite::Result<ActivityRecord> {
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
        enqueued_at: at(row, 12)?,
        started_at: at_opt(row, 13)?,
        completed_at: at_opt(row, 14)?,
        reaped_at: at_opt(row, 15)?,
        declared_deadline_ms: row.get(16)?,
        deadline_ms: row.get(17)?,
        reapable_at: at_opt(row, 18)?,
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

/// Binds the columns of `record`, in `record_columns!` order, from
/// parameter `first` on.
pub(super) fn bind_record(
    statement: &mut Statement<'_>,
    first: usize,
    record: &ActivityRecord,
) -> rusqlite::Result<()> {
    let id = record.activity_id.to_string();
    let labels = &record.labels;
    let values: [&dyn ToSql; 23] = [
        &id,
        &labels.service.as_str(),
        &labels.provider.as_str(),
        &labels.class.as_str(),
        &labels.operation_stage.as_str(),
        &labels.model,
        &record.priority.as_str(),
        &record.admission.as_str(),
        &record.state.as_str(),
        &record.disposition.map(|d| d.as_str()),
        &record.reap_reason.map(|r| r.as_str()),
        &record.owner_id,
        &ms(record.enqueued_at),
        &ms_opt(record.started_at),
        &ms_opt(record.completed_at),
        &ms_opt(record.reaped_at),
        &record.declared_deadline_ms,
        &record.deadline_ms,
        &ms_opt(record.reapable_at),
        &record.success,
        &record.failure_stage.map(|s| s.as_str()),
        &record.late_settle,
        &record.cancel_reason,
    ];
    for (index, value) in values.into_iter().enumerate() {
        statement.raw_bind_parameter(first + index, value)?;
    }
    Ok(())
}

/// Binds `totals`, in `totals_columns!` order, from parameter `first` on.
pub(super) fn bind_totals(statement: &mut Statement<'_>, first: usize, d: &Totals) -> rusqlite::Result<()> {
    let counts = [
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
    ];
    for (index, count) in counts.iter().enumerate() {
        statement.raw_bind_parameter(first + index, count)?;
    }
    statement.raw_bind_parameter(first + counts.len(), ms_opt(d.last_seen_at))?;
    statement.raw_bind_parameter(first + counts.len() + 1, d.reaped_owner_lost_abandoned)
}

/// Totals read from `totals_columns!`, the first at `first`.
pub(super) fn totals_from_row(row: &Row<'_>, first: usize) -> rusqlite::Result<Totals> {
    Ok(Totals {
        calls: row.get(first)?,
        succeeded: row.get(first + 1)?,
        failed: row.get(first + 2)?,
        cancelled: row.get(first + 3)?,
        reaped_abandoned: row.get(first + 4)?,
        reaped_unsettled: row.get(first + 5)?,
        reaped_owner_lost: row.get(first + 6)?,
        late_settles: row.get(first + 7)?,
        resurrections: row.get(first + 8)?,
        in_flight: row.get(first + 9)?,
        queue_wait_count: row.get(first + 10)?,
        queue_wait_sum_ms: row.get(first + 11)?,
        queue_wait_max_ms: row.get(first + 12)?,
        execution_count: row.get(first + 13)?,
        execution_sum_ms: row.get(first + 14)?,
        execution_max_ms: row.get(first + 15)?,
        last_seen_at: at_opt(row, first + 16)?,
        reaped_owner_lost_abandoned: row.get(first + 17)?,
    })
}

/// The statements of `sql.rs` prepared on one connection, each once, found
/// again by the address of its text. rusqlite's own `prepare_cached` hashes
/// the whole text of a statement to find it, and again to put it back: for
/// the long record and counter statements that was about a tenth of a
/// lifecycle's instructions.
pub(super) struct Statements<'c> {
    conn: &'c Connection,
    prepared: Vec<(usize, usize, Statement<'c>)>,
    /// Records in flight as this connection last wrote or read them.
    pub(super) records: RecordCache,
    /// The id of each aggregate this connection saw stored (ids are never
    /// reused while the row lives, and aggregates are never deleted): it
    /// lives as long as the statements, and says which aggregates are known.
    pub(super) aggregate_ids: crate::store::SeenAggregates<i64>,
    /// What this connection wrote ahead and has not applied.
    pub(super) journal: Journal,
}

impl<'c> Statements<'c> {
    pub(super) fn new(conn: &'c Connection) -> Self {
        Self {
            conn,
            prepared: Vec::with_capacity(48),
            records: RecordCache::default(),
            aggregate_ids: crate::store::SeenAggregates::default(),
            journal: Journal::default(),
        }
    }

    /// Forgets what this connection kept of what it wrote, once a
    /// transaction or a savepoint is rolled back.
    pub(super) fn forget_uncommitted(&mut self) {
        self.records.forget_all();
        self.aggregate_ids.clear();
        self.journal.forget();
    }

    /// Reads SQLite's `data_version`, once a transaction holds the write
    /// lock: if another connection committed since this one's last
    /// transaction, forgets the records kept and what was known of the rows
    /// written ahead, which it may have applied.
    pub(super) fn check_data_version(&mut self) -> rusqlite::Result<()> {
        let version = self
            .prepare(sql::DATA_VERSION)?
            .query_row([], |row| row.get::<_, i64>(0))?;
        if self.records.check(version) {
            self.journal.forget();
        }
        Ok(())
    }

    /// The connection.
    pub(super) fn conn(&self) -> &'c Connection {
        self.conn
    }

    /// `sql`, prepared the first time it is asked for. A statement is
    /// reset after each use by rusqlite (`execute`, `query_row`, a dropped
    /// `Rows`), so it is ready for the next.
    pub(super) fn prepare(&mut self, sql: &'static str) -> rusqlite::Result<&mut Statement<'c>> {
        let key = (sql.as_ptr() as usize, sql.len());
        let found = self
            .prepared
            .iter()
            .position(|(address, len, _)| (*address, *len) == key);
        let index = match found {
            Some(index) => index,
            None => {
                let statement = self.conn.prepare(sql)?;
                self.prepared.push((key.0, key.1, statement));
                self.prepared.len() - 1
            }
        };
        Ok(&mut self.prepared[index].2)
    }
}

/// Runs a query and maps every row with `from_row`.
pub(super) fn query_rows<T>(
    statements: &mut Statements<'_>,
    sql: &'static str,
    params: impl rusqlite::Params,
    from_row: fn(&Row<'_>) -> rusqlite::Result<T>,
) -> Result<Vec<T>, LedgerError> {
    let statement = statements.prepare(sql).map_err(sql_error("cannot prepare"))?;
    let rows = statement
        .query_map(params, from_row)
        .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
        .map_err(sql_error("cannot read rows"))?;
    Ok(rows)
}

/// Records read for the engine, which shares what it reads.
pub(super) fn shared(
    records: Result<Vec<ActivityRecord>, LedgerError>,
) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
    records.map(|records| records.into_iter().map(Arc::new).collect())
}

pub(super) fn query_records(
    statements: &mut Statements<'_>,
    sql: &'static str,
    params: impl rusqlite::Params,
) -> Result<Vec<ActivityRecord>, LedgerError> {
    query_rows(statements, sql, params, record_from_row)
}
