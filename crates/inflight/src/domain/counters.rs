//! Counters maintained as records change, never recomputed from history.
//!
//! What operators count (calls, outcomes, reaps by disposition and reason,
//! late settles, resurrections) lives in per-aggregate counters, so that
//! pruning old records can never lower a count and a snapshot never scans
//! history.

use std::sync::Arc;

use serde::Serialize;

use super::effect::Effect;
use super::labels::LabelSet;
use super::record::{ActivityRecord, Admission, Disposition, Priority, ReapReason, State};
use super::timestamp::Timestamp;
use super::usage::Tokens;

/// The grain of the counters: one row per combination of these labels.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AggregateKey {
    /// The calling service.
    pub service: Arc<str>,
    /// The caller's stage.
    pub operation_stage: Arc<str>,
    /// The deadline class.
    pub class: Arc<str>,
    /// The provider.
    pub provider: Arc<str>,
    /// The model (sanitized).
    pub model: Arc<str>,
    /// The priority.
    pub priority: Priority,
    /// Queued, direct or external.
    pub admission: Admission,
}

impl AggregateKey {
    /// The aggregate `record` counts in.
    pub fn of(record: &ActivityRecord) -> Self {
        Self::new(&record.labels, record.priority, record.admission)
    }

    /// The aggregate of calls with these labels, priority and admission.
    pub fn new(labels: &LabelSet, priority: Priority, admission: Admission) -> Self {
        Self {
            service: labels.service.shared(),
            operation_stage: labels.operation_stage.shared(),
            class: labels.class.shared(),
            provider: labels.provider.shared(),
            model: Arc::clone(&labels.model),
            priority,
            admission,
        }
    }
}

/// Running totals of one aggregate. Also used as a change to add.
///
/// A call counts into its aggregate when it ends (its outcome, its queue
/// wait and execution time), under the model it ended with; while in
/// flight it counts only in `in_flight`, which a refinement moves to the
/// aggregate of the new model. So a refinement moves no counted call, and
/// no counter a monitor reads ever goes down ([`Totals::calls`],
/// [`Totals::ends_ever`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Settled with success.
    pub succeeded: i64,
    /// Settled with failure.
    pub failed: i64,
    /// Cancelled by the caller.
    pub cancelled: i64,
    /// Ended reaped as abandoned (a resurrection takes one back out).
    pub reaped_abandoned: i64,
    /// Ended reaped as unsettled.
    pub reaped_unsettled: i64,
    /// Reaps (of either disposition) because the owner's lease expired.
    pub reaped_owner_lost: i64,
    /// Of those, reaps of records that had not started (`abandoned`),
    /// ever: a resurrection does not take one back out, so that reaps by
    /// disposition and reason can be told apart
    /// ([`Totals::reaps_ever`]).
    pub reaped_owner_lost_abandoned: i64,
    /// Of `succeeded`, the records settled with success that never
    /// started: a caller that reports its starts as facts forgot one, or
    /// began and settled without the start. Never a normal completion.
    pub succeeded_unstarted: i64,
    /// Records that received a settle or cancel after being reaped.
    pub late_settles: i64,
    /// Abandoned records started after all.
    pub resurrections: i64,
    /// Records currently in flight.
    pub in_flight: i64,
    /// Number of queue-wait samples.
    pub queue_wait_count: i64,
    /// Sum of queue waits, ms.
    pub queue_wait_sum_ms: i64,
    /// Longest queue wait, ms.
    pub queue_wait_max_ms: i64,
    /// Number of execution-time samples.
    pub execution_count: i64,
    /// Sum of execution times, ms.
    pub execution_sum_ms: i64,
    /// Longest execution time, ms.
    pub execution_max_ms: i64,
    /// Last caller-observed event; reaps never move it.
    pub last_seen_at: Option<Timestamp>,
    /// Input tokens the calls that ended here reported (a late settle's
    /// included: the call ran).
    pub input_tokens: i64,
    /// Output tokens, likewise.
    pub output_tokens: i64,
}

impl Totals {
    /// The change that `effects` make to the totals.
    pub fn from_effects(effects: &[Effect]) -> Self {
        let mut delta = Self::default();
        for effect in effects {
            delta.count(effect);
        }
        delta
    }

