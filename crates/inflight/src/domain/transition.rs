//! The state machine: begin, start, settle, cancel and reap, as pure
//! functions of a record, a request and the time.
//!
//! Stores load a record, call these functions, and persist what they return
//! together with the counter changes their [`Effect`]s imply. No rule of the
//! state machine lives anywhere else.

use std::sync::Arc;

use smallvec::smallvec;

use super::admission::MAX_RETRY_AFTER_MS;
use super::bounds::ReapPolicy;
use super::idempotency::Idempotency;
use super::labels::{sanitize_note, ActivityLabels, UNKNOWN};
use super::record::{
    ActivityId, ActivityRecord, Admission, Disposition, FailureStage, Priority, ReapReason, State,
};
use super::timestamp::Timestamp;
use super::trace::TraceParent;
use super::usage::Usage;

// Defined in leaf modules, so that the counters and owners need not depend
// on the state machine; still public here, where they always were.
pub use super::effect::{Effect, Effects};
pub use super::refusal::Refusal;

/// How far in the future a caller's timestamp may be (clock skew), in ms.
pub const MAX_FUTURE_SKEW_MS: i64 = 5 * 60 * 1000;

/// A record just begun, and what its begin did for the counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The new record.
    pub record: ActivityRecord,
    /// What changed, for the counters.
    pub effects: Effects,
}

/// A validated request to create a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewActivity {
    /// The identity to create it under.
    pub activity_id: ActivityId,
    /// Its validated labels.
    pub labels: ActivityLabels,
    /// The priority.
    pub priority: Priority,
    /// Queued, direct or external.
    pub admission: Admission,
    /// When it was enqueued; `now` when not given.
    pub enqueued_at: Option<Timestamp>,
    /// When it started, for a record begun already started.
    pub started_at: Option<Timestamp>,
    /// Its own execution deadline, if it has one.
    pub deadline_ms: Option<i64>,
    /// The owner (process lease) it belongs to.
    pub owner_id: Option<String>,
    /// The tokens it expects to spend (`maxTokens`), if it says, checked
    /// ([`usage::estimate`](super::usage::estimate)): four bytes, so that
    /// a begin command stays small.
    pub max_tokens: Option<u32>,
    /// What few begins carry (an idempotency key, a trace context), boxed:
    /// every command carries the room.
    pub extras: Option<Box<BeginExtras>>,
}

/// The parts of a begin that few callers send.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BeginExtras {
    /// Its idempotency key, if the caller sent one.
    pub idempotency: Option<Idempotency>,
    /// The caller's trace context, if its begin carried one.
    pub trace_parent: Option<TraceParent>,
}

#[cfg(test)]
impl NewActivity {
    /// The unit tests' call: queued, from `kb` to `ollama` in `class`, begun
    /// when the store says, with nothing else given.
    pub(crate) fn fixture(class: &str) -> Self {
        let labels = ActivityLabels::validate(&super::labels::RawLabels {
            service: "kb",
            provider: "ollama",
            class: Some(class),
            operation_stage: None,
            model: None,
        })
        .expect("valid fixture labels");
        Self {
            activity_id: ActivityId::new(),
            labels,
            priority: Priority::Unknown,
            admission: Admission::Queued,
            enqueued_at: None,
            started_at: None,
            deadline_ms: None,
            owner_id: None,
            max_tokens: None,
            extras: None,
        }
    }
}

/// What a caller asks of an existing record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// It started executing at `at`.
    Start {
        /// When; *now* (never before `enqueuedAt`) when absent.
        at: Option<Timestamp>,
    },
    /// It settled with an outcome.
    Settle {
        /// Whether it succeeded.
        success: bool,
        /// Where it failed (`unknown` when a failure does not say).
        failure_stage: Option<FailureStage>,
        /// When; *now* (never before its latest instant) when absent.
        at: Option<Timestamp>,
        /// The provider's `Retry-After`, in milliseconds (1 ms to an
        /// hour), for a failure only: the lane cools down for it.
        retry_after_ms: Option<i64>,
        /// The tokens the call spent, as the provider reported them.
        usage: Usage,
    },
    /// The caller aborted it.
    Cancel {
        /// Why, as the caller said it (redacted like model names).
        reason: Option<String>,
        /// When; *now* (never before its latest instant) when absent.
        at: Option<Timestamp>,
    },
}

