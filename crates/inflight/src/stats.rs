//! What one ledger saw happen in this process, for monitoring: the reap
//! events it logs, and its in-process statistics (refused admissions and
//! reaper passes in [`LedgerStats`]; the call histograms, which its store
//! keeps beside its commands).
//!
//! The store's counters ([`crate::domain::counters::Totals`]) are the
//! ledger's own, shared by every process on the store and kept across
//! restarts. What is here is per process instead: how long this process's
//! calls waited and ran, which of its admissions were refused, how often
//! its reaper ran and how long a pass took. A store reports what landed
//! only once its transaction committed, so a rolled-back command is never
//! observed, and each command's reaps are logged whether or not its caller
//! is still there to hear the answer.
//!
//! Nothing here depends on a metrics crate: the server turns a
//! [`StatsSnapshot`] into Prometheus series, and a Rust service can read it
//! with [`Ledger::stats`](crate::Ledger::stats).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::domain::labels::{ActivityLabels, Label};
use crate::domain::record::{ActivityId, Disposition, LaneKey, ReapReason};
use crate::domain::transition::Effect;

/// The upper bounds of the queue-wait and execution histograms, in
/// microseconds: from 5 ms (a cached embedding) to 30 minutes (a long
/// batch), about two to three buckets per tenfold.
pub const CALL_BUCKETS_US: &[u64] = &[
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    30_000_000,
    60_000_000,
    120_000_000,
    300_000_000,
    600_000_000,
    1_200_000_000,
    1_800_000_000,
];

/// The upper bounds of the reaper pass histogram, in microseconds: 0.5 ms
/// to 10 s.
pub const REAP_BUCKETS_US: &[u64] = &[
    500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000,
    5_000_000, 10_000_000,
];

/// The most label sets (or lanes, for refusals) one ledger keeps
/// statistics for: labels are the callers', and a process must not grow
/// without bound whatever they send (the store's own bounds on label sets,
/// `[labels] max_aggregates`, usually hold them well below this). Past it,
/// new ones are not observed, and a warning says so once.
pub const MAX_SERIES: usize = 10_000;

/// The log target of reap events, for filtering them
/// (`RUST_LOG=inflight::reap=info`).
pub const REAP_TARGET: &str = "inflight::reap";

/// A histogram with fixed buckets. Counted in whole microseconds, so an
/// observation is integer work; read in seconds, Prometheus's base unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    bounds_us: &'static [u64],
    /// Observations per bucket (not cumulative); the last is `+Inf`.
    counts: Vec<u64>,
    sum_us: u64,
    count: u64,
}

#[allow(clippy::cast_precision_loss)] // microseconds of a call: exact in an f64
fn us_to_seconds(us: u64) -> f64 {
    us as f64 / 1e6
}

impl Histogram {
    /// An empty histogram with these upper bounds (ascending, in
    /// microseconds).
    pub fn new(bounds_us: &'static [u64]) -> Self {
        Self {
            bounds_us,
            counts: vec![0; bounds_us.len() + 1],
            sum_us: 0,
            count: 0,
        }
    }

    /// Counts one observation of `us` microseconds.
    pub fn observe_us(&mut self, us: u64) {
        // A scan from the smallest bucket: most calls fall in the first few.
        let bucket = self
            .bounds_us
            .iter()
            .position(|&bound| us <= bound)
            .unwrap_or(self.bounds_us.len());
        self.counts[bucket] += 1;
        self.sum_us = self.sum_us.saturating_add(us);
        self.count += 1;
    }

    /// Each bucket's upper bound in seconds (`f64::INFINITY` last) and how
    /// many observations fell in it (not cumulative).
    pub fn buckets(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        self.bounds_us
            .iter()
            .map(|&us| us_to_seconds(us))
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().copied())
    }

    /// Adds `other`'s observations (with the same buckets) to these.
    fn add(&mut self, other: &Self) {
        for (count, more) in self.counts.iter_mut().zip(&other.counts) {
            *count += more;
        }
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
        self.count += other.count;
    }

    /// The sum of every observation, in seconds.
    pub fn sum(&self) -> f64 {
        us_to_seconds(self.sum_us)
    }

    /// How many observations.
    pub fn count(&self) -> u64 {
        self.count
    }
}

