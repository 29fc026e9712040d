//! The waiting line: this process's starts that wait for capacity, woken
//! one at a time in line order when it may have come back.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use crate::domain::admission::Rank;
use crate::domain::query::LineSpot;
use crate::domain::record::ActivityId;
use crate::domain::record::LaneKey;
use crate::domain::timestamp::Timestamp;

/// How long a record waiting in line sleeps before it asks again, unwoken:
/// a random time between half of `within` (the store's
/// [`Store::recheck_within`](crate::store::Store::recheck_within)) and all
/// of it, so that waiters that went to sleep together do not all ask the
/// store in the same instant.
pub(super) fn recheck_after(within: Duration) -> Duration {
    use std::hash::BuildHasher;
    let random = foldhash::fast::RandomState::default().hash_one(std::time::Instant::now());
    within / 2 + within.mul_f64((random % 1024) as f64 / 2048.0)
}

/// Where records waiting in line in this process are woken when capacity
/// may have come back (a settle, a cancel, a reap).
///
/// Not every waiter is woken. A lane admits its waiting records of one
/// rank in line order (`enqueuedAt`, then id), so when a record is
/// refused, every record of its rank behind it would be refused too. (A
/// lane whose rules do not rank keeps one line of every rank.) The line
/// keeps this process's waiters in that order, each rank apart, learned
/// from their first refusal: one wake-up goes to the first waiter of each
/// rank of the lane, is passed on to the next of its rank after an
/// admission, and ends at a refusal. On a ranked lane a waiter leaving
/// with a wake-up (admitted, or gone) also wakes the first of every other
/// rank, whose turn it may have brought (`docs/semantics.md` §6). A freed slot costs this process about two
/// attempts a rank, not one per waiter. Each freed slot gives one more
/// waiter of each rank a wake-up, so several slots are tried for at once.
/// A waiter also asks again on its own now and then ([`recheck_after`]),
/// so a wake-up that went astray costs time, never a place in line.
///
/// Every decision is [`LineState`]'s; this type only puts it under a
/// mutex and wakes waiters through tokio's `Notify`.
#[derive(Debug, Default)]
pub(crate) struct Line {
    state: Mutex<LineState<Arc<Notify>>>,
    /// How many starts are waiting in line now. A settle with no one
    /// waiting skips the wake-up, which takes the line's lock.
    waiting: AtomicUsize,
    /// The instant each lane's cooldown timer wakes its waiters, while one
    /// is armed ([`Line::arm`]).
    timers: Mutex<HashMap<LaneKey, tokio::time::Instant>>,
    /// Start attempts of records that wait in line, for the tests.
    #[cfg(test)]
    pub(super) attempts: AtomicUsize,
}

/// A waiter's place: its record's in the lane's line (its rank's first,
/// so that each rank waits apart), then the order it joined in (two starts
/// of one record may wait at once).
type Place = (LineSpot, u64);

/// How the line wakes one waiter.
///
/// A wait registers before it reads its waiter's state under the line's
/// lock, and `signal` is called under that lock once the state says
/// "woken": so a signal either finds the wait registered and ends it, or
/// came before the read, which then sees the wake-up. Production uses
/// tokio's `Notify::notify_waiters`; the loom model (`loom_tests`) its own
/// stand-in over loom's primitives, since loom cannot run tokio's.
trait Signal {
    fn signal(&self);
}

impl Signal for Notify {
    fn signal(&self) {
        self.notify_waiters();
    }
}

impl<S: Signal> Signal for Arc<S> {
    fn signal(&self) {
        S::signal(self);
    }
}

/// The waiting line's protocol: every decision of who is woken, and what
/// each waiter holds, with no lock and no wake-up primitive of its own.
///
/// [`Line`] keeps one under a std mutex and signals tokio's `Notify`; the
/// loom model keeps one under loom's mutex and signals loom's primitives.
/// So the model checks the very code production runs, under every
/// interleaving of a settle, a drop and a new waiter.
#[derive(Debug)]
struct LineState<S> {
    /// The number the next waiter joins with.
    next: u64,
    /// The waiters of each lane, in line order.
    lanes: HashMap<LaneKey, BTreeMap<Place, Waiter<S>>>,
}

impl<S> Default for LineState<S> {
    fn default() -> Self {
        Self {
            next: 0,
            lanes: HashMap::new(),
        }
    }
}

/// One start waiting in line, as the line sees it.
#[derive(Debug)]
struct Waiter<S> {
    /// Holds a wake-up not yet answered by an attempt.
    woken: bool,
    /// The attempt running now answers a wake-up.
    answering: bool,
    signal: S,
}

