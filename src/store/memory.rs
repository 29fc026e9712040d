//! The in-memory store: one process, nothing persisted. For tests, the demo,
//! and embedded use where the ledger need not survive a restart.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::domain::admission::LanePosition;
use crate::domain::counters::{AggregateKey, Totals};
use crate::domain::labels::ActivityLabels;
use crate::domain::owner::{Owner, OwnerId, OwnerState};
use crate::domain::record::{ActivityId, ActivityRecord, Admission, LaneKey, Priority, State};
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
        StoreFuture::ready(result)
    }
}

/// The record map's hasher: ids are UUIDv7s, already spread, and nothing an
/// outsider sends can choose them to collide.
type IdMap<V> = HashMap<ActivityId, V, foldhash::fast::RandomState>;

#[derive(Default)]
struct MemoryState {
    records: Records,
    indexes: Indexes,
    /// The counters, keyed by what [`AggregateKey::of`] reads from a record;
    /// the shared labels carry their hash, so no label is hashed here.
    totals: hashbrown::HashMap<AggregateSlot, Totals>,
    owners: BTreeMap<OwnerId, Owner>,
    /// Completions per minute (`completedAt / 60 000`).
    completions_by_minute: BTreeMap<i64, i64>,
}

/// The records, shared with the replies that carry them so that a reply
/// copies nothing. Those in flight live in a small hash map that stays in
/// cache; the rest (history, until retention prunes it) are ordered by id,
/// and ids are UUIDv7s, ordered by creation, so a record settling now joins
/// the newest end of the tree instead of a random slot of a table the size
/// of the whole history.
#[derive(Default)]
struct Records {
    live: IdMap<Arc<ActivityRecord>>,
    history: BTreeMap<ActivityId, Arc<ActivityRecord>>,
}

impl Records {
    fn get(&self, id: &ActivityId) -> Option<&Arc<ActivityRecord>> {
        self.live.get(id).or_else(|| self.history.get(id))
    }

    fn contains(&self, id: &ActivityId) -> bool {
        self.live.contains_key(id) || self.history.contains_key(id)
    }

    fn remove(&mut self, id: &ActivityId) -> Option<Arc<ActivityRecord>> {
        self.live.remove(id).or_else(|| self.history.remove(id))
    }

    fn len(&self) -> usize {
        self.live.len() + self.history.len()
    }

    /// Files `record` with the records of its kind.
    fn file(&mut self, record: Arc<ActivityRecord>) {
        if record.state.is_in_flight() {
            self.live.insert(record.activity_id, record);
        } else {
            self.history.insert(record.activity_id, record);
        }
    }
}

/// What a memory store keys its counters by.
type AggregateSlot = (ActivityLabels, Priority, Admission);

/// An [`AggregateSlot`] by reference, hashed exactly like the owned one.
#[derive(Hash)]
struct AggregateRef<'a>((&'a ActivityLabels, Priority, Admission));

impl hashbrown::Equivalent<AggregateSlot> for AggregateRef<'_> {
    fn equivalent(&self, key: &AggregateSlot) -> bool {
        let (labels, priority, admission) = self.0;
        *labels == key.0 && priority == key.1 && admission == key.2
    }
}

/// The ordered indexes a database would keep, each of `(instant, id)`.
#[derive(Default)]
struct Indexes {
    /// In-flight records by the instant they become reapable.
    due: BTreeSet<(Millis, ActivityId)>,
    /// In-flight records by `enqueuedAt`.
    in_flight: BTreeSet<(Millis, ActivityId)>,
    /// Settled records by `completedAt`.
    completed: BTreeSet<(Millis, ActivityId)>,
    /// Reaped records by `reapedAt`.
    reaped: BTreeSet<(Millis, ActivityId)>,
}

/// Where a record sits in each index.
#[derive(Default, Clone, Copy)]
struct IndexKeys {
    due: Option<Millis>,
    in_flight: Option<Millis>,
    completed: Option<Millis>,
    reaped: Option<Millis>,
}

impl IndexKeys {
    fn of(record: &ActivityRecord) -> Self {
        let in_flight = record.state.is_in_flight();
        Self {
            due: record.reapable_at.filter(|_| in_flight),
            in_flight: Some(record.enqueued_at).filter(|_| in_flight),
            completed: record.completed_at.filter(|_| record.state.is_settled()),
            reaped: record.reaped_at.filter(|_| record.state == State::Reaped),
        }
    }
}

impl Indexes {
    /// Moves `id` from the entries of `old` to those of `new`, touching only
    /// the indexes whose key changed.
    fn reindex(&mut self, id: ActivityId, old: Option<&ActivityRecord>, new: Option<&ActivityRecord>) {
        let old = old.map(IndexKeys::of).unwrap_or_default();
        let new = new.map(IndexKeys::of).unwrap_or_default();
        move_entry(&mut self.due, id, old.due, new.due);
        move_entry(&mut self.in_flight, id, old.in_flight, new.in_flight);
        move_entry(&mut self.completed, id, old.completed, new.completed);
        move_entry(&mut self.reaped, id, old.reaped, new.reaped);
    }
}

