//! Writes to the tables: a record stored, counters added to an aggregate
//! by its id, rows written ahead appended and applied (`journal.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use rusqlite::{params_from_iter, OptionalExtension};

use crate::domain::counters::{AggregateKey, Totals};
use crate::domain::record::ActivityRecord;
use crate::error::{ErrorKind, LedgerError};
use crate::store::sql::codec::{self, Value};
use crate::store::sql::columns::{RECORD_COLUMNS, TOTALS_COLUMNS};
use crate::store::sql::counts::AggregateSlot;
use crate::store::sql::counts::PendingCounts;

use super::journal::Ahead;
use super::rows::{query_rows, Statements};
use super::{sql, sql_error};

/// Adds what a record written ahead counted to `counts`: its totals, and
/// its completion.
pub(super) fn count_ahead(counts: &mut PendingCounts, entry: &Ahead) {
    if entry.totals != Totals::default() {
        counts
            .totals
            .entry(PendingCounts::slot(&entry.record))
            .or_default()
            .add(&entry.totals);
    }
    if let Some(minute) = entry.completion_minute {
        counts.complete(minute);
    }
}

/// Writes `counts` and forgets them.
pub(super) fn write_counts(st: &mut Statements<'_>, counts: &mut PendingCounts) -> Result<(), LedgerError> {
    for (slot, totals) in counts.totals.drain() {
        add_to_aggregate(st, slot, &totals)?;
    }
    for (minute, completions) in std::mem::take(&mut counts.completions) {
        run(st, sql::COUNT_COMPLETIONS, &[minute.into(), completions.into()])?;
    }
    Ok(())
}

/// Runs `sql` with `params` for its changes; returns how many rows it
/// changed.
pub(super) fn run(
    st: &mut Statements<'_>,
    sql: &'static str,
    params: &[Value<'_>],
) -> Result<usize, LedgerError> {
    st.prepare(sql)
        .and_then(|statement| statement.execute(params_from_iter(params)))
        .map_err(sql_error("cannot write"))
}

/// The id of the aggregate `slot`, if it is stored; remembered once seen.
pub(super) fn aggregate_id(
    st: &mut Statements<'_>,
    slot: &AggregateSlot,
) -> Result<Option<i64>, LedgerError> {
    if let Some(id) = st.aggregate_ids.get(slot) {
        return Ok(Some(id));
    }
    let key = AggregateKey::new(&slot.0, slot.1, slot.2);
    let id = st
        .prepare(sql::AGGREGATE_ID)
        .and_then(|statement| {
            statement
                .query_row(params_from_iter(codec::aggregate_key_values(&key)), |row| {
                    row.get(0)
                })
                .optional()
        })
        .map_err(sql_error("cannot read counters"))?;
    if let Some(id) = id {
        st.aggregate_ids.insert(slot.clone(), id);
    }
    Ok(id)
}

/// Adds `d` to the totals of the aggregate `slot`, by its id; a new
/// aggregate is stored.
fn add_to_aggregate(st: &mut Statements<'_>, slot: AggregateSlot, d: &Totals) -> Result<(), LedgerError> {
    let totals = codec::totals_values(d);
    let id = match aggregate_id(st, &slot)? {
        Some(id) => {
            let params = std::iter::once(Value::Int(id)).chain(totals);
            let added = st
                .prepare(sql::ADD_TO_AGGREGATE)
                .and_then(|statement| statement.execute(params_from_iter(params)))
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
            let key = AggregateKey::new(&slot.0, slot.1, slot.2);
            let params = codec::aggregate_key_values(&key).into_iter().chain(totals);
            st.prepare(sql::INSERT_AGGREGATE)
                .and_then(|statement| statement.execute(params_from_iter(params)))
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
/// after a begin; returns how many rows it changed.
pub(super) fn overwrite(st: &mut Statements<'_>, record: &ActivityRecord) -> Result<usize, LedgerError> {
    let id = record.activity_id.to_string();
    run(st, sql::UPDATE_RECORD, &codec::record_changes(record, &id))
}

/// Stores the new record `record`; a conflict when its id is taken.
pub(super) fn write_new(st: &mut Statements<'_>, record: &ActivityRecord) -> Result<(), LedgerError> {
    let id = record.activity_id.to_string();
    if run(st, sql::INSERT_RECORD, &codec::record_values(record, &id))? == 0 {
        return Err(taken(record));
    }
    Ok(())
}

/// The conflict of an insert whose id is taken. Stores agree on the kind.
pub(super) fn taken(record: &ActivityRecord) -> LedgerError {
    LedgerError::new(
        ErrorKind::Conflict,
        format!("activity {} already exists", record.activity_id),
    )
}

/// Appends `entry` to the journal.
pub(super) fn append(st: &mut Statements<'_>, entry: &Ahead) -> Result<(), LedgerError> {
    let id = entry.record.activity_id.to_string();
    let params = codec::record_values(&entry.record, &id)
        .into_iter()
        .chain(codec::totals_values(&entry.totals))
        .chain([entry.completion_minute.into()]);
    st.prepare(sql::JOURNAL_APPEND)
        .and_then(|statement| statement.execute(params_from_iter(params)))
        .map_err(sql_error("cannot write ahead"))?;
    st.journal.rows += 1;
    Ok(())
}

/// Applies every row of the journal to the tables it stands for, in the
/// open transaction, and empties it: each record stored once as its last
/// row left it, the counters and completions added up.
pub(super) fn apply(st: &mut Statements<'_>) -> Result<(), LedgerError> {
    if !st.journal.is_pending() {
        return Ok(());
    }
    let rows = query_rows(st, sql::JOURNAL_ROWS, &[], |row| {
        Ok(Ahead {
            record: Arc::new(codec::record_from(row)?),
            totals: codec::totals_from(row, RECORD_COLUMNS)?,
            completion_minute: row.int(RECORD_COLUMNS + TOTALS_COLUMNS)?,
        })
    })?;
    let mut counts = PendingCounts::default();
    let mut latest = HashMap::with_capacity(rows.len());
    for entry in rows {
        count_ahead(&mut counts, &entry);
        latest.insert(entry.record.activity_id, entry.record);
    }
    for record in latest.into_values() {
        store_record(st, &record)?;
        st.records.stored(&record);
    }
    write_counts(st, &mut counts)?;
    run(st, sql::JOURNAL_CLEAR, &[])?;
    st.journal.records.clear();
    st.journal.rows = 0;
    st.journal.known = true;
    Ok(())
}
