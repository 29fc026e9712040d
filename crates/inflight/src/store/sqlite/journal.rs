//! Writing ahead: a begin, start or settle appends one row to `journal`
//! instead of changing `activities`, its indexes, an aggregate and a
//! completion minute. The rows are applied to those tables in batches, and
//! before any command reads them.
//!
//! A lifecycle changed about fifteen pages when each transition went
//! straight to the tables: the record's row, its entries in four indexes,
//! its aggregate, the minute of its completion. Each commit wrote them all
//! to the log again. Written ahead, a transition changes the journal's
//! last page; a batch changes each of those pages once, and a record begun
//! and settled within one batch is stored once, settled, and never enters
//! the indexes of work in flight (docs/performance.md, "Writing ahead").
//!
//! What every read sees is unchanged:
//! - the writer keeps each record written ahead in memory (`Journal`), and
//!   reads it there before the tables;
//! - a command that asks anything of many records (a snapshot, a reap, an
//!   admission decision on a capped lane, a prune) applies the rows first,
//!   in its own transaction (`SqliteTxn::go_direct`);
//! - rows are applied from the table, not from memory, so the same code
//!   recovers them after a crash, and after another process's commit or a
//!   rollback made memory untrustworthy.

use std::collections::HashMap;
use std::sync::Arc;

use crate::domain::counters::Totals;
use crate::domain::record::{ActivityId, ActivityRecord};
use crate::error::LedgerError;

use super::rows::{bind_record, bind_totals, query_rows, record_from_row, totals_from_row, Statements};
use super::txn::{store_record, PendingCounts};
use super::{sql, sql_error};

/// What the writer knows of the rows written ahead.
#[derive(Default)]
pub(super) struct Journal {
    /// Each record written ahead and not applied, as last written.
    records: HashMap<ActivityId, Arc<ActivityRecord>>,
    /// Rows in the table.
    rows: usize,
    /// Whether `records` and `rows` describe the table: false until the
    /// first apply, and again after a rollback or another connection's
    /// commit.
    known: bool,
}

impl Journal {
    /// Rows past which a transaction applies them before it commits: a
    /// batch long enough that most records in it are settled, short
    /// enough that applying it is a fraction of a millisecond.
    pub(super) const APPLY_AT: usize = 256;

    pub(super) fn get(&self, id: ActivityId) -> Option<&Arc<ActivityRecord>> {
        self.records.get(&id)
    }

    /// Takes the record out, to be changed and put back once written.
    pub(super) fn take(&mut self, id: ActivityId) -> Option<Arc<ActivityRecord>> {
        self.records.remove(&id)
    }

    pub(super) fn put(&mut self, record: Arc<ActivityRecord>) {
        self.records.insert(record.activity_id, record);
    }

    /// Whether this connection can answer from memory: false when the
    /// table may hold rows it does not know of.
    pub(super) fn is_known(&self) -> bool {
        self.known
    }

    /// Whether the tables lag rows written ahead.
    pub(super) fn is_pending(&self) -> bool {
        !self.known || self.rows > 0
    }

    pub(super) fn is_full(&self) -> bool {
        self.rows >= Self::APPLY_AT
    }

    /// Forgets what memory holds: what it described may have been undone
    /// or applied by another connection. The next command applies the
    /// table's rows before it reads.
    pub(super) fn forget(&mut self) {
        self.records.clear();
        self.known = false;
    }
}

/// One record a command changed, with what the command counted for it.
pub(super) struct Ahead {
    pub(super) record: Arc<ActivityRecord>,
    pub(super) totals: Totals,
    pub(super) completion_minute: Option<i64>,
}

/// Appends `entry` to the table.
pub(super) fn append(st: &mut Statements<'_>, entry: &Ahead) -> Result<(), LedgerError> {
    let statement = st
        .prepare(sql::JOURNAL_APPEND)
        .map_err(sql_error("cannot prepare"))?;
    bind_record(statement, 1, &entry.record)
        .and_then(|()| bind_totals(statement, 24, &entry.totals))
        .and_then(|()| statement.raw_bind_parameter(42, entry.completion_minute))
        .map_err(sql_error("cannot bind"))?;
    statement.raw_execute().map_err(sql_error("cannot write ahead"))?;
    st.journal.rows += 1;
    Ok(())
}

/// Applies every row of the table to the tables it stands for, in the
/// open transaction, and empties it: each record stored once as its last
/// row left it, the counters and completions added up.
pub(super) fn apply(st: &mut Statements<'_>) -> Result<(), LedgerError> {
    if !st.journal.is_pending() {
        return Ok(());
    }
    let rows = query_rows(st, sql::JOURNAL_ROWS, [], |row| {
        Ok(Ahead {
            record: Arc::new(record_from_row(row)?),
            totals: totals_from_row(row, 23)?,
            completion_minute: row.get(41)?,
        })
    })?;
    let mut counts = PendingCounts::default();
    let mut latest = HashMap::with_capacity(rows.len());
    for entry in rows {
        counts.add_ahead(&entry);
        latest.insert(entry.record.activity_id, entry.record);
    }
    for record in latest.into_values() {
        store_record(st, &record)?;
        st.records.stored(&record);
    }
    counts.write(st)?;
    st.prepare(sql::JOURNAL_CLEAR)
        .and_then(|statement| statement.execute([]))
        .map_err(sql_error("cannot clear the journal"))?;
    st.journal.records.clear();
    st.journal.rows = 0;
    st.journal.known = true;
    Ok(())
}
