//! Activity records and their states.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::labels::{ActivityLabels, Label};
use super::timestamp::Timestamp;
use super::ParseError;

/// The opaque identity of one activity (one provider call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ActivityId(Uuid);

impl ActivityId {
    /// A fresh identity: a UUIDv7, random but ordered by creation time, so
    /// that records begun together sit together in a store's B-trees and a
    /// group commit writes a few pages rather than one page per record.
    ///
    /// Within this process ids are strictly increasing, so records begun in
    /// the same millisecond keep their order: a 12-bit counter follows the
    /// millisecond (RFC 9562, section 6.2, method 1), and 62 random bits
    /// follow the counter.
    pub fn new() -> Self {
        let (millis, counter) = id_clock::next();
        let random = *Uuid::new_v4().as_bytes();
        let mut tail = [0_u8; 10];
        // The builder overwrites the version nibble above the counter's top
        // four bits, and the variant bits above the random ones.
        tail[0] = (counter >> 8) as u8;
        tail[1] = counter as u8;
        tail[2..].copy_from_slice(&random[8..]);
        Self(uuid::Builder::from_unix_timestamp_millis(millis, &tail).into_uuid())
    }

    /// The smallest identity, for range bounds.
    pub(crate) fn nil_min() -> Self {
        Self(Uuid::nil())
    }
}

/// The millisecond and counter of the next identity.
///
/// `uuid`'s own `Uuid::now_v7` would keep ids ordered within the process
/// too (a counter in one process-wide context), but it reads the precise
/// clock, takes a mutex and does 128-bit arithmetic for every id: measured
/// at b02b459, a lifecycle of `memory_lifecycle` ran 5,244 instructions with
/// it instead of 4,866 (7.8 % more), and 7 to 12 % more wall-clock time. So
/// this counter stays (docs/performance.md, "Tricks measured").
mod id_clock {
    use std::sync::atomic::{AtomicU64, Ordering};

    /// The last `(millisecond << 12) | counter` handed out.
    static LAST: AtomicU64 = AtomicU64::new(0);

    const COUNTER_BITS: u32 = 12;

    /// A millisecond no earlier than the last one handed out, and a counter
    /// that orders ids within it. 4,096 ids in one millisecond run the
    /// millisecond ahead by one rather than break the order.
    pub(super) fn next() -> (u64, u16) {
        let floor = wall_millis() << COUNTER_BITS;
        let previous = LAST
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                Some(floor.max(last + 1))
            })
            .unwrap_or_else(|last| last);
        let stamp = floor.max(previous + 1);
        (stamp >> COUNTER_BITS, (stamp & ((1 << COUNTER_BITS) - 1)) as u16)
    }

    /// The wall clock to a clock tick, which is all an id's order needs.
    fn wall_millis() -> u64 {
        let millis = crate::clock::wall_millis(crate::clock::Precision::Tick);
        u64::try_from(millis).unwrap_or(0)
    }
}

impl Default for ActivityId {
    fn default() -> Self {
        Self::new()
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
        LaneKey {
            service: self.labels.service.clone(),
            provider: self.labels.provider.clone(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_increase_strictly_even_past_4096_in_one_millisecond() {
        let ids: Vec<ActivityId> = (0..20_000).map(|_| ActivityId::new()).collect();
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]));
    }

    #[test]
    fn ids_are_uuidv7_stamped_with_the_wall_clock() {
        let before = wall_millis();
        let id = ActivityId::new();
        let after = wall_millis();
        assert_eq!(id.0.get_version_num(), 7);
        assert_eq!(id.0.get_variant(), uuid::Variant::RFC4122);
        let (secs, nanos) = id.0.get_timestamp().expect("a v7 timestamp").to_unix();
        let millis = secs * 1_000 + u64::from(nanos) / 1_000_000;
        // The coarse clock may lag by a tick; a burst may run ahead by a few.
        assert!(
            millis + 100 >= before && millis <= after + 100,
            "{millis} vs {before}..{after}"
        );
    }

    fn wall_millis() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }
}
