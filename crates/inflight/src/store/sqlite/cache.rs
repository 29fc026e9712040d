//! Records in flight kept by the writer as it last wrote or read them, so
//! that a start or a settle does not read its record back from the file.
//!
//! The copy is the stored row only while no one else wrote the file: the
//! writer's connection asks SQLite's `data_version` at each `BEGIN` (it
//! moves when another connection, in this process or another, committed)
//! and forgets everything when it moved. A transaction or savepoint rolled
//! back forgets everything too, since what it wrote was undone.

use std::collections::HashMap;
use std::sync::Arc;

use crate::domain::record::{ActivityId, ActivityRecord};

#[derive(Default)]
pub(super) struct RecordCache {
    records: HashMap<ActivityId, Arc<ActivityRecord>>,
    /// `data_version` when the records were last known to be the stored
    /// rows; `None` before the first transaction.
    version: Option<i64>,
}

impl RecordCache {
    /// Past this many records in flight, new ones are read back instead:
    /// a few MB at most.
    const MAX: usize = 16_384;

    /// Called at each `BEGIN` with the connection's `data_version`: forgets
    /// every record if another connection committed since the last one,
    /// and says so.
    pub(super) fn check(&mut self, version: i64) -> bool {
        let moved = self.version != Some(version);
        if moved {
            self.records.clear();
            self.version = Some(version);
        }
        moved
    }

    /// Forgets every record: what was written may have been undone.
    pub(super) fn forget_all(&mut self) {
        self.records.clear();
        self.version = None;
    }

    pub(super) fn get(&self, id: ActivityId) -> Option<&Arc<ActivityRecord>> {
        self.records.get(&id)
    }

    /// Takes the record out, to be changed and put back once written.
    pub(super) fn take(&mut self, id: ActivityId) -> Option<Arc<ActivityRecord>> {
        self.records.remove(&id)
    }

    /// `record` is now the stored row: kept while it is in flight (a
    /// settled record is rarely asked for again).
    pub(super) fn stored(&mut self, record: &Arc<ActivityRecord>) {
        if !record.state.is_in_flight() {
            self.records.remove(&record.activity_id);
        } else if self.records.len() < Self::MAX || self.records.contains_key(&record.activity_id) {
            self.records.insert(record.activity_id, Arc::clone(record));
        }
    }

    pub(super) fn deleted(&mut self, id: ActivityId) {
        self.records.remove(&id);
    }
}