// The checks run on every transition and almost never fail: inlined, with
// their messages built out of line.
#[inline]
fn check_not_future(field: &str, at: Timestamp, now: Timestamp) -> Result<Timestamp, Refusal> {
    // Before 2001 is no caller's clock but seconds taken for milliseconds;
    // refusing it also keeps every difference of two timestamps far from
    // overflow.
    if at < Timestamp::EARLIEST_CALL || at > now.add_millis(MAX_FUTURE_SKEW_MS) {
        return Err(out_of_range(field, at, now));
    }
    Ok(at)
}

#[cold]
fn out_of_range(field: &str, at: Timestamp, now: Timestamp) -> Refusal {
    if at < Timestamp::EARLIEST_CALL {
        // Sent as a number or as a time, the caller sees both forms: the
        // hint fits the number, the time shows where it landed.
        return Refusal::Invalid(format!(
            "`{field}`: {at} ({} as epoch milliseconds) is before {}; sent as a number this small, \
             it looks like epoch seconds: timestamps are epoch milliseconds (multiply by 1000)",
            at.as_millis(),
            Timestamp::EARLIEST_CALL
        ));
    }
    Refusal::Invalid(format!(
        "`{field}`: {} is more than 5 minutes in the future (now is {})",
        at, now
    ))
}

#[inline]
fn check_not_before(field: &str, at: Timestamp, other_field: &str, other: Timestamp) -> Result<(), Refusal> {
    if at < other {
        return Err(out_of_order(field, at, other_field, other));
    }
    Ok(())
}

#[cold]
fn out_of_order(field: &str, at: Timestamp, other_field: &str, other: Timestamp) -> Refusal {
    Refusal::Invalid(format!("{field} {} is before {other_field} {}", at, other))
}

/// Creates a record. A record begun with a `startedAt` is executing.
///
/// # Errors
/// A timestamp more than 5 minutes in the future, a `startedAt` before the
/// `enqueuedAt`, or a non-positive `deadlineMs`.
pub fn begin(new: NewActivity, now: Timestamp, policy: &ReapPolicy) -> Result<Applied, Refusal> {
    if let Some(started) = new.started_at {
        check_not_future("startedAt", started, now)?;
    }
    let enqueued_at = match (new.enqueued_at, new.started_at) {
        (Some(at), _) => check_not_future("enqueuedAt", at, now)?,
        // Started before it says it was enqueued only because the caller's
        // clock runs behind the ledger's: it was enqueued when it started.
        (None, Some(started)) => now.min(started),
        (None, None) => now,
    };
    if let Some(started) = new.started_at {
        check_not_before("startedAt", started, "enqueuedAt", enqueued_at)?;
    }
    if let Some(deadline) = new.deadline_ms {
        if deadline <= 0 {
            return Err(Refusal::Invalid(format!(
                "deadlineMs must be a positive number of milliseconds, got {deadline}"
            )));
        }
    }
    let max_tokens = policy.estimate(new.labels.class.as_str(), new.max_tokens.map(i64::from));
    let mut record = ActivityRecord {
        activity_id: new.activity_id,
        deadline_ms: policy.effective_deadline_ms(new.labels.class.as_str(), new.deadline_ms),
        labels: new.labels,
        priority: new.priority,
        admission: new.admission,
        state: if new.started_at.is_some() {
            State::Executing
        } else {
            State::Waiting
        },
        disposition: None,
        reap_reason: None,
        owner_id: new.owner_id,
        enqueued_at,
        started_at: new.started_at,
        completed_at: None,
        reaped_at: None,
        declared_deadline_ms: new.deadline_ms,
        reapable_at: None,
        queue_wait_ms: None,
        execution_ms: None,
        success: None,
        failure_stage: None,
        late_settle: false,
        cancel_reason: None,
        refined: false,
        usage: Usage::default(),
        max_tokens,
        trace_parent: new.extras.and_then(|extras| extras.trace_parent).map(Box::new),
    };
    record.derive_durations();
    record.reapable_at = policy.reapable_at(&record);
    let mut effects: Effects = smallvec![Effect::Begun { at: enqueued_at }];
    if let (Some(at), Some(queue_wait_ms)) = (record.started_at, record.queue_wait_ms) {
        effects.push(Effect::Started { at, queue_wait_ms });
    }
    Ok(Applied { record, effects })
}

pub use super::query::is_due;

/// Whether a start would start `record`: it waits, or it was reaped
/// abandoned and would be resurrected. Anything else is executing already
/// (a start is then a no-op) or refused.
pub fn would_start(record: &ActivityRecord) -> bool {
    record.state == State::Waiting
        || (record.state == State::Reaped && record.disposition == Some(Disposition::Abandoned))
}