    /// Counts what `effect` changed, in place: the one rule for how each
    /// effect moves the counters, whether it is added to stored totals here
    /// or to a delta that a database adds.
    pub fn count(&mut self, effect: &Effect) {
        match *effect {
            Effect::Begun { at } | Effect::JoinedAggregate { at } => {
                self.in_flight += 1;
                self.seen(at);
            }
            Effect::LeftAggregate => self.in_flight -= 1,
            Effect::Started { at, .. } => self.seen(at),
            Effect::Settled {
                at,
                state,
                execution_ms,
                queue_wait_ms,
                tokens,
            } => {
                self.in_flight -= 1;
                self.spent(tokens);
                self.queue_wait(queue_wait_ms);
                match state {
                    State::Succeeded => {
                        self.succeeded += 1;
                        self.succeeded_unstarted += i64::from(queue_wait_ms.is_none());
                    }
                    State::Failed => self.failed += 1,
                    _ => self.cancelled += 1,
                }
                if let Some(ms) = execution_ms {
                    self.execution_count += 1;
                    self.execution_sum_ms += ms;
                    self.execution_max_ms = self.execution_max_ms.max(ms);
                }
                self.seen(at);
            }
            Effect::Reaped {
                disposition,
                reason,
                queue_wait_ms,
                ..
            } => {
                self.in_flight -= 1;
                self.queue_wait(queue_wait_ms);
                match disposition {
                    Disposition::Abandoned => self.reaped_abandoned += 1,
                    Disposition::Unsettled => self.reaped_unsettled += 1,
                }
                if reason == ReapReason::OwnerLost {
                    self.reaped_owner_lost += 1;
                    if disposition == Disposition::Abandoned {
                        self.reaped_owner_lost_abandoned += 1;
                    }
                }
            }
            Effect::Resurrected => {
                self.in_flight += 1;
                self.reaped_abandoned -= 1;
                self.resurrections += 1;
            }
            Effect::LateSettle { at, tokens } => {
                self.late_settles += 1;
                self.spent(tokens);
                self.seen(at);
            }
        }
    }

    fn spent(&mut self, tokens: Tokens) {
        self.input_tokens += i64::from(tokens.input);
        self.output_tokens += i64::from(tokens.output);
    }

    fn queue_wait(&mut self, sample: Option<i64>) {
        if let Some(ms) = sample {
            self.queue_wait_count += 1;
            self.queue_wait_sum_ms += ms;
            self.queue_wait_max_ms = self.queue_wait_max_ms.max(ms);
        }
    }

    /// Calls begun in this aggregate, each counted once, where it is now:
    /// the ones in flight and the ones that ended. A refinement moves a
    /// call in flight from one aggregate's count to another's; the sum over
    /// aggregates never changes.
    pub fn calls(&self) -> i64 {
        self.in_flight + self.ended()
    }

    /// Calls that ended here (settled, cancelled, or reaped and not
    /// resurrected since).
    pub fn ended(&self) -> i64 {
        self.succeeded + self.failed + self.cancelled + self.reaped()
    }

    /// Ends ever counted here, for a monitoring counter that never goes
    /// down: a call reaped `abandoned` and then resurrected counts its reap
    /// and its later end.
    pub fn ends_ever(&self) -> i64 {
        self.ended() + self.resurrections
    }

    fn seen(&mut self, at: Timestamp) {
        self.last_seen_at = Some(self.last_seen_at.map_or(at, |seen| seen.max(at)));
    }

    /// Adds `delta` to these totals (maxima take the larger value).
    pub fn add(&mut self, delta: &Self) {
        self.succeeded += delta.succeeded;
        self.failed += delta.failed;
        self.cancelled += delta.cancelled;
        self.reaped_abandoned += delta.reaped_abandoned;
        self.reaped_unsettled += delta.reaped_unsettled;
        self.reaped_owner_lost += delta.reaped_owner_lost;
        self.reaped_owner_lost_abandoned += delta.reaped_owner_lost_abandoned;
        self.succeeded_unstarted += delta.succeeded_unstarted;
        self.late_settles += delta.late_settles;
        self.resurrections += delta.resurrections;
        self.in_flight += delta.in_flight;
        self.queue_wait_count += delta.queue_wait_count;
        self.queue_wait_sum_ms += delta.queue_wait_sum_ms;
        self.queue_wait_max_ms = self.queue_wait_max_ms.max(delta.queue_wait_max_ms);
        self.execution_count += delta.execution_count;
        self.execution_sum_ms += delta.execution_sum_ms;
        self.execution_max_ms = self.execution_max_ms.max(delta.execution_max_ms);
        self.input_tokens += delta.input_tokens;
        self.output_tokens += delta.output_tokens;
        if let Some(at) = delta.last_seen_at {
            self.seen(at);
        }
    }

    /// Reaps of either disposition.
    pub fn reaped(&self) -> i64 {
        self.reaped_abandoned + self.reaped_unsettled
    }

    /// Every reap ever counted here with `disposition` and `reason`,
    /// resurrected records included: unlike [`Totals::reaped_abandoned`]
    /// (records that *ended* reaped), these never go down, which is what a
    /// monitoring counter needs. (Counters from a store written before
    /// owner-lost reaps were split by disposition may attribute a few old
    /// reaps to `unsettled`; never below zero.)
    pub fn reaps_ever(&self, disposition: Disposition, reason: ReapReason) -> i64 {
        let owner_lost_abandoned = self.reaped_owner_lost_abandoned.min(self.reaped_owner_lost);
        let owner_lost_unsettled = self.reaped_owner_lost - owner_lost_abandoned;
        let count = match (disposition, reason) {
            (Disposition::Abandoned, ReapReason::OwnerLost) => owner_lost_abandoned,
            (Disposition::Unsettled, ReapReason::OwnerLost) => owner_lost_unsettled,
            // A resurrection only ever takes back an abandoned reap.
            (Disposition::Abandoned, ReapReason::Deadline) => {
                self.reaped_abandoned + self.resurrections - owner_lost_abandoned
            }
            (Disposition::Unsettled, ReapReason::Deadline) => self.reaped_unsettled - owner_lost_unsettled,
        };
        count.max(0)
    }
}