/// A lane and a deadline class: the grain of the call histograms.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LaneClass {
    /// The lane.
    pub lane: LaneKey,
    /// The deadline class.
    pub class: Label,
}

impl LaneClass {
    fn of(labels: &ActivityLabels) -> Self {
        Self {
            lane: LaneKey::of(labels),
            class: labels.class.clone(),
        }
    }
}

/// Why an admission was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rejection {
    /// Refused at once: the lane was full (a start with no wait, a begin
    /// already started, [`Ledger::try_admit`](crate::Ledger::try_admit)).
    LaneFull,
    /// Waited in line for the time it was given, and its turn never came.
    WaitTimeout,
    /// Refused at once: the lane was cooling down after a provider's
    /// `Retry-After`.
    LaneCooling,
    /// Refused at once: the lane's token budget, or its provider's, had
    /// no room for the call's estimate.
    BudgetExhausted,
}

impl Rejection {
    /// `lane_full`, `wait_timeout`, `lane_cooling` or `budget_exhausted`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LaneFull => "lane_full",
            Self::WaitTimeout => "wait_timeout",
            Self::LaneCooling => "lane_cooling",
            Self::BudgetExhausted => "budget_exhausted",
        }
    }
}

/// A copy of a ledger's in-process statistics, taken at once.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsSnapshot {
    /// Queue waits (`startedAt - enqueuedAt`) of the starts this process
    /// made, by lane and class.
    pub queue_wait: BTreeMap<LaneClass, Histogram>,
    /// Execution times (`completedAt - startedAt`) of the settles this
    /// process made of started records, by lane and class.
    pub execution: BTreeMap<LaneClass, Histogram>,
    /// Admissions this process refused, by lane and why.
    pub rejected: BTreeMap<(LaneKey, Rejection), u64>,
    /// Reaper passes completed (whether or not they reaped anything).
    pub reaper_runs: u64,
    /// Begins through this ledger whose labels were folded into `other`
    /// ([`Ledger::labels_folded`](crate::Ledger::labels_folded)).
    pub labels_folded: u64,
    /// How long each reaper pass took.
    pub reap_duration: Histogram,
}

/// A ledger's in-process statistics of its own: refused admissions and
/// reaper passes. (The call histograms are kept by its store, which sees
/// every start and settle land; [`Ledger::stats`](crate::Ledger::stats)
/// reads both.)
#[derive(Debug)]
pub struct LedgerStats {
    state: Mutex<StatsState>,
    reaper_runs: AtomicU64,
    warned_full: AtomicBool,
}

#[derive(Debug)]
struct StatsState {
    rejected: HashMap<(LaneKey, Rejection), u64>,
    reap_duration: Histogram,
}

impl Default for LedgerStats {
    fn default() -> Self {
        Self {
            state: Mutex::new(StatsState {
                rejected: HashMap::new(),
                reap_duration: Histogram::new(REAP_BUCKETS_US),
            }),
            reaper_runs: AtomicU64::new(0),
            warned_full: AtomicBool::new(false),
        }
    }
}

impl LedgerStats {
    /// A copy of the statistics now, with the store's call histograms.
    pub(crate) fn snapshot(&self, calls: CallSnapshot) -> StatsSnapshot {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        StatsSnapshot {
            queue_wait: calls.queue_wait,
            execution: calls.execution,
            rejected: state.rejected.iter().map(|(k, n)| (k.clone(), *n)).collect(),
            reaper_runs: self.reaper_runs.load(Ordering::Relaxed),
            labels_folded: 0,
            reap_duration: state.reap_duration.clone(),
        }
    }