/// The instant a transition the caller did not stamp takes: *now*, but
/// never earlier than the record's latest instant, so that clock skew a
/// begin accepted (timestamps up to [`MAX_FUTURE_SKEW_MS`] ahead) never
/// makes a later start, settle, cancel or reap go back in time, or fail.
#[inline]
pub fn default_at(record: &ActivityRecord, now: Timestamp) -> Timestamp {
    now.max(record.started_at.unwrap_or(record.enqueued_at))
}

/// Reaps `record` when it is past its bound at `now`. Reaping is a function
/// of time: every operation calls this first, so whether a reaper pass has
/// run yet never changes the answer.
pub fn reap_if_due(record: &mut ActivityRecord, now: Timestamp) -> Option<Effect> {
    if !is_due(record, now) {
        return None;
    }
    Some(mark_reaped(record, now, ReapReason::Deadline))
}

/// Reaps an in-flight `record` because its owner's lease expired.
pub fn reap_for_owner_loss(record: &mut ActivityRecord, now: Timestamp) -> Option<Effect> {
    if !record.state.is_in_flight() {
        return None;
    }
    Some(mark_reaped(record, now, ReapReason::OwnerLost))
}

fn mark_reaped(record: &mut ActivityRecord, now: Timestamp, reason: ReapReason) -> Effect {
    let disposition = if record.state == State::Waiting {
        Disposition::Abandoned
    } else {
        Disposition::Unsettled
    };
    // The instant its bound counts from (`ReapPolicy::reapable_at`).
    let since = record.started_at.unwrap_or(record.enqueued_at);
    let bound_ms = record.reapable_at.map_or(0, |bound| bound.millis_since(since));
    record.state = State::Reaped;
    record.disposition = Some(disposition);
    record.reap_reason = Some(reason);
    record.reaped_at = Some(default_at(record, now));
    record.reapable_at = None;
    let age_ms = record.reaped_at.unwrap_or(now).millis_since(since);
    Effect::Reaped {
        disposition,
        reason,
        age_ms,
        bound_ms,
        queue_wait_ms: record.queue_wait_ms,
    }
}

/// A settle's `retryAfterMs`: a whole number of milliseconds from 1 to an
/// hour, and only with a failure (a success was not refused).
fn check_retry_after(success: bool, retry_after_ms: Option<i64>) -> Result<(), Refusal> {
    let Some(ms) = retry_after_ms else {
        return Ok(());
    };
    if success {
        return Err(Refusal::Invalid(
            "retryAfterMs is the provider's Retry-After on a refusal: it needs success false".to_owned(),
        ));
    }
    if !(1..=MAX_RETRY_AFTER_MS).contains(&ms) {
        return Err(Refusal::Invalid(format!(
            "retryAfterMs must be from 1 to {MAX_RETRY_AFTER_MS} (an hour), got {ms}"
        )));
    }
    Ok(())
}

/// Applies `transition` to `record` at `now`, in place, reaping it first if
/// it is past its bound; `effects` gains what changed.
///
/// # Errors
/// [`Refusal::Invalid`] for a bad timestamp; [`Refusal::Conflict`] for a
/// start on a settled or unsettled record, or a settle whose outcome differs
/// from the one that already landed. A refused request changes nothing it
/// asked for, but time still passed: a record past its bound is reaped all
/// the same, and `effects` then holds that reap, to be persisted.
pub fn apply(
    record: &mut ActivityRecord,
    transition: Transition,
    now: Timestamp,
    policy: &ReapPolicy,
    effects: &mut Effects,
) -> Result<(), Refusal> {
    if let Some(reaped) = reap_if_due(record, now) {
        effects.push(reaped);
    }
    match transition {
        Transition::Start { at } => {
            let at = at.unwrap_or_else(|| default_at(record, now));
            start(record, at, now, policy, effects)?;
        }
        Transition::Settle {
            success,
            failure_stage,
            at,
            retry_after_ms,
            usage,
        } => {
            check_retry_after(success, retry_after_ms)?;
            let usage = usage.checked()?;
            let outcome = if success { State::Succeeded } else { State::Failed };
            let stage = (!success).then(|| failure_stage.unwrap_or(FailureStage::Unknown));
            let at = at.unwrap_or_else(|| default_at(record, now));
            let ending = Ending {
                outcome,
                failure_stage: stage,
                reason: None,
                usage,
            };
            settle(record, ending, at, now, effects)?;
        }
        Transition::Cancel { reason, at } => {
            let ending = Ending {
                outcome: State::Cancelled,
                failure_stage: None,
                reason: sanitize_note(reason.as_deref()),
                usage: Usage::default(),
            };
            let at = at.unwrap_or_else(|| default_at(record, now));
            settle(record, ending, at, now, effects)?;
        }
    }
    // A start (or settle) stamped far enough in the past may leave the
    // record already past its bound: it is seen reaped at once.
    if let Some(reaped) = reap_if_due(record, now) {
        effects.push(reaped);
    }
    Ok(())
}

