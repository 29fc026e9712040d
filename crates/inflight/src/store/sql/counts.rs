//! What a SQL store counts and knows of its counters: the changes not yet
//! written, added up over a group of commands (the totals of each aggregate
//! and the completions of each minute), so that a group whose commands count
//! into the same rows (most groups: concurrent calls on one lane) writes
//! each row once; and the aggregates it has seen stored.

use std::collections::{BTreeMap, HashMap};

use crate::domain::counters::Totals;
use crate::domain::labels::ActivityLabels;
use crate::domain::record::{ActivityRecord, Admission, Priority};
use crate::domain::transition::Effect;

/// The aggregate of a call: its labels, priority and admission.
pub(crate) type AggregateSlot = (ActivityLabels, Priority, Admission);

/// What a SQL store remembers of the aggregates it has seen stored, by
/// aggregate: `()` when only that it holds them (PostgreSQL), their row ids
/// (SQLite). A begin on a label set it knows asks the database nothing
/// (`Txn::aggregate_known`, on every begin). Totals are never deleted, so
/// what was seen committed stays true. Bounded: past [`SeenAggregates::MAX`]
/// entries it forgets them all and asks again.
pub(crate) struct SeenAggregates<V>(HashMap<AggregateSlot, V>);

impl<V> Default for SeenAggregates<V> {
    fn default() -> Self {
        Self(HashMap::new())
    }
}

impl<V: Copy> SeenAggregates<V> {
    /// Past the default limit on label sets, and a few MB at most.
    const MAX: usize = 16_384;

    #[cfg(feature = "sqlite")]
    pub(crate) fn get(&self, slot: &AggregateSlot) -> Option<V> {
        self.0.get(slot).copied()
    }

    pub(crate) fn contains(&self, slot: &AggregateSlot) -> bool {
        self.0.contains_key(slot)
    }

    /// Remembers `slot`, which the database said it holds.
    pub(crate) fn insert(&mut self, slot: AggregateSlot, value: V) {
        if self.0.len() >= Self::MAX {
            self.0.clear();
        }
        self.0.insert(slot, value);
    }

    /// Forgets them all: what a transaction rolled back stored is gone.
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
}

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