/// One aggregate as the snapshot shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AggregateView {
    /// Its labels.
    #[serde(flatten)]
    pub key: AggregateKey,
    /// Records begun.
    pub calls: i64,
    /// Settled with success.
    pub successes: i64,
    /// Of those, without ever starting.
    pub successes_unstarted: i64,
    /// Settled with failure.
    pub failures: i64,
    /// Cancelled by the caller.
    pub cancelled: i64,
    /// Reaped, by disposition.
    pub reaped: ReapedCounts,
    /// Late settles absorbed.
    pub late_settles: i64,
    /// In flight now.
    pub in_flight: i64,
    /// Average queue wait, ms.
    pub avg_queue_wait_ms: Option<i64>,
    /// Longest queue wait, ms.
    pub max_queue_wait_ms: Option<i64>,
    /// Average execution time, ms.
    pub avg_execution_ms: Option<i64>,
    /// Longest execution time, ms.
    pub max_execution_ms: Option<i64>,
    /// Last caller-observed event.
    pub last_seen_at: Option<Timestamp>,
    /// Input tokens reported by the calls that ended here.
    pub input_tokens: i64,
    /// Output tokens, likewise.
    pub output_tokens: i64,
    /// The counters it was made from, whole (not on the wire): `/metrics`
    /// reads what the view leaves out, such as reaps by reason.
    #[serde(skip)]
    pub totals: Totals,
}

impl AggregateView {
    /// The view of `totals` under `key`.
    pub fn new(key: AggregateKey, totals: &Totals) -> Self {
        let avg = |sum: i64, count: i64| (count > 0).then(|| sum / count);
        let max = |max: i64, count: i64| (count > 0).then_some(max);
        Self {
            key,
            calls: totals.calls(),
            successes: totals.succeeded,
            successes_unstarted: totals.succeeded_unstarted,
            failures: totals.failed,
            cancelled: totals.cancelled,
            reaped: ReapedCounts {
                abandoned: totals.reaped_abandoned,
                unsettled: totals.reaped_unsettled,
            },
            late_settles: totals.late_settles,
            in_flight: totals.in_flight,
            avg_queue_wait_ms: avg(totals.queue_wait_sum_ms, totals.queue_wait_count),
            max_queue_wait_ms: max(totals.queue_wait_max_ms, totals.queue_wait_count),
            avg_execution_ms: avg(totals.execution_sum_ms, totals.execution_count),
            max_execution_ms: max(totals.execution_max_ms, totals.execution_count),
            last_seen_at: totals.last_seen_at,
            input_tokens: totals.input_tokens,
            output_tokens: totals.output_tokens,
            totals: *totals,
        }
    }
}

/// Counts of reaped records by disposition.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReapedCounts {
    /// Never started.
    pub abandoned: i64,
    /// Started, never settled.
    pub unsettled: i64,
}

impl ReapedCounts {
    /// Counts one reap.
    pub fn count(&mut self, disposition: Disposition) {
        match disposition {
            Disposition::Abandoned => self.abandoned += 1,
            Disposition::Unsettled => self.unsettled += 1,
        }
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: Self) {
        self.abandoned += other.abandoned;
        self.unsettled += other.unsettled;
    }

    /// Both dispositions together.
    pub fn total(&self) -> i64 {
        self.abandoned + self.unsettled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reaped(disposition: Disposition, reason: ReapReason) -> Effect {
        Effect::Reaped {
            disposition,
            reason,
            age_ms: 0,
            bound_ms: 0,
            queue_wait_ms: None,
        }
    }

    #[test]
    fn reaps_ever_never_go_down_when_a_reaped_record_is_resurrected() {
        use Disposition::{Abandoned, Unsettled};
        use ReapReason::{Deadline, OwnerLost};
        let mut totals = Totals::default();
        for effect in [
            Effect::Begun { at: Timestamp::MIN },
            reaped(Abandoned, Deadline),
            Effect::Resurrected,
            reaped(Unsettled, Deadline),
            Effect::Begun { at: Timestamp::MIN },
            reaped(Abandoned, OwnerLost),
            Effect::Resurrected,
            reaped(Unsettled, OwnerLost),
        ] {
            totals.count(&effect);
        }
        // Both records ended reaped unsettled: the snapshot's count.
        assert_eq!((totals.reaped_abandoned, totals.reaped_unsettled), (0, 2));
        // Every reap that happened: what a monitoring counter needs.
        for (disposition, reason) in [
            (Abandoned, Deadline),
            (Unsettled, Deadline),
            (Abandoned, OwnerLost),
            (Unsettled, OwnerLost),
        ] {
            assert_eq!(
                totals.reaps_ever(disposition, reason),
                1,
                "{disposition} {reason}"
            );
        }
    }
}