impl<S: Signal> LineState<S> {
    /// Puts a waiter in line on `lane` at its record's `place`; returns
    /// its place in this line.
    fn join(&mut self, lane: &LaneKey, place: LineSpot, signal: S) -> Place {
        let place = (place, self.next);
        self.next += 1;
        let waiter = Waiter {
            woken: false,
            answering: false,
            signal,
        };
        self.lanes.entry(lane.clone()).or_default().insert(place, waiter);
        place
    }

    /// Capacity may have come back on `lane` (on every lane when `None`):
    /// gives one more waiter of each rank of it a wake-up, the first that
    /// holds none.
    fn capacity_freed(&mut self, lane: Option<&LaneKey>) {
        match lane {
            Some(lane) => {
                if let Some(waiters) = self.lanes.get_mut(lane) {
                    wake_each_rank(waiters);
                }
            }
            None => {
                for waiters in self.lanes.values_mut() {
                    wake_each_rank(waiters);
                }
            }
        }
    }

    /// The waiter at `place` starts an attempt: if it holds a wake-up, the
    /// attempt answers it. Returns whether it held one.
    fn take(&mut self, lane: &LaneKey, place: &Place) -> bool {
        let Some(waiter) = self
            .lanes
            .get_mut(lane)
            .and_then(|waiters| waiters.get_mut(place))
        else {
            return false;
        };
        if !waiter.woken {
            return false;
        }
        waiter.woken = false;
        waiter.answering = true;
        true
    }

    /// The waiter's attempt was refused: the wake-up it answered ends
    /// here, since every waiter of its rank behind would be refused too.
    fn refused(&mut self, lane: &LaneKey, place: &Place) {
        if let Some(waiter) = self
            .lanes
            .get_mut(lane)
            .and_then(|waiters| waiters.get_mut(place))
        {
            waiter.answering = false;
        }
    }

    /// The waiter leaves the line. Admitted, or gone (a timeout, a dropped
    /// future, an error) with a wake-up in hand or being answered, it
    /// passes that on: the next waiter of its rank may have its turn, and
    /// on a ranked lane the first of every other rank too.
    fn leave(&mut self, lane: &LaneKey, place: &Place) {
        let Some(waiters) = self.lanes.get_mut(lane) else {
            return;
        };
        if let Some(gone) = waiters.remove(place) {
            if gone.answering || gone.woken {
                let (rank, _) = place.0;
                wake_first(waiters, rank, Some(place));
                // Its grant may have brought another rank's turn.
                for other in [Rank::Interactive, Rank::Batch] {
                    if rank.is_some_and(|rank| rank != other) {
                        wake_first(waiters, Some(other), None);
                    }
                }
            }
        }
        if waiters.is_empty() {
            self.lanes.remove(lane);
        }
    }
}

/// Gives a wake-up to the first waiter of `rank` in `waiters` after
/// `after` (from the rank's start when `None`) that holds none.
fn wake_first<S: Signal>(
    waiters: &mut BTreeMap<Place, Waiter<S>>,
    rank: Option<Rank>,
    after: Option<&Place>,
) {
    let from = match after {
        Some(after) => Bound::Excluded(*after),
        None => Bound::Included((
            (rank, (Timestamp::from_millis(i64::MIN), ActivityId::nil_min())),
            0,
        )),
    };
    if let Some(waiter) = waiters
        .range_mut((from, Bound::Unbounded))
        .take_while(|(((of, _), _), _)| *of == rank)
        .map(|(_, waiter)| waiter)
        .find(|waiter| !waiter.woken)
    {
        waiter.woken = true;
        waiter.signal.signal();
    }
}

/// [`wake_first`] for each rank of `waiters`: the line of a lane that does
/// not rank, or each rank's of one that does.
fn wake_each_rank<S: Signal>(waiters: &mut BTreeMap<Place, Waiter<S>>) {
    for rank in [None, Some(Rank::Interactive), Some(Rank::Batch)] {
        wake_first(waiters, rank, None);
    }
}

