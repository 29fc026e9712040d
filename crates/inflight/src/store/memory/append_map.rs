//! An ordered map for keys that arrive mostly in increasing order.
//!
//! The memory store keeps its history by id (UUIDv7s, ordered by creation)
//! and by the instant each record ended: keys that mostly arrive newest
//! last. A B-tree pays a search and, every few inserts, a node split for
//! each of them, and leaves its nodes half full when keys arrive in order.
//! Here the bulk of the entries sit in one sorted, dense run: a key above the
//! newest is pushed at its end, a key a little below it is shifted into
//! place, and only a key far out of order goes to a small side tree that is
//! merged into the run once it grows.

use std::collections::{BTreeMap, VecDeque};
use std::iter::Peekable;
use std::ops::{Bound, RangeBounds};

/// How far from the end of the run a late key is shifted into place rather
/// than sent to the side tree.
const SHIFT_WINDOW: usize = 64;

/// The side tree is merged into the run once it holds more than this many
/// entries, or an eighth of the run, whichever is larger.
/// (Small under test, so that the property test reaches it.)
const MIN_MERGE: usize = if cfg!(test) { 16 } else { 1024 };

/// Holes (entries removed from the middle of the run) are swept out once
/// they are more than this many and half the run.
const MIN_SWEEP: usize = if cfg!(test) { 4 } else { 64 };

/// An ordered map, cheap when keys arrive in increasing order.
#[derive(Debug)]
pub(crate) struct AppendMap<K, V> {
    /// Sorted by key. A removed entry leaves a hole (`None`) until the holes
    /// are swept; the first and last entries are never holes.
    run: VecDeque<(K, Option<V>)>,
    /// Entries that arrived far below the run's newest key.
    side: BTreeMap<K, V>,
    /// Holes in `run`.
    holes: usize,
}

impl<K, V> Default for AppendMap<K, V> {
    fn default() -> Self {
        Self {
            run: VecDeque::new(),
            side: BTreeMap::new(),
            holes: 0,
        }
    }
}

impl<K: Ord + Copy, V> AppendMap<K, V> {
    /// How many entries it holds.
    pub(crate) fn len(&self) -> usize {
        self.run.len() - self.holes + self.side.len()
    }

    /// The largest key.
    pub(crate) fn last_key(&self) -> Option<&K> {
        let run = self.run.back().map(|(key, _)| key);
        let side = self.side.last_key_value().map(|(key, _)| key);
        run.max(side)
    }

    /// Where `key` is, or would be, in the run.
    fn search(&self, key: &K) -> Result<usize, usize> {
        self.run.binary_search_by(|(probe, _)| probe.cmp(key))
    }

    /// The value of `key`.
    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        match self.search(key) {
            Ok(at) => self.run[at].1.as_ref(),
            Err(_) => self.side.get(key),
        }
    }

    /// Whether `key` has a value.
    pub(crate) fn contains_key(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    /// Sets the value of `key`; returns the value it replaced.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        let Some((newest, _)) = self.run.back() else {
            // An empty run: whatever the side tree holds becomes the run.
            let old = self.side.insert(key, value);
            self.merge();
            return old;
        };
        if *newest < key && self.side.last_key_value().is_none_or(|(last, _)| *last < key) {
            self.run.push_back((key, Some(value)));
            return None;
        }
        match self.search(&key) {
            Ok(at) => {
                let old = self.run[at].1.replace(value);
                if old.is_none() {
                    self.holes -= 1;
                }
                old
            }
            Err(at) if self.run.len() - at <= SHIFT_WINDOW && !self.side.contains_key(&key) => {
                self.run.insert(at, (key, Some(value)));
                None
            }
            Err(_) => {
                let old = self.side.insert(key, value);
                if self.side.len() > MIN_MERGE.max(self.run.len() / 8) {
                    self.merge();
                }
                old
            }
        }
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        let Ok(at) = self.search(key) else {
            return self.side.remove(key);
        };
        let value = self.run[at].1.take()?;
        self.holes += 1;
        // Keep holes off both ends: pruning takes from the front, and the
        // newest key is read from the back.
        while self.run.front().is_some_and(|(_, value)| value.is_none()) {
            self.run.pop_front();
            self.holes -= 1;
        }
        while self.run.back().is_some_and(|(_, value)| value.is_none()) {
            self.run.pop_back();
            self.holes -= 1;
        }
        if self.holes > MIN_SWEEP.max(self.run.len() / 2) {
            self.run.retain(|(_, value)| value.is_some());
            self.holes = 0;
        }
        Some(value)
    }

    /// Moves the side tree into the run, in order.
    fn merge(&mut self) {
        if self.side.is_empty() {
            return;
        }
        let side = std::mem::take(&mut self.side);
        let run = std::mem::take(&mut self.run);
        let mut merged = VecDeque::with_capacity(run.len() - self.holes + side.len());
        let mut run = run.into_iter().filter(|(_, value)| value.is_some()).peekable();
        let mut side = side.into_iter().map(|(key, value)| (key, Some(value))).peekable();
        loop {
            let from_run = match (run.peek(), side.peek()) {
                (Some((a, _)), Some((b, _))) => a < b,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => break,
            };
            merged.extend(if from_run { run.next() } else { side.next() });
        }
        self.run = merged;
        self.holes = 0;
    }

    /// The entries within `range`, smallest key first.
    pub(crate) fn ascending<R: RangeBounds<K>>(&self, range: R) -> impl Iterator<Item = (&K, &V)> {
        let (start, end) = self.span(&range);
        Merge {
            run: self.run.range(start..end).filter_map(present).peekable(),
            side: self.side.range(range).peekable(),
            ascending: true,
        }
    }

    /// The entries within `range`, largest key first.
    pub(crate) fn descending<R: RangeBounds<K>>(&self, range: R) -> impl Iterator<Item = (&K, &V)> {
        let (start, end) = self.span(&range);
        Merge {
            run: self.run.range(start..end).rev().filter_map(present).peekable(),
            side: self.side.range(range).rev().peekable(),
            ascending: false,
        }
    }

    /// The positions of the run within `range`.
    fn span<R: RangeBounds<K>>(&self, range: &R) -> (usize, usize) {
        let start = match range.start_bound() {
            Bound::Included(key) => self.run.partition_point(|(probe, _)| probe < key),
            Bound::Excluded(key) => self.run.partition_point(|(probe, _)| probe <= key),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(key) => self.run.partition_point(|(probe, _)| probe <= key),
            Bound::Excluded(key) => self.run.partition_point(|(probe, _)| probe < key),
            Bound::Unbounded => self.run.len(),
        };
        (start, end.max(start))
    }
}

