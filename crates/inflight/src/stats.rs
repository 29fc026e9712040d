//! What one ledger saw happen in this process, for monitoring: the reap
//! events it logs, and its in-process statistics ([`LedgerStats`]).
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

use crate::domain::labels::Label;
use crate::domain::record::{ActivityId, ActivityRecord, Disposition, LaneKey, ReapReason};
use crate::domain::transition::Effect;

/// The upper bounds (seconds) of the queue-wait and execution histograms:
/// from 5 ms (a cached embedding) to 30 minutes (a long batch), about
/// two to three buckets per tenfold.
pub const CALL_SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
    1800.0,
];

/// The upper bounds (seconds) of the reaper pass histogram.
pub const REAP_SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The most `service`, `provider`, `class` combinations (or lanes, for
/// refusals) one ledger keeps statistics for: labels are the callers', and
/// a process must not grow without bound whatever they send. Past it, new
/// combinations are not observed, and a warning says so once.
pub const MAX_SERIES: usize = 1024;

/// The log target of reap events, for filtering them
/// (`RUST_LOG=inflight::reap=info`).
pub const REAP_TARGET: &str = "inflight::reap";

/// A histogram with fixed buckets, in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); the last is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with these upper bounds (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    /// Counts one observation of `seconds`.
    pub fn observe(&mut self, seconds: f64) {
        let bucket = self.bounds.partition_point(|&bound| bound < seconds);
        self.counts[bucket] += 1;
        self.sum += seconds;
        self.count += 1;
    }

    /// Each bucket's upper bound (`f64::INFINITY` last) and how many
    /// observations fell in it (not cumulative).
    pub fn buckets(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        self.bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().copied())
    }

    /// The sum of every observation.
    pub fn sum(&self) -> f64 {
        self.sum
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
    fn of(record: &ActivityRecord) -> Self {
        Self {
            lane: record.lane(),
            class: record.labels.class.clone(),
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
}

impl Rejection {
    /// `lane_full` or `wait_timeout`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LaneFull => "lane_full",
            Self::WaitTimeout => "wait_timeout",
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
    /// How long each reaper pass took.
    pub reap_duration: Histogram,
}

/// A ledger's in-process statistics, shared by its clones and its store.
#[derive(Debug)]
pub struct LedgerStats {
    state: Mutex<StatsState>,
    reaper_runs: AtomicU64,
    warned_full: AtomicBool,
}

#[derive(Debug)]
struct StatsState {
    queue_wait: HashMap<LaneClass, Histogram>,
    execution: HashMap<LaneClass, Histogram>,
    rejected: HashMap<(LaneKey, Rejection), u64>,
    reap_duration: Histogram,
}

impl Default for LedgerStats {
    fn default() -> Self {
        Self {
            state: Mutex::new(StatsState {
                queue_wait: HashMap::new(),
                execution: HashMap::new(),
                rejected: HashMap::new(),
                reap_duration: Histogram::new(REAP_SECONDS_BUCKETS),
            }),
            reaper_runs: AtomicU64::new(0),
            warned_full: AtomicBool::new(false),
        }
    }
}

/// Something a command did that this process observes once it landed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Landed {
    /// A record was reaped.
    Reaped {
        id: ActivityId,
        key: LaneClass,
        disposition: Disposition,
        reason: ReapReason,
        age_ms: i64,
        bound_ms: i64,
    },
    /// A record started after waiting.
    Started { key: LaneClass, queue_wait_ms: i64 },
    /// A started record settled after running.
    Settled { key: LaneClass, execution_ms: i64 },
}

impl Landed {
    /// What `effect`, counted for `record`, shows this process, if anything.
    pub(crate) fn of(record: &ActivityRecord, effect: &Effect) -> Option<Self> {
        match *effect {
            Effect::Reaped {
                disposition,
                reason,
                age_ms,
                bound_ms,
            } => Some(Self::Reaped {
                id: record.activity_id,
                key: LaneClass::of(record),
                disposition,
                reason,
                age_ms,
                bound_ms,
            }),
            Effect::Started { queue_wait_ms, .. } => Some(Self::Started {
                key: LaneClass::of(record),
                queue_wait_ms,
            }),
            Effect::Settled {
                execution_ms: Some(execution_ms),
                ..
            } => Some(Self::Settled {
                key: LaneClass::of(record),
                execution_ms,
            }),
            _ => None,
        }
    }
}

fn seconds(ms: i64) -> f64 {
    // Milliseconds of a call: exact in an f64.
    #[allow(clippy::cast_precision_loss)]
    let ms = ms.max(0) as f64;
    ms / 1000.0
}

impl LedgerStats {
    /// A copy of the statistics now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        StatsSnapshot {
            queue_wait: state
                .queue_wait
                .iter()
                .map(|(k, h)| (k.clone(), h.clone()))
                .collect(),
            execution: state
                .execution
                .iter()
                .map(|(k, h)| (k.clone(), h.clone()))
                .collect(),
            rejected: state.rejected.iter().map(|(k, n)| (k.clone(), *n)).collect(),
            reaper_runs: self.reaper_runs.load(Ordering::Relaxed),
            reap_duration: state.reap_duration.clone(),
        }
    }

    /// Counts an admission of `lane` refused for `why`.
    pub(crate) fn rejected(&self, lane: LaneKey, why: Rejection) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let full = state.rejected.len() >= MAX_SERIES;
        match state.rejected.get_mut(&(lane.clone(), why)) {
            Some(count) => *count += 1,
            None if full => self.warn_full(),
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
            .observe(took.as_secs_f64());
        self.reaper_runs.fetch_add(1, Ordering::Relaxed);
    }

    /// Observes what one command did, once it landed: logs each reap (and
    /// a summary when it reaped several), and counts starts and settles in
    /// the histograms.
    pub(crate) fn publish(&self, landed: &[Landed]) {
        let mut reaped = 0_u64;
        let (mut abandoned, mut owner_lost) = (0_u64, 0_u64);
        let mut state = None;
        for event in landed {
            match event {
                Landed::Reaped {
                    id,
                    key,
                    disposition,
                    reason,
                    age_ms,
                    bound_ms,
                } => {
                    reaped += 1;
                    abandoned += u64::from(*disposition == Disposition::Abandoned);
                    owner_lost += u64::from(*reason == ReapReason::OwnerLost);
                    log_reap(*id, key, *disposition, *reason, *age_ms, *bound_ms);
                }
                Landed::Started { key, queue_wait_ms } => {
                    let state = state
                        .get_or_insert_with(|| self.state.lock().unwrap_or_else(PoisonError::into_inner));
                    self.observe(&mut state.queue_wait, key, *queue_wait_ms);
                }
                Landed::Settled { key, execution_ms } => {
                    let state = state
                        .get_or_insert_with(|| self.state.lock().unwrap_or_else(PoisonError::into_inner));
                    self.observe(&mut state.execution, key, *execution_ms);
                }
            }
        }
        if reaped > 1 {
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
    }

    fn observe(&self, histograms: &mut HashMap<LaneClass, Histogram>, key: &LaneClass, ms: i64) {
        if let Some(histogram) = histograms.get_mut(key) {
            histogram.observe(seconds(ms));
            return;
        }
        if histograms.len() >= MAX_SERIES {
            self.warn_full();
            return;
        }
        let mut histogram = Histogram::new(CALL_SECONDS_BUCKETS);
        histogram.observe(seconds(ms));
        histograms.insert(key.clone(), histogram);
    }

    fn warn_full(&self) {
        if !self.warned_full.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                max = MAX_SERIES,
                "more than {MAX_SERIES} lane and class combinations: new ones are not observed in this \
                 process's statistics (the store's counters still count them)"
            );
        }
    }
}

/// One reap, as one structured event.
fn log_reap(
    id: ActivityId,
    key: &LaneClass,
    disposition: Disposition,
    reason: ReapReason,
    age_ms: i64,
    bound_ms: i64,
) {
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
        let mut histogram = Histogram::new(&[0.1, 1.0]);
        for seconds in [0.05, 0.1, 0.5, 2.0] {
            histogram.observe(seconds);
        }
        let buckets: Vec<(f64, u64)> = histogram.buckets().collect();
        assert_eq!(buckets, [(0.1, 2), (1.0, 1), (f64::INFINITY, 1)]);
        assert_eq!(histogram.count(), 4);
        assert!((histogram.sum() - 2.65).abs() < 1e-9);
    }

    #[test]
    fn call_buckets_run_from_5ms_to_30min() {
        assert_eq!(CALL_SECONDS_BUCKETS.first(), Some(&0.005));
        assert_eq!(CALL_SECONDS_BUCKETS.last(), Some(&1800.0));
        assert!(CALL_SECONDS_BUCKETS.windows(2).all(|w| w[0] < w[1]));
        assert!(REAP_SECONDS_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    }
}
