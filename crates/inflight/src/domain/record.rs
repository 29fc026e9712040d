//! Activity records and their states.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::labels::{ActivityLabels, Label, LabelSet};
use super::timestamp::Timestamp;
use super::trace::TraceParent;
use super::usage::Usage;
use super::ParseError;

/// The opaque identity of one activity (one provider call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ActivityId(Uuid);

impl ActivityId {
    /// The UUIDv7 of `millis`, `counter` (12 bits) and `random`: the
    /// counter follows the millisecond (RFC 9562, section 6.2, method 1),
    /// and 62 random bits follow it. [`ActivityId::new`] (`ids.rs`) takes
    /// the millisecond and counter from the clock, so the domain reads none.
    pub(crate) fn from_parts(millis: u64, counter: u16, random: [u8; 8]) -> Self {
        let mut tail = [0_u8; 10];
        // The builder overwrites the version nibble above the counter's top
        // four bits, and the variant bits above the random ones.
        tail[0] = (counter >> 8) as u8;
        tail[1] = counter as u8;
        tail[2..].copy_from_slice(&random);
        Self(uuid::Builder::from_unix_timestamp_millis(millis, &tail).into_uuid())
    }

    /// The UUID itself.
    #[cfg(test)]
    pub(crate) fn as_uuid(&self) -> &Uuid {
        &self.0
    }

    /// The smallest identity, for range bounds.
    pub(crate) fn nil_min() -> Self {
        Self(Uuid::nil())
    }
}

impl fmt::Display for ActivityId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for ActivityId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(Self)
    }
}

// The small string enums records are made of are the wire's own, defined
// once in `inflight-api` with their names, parsing and classification.
pub use inflight_api::{Admission, Disposition, FailureStage, Priority, ReapReason, State};

/// One activity: a provider call as the ledger knows it. No payload (prompt,
/// text, vectors) is ever part of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ActivityRecord {
    /// Opaque identity.
    pub activity_id: ActivityId,
    /// Its labels: service, provider, class, stage and model.
    #[serde(flatten)]
    pub labels: ActivityLabels,
    /// The caller's priority.
    pub priority: Priority,
    /// Whether it counts in native admission.
    pub admission: Admission,
    /// Its state.
    pub state: State,
    /// How it leaked, when reaped.
    pub disposition: Option<Disposition>,
    /// Why it was reaped, when reaped.
    pub reap_reason: Option<ReapReason>,
    /// The owner (process lease) it belongs to, if any.
    pub owner_id: Option<String>,
    /// When it was enqueued.
    pub enqueued_at: Timestamp,
    /// When it started executing.
    pub started_at: Option<Timestamp>,
    /// When it settled.
    pub completed_at: Option<Timestamp>,
    /// When it was reaped.
    pub reaped_at: Option<Timestamp>,
    /// The deadline it declared itself, if any.
    #[serde(skip)]
    pub declared_deadline_ms: Option<i64>,
    /// The effective execution deadline: its own, else its class's.
    pub deadline_ms: i64,
    /// While in flight: the instant past which it is reaped.
    pub reapable_at: Option<Timestamp>,
    /// `startedAt - enqueuedAt`, once started.
    pub queue_wait_ms: Option<i64>,
    /// `completedAt - startedAt`, once settled after a start.
    pub execution_ms: Option<i64>,
    /// The settled outcome; `null` while in flight, when cancelled or reaped.
    pub success: Option<bool>,
    /// Where a failure happened.
    pub failure_stage: Option<FailureStage>,
    /// A settle or cancel arrived after it was reaped.
    pub late_settle: bool,
    /// Why the caller cancelled, when it said so (redacted like model names).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cancel_reason: Option<String>,
    /// A refinement set its model (`model` is then the one it was
    /// dispatched to, or `unknown` when dispatches named different ones).
    pub refined: bool,
    /// The tokens its settle reported (`inputTokens`, `outputTokens`).
    #[serde(flatten)]
    pub usage: Usage,
    /// The tokens it was estimated to spend: its begin's `maxTokens`, else
    /// its class's `tokens` ([`ReapPolicy::estimate`](super::bounds::ReapPolicy::estimate)).
    /// Executing, it reserves them in its lane's token window; ended
    /// without reported usage after running, it charges them.
    pub max_tokens: Option<i64>,
    /// The caller's trace context, when its begin carried one: the span
    /// exported when the record ends is a child of that span. Boxed: most
    /// records have none.
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "trace_text")]
    pub trace_parent: Option<Box<TraceParent>>,
}

/// A trace context in its header form.
fn trace_text<S: serde::Serializer>(parent: &Option<Box<TraceParent>>, out: S) -> Result<S::Ok, S::Error> {
    match parent {
        Some(parent) => out.collect_str(parent),
        None => out.serialize_none(),
    }
}

impl ActivityRecord {
    /// The queue wait (`startedAt - enqueuedAt`) and execution time
    /// (`completedAt - startedAt`) its instants imply, the one definition of
    /// `queueWaitMs` and `executionMs`; `None` when one overflows.
    #[allow(clippy::option_option)]
    pub fn implied_durations(&self) -> Option<(Option<i64>, Option<i64>)> {
        let queue_wait = match self.started_at {
            Some(started) => Some(started.as_millis().checked_sub(self.enqueued_at.as_millis())?),
            None => None,
        };
        let execution = match (self.started_at, self.completed_at) {
            (Some(started), Some(completed)) => Some(completed.as_millis().checked_sub(started.as_millis())?),
            _ => None,
        };
        Some((queue_wait, execution))
    }

    /// Sets `queue_wait_ms` and `execution_ms` from the instants (to `None`
    /// in the overflow no accepted timestamp can reach).
    pub fn derive_durations(&mut self) {
        (self.queue_wait_ms, self.execution_ms) = self.implied_durations().unwrap_or_default();
    }

    /// The `service::provider` lane it belongs to.
    pub fn lane(&self) -> LaneKey {
        LaneKey::of(&self.labels)
    }
}

/// A `service::provider` lane.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LaneKey {
    /// The calling service.
    pub service: Label,
    /// The provider.
    pub provider: Label,
}

impl LaneKey {
    /// The lane of a call with `labels`.
    pub fn of(labels: &LabelSet) -> Self {
        Self {
            service: labels.service.clone(),
            provider: labels.provider.clone(),
        }
    }

    /// Parses `"service::provider"`.
    ///
    /// # Errors
    /// Says what is wrong when the separator is missing or either side is
    /// not a valid label.
    pub fn parse(key: &str) -> Result<Self, ParseError> {
        let (service, provider) = key
            .split_once("::")
            .ok_or_else(|| ParseError::new(key, "of the form \"service::provider\""))?;
        let label = |name, value| {
            Label::new(name, value).map_err(|err| ParseError::new(key, format!("a lane ({err})")))
        };
        Ok(Self {
            service: label("service", service)?,
            provider: label("provider", provider)?,
        })
    }
}

impl fmt::Display for LaneKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}::{}", self.service, self.provider)
    }
}