fn move_entry(
    set: &mut BTreeSet<(Millis, ActivityId)>,
    id: ActivityId,
    old: Option<Millis>,
    new: Option<Millis>,
) {
    if old == new {
        return;
    }
    if let Some(at) = old {
        set.remove(&(at, id));
    }
    if let Some(at) = new {
        set.insert((at, id));
    }
}

impl MemoryState {
    /// Completions from `since` on: whole minutes from their counters, the
    /// first (partial) minute from the index.
    fn completions_since(&self, since: Millis) -> i64 {
        let minute = since.div_euclid(MINUTE_MS);
        let next_minute = (minute + 1) * MINUTE_MS;
        let partial = self
            .indexes
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

    /// The counters as a report lists them, in [`AggregateKey`] order.
    fn aggregates(&self) -> Vec<(AggregateKey, Totals)> {
        let mut aggregates: Vec<(AggregateKey, Totals)> = self
            .totals
            .iter()
            .map(|((labels, priority, admission), totals)| {
                (AggregateKey::new(labels, *priority, *admission), *totals)
            })
            .collect();
        aggregates.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        aggregates
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

    fn insert(&mut self, record: ActivityRecord) -> Result<Arc<ActivityRecord>, LedgerError> {
        if self.records.contains(&record.activity_id) {
            return Err(LedgerError::new(
                ErrorKind::Conflict,
                format!("activity {} already exists", record.activity_id),
            ));
        }
        self.indexes.reindex(record.activity_id, None, Some(&record));
        let record = Arc::new(record);
        self.records.file(Arc::clone(&record));
        Ok(record)
    }

    fn update(&mut self, record: ActivityRecord) -> Result<Arc<ActivityRecord>, LedgerError> {
        let id = record.activity_id;
        let stored = match self.records.remove(&id) {
            Some(mut stored) => {
                self.indexes.reindex(id, Some(&stored), Some(&record));
                match Arc::get_mut(&mut stored) {
                    // No reply holds the old version: overwrite it in place.
                    Some(old) => *old = record,
                    // A reply still holds it, and it stays as it was.
                    None => stored = Arc::new(record),
                }
                stored
            }
            None => {
                self.indexes.reindex(id, None, Some(&record));
                Arc::new(record)
            }
        };
        self.records.file(Arc::clone(&stored));
        Ok(stored)
    }

    fn due(&mut self, now: Millis, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        let keys = self
            .indexes
            .due
            .iter()
            .take_while(|(at, _)| *at < now)
            .take(limit);
        Ok(self.records_of(keys))
    }

    fn add_totals(&mut self, record: &ActivityRecord, delta: &Totals) -> Result<(), LedgerError> {
        // Looked up by reference: the key is cloned only for a new aggregate.
        let slot = (&record.labels, record.priority, record.admission);
        match self.totals.get_mut(&AggregateRef(slot)) {
            Some(totals) => totals.add(delta),
            None => {
                let mut totals = Totals::default();
                totals.add(delta);
                self.totals
                    .insert((record.labels.clone(), record.priority, record.admission), totals);
            }
        }
        Ok(())
    }

    fn snapshot_parts(&mut self, since: Millis, limit: usize) -> Result<SnapshotParts, LedgerError> {
        let mut loads: BTreeMap<LaneKey, LaneLoad> = BTreeMap::new();
        for (_, id) in &self.indexes.in_flight {
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
        let in_flight = self.records_of(self.indexes.in_flight.iter().take(limit + 1));
        let recent = self.records_of(self.indexes.completed.range(window.clone()).rev().take(limit + 1));
        let reaped = self.records_of(self.indexes.reaped.range(window.clone()).rev().take(limit + 1));
        Ok(SnapshotParts {
            lane_loads: loads.into_values().collect(),
            aggregates: self.aggregates(),
            in_flight,
            in_flight_total: self.indexes.in_flight.len() as i64,
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
        let minute = completed_at.div_euclid(MINUTE_MS);
        // Completions mostly land in the newest minute: no tree search.
        if let Some(mut newest) = self.completions_by_minute.last_entry() {
            if *newest.key() == minute {
                *newest.get_mut() += 1;
                return Ok(());
            }
        }
        *self.completions_by_minute.entry(minute).or_default() += 1;
        Ok(())
    }

    fn prune(&mut self, before: Millis, limit: usize) -> Result<usize, LedgerError> {
        let bound = (before, ActivityId::nil_min());
        let mut doomed: Vec<ActivityId> = self
            .indexes
            .completed
            .range(..bound)
            .take(limit)
            .map(|(_, id)| *id)
            .collect();
        let room = limit - doomed.len();
        doomed.extend(self.indexes.reaped.range(..bound).take(room).map(|(_, id)| *id));
        for id in &doomed {
            if let Some(record) = self.records.remove(id) {
                self.indexes.reindex(*id, Some(&record), None);
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
        for key in &self.indexes.in_flight {
            let Some(other) = self.records.get(&key.1) else {
                continue;
            };
            if other.admission != Admission::Queued
                || other.labels.service != record.labels.service
                || other.labels.provider != record.labels.provider
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
        let keys = self.indexes.in_flight.iter().filter(|(_, activity)| {
            self.records
                .get(activity)
                .is_some_and(|record| record.owner_id.as_deref() == Some(id.as_str()))
        });
        Ok(self.records_of(keys))
    }
}
