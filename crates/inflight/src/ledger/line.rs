//! The waiting line: this process's starts that wait for capacity, woken
//! one at a time in line order when it may have come back.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use crate::domain::query::LinePlace;
use crate::domain::record::LaneKey;

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
/// Not every waiter is woken. A lane admits its waiting records in line
/// order (`enqueuedAt`, then id), so when a record is refused, every
/// record behind it would be refused too. The line keeps this process's
/// waiters in that order, learned from their first refusal: one wake-up
/// goes to the first waiter of the lane, is passed on to the next after an
/// admission, and ends at a refusal. A freed slot costs this process about
/// two attempts, not one per waiter. Each freed slot gives one more waiter
/// a wake-up, so several slots are tried for at once. A waiter also asks
/// again on its own now and then ([`recheck_after`]), so a wake-up that
/// went astray costs time, never a place in line.
#[derive(Debug, Default)]
pub(crate) struct Line {
    state: Mutex<LineState>,
    /// How many starts are waiting in line now. A settle with no one
    /// waiting skips the wake-up, which takes the line's lock.
    waiting: AtomicUsize,
    /// Start attempts of records that wait in line, for the tests.
    #[cfg(test)]
    pub(super) attempts: AtomicUsize,
}

#[derive(Debug, Default)]
struct LineState {
    /// The number the next waiter joins with.
    next: u64,
    /// The waiters of each lane, in line order.
    lanes: HashMap<LaneKey, BTreeMap<Place, Arc<Waiter>>>,
}

/// A waiter's place: its record's in the lane's line, then the order it
/// joined in (two starts of one record may wait at once).
type Place = (LinePlace, u64);

impl LineState {
    /// Gives a wake-up to the first waiter of `lane` after `after` (from
    /// the start when `None`) that holds none.
    fn wake_first(&self, lane: &LaneKey, after: Option<&Place>) {
        let Some(waiters) = self.lanes.get(lane) else {
            return;
        };
        let from = after.map_or(Bound::Unbounded, |after| Bound::Excluded(*after));
        for waiter in waiters.range((from, Bound::Unbounded)).map(|(_, waiter)| waiter) {
            if waiter.wake() {
                return;
            }
        }
    }
}

/// One start waiting in line, as the line sees it.
#[derive(Debug, Default)]
struct Waiter {
    /// Holds a wake-up not yet answered by an attempt.
    woken: AtomicBool,
    changed: Notify,
}

impl Waiter {
    /// Gives it a wake-up; false when it holds one already.
    fn wake(&self) -> bool {
        if self.woken.swap(true, Ordering::SeqCst) {
            return false;
        }
        self.changed.notify_waiters();
        true
    }
}

impl Line {
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
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match lane {
            Some(lane) => state.wake_first(lane, None),
            None => {
                for lane in state.lanes.keys() {
                    state.wake_first(lane, None);
                }
            }
        }
    }

    /// Whether any start waits in line in this process.
    #[inline]
    pub(crate) fn anyone_waiting(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) > 0
    }

    /// Counts the caller in line on `lane`, at its record's `place`, until
    /// the guard is dropped.
    pub(crate) fn join(&self, lane: LaneKey, place: LinePlace) -> InLine<'_> {
        let waiter = Arc::new(Waiter::default());
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let place = (place, state.next);
        state.next += 1;
        state
            .lanes
            .entry(lane.clone())
            .or_default()
            .insert(place, Arc::clone(&waiter));
        self.waiting.fetch_add(1, Ordering::SeqCst);
        InLine {
            line: self,
            lane,
            place,
            waiter,
            answering: false,
        }
    }
}

/// One start waiting in line; counted out when dropped.
pub(crate) struct InLine<'a> {
    line: &'a Line,
    lane: LaneKey,
    place: Place,
    waiter: Arc<Waiter>,
    /// Whether the attempt running now answers a wake-up.
    answering: bool,
}

impl InLine<'_> {
    /// Waits up to `poll` for a wake-up, and takes it: the next attempt
    /// answers it. Returns whether one came (held already, or given while
    /// waiting).
    pub(crate) async fn wait(&mut self, poll: Duration) -> bool {
        let sleep = tokio::time::sleep(poll);
        tokio::pin!(sleep);
        loop {
            // Registered before the flag is read, so that a wake-up given
            // in between still ends the wait.
            let changed = self.waiter.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.waiter.woken.swap(false, Ordering::SeqCst) {
                self.answering = true;
                return true;
            }
            tokio::select! {
                () = &mut changed => {}
                () = &mut sleep => {
                    self.answering = self.waiter.woken.swap(false, Ordering::SeqCst);
                    return self.answering;
                }
            }
        }
    }

    /// The attempt was refused: the wake-up it answered ends here, since
    /// every waiter behind would be refused too.
    pub(crate) fn refused(&mut self) {
        self.answering = false;
    }
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        let mut state = self.line.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(waiters) = state.lanes.get_mut(&self.lane) {
            waiters.remove(&self.place);
            if waiters.is_empty() {
                state.lanes.remove(&self.lane);
            }
        }
        self.line.waiting.fetch_sub(1, Ordering::SeqCst);
        // Admitted, or gone (a timeout, a dropped future, an error) with a
        // wake-up in hand or being answered: the next waiter may have its
        // turn.
        let held = self.waiter.woken.load(Ordering::SeqCst);
        if self.answering || held {
            state.wake_first(&self.lane, Some(&self.place));
        }
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
    fn place() -> LinePlace {
        (Timestamp::from_millis(1_000), ActivityId::new())
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
        in_line.answering = in_line.waiter.woken.swap(false, Ordering::SeqCst);
        in_line.answering
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
        let mut later = line.join(kb.clone(), (Timestamp::from_millis(2_000), ActivityId::new()));
        let mut earlier = line.join(kb.clone(), (Timestamp::from_millis(1_000), ActivityId::new()));
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
    async fn a_freed_slot_costs_two_attempts_however_many_wait() {
        // Eight wait on a cap-1 lane. Time stands still (nobody's recheck
        // comes due), so every attempt after the settle is one a wake-up
        // caused: the first in line, admitted, and the next, refused on a
        // full lane. Woken all at once, all eight would have asked.
        let config = crate::LedgerConfig::default()
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
        assert!(!line.anyone_waiting());
    }
}