    /// Counts an admission of `lane` refused for `why`.
    pub(crate) fn rejected(&self, lane: LaneKey, why: Rejection) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let full = state.rejected.len() >= MAX_SERIES;
        match state.rejected.get_mut(&(lane.clone(), why)) {
            Some(count) => *count += 1,
            None if full => {
                if !self.warned_full.swap(true, Ordering::Relaxed) {
                    warn_full();
                }
            }
            None => {
                state.rejected.insert((lane, why), 1);
            }
        }
    }

    /// Counts a reaper pass that took `took`.
    pub(crate) fn reaper_ran(&self, took: Duration) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .reap_duration
            .observe_us(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
        self.reaper_runs.fetch_add(1, Ordering::Relaxed);
    }
}

fn warn_full() {
    tracing::warn!(
        max = MAX_SERIES,
        "more than {MAX_SERIES} label sets or lanes: new ones are not observed in this process's \
         statistics (the store's counters still count them)"
    );
}

/// Histograms by label set. A store observes a start or settle with the
/// record's shared label set: the set used last is recognized by pointer,
/// any other is found by its precomputed hash, and only a new one is
/// copied. They are added up by lane and class when read.
#[derive(Debug, Default)]
struct ByLabels {
    histograms: Vec<(ActivityLabels, Histogram)>,
    index: HashMap<ActivityLabels, usize, foldhash::fast::RandomState>,
    /// Where the last observation went.
    last: usize,
}

impl ByLabels {
    /// Counts `ms` for `labels`; `false` when it is a new label set and
    /// [`MAX_SERIES`] are kept already.
    fn observe(&mut self, labels: &ActivityLabels, ms: i64) -> bool {
        let us = ms.max(0).unsigned_abs().saturating_mul(1000);
        if let Some((last, histogram)) = self.histograms.get_mut(self.last) {
            if last.same_set(labels) {
                histogram.observe_us(us);
                return true;
            }
        }
        let at = match self.index.get(labels) {
            Some(&at) => at,
            None if self.histograms.len() >= MAX_SERIES => return false,
            None => {
                self.histograms
                    .push((labels.clone(), Histogram::new(CALL_BUCKETS_US)));
                self.index.insert(labels.clone(), self.histograms.len() - 1);
                self.histograms.len() - 1
            }
        };
        self.last = at;
        self.histograms[at].1.observe_us(us);
        true
    }

    /// The histograms, added up by lane and class.
    fn by_lane_class(&self) -> BTreeMap<LaneClass, Histogram> {
        let mut merged: BTreeMap<LaneClass, Histogram> = BTreeMap::new();
        for (labels, histogram) in &self.histograms {
            match merged.entry(LaneClass::of(labels)) {
                std::collections::btree_map::Entry::Vacant(entry) => {
                    entry.insert(histogram.clone());
                }
                std::collections::btree_map::Entry::Occupied(mut entry) => entry.get_mut().add(histogram),
            }
        }
        merged
    }
}

/// The queue-wait and execution histograms of what a store committed. The
/// store keeps them under its own lock (the memory store's state, the
/// SQLite writer's), so a start or settle pays no lock of its own for them.
#[derive(Debug, Default)]
pub(crate) struct CallStats {
    queue_wait: ByLabels,
    execution: ByLabels,
    warned_full: bool,
    /// Reaps of the command being run, for its summary line.
    reaped: u64,
    abandoned: u64,
    owner_lost: u64,
}

/// The call histograms, by lane and class.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallSnapshot {
    /// Queue waits.
    pub queue_wait: BTreeMap<LaneClass, Histogram>,
    /// Execution times.
    pub execution: BTreeMap<LaneClass, Histogram>,
}

