//! The in-memory store: one process, nothing persisted. For tests, the demo,
//! and embedded use where the ledger need not survive a restart.

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::domain::admission::{LanePosition, LaneState};
use crate::domain::budget::{self, WindowUse};
use crate::domain::capacity::Capacity;
use crate::domain::counters::{AggregateKey, Totals};
use crate::domain::idempotency::Idempotency;
use crate::domain::labels::{ActivityLabels, Label, LabelSet};
use crate::domain::owner::{Owner, OwnerId};
use crate::domain::query::{self, LaneQuery, Retention, Window};
use crate::domain::record::{ActivityId, ActivityRecord, Admission, LaneKey, Priority, State};
use crate::domain::snapshot::LaneLoad;
use crate::domain::timestamp::Timestamp;
use crate::domain::transition::Effect;
use crate::domain::window;
use crate::domain::window::LaneTokens;
use crate::error::{ErrorKind, LedgerError};
use crate::stats::{CallSnapshot, CallStats};

use super::engine::{self, Questions, Txn};
use super::{Command, EndWatch, Store, StoreFuture, Wake, Watchers};

mod append_map;
mod history;

use append_map::AppendMap;
use history::History;

/// Records and counters in this process's memory, with the same indexes a
/// database would keep.
pub struct MemoryStore {
    config: Arc<LedgerConfig>,
    clock: Arc<dyn Clock>,
    state: Mutex<MemoryState>,
    watchers: Watchers,
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
            watchers: Watchers::default(),
        }
    }
}

impl Store for MemoryStore {
    fn execute(&self, command: Command) -> StoreFuture {
        // Runs at once, so the command lands even if the future is dropped.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = self.clock.now();
        let result = engine::execute(&mut *state, &self.config, command, now);
        // Nothing to roll back here: what the engine did landed as it went
        // (`Txn::landed`), refusals included (they keep the reaps time
        // forced); the command's reap summary, if any, follows.
        state.calls.finish();
        if state.changed.is_empty() && state.ended.is_empty() {
            return StoreFuture::ready(result);
        }
        let changed = std::mem::take(&mut state.changed);
        let ended = std::mem::take(&mut state.ended);
        drop(state);
        // Woken and shown outside the store's lock: a waiter asks again at
        // once, and a watcher of ends may read the store.
        for (lane, change) in &changed {
            self.watchers.changed(lane, *change);
        }
        for (record, effect) in &ended {
            self.watchers.ended(record, effect);
        }
        StoreFuture::ready(result)
    }

    fn watch_capacity(&self, wake: Wake) {
        self.watchers.add(wake);
    }

    fn watch_ends(&self, watch: EndWatch) {
        self.watchers.add_end_watch(watch);
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keep_ends = true;
    }

    fn call_stats(&self) -> CallSnapshot {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .calls
            .snapshot()
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
    totals: Counters,
    owners: BTreeMap<OwnerId, Owner>,
    /// Idempotency keys: the record each was first used for and the
    /// fingerprint of that begin; and each keyed record's key, so that a
    /// prune forgets it.
    keys: HashMap<Box<str>, (ActivityId, i64)>,
    key_of: HashMap<ActivityId, Box<str>>,
    /// What each lane remembers between admission decisions.
    lane_states: HashMap<LaneKey, LaneState>,
    /// Completions per minute (`completedAt / 60 000`).
    completions_by_minute: BTreeMap<i64, i64>,
    /// Tokens charged per second and lane ([`window::moves`]).
    token_seconds: BTreeMap<i64, HashMap<LaneKey, i64>>,
    /// The call histograms and the running command's reaps: kept under
    /// the store's own lock, so a start or settle pays no other.
    calls: CallStats,
    /// What the running command did to capacity, for the watchers.
    changed: Vec<(LaneKey, Capacity)>,
    /// Whether anyone watches ends ([`Store::watch_ends`]): only then are
    /// they kept in `ended`, so that a store no one watches pays nothing.
    keep_ends: bool,
    /// The ends the running command made, for their watchers.
    ended: Vec<(Arc<ActivityRecord>, Effect)>,
}

/// The records. Those in flight live in a small hash map that stays in
/// cache, shared with the replies that carry them so that a reply copies
/// nothing. The rest (history, until retention prunes it) are packed and
/// ordered by id; ids are UUIDv7s, ordered by creation, so a record settling
/// now joins the newest end of the history instead of a random slot of a
/// table the size of the whole history.
#[derive(Default)]
struct Records {
    live: IdMap<Arc<ActivityRecord>>,
    history: History,
}

impl Records {
    fn get(&self, id: &ActivityId) -> Option<Arc<ActivityRecord>> {
        match self.live.get(id) {
            Some(record) => Some(Arc::clone(record)),
            None => self.history.get(id),
        }
    }

