//! Counter changes not yet written, added up over a group of commands: the
//! totals of each aggregate and the completions of each minute. A group
//! whose commands count into the same rows (most groups: concurrent calls
//! on one lane) writes each row once instead of once per command.

use std::collections::{BTreeMap, HashMap};

use crate::domain::counters::Totals;
use crate::domain::record::ActivityRecord;
use crate::domain::transition::Effect;
use crate::store::AggregateSlot;

#[derive(Default)]
pub(crate) struct PendingCounts {
    pub(crate) totals: HashMap<AggregateSlot, Totals>,
    /// In minute order, so that two groups that count into the same rows
    /// lock them in the same order.
    pub(crate) completions: BTreeMap<i64, i64>,
}

impl PendingCounts {
    /// The aggregate `record` counts in.
    pub(crate) fn slot(record: &ActivityRecord) -> AggregateSlot {
        (record.labels.clone(), record.priority, record.admission)
    }

    /// Counts `effects` for `record`.
    pub(crate) fn count(&mut self, record: &ActivityRecord, effects: &[Effect]) {
        let totals = self.totals.entry(Self::slot(record)).or_default();
        for effect in effects {
            totals.count(effect);
        }
    }

    /// Counts one completion in `minute`.
    pub(crate) fn complete(&mut self, minute: i64) {
        *self.completions.entry(minute).or_default() += 1;
    }

    /// Adds a command's counts to its group's.
    pub(crate) fn merge(&mut self, other: Self) {
        for (slot, totals) in other.totals {
            self.totals.entry(slot).or_default().add(&totals);
        }
        for (minute, completions) in other.completions {
            *self.completions.entry(minute).or_default() += completions;
        }
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn is_empty(&self) -> bool {
        self.totals.is_empty() && self.completions.is_empty()
    }

    /// Whether an earlier command of the group counted into `slot`: its
    /// aggregate is as good as stored for the group. Those commands decide
    /// against what was committed, so a group of new aggregates can pass a
    /// label limit by at most its own size.
    pub(crate) fn counts_into(&self, slot: &AggregateSlot) -> bool {
        self.totals.contains_key(slot)
    }
}
