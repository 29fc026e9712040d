//! The in-memory store: one process, nothing persisted. For tests, the demo,
//! and embedded use where the ledger need not survive a restart.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::domain::admission::LanePosition;
use crate::domain::counters::{AggregateKey, Totals};
use crate::domain::owner::{Owner, OwnerId, OwnerState};
use crate::domain::record::{ActivityId, ActivityRecord, Admission, LaneKey, State};
use crate::domain::snapshot::{LaneLoad, SnapshotParts};
use crate::domain::timestamp::Millis;
use crate::error::{ErrorKind, LedgerError};

use super::engine::{self, Txn};
use super::MINUTE_MS;
use super::{Command, Store, StoreFuture};

/// Records and counters in this process's memory, with the same indexes a
/// database would keep.
pub struct MemoryStore {
    config: Arc<LedgerConfig>,
    clock: Arc<dyn Clock>,
    state: Mutex<MemoryState>,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// An empty store under `config`, reading time from `clock`.
    pub fn new(config: Arc<LedgerConfig>, clock: Arc<dyn Clock>) -> Self {
        Self {
            config,
            clock,
            state: Mutex::new(MemoryState::default()),
        }
    }
}

impl Store for MemoryStore {
    fn execute(&self, command: Command) -> StoreFuture {
        // Runs at once, so the command lands even if the future is dropped.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = self.clock.now();
        let result = engine::execute(&mut *state, &self.config, command, now);
        Box::pin(std::future::ready(result))
    }
}

#[derive(Default)]
struct MemoryState {
    /// Boxed, so that growing the map moves pointers, not records.
    records: HashMap<ActivityId, Box<ActivityRecord>>,
    /// In-flight records by the instant they become reapable.
    due: BTreeSet<(Millis, ActivityId)>,
    /// In-flight records by `enqueuedAt`.
    in_flight: BTreeSet<(Millis, ActivityId)>,
    /// Settled records by `completedAt`.
    completed: BTreeSet<(Millis, ActivityId)>,
    /// Reaped records by `reapedAt`.
    reaped: BTreeSet<(Millis, ActivityId)>,
    totals: BTreeMap<AggregateKey, Totals>,
    owners: BTreeMap<OwnerId, Owner>,
    /// Completions per minute (`completedAt / 60 000`).
    completions_by_minute: BTreeMap<i64, i64>,
}

impl MemoryState {
    fn index(&mut self, record: &ActivityRecord, present: bool) {
        let key = |at: Millis| (at, record.activity_id);
        let apply = |set: &mut BTreeSet<(Millis, ActivityId)>, at: Millis| {
            if present {
                set.insert(key(at));
            } else {
                set.remove(&key(at));
            }
        };
        if record.state.is_in_flight() {
            if let Some(at) = record.reapable_at {
                apply(&mut self.due, at);
            }
            apply(&mut self.in_flight, record.enqueued_at);
        }
        if let Some(at) = record.completed_at.filter(|_| record.state.is_settled()) {
            apply(&mut self.completed, at);
        }
        if let Some(at) = record.reaped_at.filter(|_| record.state == State::Reaped) {
            apply(&mut self.reaped, at);
        }
    }

    /// Completions from `since` on: whole minutes from their counters, the
    /// first (partial) minute from the index.
    fn completions_since(&self, since: Millis) -> i64 {
        let minute = since.div_euclid(MINUTE_MS);
        let next_minute = (minute + 1) * MINUTE_MS;
        let partial = self
            .completed
            .range((since, ActivityId::nil_min())..(next_minute, ActivityId::nil_min()))
            .count() as i64;
        let whole: i64 = self
            .completions_by_minute
            .range(minute + 1..)
            .map(|(_, n)| n)
            .sum();
        partial + whole
    }

    fn records_of<'a>(&'a self, keys: impl Iterator<Item = &'a (Millis, ActivityId)>) -> Vec<ActivityRecord> {
        keys.filter_map(|(_, id)| self.records.get(id))
            .map(|record| (**record).clone())
            .collect()
    }
}

impl Txn for MemoryState {
    fn get(&mut self, id: ActivityId) -> Result<Option<ActivityRecord>, LedgerError> {
        Ok(self.records.get(&id).map(|record| (**record).clone()))
    }

    fn insert(&mut self, record: &ActivityRecord) -> Result<(), LedgerError> {
        if self.records.contains_key(&record.activity_id) {
            return Err(LedgerError::new(
                ErrorKind::Conflict,
                format!("activity {} already exists", record.activity_id),
            ));
        }
        self.index(record, true);
        self.records.insert(record.activity_id, Box::new(record.clone()));
        Ok(())
    }

    fn update(&mut self, record: &ActivityRecord) -> Result<(), LedgerError> {
        let mut slot = match self.records.remove(&record.activity_id) {
            Some(old) => {
                self.index(&old, false);
                old
            }
            None => Box::new(record.clone()),
        };
        self.index(record, true);
        // Reuses the record's allocation.
        (*slot).clone_from(record);
        self.records.insert(record.activity_id, slot);
        Ok(())
    }