fn present<K, V>((key, value): &(K, Option<V>)) -> Option<(&K, &V)> {
    value.as_ref().map(|value| (key, value))
}

/// Two iterators over disjoint sorted entries, merged in their order.
struct Merge<A: Iterator, B: Iterator> {
    run: Peekable<A>,
    side: Peekable<B>,
    ascending: bool,
}

impl<'a, K: Ord + 'a, V: 'a, A, B> Iterator for Merge<A, B>
where
    A: Iterator<Item = (&'a K, &'a V)>,
    B: Iterator<Item = (&'a K, &'a V)>,
{
    type Item = (&'a K, &'a V);

    fn next(&mut self) -> Option<Self::Item> {
        let from_run = match (self.run.peek(), self.side.peek()) {
            (Some((a, _)), Some((b, _))) => (a < b) == self.ascending,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if from_run {
            self.run.next()
        } else {
            self.side.next()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u16),
        Remove(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => any::<u16>().prop_map(Op::Insert),
            1 => any::<u16>().prop_map(Op::Remove),
        ]
    }

    /// Keys mostly increasing, some a little late, some far out of order.
    fn mostly_increasing() -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec((0_u16..100, op()), 0..3000).prop_map(|ops| {
            let mut clock = 0_u16;
            ops.into_iter()
                .map(|(jitter, op)| {
                    clock = clock.saturating_add(1);
                    match op {
                        Op::Insert(_) if jitter < 80 => Op::Insert(clock.saturating_sub(jitter % 70)),
                        Op::Remove(_) if jitter < 60 => Op::Remove(clock.saturating_sub(jitter)),
                        other => other,
                    }
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn behaves_like_a_btree_map(ops in mostly_increasing()) {
            let mut map = AppendMap::default();
            let mut model = BTreeMap::new();
            for (step, op) in ops.iter().enumerate() {
                match *op {
                    Op::Insert(key) => prop_assert_eq!(map.insert(key, step), model.insert(key, step)),
                    Op::Remove(key) => prop_assert_eq!(map.remove(&key), model.remove(&key)),
                }
                prop_assert_eq!(map.len(), model.len());
            }
            prop_assert_eq!(map.last_key(), model.last_key_value().map(|(key, _)| key));
            let all: Vec<_> = map.ascending(..).collect();
            prop_assert_eq!(all, model.iter().collect::<Vec<_>>());
            for key in [0_u16, 7, 500, 1000, 2999, u16::MAX] {
                prop_assert_eq!(map.get(&key), model.get(&key));
                prop_assert_eq!(
                    map.descending(key..).collect::<Vec<_>>(),
                    model.range(key..).rev().collect::<Vec<_>>()
                );
                prop_assert_eq!(
                    map.ascending(..key).collect::<Vec<_>>(),
                    model.range(..key).collect::<Vec<_>>()
                );
                prop_assert_eq!(
                    map.ascending(key / 2..=key).count(),
                    model.range(key / 2..=key).count()
                );
            }
        }
    }

    #[test]
    fn keys_in_order_stay_in_the_run() {
        let mut map = AppendMap::default();
        for key in 0..10_000 {
            map.insert(key, ());
        }
        assert!(map.side.is_empty());
        assert_eq!(map.run.len(), 10_000);
    }

    #[test]
    fn a_key_far_out_of_order_waits_in_the_side_tree_then_joins_the_run() {
        let mut map = AppendMap::default();
        for key in 10_000..20_000 {
            map.insert(key, ());
        }
        map.insert(5, ());
        assert_eq!(map.side.len(), 1);
        for key in 0..MIN_MERGE.max(10_000 / 8) {
            map.insert(key as i64 * 2 + 1001, ());
        }
        assert!(map.side.is_empty(), "merged once the side tree grew");
        assert_eq!(map.ascending(..).next(), Some((&5, &())));
    }

    #[test]
    fn holes_are_swept_once_they_are_half_the_run() {
        let mut map = AppendMap::default();
        for key in 0..1_000 {
            map.insert(key, ());
        }
        let mut removed = 0;
        for key in (1..999).filter(|key| key % 4 != 0) {
            map.remove(&key);
            removed += 1;
        }
        assert!(map.run.len() < 1_000 - MIN_SWEEP, "swept");
        assert_eq!(map.len(), 1_000 - removed);
        assert!(map.contains_key(&0) && map.contains_key(&4) && !map.contains_key(&5));
    }
}