impl Line {
    fn state(&self) -> MutexGuard<'_, LineState<Arc<Notify>>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Capacity may have come back on `lane` (on any lane when `None`, as
    /// after a reap or another process's change): gives one more waiter of
    /// it a wake-up, the first that holds none.
    ///
    /// Skipping the wake-up when none is waiting loses nothing: a start
    /// joins the line only after a refusal, and then asks once more at once
    /// (see `Ledger::start_waiting`), so a settle this did not see landed
    /// before that attempt took the store's lock, and the slot is found.
    pub(crate) fn capacity_freed(&self, lane: Option<&LaneKey>) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        self.state().capacity_freed(lane);
    }

    /// Arms `lane`'s cooldown timer for `at`, unless one is armed for that
    /// instant or sooner; returns whether the caller should start it.
    pub(crate) fn arm(&self, lane: &LaneKey, at: tokio::time::Instant) -> bool {
        let mut timers = self.timers.lock().unwrap_or_else(PoisonError::into_inner);
        match timers.get(lane) {
            Some(armed) if *armed <= at => false,
            _ => {
                timers.insert(lane.clone(), at);
                true
            }
        }
    }

    /// `lane`'s timer for `at` went off: the cooldown ended, and capacity
    /// came back on the lane.
    pub(crate) fn fire(&self, lane: &LaneKey, at: tokio::time::Instant) {
        {
            let mut timers = self.timers.lock().unwrap_or_else(PoisonError::into_inner);
            if timers.get(lane) == Some(&at) {
                timers.remove(lane);
            }
        }
        self.capacity_freed(Some(lane));
    }

    /// Counts the caller in line on `lane`, at its record's `place`, until
    /// the guard is dropped.
    pub(crate) fn join(&self, lane: LaneKey, place: LineSpot) -> InLine<'_> {
        let changed = Arc::new(Notify::new());
        let mut state = self.state();
        let place = state.join(&lane, place, Arc::clone(&changed));
        self.waiting.fetch_add(1, Ordering::SeqCst);
        InLine {
            line: self,
            lane,
            place,
            changed,
        }
    }
}

/// One start waiting in line; counted out when dropped.
pub(crate) struct InLine<'a> {
    line: &'a Line,
    lane: LaneKey,
    place: Place,
    /// Signalled when the line gives this waiter a wake-up.
    changed: Arc<Notify>,
}