    fn due(&mut self, now: Millis, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        let keys = self.due.iter().take_while(|(at, _)| *at < now).take(limit);
        Ok(self.records_of(keys))
    }

    fn add_totals(&mut self, key: &AggregateKey, delta: &Totals) -> Result<(), LedgerError> {
        match self.totals.get_mut(key) {
            Some(totals) => totals.add(delta),
            None => {
                let mut totals = Totals::default();
                totals.add(delta);
                self.totals.insert(key.clone(), totals);
            }
        }
        Ok(())
    }

    fn snapshot_parts(&mut self, since: Millis, limit: usize) -> Result<SnapshotParts, LedgerError> {
        let mut loads: BTreeMap<LaneKey, LaneLoad> = BTreeMap::new();
        for (_, id) in &self.in_flight {
            let Some(record) = self.records.get(id) else {
                continue;
            };
            if record.admission != Admission::Queued {
                continue;
            }
            let lane = record.lane();
            let load = loads.entry(lane.clone()).or_insert(LaneLoad {
                lane,
                executing: 0,
                waiting: 0,
                oldest_waiting_since: None,
            });
            if record.state == State::Executing {
                load.executing += 1;
            } else {
                load.waiting += 1;
                // `in_flight` is ordered by enqueuedAt, so the first is oldest.
                load.oldest_waiting_since.get_or_insert(record.enqueued_at);
            }
        }
        let window = (since, ActivityId::nil_min())..;
        let in_flight = self.records_of(self.in_flight.iter().take(limit + 1));
        let recent = self.records_of(self.completed.range(window.clone()).rev().take(limit + 1));
        let reaped = self.records_of(self.reaped.range(window.clone()).rev().take(limit + 1));
        Ok(SnapshotParts {
            lane_loads: loads.into_values().collect(),
            aggregates: self.totals.iter().map(|(k, t)| (k.clone(), *t)).collect(),
            in_flight,
            in_flight_total: self.in_flight.len() as i64,
            recent_completions: recent,
            recent_completions_total: self.completions_since(since),
            reaped,
            owners: self
                .owners
                .values()
                .filter(|owner| {
                    owner.state == OwnerState::Live || owner.ended_at.is_some_and(|at| at >= since)
                })
                .cloned()
                .collect(),
        })
    }

    fn count_completion(&mut self, completed_at: Millis) -> Result<(), LedgerError> {
        *self
            .completions_by_minute
            .entry(completed_at.div_euclid(MINUTE_MS))
            .or_default() += 1;
        Ok(())
    }

    fn prune(&mut self, before: Millis, limit: usize) -> Result<usize, LedgerError> {
        let bound = (before, ActivityId::nil_min());
        let mut doomed: Vec<ActivityId> = self
            .completed
            .range(..bound)
            .take(limit)
            .map(|(_, id)| *id)
            .collect();
        let room = limit - doomed.len();
        doomed.extend(self.reaped.range(..bound).take(room).map(|(_, id)| *id));
        for id in &doomed {
            if let Some(record) = self.records.remove(id) {
                self.index(&record, false);
            }
        }
        self.owners
            .retain(|_, owner| owner.ended_at.is_none_or(|ended| ended >= before));
        let first_kept = before.div_euclid(MINUTE_MS);
        self.completions_by_minute = self.completions_by_minute.split_off(&first_kept);
        Ok(doomed.len())
    }

    fn stored_records(&mut self) -> Result<i64, LedgerError> {
        Ok(self.records.len() as i64)
    }

    fn lane_position(
        &mut self,
        record: &ActivityRecord,
        newcomer: bool,
    ) -> Result<LanePosition, LedgerError> {
        let mut position = LanePosition {
            executing: 0,
            waiting_ahead: 0,
        };
        let me = (record.enqueued_at, record.activity_id);
        for key in &self.in_flight {
            let Some(other) = self.records.get(&key.1) else {
                continue;
            };
            if other.admission != Admission::Queued
                || other.service != record.service
                || other.provider != record.provider
                || other.activity_id == record.activity_id
            {
                continue;
            }
            match other.state {
                State::Executing => position.executing += 1,
                State::Waiting if *key < me || (newcomer && key.0 == me.0) => position.waiting_ahead += 1,
                _ => {}
            }
        }
        Ok(position)
    }

    fn get_owner(&mut self, id: &OwnerId) -> Result<Option<Owner>, LedgerError> {
        Ok(self.owners.get(id).cloned())
    }

    fn put_owner(&mut self, owner: &Owner) -> Result<(), LedgerError> {
        self.owners.insert(owner.owner_id.clone(), owner.clone());
        Ok(())
    }

    fn expired_owners(&mut self, now: Millis) -> Result<Vec<Owner>, LedgerError> {
        Ok(self
            .owners
            .values()
            .filter(|owner| owner.is_expired(now))
            .cloned()
            .collect())
    }

    fn owner_in_flight(&mut self, id: &OwnerId) -> Result<Vec<ActivityRecord>, LedgerError> {
        let keys = self.in_flight.iter().filter(|(_, activity)| {
            self.records
                .get(activity)
                .is_some_and(|record| record.owner_id.as_deref() == Some(id.as_str()))
        });
        Ok(self.records_of(keys))
    }
}
