//! Writing ahead: a begin, start or settle appends one row to `journal`
//! instead of changing `activities`, its indexes, an aggregate and a
//! completion minute. The rows are applied to those tables in batches, and
//! before any command reads them (`tables.rs` appends and applies them).
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

/// What the writer knows of the rows written ahead.
#[derive(Default)]
pub(super) struct Journal {
    /// Each record written ahead and not applied, as last written.
    pub(super) records: HashMap<ActivityId, Arc<ActivityRecord>>,
    /// Rows in the table.
    pub(super) rows: usize,
    /// Whether `records` and `rows` describe the table: false until the
    /// first apply, and again after a rollback or another connection's
    /// commit.
    pub(super) known: bool,
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