impl CallStats {
    /// Observes what `effect`, which landed for the record `id` with
    /// `labels`, shows: a reap is logged at once (see [`CallStats::finish`]
    /// for the summary), a start's queue wait and a settle's execution time
    /// are counted in the histograms.
    #[inline]
    pub(crate) fn land(&mut self, id: ActivityId, labels: &ActivityLabels, effect: &Effect) {
        let kept = match *effect {
            Effect::Reaped {
                disposition,
                reason,
                age_ms,
                bound_ms,
                ..
            } => {
                self.reaped += 1;
                self.abandoned += u64::from(disposition == Disposition::Abandoned);
                self.owner_lost += u64::from(reason == ReapReason::OwnerLost);
                log_reap(id, labels, disposition, reason, age_ms, bound_ms);
                true
            }
            Effect::Started { queue_wait_ms, .. } => self.queue_wait.observe(labels, queue_wait_ms),
            Effect::Settled {
                execution_ms: Some(execution_ms),
                ..
            } => self.execution.observe(labels, execution_ms),
            _ => true,
        };
        if !kept {
            self.full();
        }
    }

    fn full(&mut self) {
        if !std::mem::replace(&mut self.warned_full, true) {
            warn_full();
        }
    }

    /// Ends a command: one summary line when it reaped several records.
    #[inline]
    pub(crate) fn finish(&mut self) {
        if self.reaped > 0 {
            self.summarize();
        }
    }

    fn summarize(&mut self) {
        if self.reaped > 1 {
            let (reaped, abandoned, owner_lost) = (self.reaped, self.abandoned, self.owner_lost);
            tracing::info!(
                target: REAP_TARGET,
                reaped,
                abandoned,
                unsettled = reaped - abandoned,
                owner_lost,
                "one pass reaped {reaped} records ({abandoned} abandoned, {} unsettled; {owner_lost} for a lost owner)",
                reaped - abandoned
            );
        }
        (self.reaped, self.abandoned, self.owner_lost) = (0, 0, 0);
    }

    /// The histograms, added up by lane and class.
    pub(crate) fn snapshot(&self) -> CallSnapshot {
        CallSnapshot {
            queue_wait: self.queue_wait.by_lane_class(),
            execution: self.execution.by_lane_class(),
        }
    }
}

/// One reap, as one structured event.
fn log_reap(
    id: ActivityId,
    labels: &ActivityLabels,
    disposition: Disposition,
    reason: ReapReason,
    age_ms: i64,
    bound_ms: i64,
) {
    let key = LaneClass::of(labels);
    let age = Duration::from_millis(age_ms.max(0).unsigned_abs());
    let bound = Duration::from_millis(bound_ms.max(0).unsigned_abs());
    tracing::info!(
        target: REAP_TARGET,
        activity_id = %id,
        lane = %key.lane,
        class = %key.class,
        disposition = disposition.as_str(),
        reason = reason.as_str(),
        age_ms,
        bound_ms,
        "reaped activity {id} on lane {} as {} ({}): {} old, bound {}",
        key.lane,
        disposition.as_str(),
        reason.as_str(),
        humantime::format_duration(age),
        humantime::format_duration(bound),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_counts_each_observation_in_the_first_bucket_that_holds_it() {
        let mut histogram = Histogram::new(&[100_000, 1_000_000]);
        for us in [50_000, 100_000, 500_000, 2_000_000] {
            histogram.observe_us(us);
        }
        let buckets: Vec<(f64, u64)> = histogram.buckets().collect();
        assert_eq!(buckets, [(0.1, 2), (1.0, 1), (f64::INFINITY, 1)]);
        assert_eq!(histogram.count(), 4);
        assert!((histogram.sum() - 2.65).abs() < 1e-9);
    }

    #[test]
    fn call_buckets_run_from_5ms_to_30min() {
        assert_eq!(CALL_BUCKETS_US.first(), Some(&5_000));
        assert_eq!(CALL_BUCKETS_US.last(), Some(&1_800_000_000));
        assert!(CALL_BUCKETS_US.windows(2).all(|w| w[0] < w[1]));
        assert!(REAP_BUCKETS_US.windows(2).all(|w| w[0] < w[1]));
    }
}