    fn contains(&self, id: &ActivityId) -> bool {
        self.live.contains_key(id) || (!self.history.is_newer(id) && self.history.contains(id))
    }

    fn remove(&mut self, id: &ActivityId) -> Option<Arc<ActivityRecord>> {
        self.live.remove(id).or_else(|| self.history.remove(id))
    }

    fn len(&self) -> usize {
        self.live.len() + self.history.len()
    }

    /// Files `record` with the records of its kind, replacing any version
    /// of it there.
    fn file(&mut self, record: Arc<ActivityRecord>) {
        if record.state.is_in_flight() {
            self.live.insert(record.activity_id, record);
        } else {
            self.history.insert(&record);
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

/// The counters, one [`Totals`] per aggregate.
#[derive(Default)]
struct Counters {
    entries: Vec<(AggregateSlot, Totals)>,
    /// Where each aggregate's entry is.
    by_key: hashbrown::HashMap<AggregateSlot, usize>,
    /// The entry counted into last. A service mostly calls the same lane
    /// with the same labels again and again, and then the entry is found
    /// by comparing one pointer instead of hashing the key.
    last: usize,
    /// Every lane some aggregate is of.
    lanes: hashbrown::HashSet<(Label, Label)>,
}

impl Counters {
    /// Whether the aggregate of `slot` has an entry.
    fn contains(&self, slot: (&ActivityLabels, Priority, Admission)) -> bool {
        let last = self
            .entries
            .get(self.last)
            .is_some_and(|((labels, priority, admission), _)| {
                labels == slot.0 && *priority == slot.1 && *admission == slot.2
            });
        last || self.by_key.contains_key(&AggregateRef(slot))
    }

    /// The totals of the aggregate `record` counts in, created at zero.
    fn of(&mut self, record: &ActivityRecord) -> &mut Totals {
        let slot = (&record.labels, record.priority, record.admission);
        let hit = self
            .entries
            .get(self.last)
            .is_some_and(|((labels, priority, admission), _)| {
                labels == slot.0 && *priority == slot.1 && *admission == slot.2
            });
        if !hit {
            // Looked up by reference: the key is cloned only for a new aggregate.
            self.last = match self.by_key.get(&AggregateRef(slot)) {
                Some(&at) => at,
                None => {
                    let key = (record.labels.clone(), record.priority, record.admission);
                    self.lanes
                        .insert((record.labels.service.clone(), record.labels.provider.clone()));
                    self.entries.push((key.clone(), Totals::default()));
                    self.by_key.insert(key, self.entries.len() - 1);
                    self.entries.len() - 1
                }
            };
        }
        &mut self.entries[self.last].1
    }
}

/// The indexes a database would keep. Records in flight need none beyond
/// the live map besides the expiry heap: every read of them (a snapshot, a
/// lane's position, an owner's work) visits each of them anyway.
#[derive(Default)]
struct Indexes {
    /// In-flight records by the instant they become reapable.
    due: DueIndex,
    /// Settled records by `completedAt`.
    completed: AppendMap<(Timestamp, ActivityId), ()>,
    /// Reaped records by `reapedAt`.
    reaped: AppendMap<(Timestamp, ActivityId), ()>,
}

/// Where a record sits in each index.
#[derive(Default, Clone, Copy)]
struct IndexKeys {
    due: Option<Timestamp>,
    completed: Option<Timestamp>,
    reaped: Option<Timestamp>,
}

impl IndexKeys {
    fn of(record: &ActivityRecord) -> Self {
        Self {
            due: due_key(record),
            completed: record.completed_at.filter(|_| record.state.is_settled()),
            reaped: record.reaped_at.filter(|_| record.state == State::Reaped),
        }
    }
}

/// The instant past which an in-flight record is reaped.
fn due_key(record: &ActivityRecord) -> Option<Timestamp> {
    record.reapable_at.filter(|_| record.state.is_in_flight())
}

impl Indexes {
    /// Moves `id` from the entries of `old` to those of `new`, touching only
    /// the indexes whose key changed.
    fn reindex(&mut self, id: ActivityId, old: Option<&ActivityRecord>, new: Option<&ActivityRecord>) {
        let old = old.map(IndexKeys::of).unwrap_or_default();
        let new = new.map(IndexKeys::of).unwrap_or_default();
        self.move_keys(id, old, new);
    }

    fn move_keys(&mut self, id: ActivityId, old: IndexKeys, new: IndexKeys) {
        if old.due != new.due {
            if let Some(at) = new.due {
                self.due.push(at, id);
            }
        }
        move_entry(&mut self.completed, id, old.completed, new.completed);
        move_entry(&mut self.reaped, id, old.reaped, new.reaped);
    }
}

fn move_entry(
    set: &mut AppendMap<(Timestamp, ActivityId), ()>,
    id: ActivityId,
    old: Option<Timestamp>,
    new: Option<Timestamp>,
) {
    if old == new {
        return;
    }
    if let Some(at) = old {
        set.remove(&(at, id));
    }
    if let Some(at) = new {
        set.insert((at, id), ());
    }
}

/// In-flight records by the instant they become reapable: a min-heap whose
/// entries are checked against the live record when they come due. A start
/// or a settle then costs one push or nothing, where an ordered set would
/// cost a removal and an insertion; an entry a transition made stale is
/// dropped when it reaches the top, or when stale entries outnumber live
/// ones and the heap is rebuilt from the live records.
#[derive(Default)]
struct DueIndex {
    heap: BinaryHeap<Reverse<(Timestamp, ActivityId)>>,
}

impl DueIndex {
    fn push(&mut self, at: Timestamp, id: ActivityId) {
        self.heap.push(Reverse((at, id)));
    }

    /// Rebuilds the heap from `live` once stale entries dominate it, so that
    /// its size follows the records in flight, not the throughput.
    fn compact(&mut self, live: &IdMap<Arc<ActivityRecord>>) {
        if self.heap.len() <= 2 * live.len() + 1024 {
            return;
        }
        let entries: Vec<_> = live
            .values()
            .filter_map(|record| due_key(record).map(|at| Reverse((at, record.activity_id))))
            .collect();
        self.heap = BinaryHeap::from(entries);
    }

    /// In-flight records of `live` reapable before `now`, at most `limit`,
    /// earliest first. Stale entries met on the way are dropped.
    fn due(
        &mut self,
        live: &IdMap<Arc<ActivityRecord>>,
        now: Timestamp,
        limit: usize,
    ) -> Vec<Arc<ActivityRecord>> {
        let mut found: Vec<Arc<ActivityRecord>> = Vec::new();
        let mut kept: Vec<(Timestamp, ActivityId)> = Vec::new();
        while found.len() < limit {
            let Some(&Reverse((at, id))) = self.heap.peek() else {
                break;
            };
            if !query::is_past(at, now) {
                break;
            }
            self.heap.pop();
            let Some(record) = live.get(&id).filter(|record| due_key(record) == Some(at)) else {
                continue;
            };
            // A record can have two current entries when it left flight and
            // came back with the same instant; equal entries pop one after
            // the other, and it is due once.
            if kept.last() == Some(&(at, id)) {
                continue;
            }
            kept.push((at, id));
            found.push(Arc::clone(record));
        }
        // Kept until the records are seen reaped, in case a caller does not
        // reap what it was shown.
        for (at, id) in kept {
            self.push(at, id);
        }
        found
    }
}

impl MemoryState {
    /// The records in flight in [`query::line_order`]. Sorted when read,
    /// because every read of them visits them all anyway, and a start or
    /// settle then touches no ordered index of them.
    fn in_flight_in_order(&self) -> Vec<&Arc<ActivityRecord>> {
        let mut records: Vec<_> = self.records.live.values().collect();
        records.sort_unstable_by_key(|record| query::line_order(record));
        records
    }

    fn records_of<'a>(
        &'a self,
        keys: impl Iterator<Item = (&'a (Timestamp, ActivityId), &'a ())>,
    ) -> Vec<ActivityRecord> {
        keys.filter_map(|((_, id), ())| self.records.get(id))
            .map(Arc::unwrap_or_clone)
            .collect()
    }
}

impl Txn for MemoryState {
    fn get(&mut self, id: ActivityId) -> Result<Option<Arc<ActivityRecord>>, LedgerError> {
        Ok(self.records.get(&id))
    }

    fn insert(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        if self.records.contains(&record.activity_id) {
            return Err(LedgerError::new(
                ErrorKind::Conflict,
                format!("activity {} already exists", record.activity_id),
            ));
        }
        self.indexes.reindex(record.activity_id, None, Some(record));
        self.records.file(Arc::clone(record));
        self.indexes.due.compact(&self.records.live);
        Ok(())
    }

    fn update(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        // Starts and settles go through `modify`; what comes here (reaps,
        // cancels of a released owner, late settles) is rare.
        let id = record.activity_id;
        let old = self.records.remove(&id);
        self.indexes.reindex(id, old.as_deref(), Some(record));
        self.records.file(Arc::clone(record));
        self.indexes.due.compact(&self.records.live);
        Ok(())
    }

    fn peek(&mut self, id: ActivityId, look: &mut dyn FnMut(&ActivityRecord)) -> Result<bool, LedgerError> {
        if let Some(record) = self.records.live.get(&id) {
            look(record);
            return Ok(true);
        }
        Ok(self
            .records
            .history
            .get(&id)
            .map(|record| look(&record))
            .is_some())
    }

    fn modify(
        &mut self,
        id: ActivityId,
        change: &mut dyn FnMut(&mut ActivityRecord) -> bool,
    ) -> Result<Option<Arc<ActivityRecord>>, LedgerError> {
        let Entry::Occupied(mut entry) = self.records.live.entry(id) else {
            // Out of flight (a late settle, a resurrection): changed on an
            // unpacked copy, and filed again.
            let Some(mut record) = self.records.history.get(&id) else {
                return Ok(None);
            };
            let old = IndexKeys::of(&record);
            if change(Arc::make_mut(&mut record)) {
                self.indexes.move_keys(id, old, IndexKeys::of(&record));
                if record.state.is_in_flight() {
                    self.records.history.forget(&id);
                }
                // Back in flight, or packed again over its old version.
                self.records.file(Arc::clone(&record));
                self.indexes.due.compact(&self.records.live);
            }
            return Ok(Some(record));
        };
        // Shared only by replies still held: changed in place when there
        // are none.
        let stored = entry.get_mut();
        let old = IndexKeys::of(stored);
        if !change(Arc::make_mut(stored)) {
            return Ok(Some(Arc::clone(stored)));
        }
        let record = if stored.state.is_in_flight() {
            Arc::clone(stored)
        } else {
            // Out of flight now: the entry found is the one removed, with no
            // second search of the live map, and filed where its kind goes.
            let record = entry.remove();
            self.records.file(Arc::clone(&record));
            record
        };
        self.indexes.move_keys(id, old, IndexKeys::of(&record));
        self.indexes.due.compact(&self.records.live);
        Ok(Some(record))
    }

    fn delete(&mut self, ids: &[ActivityId]) -> Result<usize, LedgerError> {
        let mut deleted = 0;
        for id in ids {
            if let Some(key) = self.key_of.remove(id) {
                self.keys.remove(&key);
            }
            if let Some(record) = self.records.remove(id) {
                self.indexes.reindex(*id, Some(&record), None);
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    fn claim_key(&mut self, key: &Idempotency, record: &ActivityRecord) -> Result<(), LedgerError> {
        let id = record.activity_id;
        let key_text: Box<str> = key.key.as_str().into();
        self.keys.insert(key_text.clone(), (id, key.fingerprint));
        self.key_of.insert(id, key_text);
        Ok(())
    }

    fn aggregate_known(
        &mut self,
        labels: &ActivityLabels,
        priority: Priority,
        admission: Admission,
    ) -> Result<bool, LedgerError> {
        Ok(self.totals.contains((labels, priority, admission)))
    }

    fn add_totals(&mut self, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError> {
        let totals = self.totals.of(record);
        // Counted straight into the stored totals: no delta to build and add.
        for effect in effects {
            totals.count(effect);
        }
        Ok(())
    }

    fn count_completion(&mut self, _record: &ActivityRecord, minute: i64) -> Result<(), LedgerError> {
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

    fn spend(&mut self, lane: &LaneKey, second: i64, tokens: i64) -> Result<(), LedgerError> {
        *self
            .token_seconds
            .entry(second)
            .or_default()
            .entry(lane.clone())
            .or_default() += tokens;
        Ok(())
    }

    fn landed(&mut self, record: &Arc<ActivityRecord>, effect: &Effect, capacity: Option<Capacity>) {
        self.calls.land(record.activity_id, &record.labels, effect);
        if let Some(change) = capacity {
            self.changed.push((record.lane(), change));
        }
        if self.keep_ends && effect.marks_end() {
            self.ended.push((Arc::clone(record), *effect));
        }
    }
}

impl Questions for MemoryState {
    fn lane_known(&mut self, labels: &LabelSet) -> Result<bool, LedgerError> {
        Ok(self
            .totals
            .lanes
            .contains(&(labels.service.clone(), labels.provider.clone())))
    }

    fn label_census(&mut self) -> Result<(i64, i64), LedgerError> {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        Ok((count(self.totals.lanes.len()), count(self.totals.entries.len())))
    }

    fn aggregates(&mut self) -> Result<Vec<(AggregateKey, Totals)>, LedgerError> {
        Ok(self
            .totals
            .entries
            .iter()
            .map(|((labels, priority, admission), totals)| {
                (AggregateKey::new(labels, *priority, *admission), *totals)
            })
            .collect())
    }

    fn completion_minutes_from(&mut self, minute: i64) -> Result<i64, LedgerError> {
        Ok(self.completions_by_minute.range(minute..).map(|(_, n)| n).sum())
    }

    fn delete_minutes_before(&mut self, minute: i64) -> Result<(), LedgerError> {
        self.completions_by_minute = self.completions_by_minute.split_off(&minute);
        Ok(())
    }

    fn tokens_since(&mut self, second: i64) -> Result<Vec<LaneTokens>, LedgerError> {
        let seconds = self
            .token_seconds
            .range(second..)
            .flat_map(|(&at, lanes)| lanes.iter().map(move |(lane, &tokens)| (at, lane, tokens)));
        Ok(window::lane_tokens(seconds, second))
    }

    fn window_use(&mut self, lane: &LaneKey, first: i64) -> Result<(WindowUse, WindowUse), LedgerError> {
        let seconds = self.token_seconds.range(first..).map(|(&second, lanes)| {
            let (mut own, mut provider) = (0, 0);
            for (other, &tokens) in lanes.iter().filter(|(other, _)| other.provider == lane.provider) {
                provider += tokens;
                if other.service == lane.service {
                    own += tokens;
                }
            }
            (second, own, provider)
        });
        Ok(budget::windows(seconds))
    }

    fn delete_token_seconds_before(&mut self, second: i64) -> Result<(), LedgerError> {
        self.token_seconds = self.token_seconds.split_off(&second);
        Ok(())
    }

    fn stored_records(&mut self) -> Result<i64, LedgerError> {
        Ok(self.records.len() as i64)
    }

    fn find_key(&mut self, key: &str) -> Result<Option<(ActivityId, i64)>, LedgerError> {
        Ok(self.keys.get(key).copied())
    }

    fn get_owner(&mut self, id: &OwnerId) -> Result<Option<Owner>, LedgerError> {
        Ok(self.owners.get(id).cloned())
    }

    fn put_owner(&mut self, owner: &Owner) -> Result<(), LedgerError> {
        self.owners.insert(owner.owner_id.clone(), owner.clone());
        Ok(())
    }

    fn due(&mut self, now: Timestamp, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        Ok(self.indexes.due.due(&self.records.live, now, limit))
    }

    fn lane_position(&mut self, query: &LaneQuery) -> Result<LanePosition, LedgerError> {
        Ok(query.answer(self.records.live.values().map(|record| &**record)))
    }

    fn lane_state(&mut self, lane: &LaneKey) -> Result<LaneState, LedgerError> {
        Ok(self.lane_states.get(lane).copied().unwrap_or_default())
    }

    fn put_lane_state(&mut self, lane: &LaneKey, state: LaneState) -> Result<(), LedgerError> {
        self.lane_states.insert(lane.clone(), state);
        Ok(())
    }

    fn lane_states(&mut self) -> Result<Vec<(LaneKey, LaneState)>, LedgerError> {
        Ok(self
            .lane_states
            .iter()
            .map(|(lane, state)| (lane.clone(), *state))
            .collect())
    }

    fn in_flight(&mut self, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        Ok(self
            .in_flight_in_order()
            .into_iter()
            .take(limit)
            .cloned()
            .collect())
    }

    fn in_flight_count(&mut self) -> Result<i64, LedgerError> {
        Ok(self.records.live.len() as i64)
    }

    fn lane_loads(&mut self) -> Result<Vec<LaneLoad>, LedgerError> {
        Ok(query::lane_loads(
            self.records.live.values().map(|record| &**record),
        ))
    }

    fn completed(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        let keys = self
            .indexes
            .completed
            .descending((window.since, ActivityId::nil_min())..);
        Ok(self.records_of(keys.take(limit)))
    }

    fn completed_between(&mut self, from: Timestamp, to: Timestamp) -> Result<i64, LedgerError> {
        let range = (from, ActivityId::nil_min())..(to, ActivityId::nil_min());
        Ok(self.indexes.completed.ascending(range).count() as i64)
    }

    fn reaped(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        let keys = self
            .indexes
            .reaped
            .descending((window.since, ActivityId::nil_min())..);
        Ok(self.records_of(keys.take(limit)))
    }

    fn listed_owners(&mut self, window: Window) -> Result<Vec<Owner>, LedgerError> {
        let mut owners: Vec<Owner> = self
            .owners
            .values()
            .filter(|owner| window.lists_owner(owner))
            .cloned()
            .collect();
        owners.sort_by(|a, b| Window::owner_order(a).cmp(&Window::owner_order(b)));
        Ok(owners)
    }

    fn expired_owners(&mut self, now: Timestamp) -> Result<Vec<Owner>, LedgerError> {
        Ok(self
            .owners
            .values()
            .filter(|owner| owner.is_expired(now))
            .cloned()
            .collect())
    }

    fn owner_in_flight(&mut self, id: &OwnerId) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        Ok(self
            .in_flight_in_order()
            .into_iter()
            .filter(|record| record.owner_id.as_deref() == Some(id.as_str()))
            .cloned()
            .collect())
    }

    fn prunable(&mut self, retention: Retention, limit: usize) -> Result<Vec<ActivityId>, LedgerError> {
        // Each index gives its oldest first; the oldest `limit` of both are
        // among the first `limit` of each.
        let bound = (retention.before, ActivityId::nil_min());
        let mut oldest: Vec<(Timestamp, ActivityId)> = self
            .indexes
            .completed
            .ascending(..bound)
            .take(limit)
            .chain(self.indexes.reaped.ascending(..bound).take(limit))
            .map(|(key, ())| *key)
            .collect();
        oldest.sort_unstable();
        Ok(oldest.into_iter().take(limit).map(|(_, id)| id).collect())
    }

    fn prune_owners(&mut self, retention: Retention) -> Result<(), LedgerError> {
        self.owners.retain(|_, owner| !retention.prunes_owner(owner));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::transition::{self, NewActivity};

    /// `ms` after a realistic instant: the ledger refuses a caller's time
    /// before 2001.
    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(1_786_000_000_000 + ms)
    }

    /// A record in flight, enqueued and reapable at these milliseconds
    /// after [`at`]'s instant.
    fn in_flight(enqueued_at: i64, reapable_at: i64) -> Arc<ActivityRecord> {
        let (enqueued_at, reapable_at) = (at(enqueued_at), at(reapable_at));
        let new = NewActivity {
            enqueued_at: Some(enqueued_at),
            ..NewActivity::fixture("embedding")
        };
        let mut record = transition::begin(new, enqueued_at, LedgerConfig::default().policy())
            .unwrap()
            .record;
        record.reapable_at = Some(reapable_at);
        Arc::new(record)
    }

    fn live_of(records: &[&Arc<ActivityRecord>]) -> IdMap<Arc<ActivityRecord>> {
        records
            .iter()
            .map(|record| (record.activity_id, Arc::clone(record)))
            .collect()
    }

    fn ids(records: &[Arc<ActivityRecord>]) -> Vec<ActivityId> {
        records.iter().map(|record| record.activity_id).collect()
    }

    #[test]
    fn counters_keep_one_entry_per_aggregate_whichever_way_they_are_found() {
        let mut counters = Counters::default();
        let first = in_flight(0, 10);
        let other = ActivityRecord {
            labels: NewActivity::fixture("chat").labels,
            ..(*first).clone()
        };
        let batch = ActivityRecord {
            priority: Priority::Batch,
            ..(*first).clone()
        };
        // The same set spelled again is a separate Arc, equal by content.
        let respelled = ActivityRecord {
            labels: NewActivity::fixture("embedding").labels,
            ..(*first).clone()
        };
        for record in [&*first, &other, &first, &batch, &respelled, &first] {
            counters.of(record).in_flight += 1;
        }
        assert_eq!(counters.entries.len(), 3);
        assert_eq!(counters.of(&first).in_flight, 4);
        assert_eq!(counters.of(&other).in_flight, 1);
        assert_eq!(counters.of(&batch).in_flight, 1);
    }

    #[test]
    fn due_skips_entries_a_transition_made_stale() {
        let first = in_flight(0, 10);
        let mut index = DueIndex::default();
        index.push(at(10), first.activity_id);
        // Started: its bound moved to 50, and the entry for 10 is stale.
        let mut started = (*first).clone();
        started.reapable_at = Some(at(50));
        let started = Arc::new(started);
        index.push(at(50), started.activity_id);
        let live = live_of(&[&started]);
        assert!(index.due(&live, at(40), 10).is_empty());
        assert_eq!(ids(&index.due(&live, at(51), 10)), vec![started.activity_id]);
    }

    #[test]
    fn due_forgets_records_no_longer_in_flight() {
        let settled = in_flight(0, 10);
        let mut index = DueIndex::default();
        index.push(at(10), settled.activity_id);
        assert!(index.due(&IdMap::default(), at(100), 10).is_empty());
        assert!(index.heap.is_empty());
    }

    #[test]
    fn due_returns_a_record_once_however_many_entries_it_has() {
        let record = in_flight(0, 10);
        let mut index = DueIndex::default();
        index.push(at(10), record.activity_id);
        index.push(at(10), record.activity_id);
        let live = live_of(&[&record]);
        assert_eq!(ids(&index.due(&live, at(11), 10)), vec![record.activity_id]);
    }

    #[test]
    fn due_is_earliest_first_and_keeps_what_it_returned() {
        let (a, b, c) = (in_flight(0, 30), in_flight(0, 10), in_flight(0, 20));
        let mut index = DueIndex::default();
        for record in [&a, &b, &c] {
            index.push(record.reapable_at.unwrap(), record.activity_id);
        }
        let live = live_of(&[&a, &b, &c]);
        assert_eq!(
            ids(&index.due(&live, at(100), 2)),
            vec![b.activity_id, c.activity_id]
        );
        // Not reaped by the caller: shown again.
        assert_eq!(
            ids(&index.due(&live, at(100), 5)),
            vec![b.activity_id, c.activity_id, a.activity_id]
        );
    }

    #[test]
    fn compaction_keeps_the_heap_the_size_of_the_records_in_flight() {
        let record = in_flight(0, 10);
        let live = live_of(&[&record]);
        let mut index = DueIndex::default();
        for ms in 0..10_000 {
            index.push(at(ms), record.activity_id);
            index.compact(&live);
        }
        assert!(index.heap.len() <= 2 * live.len() + 1024 + 1);
        assert_eq!(ids(&index.due(&live, at(11), 10)), vec![record.activity_id]);
    }
}