fn start(
    record: &mut ActivityRecord,
    at: Timestamp,
    now: Timestamp,
    policy: &ReapPolicy,
    effects: &mut Effects,
) -> Result<(), Refusal> {
    if !would_start(record) {
        return match (record.state, record.disposition) {
            (State::Executing, _) => Ok(()),
            (State::Reaped, _) => Err(Refusal::Conflict(format!(
                "activity {} was reaped as unsettled and cannot start again",
                record.activity_id
            ))),
            (settled, _) => Err(Refusal::Conflict(format!(
                "activity {} is already {settled} and cannot start",
                record.activity_id
            ))),
        };
    }
    // Start is proof of life: whoever starts it is still there.
    let resurrects = record.state == State::Reaped;
    // Checked before anything changes: a refusal leaves the record as it was.
    check_not_future("startedAt", at, now)?;
    check_not_before("startedAt", at, "enqueuedAt", record.enqueued_at)?;
    if resurrects {
        effects.push(Effect::Resurrected);
        record.disposition = None;
        record.reap_reason = None;
        record.reaped_at = None;
    }
    record.state = State::Executing;
    record.started_at = Some(at);
    record.derive_durations();
    record.reapable_at = policy.reapable_at(record);
    effects.push(Effect::Started {
        at,
        queue_wait_ms: record.queue_wait_ms.unwrap_or_default(),
    });
    Ok(())
}

/// How a settle or cancel ends a record.
struct Ending {
    outcome: State,
    failure_stage: Option<FailureStage>,
    reason: Option<String>,
    usage: Usage,
}

fn settle(
    record: &mut ActivityRecord,
    ending: Ending,
    at: Timestamp,
    now: Timestamp,
    effects: &mut Effects,
) -> Result<(), Refusal> {
    let Ending {
        outcome,
        failure_stage,
        reason,
        usage,
    } = ending;
    match record.state {
        State::Reaped => {
            // Neither success nor failure: absorbed, and counted once. The
            // call ran, so the tokens it reports were spent.
            if !record.late_settle {
                record.late_settle = true;
                if !usage.is_empty() {
                    record.usage = usage;
                }
                effects.push(Effect::LateSettle {
                    at: now.min(at.max(record.enqueued_at)),
                    tokens: usage.tokens(),
                });
            }
            return Ok(());
        }
        settled if settled.is_settled() => {
            if settled == outcome {
                return Ok(());
            }
            return Err(Refusal::Conflict(format!(
                "activity {} already settled as {settled}; refusing {outcome}",
                record.activity_id
            )));
        }
        _ => {}
    }
    check_not_future("completedAt", at, now)?;
    let since = record.started_at.unwrap_or(record.enqueued_at);
    check_not_before(
        "completedAt",
        at,
        if record.started_at.is_some() {
            "startedAt"
        } else {
            "enqueuedAt"
        },
        since,
    )?;
    record.state = outcome;
    record.completed_at = Some(at);
    record.reapable_at = None;
    record.derive_durations();
    record.success = match outcome {
        State::Succeeded => Some(true),
        State::Failed => Some(false),
        _ => None,
    };
    record.failure_stage = failure_stage;
    record.cancel_reason = reason;
    record.usage = usage;
    effects.push(Effect::Settled {
        at,
        state: outcome,
        execution_ms: record.execution_ms,
        queue_wait_ms: record.queue_wait_ms,
        tokens: usage.tokens(),
    });
    Ok(())
}

/// The model a refinement to `model` (already sanitized and restricted to
/// its vocabulary) gives `record`: the first refinement replaces the
/// begin's model, the same model again keeps it, and a different one folds
/// it to `unknown`, for good (as the seed's dispatch hook does, so that a
/// call is never attributed to a model that may not have served it).
pub fn refined_model(record: &ActivityRecord, model: &Arc<str>) -> Arc<str> {
    if !record.refined || *record.labels.model == **model {
        Arc::clone(model)
    } else {
        UNKNOWN.into()
    }
}