impl InLine<'_> {
    /// Waits up to `poll` for a wake-up, and takes it: the next attempt
    /// answers it. Returns whether one came (held already, or given while
    /// waiting).
    pub(crate) async fn wait(&mut self, poll: Duration) -> bool {
        let sleep = tokio::time::sleep(poll);
        tokio::pin!(sleep);
        loop {
            // Registered before the state is read, so that a wake-up given
            // in between still ends the wait.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.take() {
                return true;
            }
            tokio::select! {
                () = &mut changed => {}
                () = &mut sleep => return self.take(),
            }
        }
    }

    /// Takes a wake-up it holds, if any, for the next attempt to answer.
    fn take(&self) -> bool {
        self.line.state().take(&self.lane, &self.place)
    }

    /// The attempt was refused: the wake-up it answered ends here, since
    /// every waiter behind would be refused too.
    pub(crate) fn refused(&mut self) {
        self.line.state().refused(&self.lane, &self.place);
    }
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        let mut state = self.line.state();
        state.leave(&self.lane, &self.place);
        self.line.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use tokio::time::Instant;

    use super::*;
    use crate::domain::record::ActivityId;
    use crate::domain::timestamp::Timestamp;
    use crate::ledger::{ActivitySpec, Ledger, Outcome};

    #[test]
    fn a_waiter_asks_again_between_half_and_all_of_the_stores_recheck() {
        let within = Duration::from_millis(1000);
        let pauses: Vec<Duration> = (0..200).map(|_| recheck_after(within)).collect();
        assert!(
            pauses.iter().all(|p| *p >= within / 2 && *p <= within),
            "{pauses:?}"
        );
        // Jittered: waiters that slept together do not all wake together.
        let distinct: std::collections::HashSet<_> = pauses.iter().collect();
        assert!(distinct.len() > 20, "{} distinct pauses", distinct.len());
    }

    /// A place in line behind every one made before it.
    fn place() -> LineSpot {
        (None, (Timestamp::from_millis(1_000), ActivityId::new()))
    }

    fn lane(name: &str) -> LaneKey {
        LaneKey::parse(&format!("{name}::ollama")).unwrap()
    }

    /// Three waiters on `lane`, in the order they joined.
    fn three_in_line<'a>(line: &'a Line, lane: &LaneKey) -> (InLine<'a>, InLine<'a>, InLine<'a>) {
        (
            line.join(lane.clone(), place()),
            line.join(lane.clone(), place()),
            line.join(lane.clone(), place()),
        )
    }

    /// Whether `in_line` holds a wake-up, taken as `InLine::wait` takes it
    /// (the next attempt answers it).
    fn woken(in_line: &mut InLine<'_>) -> bool {
        in_line.take()
    }

    #[test]
    fn a_freed_slot_wakes_the_first_waiter_of_its_lane_only() {
        let line = Line::default();
        let (kb, chat) = (lane("kb"), lane("chat"));
        let mut first = line.join(kb.clone(), place());
        let mut second = line.join(kb.clone(), place());
        let mut other = line.join(chat, place());
        line.capacity_freed(Some(&kb));
        assert!(woken(&mut first));
        assert!(!woken(&mut second));
        assert!(!woken(&mut other));
    }

    #[test]
    fn each_slot_freed_wakes_one_more_waiter() {
        let line = Line::default();
        let kb = lane("kb");
        let (mut first, mut second, mut third) = three_in_line(&line, &kb);
        line.capacity_freed(Some(&kb));
        line.capacity_freed(Some(&kb));
        assert!(woken(&mut first));
        assert!(woken(&mut second));
        assert!(!woken(&mut third));
    }

    #[test]
    fn a_change_on_no_named_lane_wakes_the_first_waiter_of_every_lane() {
        let line = Line::default();
        let (kb, chat) = (lane("kb"), lane("chat"));
        let mut first_kb = line.join(kb.clone(), place());
        let mut second_kb = line.join(kb, place());
        let mut first_chat = line.join(chat, place());
        line.capacity_freed(None);
        assert!(woken(&mut first_kb));
        assert!(!woken(&mut second_kb));
        assert!(woken(&mut first_chat));
    }

    #[test]
    fn a_wake_up_passes_on_after_an_admission_and_ends_at_a_refusal() {
        let line = Line::default();
        let kb = lane("kb");
        let (mut first, mut second, _third) = three_in_line(&line, &kb);
        line.capacity_freed(Some(&kb));
        assert!(woken(&mut first));
        // Refused: everyone behind would be too.
        first.refused();
        assert!(!woken(&mut second));
        // Admitted: leaving the line hands it on.
        line.capacity_freed(Some(&kb));
        assert!(woken(&mut first));
        drop(first);
        assert!(woken(&mut second));
    }

    #[test]
    fn waiters_are_woken_in_line_order_not_in_the_order_they_joined() {
        let line = Line::default();
        let kb = lane("kb");
        let mut later = line.join(
            kb.clone(),
            (None, (Timestamp::from_millis(2_000), ActivityId::new())),
        );
        let mut earlier = line.join(
            kb.clone(),
            (None, (Timestamp::from_millis(1_000), ActivityId::new())),
        );
        line.capacity_freed(Some(&kb));
        assert!(woken(&mut earlier));
        assert!(!woken(&mut later));
    }

    #[test]
    fn a_waiter_gone_with_a_wake_up_in_hand_passes_it_on() {
        let line = Line::default();
        let kb = lane("kb");
        let first = line.join(kb.clone(), place());
        let mut second = line.join(kb.clone(), place());
        line.capacity_freed(Some(&kb));
        drop(first);
        assert!(woken(&mut second));
    }

    /// A place on a ranked lane.
    fn ranked(rank: Rank, ms: i64) -> LineSpot {
        (Some(rank), (Timestamp::from_millis(ms), ActivityId::new()))
    }

    #[test]
    fn on_a_ranked_lane_each_rank_waits_apart() {
        let line = Line::default();
        let kb = lane("kb");
        // The batch records came first; each rank is its own line.
        let mut batch_1 = line.join(kb.clone(), ranked(Rank::Batch, 1));
        let mut batch_2 = line.join(kb.clone(), ranked(Rank::Batch, 2));
        let mut interactive_1 = line.join(kb.clone(), ranked(Rank::Interactive, 3));
        let mut interactive_2 = line.join(kb.clone(), ranked(Rank::Interactive, 4));
        line.capacity_freed(Some(&kb));
        assert!(woken(&mut interactive_1));
        assert!(woken(&mut batch_1));
        assert!(!woken(&mut interactive_2));
        assert!(!woken(&mut batch_2));
        // The batch record is refused (its turn comes after an overtake):
        // that ends its rank's wake-up, not the other's.
        batch_1.refused();
        assert!(!woken(&mut batch_2));
        // The interactive record admitted may have brought the batch
        // record's turn: leaving, it wakes the next of its own rank and
        // the first of the other.
        drop(interactive_1);
        assert!(woken(&mut interactive_2));
        assert!(woken(&mut batch_1));
        assert!(!woken(&mut batch_2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wake_up_given_while_waiting_ends_the_wait() {
        let line = Arc::new(Line::default());
        let kb = lane("kb");
        let mut in_line = line.join(kb.clone(), place());
        let waker = Arc::clone(&line);
        let kb_again = kb.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            waker.capacity_freed(Some(&kb_again));
        });
        let started = Instant::now();
        assert!(in_line.wait(Duration::from_secs(60)).await);
        assert_eq!(started.elapsed(), Duration::from_millis(10));
        // Unwoken, the wait ends at its bound.
        assert!(!in_line.wait(Duration::from_secs(1)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cooldown_timer_wakes_the_line_when_it_ends_once_a_lane() {
        let ledger = Ledger::builder(crate::config::LedgerConfig::default())
            .store_url("memory:")
            .build()
            .unwrap();
        let line = &ledger.inner.capacity_changed;
        let kb = lane("kb");
        let mut first = line.join(kb.clone(), place());
        let mut second = line.join(kb.clone(), place());
        ledger.wake_line_after(&kb, Duration::from_millis(30));
        // A later cooldown's refusal arms nothing new: the earlier timer
        // stands.
        assert!(!line.arm(&kb, Instant::now() + Duration::from_millis(40)));
        tokio::time::sleep(Duration::from_millis(29)).await;
        assert!(!woken(&mut first));
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert!(woken(&mut first), "the cooldown's end is capacity come back");
        assert!(!woken(&mut second));
        // Fired, the lane can be armed again.
        assert!(line.arm(&kb, Instant::now() + Duration::from_millis(5)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_freed_slot_costs_two_attempts_however_many_wait() {
        // Eight wait on a cap-1 lane. Time stands still (nobody's recheck
        // comes due), so every attempt after the settle is one a wake-up
        // caused: the first in line, admitted, and the next, refused on a
        // full lane. Woken all at once, all eight would have asked.
        let config = crate::config::LedgerConfig::default()
            .with_lane_cap("kb::ollama", 1)
            .unwrap();
        let ledger = Ledger::builder(config).store_url("memory:").build().unwrap();
        let spec = || ActivitySpec::new("kb", "ollama").class("embedding");
        let holder = ledger.admit(spec()).await.unwrap();
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                let ledger = ledger.clone();
                tokio::spawn(async move { ledger.admit(spec()).await })
            })
            .collect();
        let line = &ledger.inner.capacity_changed;
        while line.waiting.load(Ordering::SeqCst) < 8 {
            tokio::task::yield_now().await;
        }
        let before = line.attempts.load(Ordering::SeqCst);
        holder.settle(Outcome::Success).await.unwrap();
        // Yielding keeps the runtime busy, so time does not move.
        for _ in 0..200 {
            tokio::task::yield_now().await;
        }
        assert_eq!(line.attempts.load(Ordering::SeqCst) - before, 2);
        let admitted: Vec<_> = waiters.iter().filter(|waiter| waiter.is_finished()).collect();
        assert_eq!(admitted.len(), 1);
        assert_eq!(line.waiting.load(Ordering::SeqCst), 7);
    }

    #[test]
    fn leaving_the_line_counts_the_start_out() {
        let line = Line::default();
        let kb = lane("kb");
        let first = line.join(kb.clone(), place());
        let second = line.join(kb.clone(), place());
        drop(first);
        assert_eq!(line.waiting.load(Ordering::SeqCst), 1);
        drop(second);
        assert_eq!(line.waiting.load(Ordering::SeqCst), 0);
        assert!(line.state.lock().unwrap().lanes.is_empty());
    }
}

/// The loom model of the waiting line's wake-up protocol.
///
/// The protocol's decisions are [`LineState`]'s, and the model runs that
/// very structure, under loom's mutex and with a stand-in for tokio's
/// `Notify` (which loom cannot run); the rest mirrors [`Line`], [`InLine`]
/// and `Ledger::start_waiting`, with one capped lane's store beside it.
/// Loom runs each scenario under every interleaving of its threads up to
/// [`PREEMPTIONS`] preemptions. A waiter has no timer here, so a lost
/// wake-up leaves it blocked for good, and loom fails a model whose
/// threads are all blocked; the scenarios assert the order of wake-ups
/// themselves. Run it with (from the repository's root; its own target
/// directory, since the flag rebuilds every crate):
///
/// ```text
/// RUSTFLAGS="--cfg inflight_loom" CARGO_TARGET_DIR=target/loom \
///     cargo test -p inflight --release --no-default-features --lib loom
/// ```
///
/// The cfg is not `loom`, which tokio reads for its own model tests and
/// does not build under.
#[cfg(inflight_loom)]
#[cfg(test)]
mod loom_tests {
    use std::collections::{BTreeMap, BTreeSet};

    use loom::sync::atomic::{AtomicUsize, Ordering};
    use loom::sync::{Arc, Condvar, Mutex};
    use loom::thread;

    use super::{LineState, Place, Signal};
    use crate::domain::admission::{
        decide, Decision, LanePosition, LaneRules, LaneState, Rank, RankedPosition,
    };
    use crate::domain::query::LinePlace;
    use crate::domain::record::Priority;
    use crate::domain::record::{ActivityId, LaneKey};
    use crate::domain::timestamp::Timestamp;

    /// Each scenario's threads may be cut this often anywhere. 3 checks
    /// the three in about 20 s on two cores (2 in under a second).
    const PREEMPTIONS: usize = 3;

    /// tokio's `Notify` as the line uses it (`notified`, `enable`,
    /// `notify_waiters`): a signal ends the waits registered before it and
    /// is kept for none registered after.
    struct Notify {
        /// Signals given so far: a wait ends when the count moves past
        /// the one it registered at.
        given: Mutex<u64>,
        changed: Condvar,
    }

    impl Notify {
        fn new() -> Self {
            Self {
                given: Mutex::new(0),
                changed: Condvar::new(),
            }
        }

        fn register(&self) -> u64 {
            *self.given.lock().unwrap()
        }

        fn wait(&self, registered: u64) {
            let mut given = self.given.lock().unwrap();
            while *given == registered {
                given = self.changed.wait(given).unwrap();
            }
        }
    }

    impl Signal for Notify {
        fn signal(&self) {
            *self.given.lock().unwrap() += 1;
            self.changed.notify_all();
        }
    }

    impl Signal for Arc<Notify> {
        fn signal(&self) {
            Notify::signal(self);
        }
    }

    /// The store's side of one capped lane: its free slots, and its
    /// waiting records, which it admits first come, first served, or (a
    /// ranked lane of one slot, `ranks` set) as the production decision
    /// orders them.
    struct Store {
        free: usize,
        waiting: BTreeSet<LinePlace>,
        admitted: Vec<LinePlace>,
        /// Each record's rank, on a ranked lane.
        ranks: BTreeMap<LinePlace, Rank>,
        state: LaneState,
    }

    impl Store {
        fn start(&mut self, record: LinePlace) -> bool {
            let turn = if self.ranks.is_empty() {
                self.free > 0 && self.waiting.first() == Some(&record)
            } else {
                self.ranked_turn(record)
            };
            if !turn {
                return false;
            }
            self.free -= 1;
            self.waiting.remove(&record);
            self.admitted.push(record);
            true
        }

        /// `domain::admission::decide` on a lane of one slot with one
        /// overtake, over the records waiting.
        fn ranked_turn(&mut self, record: LinePlace) -> bool {
            let rules = LaneRules {
                max_overtakes: 1,
                ..LaneRules::capped(1)
            };
            let mut ranks = RankedPosition::default();
            for other in self.waiting.iter().filter(|other| **other != record) {
                let ahead = i64::from(*other < record);
                if self.ranks[other] == Rank::Interactive {
                    ranks.interactive_waiting += 1;
                    ranks.interactive_ahead += ahead;
                } else {
                    ranks.batch_waiting += 1;
                    ranks.batch_ahead += ahead;
                }
            }
            let position = LanePosition {
                executing: i64::from(self.free == 0),
                waiting_ahead: ranks.interactive_ahead + ranks.batch_ahead,
                ranks: Some(ranks),
                tokens_ahead: 0,
            };
            let priority = match self.ranks[&record] {
                Rank::Interactive => Priority::Interactive,
                Rank::Batch => Priority::Batch,
            };
            match decide(&rules, priority, &position, self.state, Timestamp::from_millis(0)) {
                Decision::Admit(next) => {
                    self.state = next;
                    true
                }
                _ => false,
            }
        }
    }

    /// A ledger of one process: its line, as [`super::Line`] keeps it, and
    /// the store.
    struct Model {
        lane: LaneKey,
        line: Mutex<LineState<Arc<Notify>>>,
        waiting: AtomicUsize,
        store: Mutex<Store>,
    }

    /// One start in line, as [`super::InLine`].
    struct InLine {
        record: LinePlace,
        place: Place,
        changed: Arc<Notify>,
    }

    impl Model {
        /// A lane whose `records` wait in the store, with no slot free.
        fn new(records: &[LinePlace]) -> Arc<Self> {
            Arc::new(Self {
                lane: LaneKey::parse("kb::ollama").unwrap(),
                line: Mutex::new(LineState::default()),
                waiting: AtomicUsize::new(0),
                store: Mutex::new(Store {
                    free: 0,
                    waiting: records.iter().copied().collect(),
                    admitted: Vec::new(),
                    ranks: BTreeMap::new(),
                    state: LaneState::default(),
                }),
            })
        }

        /// A ranked lane of one slot whose `records` wait, with their
        /// ranks, no slot free.
        fn ranked(records: &[(LinePlace, Rank)]) -> Arc<Self> {
            let model = Self::new(&records.iter().map(|(record, _)| *record).collect::<Vec<_>>());
            model.store.lock().unwrap().ranks = records.iter().copied().collect();
            model
        }

        /// `Line::capacity_freed` on the lane, with its check of no one
        /// waiting.
        fn capacity_freed(&self) {
            if self.waiting.load(Ordering::SeqCst) == 0 {
                return;
            }
            self.line.lock().unwrap().capacity_freed(Some(&self.lane));
        }

        /// A settle: it lands in the store, and its reply wakes the line.
        fn settle(&self) {
            self.store.lock().unwrap().free += 1;
            self.capacity_freed();
        }

        fn attempt(&self, record: LinePlace) -> bool {
            self.store.lock().unwrap().start(record)
        }

        /// `Line::join`.
        fn join(&self, record: LinePlace) -> InLine {
            let changed = Arc::new(Notify::new());
            let mut line = self.line.lock().unwrap();
            let rank = self.store.lock().unwrap().ranks.get(&record).copied();
            let place = line.join(&self.lane, (rank, record), Arc::clone(&changed));
            self.waiting.fetch_add(1, Ordering::SeqCst);
            InLine {
                record,
                place,
                changed,
            }
        }

        /// `InLine::wait` with no timer: registered before the state is
        /// read, as there.
        fn wait(&self, in_line: &InLine) {
            loop {
                let registered = in_line.changed.register();
                if self.line.lock().unwrap().take(&self.lane, &in_line.place) {
                    return;
                }
                in_line.changed.wait(registered);
            }
        }

        fn refused(&self, in_line: &InLine) {
            self.line.lock().unwrap().refused(&self.lane, &in_line.place);
        }

        /// `InLine`'s drop.
        fn leave(&self, in_line: &InLine) {
            let mut line = self.line.lock().unwrap();
            line.leave(&self.lane, &in_line.place);
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }

        /// A start in line until admitted: its attempts after it joined, as
        /// `Ledger::start_waiting` makes them.
        fn until_admitted(&self, in_line: &InLine) {
            loop {
                if self.attempt(in_line.record) {
                    self.leave(in_line);
                    return;
                }
                self.refused(in_line);
                self.wait(in_line);
            }
        }

        /// `Ledger::start_waiting` with no time limit: it joins after its
        /// first refusal and asks once more at once.
        fn start_waiting(&self, record: LinePlace) {
            if !self.attempt(record) {
                let in_line = self.join(record);
                self.until_admitted(&in_line);
            }
        }

        /// Every start in line has left it.
        fn assert_line_empty(&self) {
            assert!(self.line.lock().unwrap().lanes.is_empty());
            assert_eq!(self.waiting.load(Ordering::SeqCst), 0);
        }

        fn admitted(&self) -> Vec<LinePlace> {
            let store = self.store.lock().unwrap();
            assert_eq!(store.free, 0, "a slot left free");
            let mut admitted = store.admitted.clone();
            admitted.sort_unstable();
            admitted
        }
    }

    /// The `n`th record in the lane's line.
    fn record(n: i64) -> LinePlace {
        (Timestamp::from_millis(n), ActivityId::nil_min())
    }

    fn check(model: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(PREEMPTIONS);
        builder.check(model);
    }

    /// (a) A settle racing a start that is refused, joins, asks once more
    /// and waits: whichever comes first, the start is admitted, never left
    /// to its timer (with no timer here, a lost wake-up blocks it for good).
    #[test]
    fn a_settle_racing_a_start_in_line_is_never_lost() {
        check(|| {
            let model = Model::new(&[record(1)]);
            let waiter = {
                let model = Arc::clone(&model);
                thread::spawn(move || model.start_waiting(record(1)))
            };
            model.settle();
            waiter.join().unwrap();
            assert_eq!(model.admitted(), [record(1)]);
            model.assert_line_empty();
        });
    }

    /// (b) Two in line and one slot freed: the first in line is woken and
    /// admitted, and the second is woken only after that (by the wake-up
    /// passed on), never before the first.
    #[test]
    fn one_freed_slot_wakes_the_first_in_line_never_the_second_before_it() {
        check(|| {
            let model = Model::new(&[record(1), record(2)]);
            // Both refused and in line, the second joined first: line
            // order, not the order of joining.
            let second = model.join(record(2));
            let first = model.join(record(1));
            let first = {
                let model = Arc::clone(&model);
                thread::spawn(move || {
                    model.wait(&first);
                    assert!(model.attempt(record(1)), "the first in line was refused");
                    model.leave(&first);
                })
            };
            let second = {
                let model = Arc::clone(&model);
                thread::spawn(move || {
                    model.wait(&second);
                    assert!(
                        model.store.lock().unwrap().admitted.contains(&record(1)),
                        "the second in line was woken before the first was admitted"
                    );
                    if !model.attempt(record(2)) {
                        model.refused(&second);
                    }
                    model.leave(&second);
                })
            };
            model.settle();
            first.join().unwrap();
            second.join().unwrap();
            assert_eq!(model.admitted(), [record(1)]);
            model.assert_line_empty();
        });
    }

    /// (c) The first in line holds the wake-up of a freed slot when its
    /// future is dropped, while a new start joins behind and another slot
    /// is freed: the wake-up passes on to the next in line, none is lost,
    /// and both behind are admitted.
    #[test]
    fn a_wake_up_in_the_hand_of_a_start_gone_passes_on() {
        check(|| {
            let model = Model::new(&[record(1), record(2), record(3)]);
            let gone = model.join(record(1));
            let second = model.join(record(2));
            model.settle();
            let dropped = {
                let model = Arc::clone(&model);
                thread::spawn(move || {
                    // Its handle cancels its record. The wake-up that cancel
                    // gives once it lands is left out, so that only the
                    // pass-on can carry the slot on.
                    model.store.lock().unwrap().waiting.remove(&gone.record);
                    let mut line = model.line.lock().unwrap();
                    line.leave(&model.lane, &gone.place);
                    model.waiting.fetch_sub(1, Ordering::SeqCst);
                    let passed_on = line.lanes.get(&model.lane).is_none_or(|waiters| {
                        waiters.values().any(|waiter| waiter.woken || waiter.answering)
                    });
                    assert!(passed_on, "the wake-up of a start gone was not passed on");
                })
            };
            let second = {
                let model = Arc::clone(&model);
                thread::spawn(move || model.until_admitted(&second))
            };
            let newcomer = {
                let model = Arc::clone(&model);
                thread::spawn(move || model.start_waiting(record(3)))
            };
            model.settle();
            dropped.join().unwrap();
            second.join().unwrap();
            newcomer.join().unwrap();
            assert_eq!(model.admitted(), [record(2), record(3)]);
            model.assert_line_empty();
        });
    }

    /// (d) A ranked lane of one slot, one overtake: an interactive record
    /// and a batch one wait in line, each of its own rank. A freed slot
    /// wakes the first of each rank. The batch record may be refused
    /// (interactive work goes first), which ends only its rank's wake-up;
    /// the interactive start goes away with its wake-up in hand (its
    /// cancel's own wake-up left out, as in (c)). Its leaving must wake the
    /// batch record, whose turn it brought, though of another rank: the
    /// batch record is admitted, and no wake-up is lost.
    #[test]
    fn on_a_ranked_lane_a_wake_up_passes_on_to_the_other_rank() {
        check(|| {
            let (interactive, batch) = (record(1), record(2));
            let model = Model::ranked(&[(interactive, Rank::Interactive), (batch, Rank::Batch)]);
            let gone = model.join(interactive);
            let batch_in_line = model.join(batch);
            model.settle();
            let dropped = {
                let model = Arc::clone(&model);
                thread::spawn(move || {
                    model.wait(&gone);
                    model.store.lock().unwrap().waiting.remove(&gone.record);
                    model.leave(&gone);
                })
            };
            let batch = {
                let model = Arc::clone(&model);
                thread::spawn(move || model.until_admitted(&batch_in_line))
            };
            dropped.join().unwrap();
            batch.join().unwrap();
            assert_eq!(model.admitted(), [record(2)]);
            model.assert_line_empty();
        });
    }
}