/// Refines `record` at `now` to `labels` (its labels with the model
/// [`refined_model`] chose, kept within the label limits), in place,
/// reaping it first if it is past its bound. Returns whether the record
/// changed.
///
/// # Errors
/// [`Refusal::Conflict`] when it is no longer in flight; a reap that was
/// due is then still in `effects`, to be persisted.
pub fn refine(
    record: &mut ActivityRecord,
    labels: ActivityLabels,
    now: Timestamp,
    effects: &mut Effects,
) -> Result<bool, Refusal> {
    if let Some(reaped) = reap_if_due(record, now) {
        effects.push(reaped);
    }
    if !record.state.is_in_flight() {
        return Err(Refusal::Conflict(format!(
            "activity {} is already {}: only a record in flight can be refined",
            record.activity_id, record.state
        )));
    }
    let changed = !record.refined || record.labels != labels;
    if record.labels != labels {
        record.labels = labels;
        effects.push(Effect::JoinedAggregate {
            at: default_at(record, now),
        });
    }
    record.refined = true;
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LedgerConfig;
    use crate::domain::bounds::ClassBounds;
    use std::time::Duration;

    const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);
    const MIN: i64 = 60_000;

    fn waiting(policy: &ReapPolicy) -> ActivityRecord {
        begin(NewActivity::fixture("embedding"), T0, policy)
            .unwrap()
            .record
    }

    #[test]
    fn an_executing_bound_is_the_effective_deadline_times_the_factor() {
        let classes = std::collections::BTreeMap::from([
            (
                "embedding".to_owned(),
                ClassBounds::new(Duration::from_secs(300), None).unwrap(),
            ),
            (
                "chat".to_owned(),
                ClassBounds::new(Duration::from_secs(600), Some(Duration::from_secs(900))).unwrap(),
            ),
        ]);
        let policy = ReapPolicy::new(classes, 4.0).unwrap();
        let started = |class: &str, declared: Option<i64>| {
            let new = NewActivity {
                enqueued_at: Some(T0),
                started_at: Some(T0),
                deadline_ms: declared,
                ..NewActivity::fixture(class)
            };
            begin(new, T0, &policy).unwrap().record.reapable_at
        };
        assert_eq!(started("embedding", None), Some(T0 + 4 * 300_000));
        assert_eq!(started("embedding", Some(1_000)), Some(T0 + 4 * 1_000));
        // An unconfigured class runs under the widest bound of any class.
        assert_eq!(started("batch", None), Some(T0 + 4 * 900_000));
        assert_eq!(started("batch", None), Some(T0 + policy.widest_bound_ms()));
    }

    #[test]
    fn refused_start_changes_nothing() {
        let config = LedgerConfig::default();
        let mut record = waiting(config.policy());
        let before = record.clone();
        let mut effects = Effects::new();
        let too_late = Transition::Start {
            at: Some(T0 + MAX_FUTURE_SKEW_MS + 1),
        };
        let refusal = apply(&mut record, too_late, T0, config.policy(), &mut effects).unwrap_err();
        assert!(matches!(refusal, Refusal::Invalid(_)));
        assert_eq!(record, before);
        assert!(effects.is_empty());
    }

    #[test]
    fn refused_start_past_the_bound_keeps_only_the_reap() {
        let config = LedgerConfig::default();
        let mut record = waiting(config.policy());
        let now = record.reapable_at.unwrap() + 1;
        let mut effects = Effects::new();
        let before_enqueue = Transition::Start { at: Some(T0 - MIN) };
        apply(&mut record, before_enqueue, now, config.policy(), &mut effects).unwrap_err();
        // Time passed whatever was asked: it is reaped, and nothing else.
        assert_eq!(record.state, State::Reaped);
        assert_eq!(record.disposition, Some(Disposition::Abandoned));
        assert_eq!(record.started_at, None);
        assert_eq!(
            effects.as_slice(),
            [Effect::Reaped {
                disposition: Disposition::Abandoned,
                reason: ReapReason::Deadline,
                age_ms: now.millis_since(record.enqueued_at),
                bound_ms: (now - 1).millis_since(record.enqueued_at),
                queue_wait_ms: None,
            }]
        );
    }
}
