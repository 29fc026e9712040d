//! What the server answers: the record, the snapshot, owners, reap counts.
//!
//! Fields are written in the order documented in `docs/api.md`; an unset
//! optional field is written as `null` (except [`ActivityRecord::cancel_reason`],
//! which is left out). So, with the `openapi` feature, such a field is
//! `required` (and nullable) in its schema: a client can count on the key.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::values::{
    Admission, Disposition, FailureStage, HealthStatus, OwnerState, Priority, ReapReason, SnapshotStatus,
    State, Timestamp,
};

/// One activity (a provider call) as the ledger knows it: every activity
/// route answers with it. No payload is ever part of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ActivityRecord {
    /// Its opaque id (a UUID).
    pub activity_id: String,
    /// The calling service; with `provider`, the lane `service::provider`.
    pub service: String,
    /// The provider called.
    pub provider: String,
    /// The deadline class its bounds derive from.
    pub class: String,
    /// The caller's stage.
    pub operation_stage: String,
    /// The model, or `unknown`, or `redacted`.
    pub model: String,
    /// The caller's priority.
    pub priority: Priority,
    /// `queued` (counts in its lane) or `direct` (observed only).
    pub admission: Admission,
    /// Where it is in its life.
    pub state: State,
    /// How it leaked, when reaped.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub disposition: Option<Disposition>,
    /// Why it was reaped, when reaped.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub reap_reason: Option<ReapReason>,
    /// The owner it belongs to, as given at begin.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub owner_id: Option<String>,
    /// When it was enqueued.
    pub enqueued_at: Timestamp,
    /// When it started executing.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub started_at: Option<Timestamp>,
    /// When it settled.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub completed_at: Option<Timestamp>,
    /// When it was reaped.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub reaped_at: Option<Timestamp>,
    /// The effective execution deadline: its own, else its class's.
    pub deadline_ms: i64,
    /// While in flight, the instant past which it is reaped.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub reapable_at: Option<Timestamp>,
    /// `startedAt - enqueuedAt`, once started.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub queue_wait_ms: Option<i64>,
    /// `completedAt - startedAt`, once settled after a start.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub execution_ms: Option<i64>,
    /// `true` or `false` once succeeded or failed; unset in flight, cancelled
    /// or reaped.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub success: Option<bool>,
    /// Where a failure happened.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub failure_stage: Option<FailureStage>,
    /// A settle or cancel arrived after it was reaped.
    pub late_settle: bool,
    /// It was settled with success without ever starting: not a normal
    /// completion (`success` and no `startedAt`; absent, as `false`, from
    /// older servers).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub unstarted_success: bool,
    /// A refinement set its model: `model` is then the one its call was
    /// dispatched to, or `unknown` when dispatches named different ones.
    /// (Absent, as `false`, from servers older than refinement.)
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub refined: bool,
    /// Input tokens its settle reported; unset when it reported none.
    /// (Absent, as unset, from servers older than usage.)
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(required = true, minimum = 0, maximum = 1_000_000_000)
    )]
    pub input_tokens: Option<i64>,
    /// Output tokens its settle reported, likewise.
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(required = true, minimum = 0, maximum = 1_000_000_000)
    )]
    pub output_tokens: Option<i64>,
    /// The tokens it was estimated to spend: its begin's `maxTokens`, else
    /// its class's `tokens`; unset when neither. (Absent, as unset, from
    /// servers older than estimates.)
    #[serde(default)]
    #[cfg_attr(
        feature = "openapi",
        schema(required = true, minimum = 0, maximum = 1_000_000_000)
    )]
    pub max_tokens: Option<i64>,
    /// Why the caller cancelled, when it said so (redacted like models);
    /// left out of the JSON when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel_reason: Option<String>,
    /// The W3C `traceparent` its begin carried (version `00`), whose span
    /// is the parent of the record's exported span; left out of the JSON
    /// when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = "^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
    )]
    pub traceparent: Option<String>,
    /// On a begin's answer only: the top-level fields of the request this
    /// server does not know, and so ignored (a misspelled `clas`, or a
    /// field of a newer API); at most 16 names, each cut to 64 characters.
    /// Left out of the JSON when there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ignored_fields: Vec<String>,
}

/// The most field names a begin's answer lists in `ignoredFields`.
pub const MAX_IGNORED_FIELDS: usize = 16;
/// The most characters of a field name `ignoredFields` keeps.
pub const MAX_IGNORED_FIELD_CHARS: usize = 64;

/// An in-flight record in the snapshot: the record and its age.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct InFlightRecord {
    /// The record, its fields inline.
    #[serde(flatten)]
    pub record: ActivityRecord,
    /// How long ago it was enqueued (the snapshot's `at - enqueuedAt`).
    pub elapsed_ms: i64,
}

/// A reaped record in the snapshot: the record and its age.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReapedRecord {
    /// The record, its fields inline.
    #[serde(flatten)]
    pub record: ActivityRecord,
    /// How long ago it was enqueued (the snapshot's `at - enqueuedAt`).
    pub age_ms: i64,
}

/// Counts of reaped records by disposition: `POST /v1/reap`'s answer, and
/// part of lanes, aggregates and the snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReapCounts {
    /// Never started.
    pub abandoned: i64,
    /// Started, never settled.
    pub unsettled: i64,
}

impl ReapCounts {
    /// Both dispositions together.
    pub fn total(&self) -> i64 {
        self.abandoned + self.unsettled
    }
}

/// One lane of native admission, over its `queued` records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Lane {
    /// The calling service.
    pub service: String,
    /// The provider.
    pub provider: String,
    /// The enforced cap, or unset when none is declared.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub cap: Option<u32>,
    /// Records executing.
    pub executing: i64,
    /// Records waiting.
    pub waiting: i64,
    /// Records that ended reaped, ever, by disposition.
    pub reaped: ReapCounts,
    /// Of those, records reaped because their owner's lease ran out.
    pub reaped_owner_lost: i64,
    /// Settles absorbed after a reap.
    pub late_settles: i64,
    /// Abandoned records started after all.
    pub resurrections: i64,
    /// How long its oldest waiting record has waited (`0` when none waits).
    pub longest_wait_ms: i64,
    /// The cap in force: `cap`, or an adaptive lane's cap lowered by a
    /// provider's refusals; unset when none is declared.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub effective_cap: Option<u32>,
    /// While the lane cools down after a provider's `Retry-After`: when it
    /// grants again. Unset otherwise.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub cooling_until: Option<Timestamp>,
    /// Cooldowns the lane ever began.
    pub cooldowns: i64,
    /// Executing and waiting records by `priority`.
    pub by_priority: ByPriority,
    /// The tokens its calls reported in the last minute, by the second of
    /// their settle (so a call counts at most a second longer); late
    /// settles count at their record's `reapedAt`. (Absent, as 0, from
    /// servers older than usage.)
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub tokens_last_minute: i64,
    /// The `maxTokens` estimates of its calls executing. (Absent, as 0,
    /// from servers older than estimates.)
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub tokens_reserved: i64,
    /// The lane's own token budget (`tokens_per_minute`); `null` when it
    /// has none. (Absent, as `null`, from servers older than budgets.)
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub tokens_per_minute: Option<u32>,
    /// Its provider's token budget, shared by every lane of the provider;
    /// `null` when it has none.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub provider_tokens_per_minute: Option<u32>,
}

/// A lane's executing and waiting records by `priority`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ByPriority {
    /// `interactive`.
    pub interactive: PriorityCounts,
    /// `batch`.
    pub batch: PriorityCounts,
    /// `unknown` (ranked with batch work).
    pub unknown: PriorityCounts,
}

impl ByPriority {
    /// The counts of `priority`.
    pub fn of_mut(&mut self, priority: Priority) -> &mut PriorityCounts {
        match priority {
            Priority::Interactive => &mut self.interactive,
            Priority::Batch => &mut self.batch,
            Priority::Unknown => &mut self.unknown,
        }
    }
}

/// Executing and waiting records of one priority on a lane.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PriorityCounts {
    /// Records executing.
    pub executing: i64,
    /// Records waiting in line.
    pub waiting: i64,
}

/// The counters of one combination of service, stage, class, provider,
/// model, priority and admission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Aggregate {
    /// The calling service.
    pub service: String,
    /// The caller's stage.
    pub operation_stage: String,
    /// The deadline class.
    pub class: String,
    /// The provider.
    pub provider: String,
    /// The model (sanitized).
    pub model: String,
    /// The priority.
    pub priority: Priority,
    /// Queued, direct or external.
    pub admission: Admission,
    /// Records begun.
    pub calls: i64,
    /// Settled with success.
    pub successes: i64,
    /// Of those, settled with success without ever starting (absent from
    /// older servers: 0).
    #[cfg_attr(feature = "openapi", schema(required = true))]
    #[serde(default)]
    pub successes_unstarted: i64,
    /// Settled with failure.
    pub failures: i64,
    /// Cancelled by the caller.
    pub cancelled: i64,
    /// Reaped, by disposition.
    pub reaped: ReapCounts,
    /// Late settles absorbed.
    pub late_settles: i64,
    /// In flight now.
    pub in_flight: i64,
    /// Average queue wait in milliseconds, when any record started.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub avg_queue_wait_ms: Option<i64>,
    /// Longest queue wait in milliseconds, when any record started.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub max_queue_wait_ms: Option<i64>,
    /// Average execution time in milliseconds, when any record settled after
    /// a start.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub avg_execution_ms: Option<i64>,
    /// Longest execution time in milliseconds, likewise.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub max_execution_ms: Option<i64>,
    /// Its last caller-observed event.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub last_seen_at: Option<Timestamp>,
    /// Input tokens reported by the calls that ended here, late settles
    /// included. (Absent, as 0, from servers older than usage.)
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub input_tokens: i64,
    /// Output tokens, likewise.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub output_tokens: i64,
}

/// A registered owner and its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Owner {
    /// Its id (a UUID, lowercase with hyphens).
    pub owner_id: String,
    /// Its label.
    pub name: String,
    /// Its lease's time-to-live, in milliseconds.
    pub ttl_ms: i64,
    /// When it registered.
    pub registered_at: Timestamp,
    /// When it last renewed.
    pub renewed_at: Timestamp,
    /// When its lease runs out unless renewed; it is lost strictly after.
    pub expires_at: Timestamp,
    /// Live, lost or released.
    pub state: OwnerState,
    /// When it was lost or released.
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub ended_at: Option<Timestamp>,
    /// Records its loss reaped.
    pub reaped_records: i64,
    /// Records its release cancelled.
    pub cancelled_records: i64,
}

/// `GET /v1/snapshot`: the ledger as operators read it, reaped first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// `ok`, or `degraded` when records were reaped within the window.
    pub status: SnapshotStatus,
    /// When it was taken.
    pub at: Timestamp,
    /// The start of the history window.
    pub since: Timestamp,
    /// Lanes keyed `service::provider`, over `queued` records.
    pub native_admission: BTreeMap<String, Lane>,
    /// Records ever begun.
    pub total_activities: i64,
    /// Records ever settled as succeeded (absent from older servers: 0).
    #[cfg_attr(feature = "openapi", schema(required = true))]
    #[serde(default)]
    pub total_succeeded: i64,
    /// Of those, records settled as succeeded that never started: not a
    /// normal completion (absent from older servers: 0).
    #[cfg_attr(feature = "openapi", schema(required = true))]
    #[serde(default)]
    pub total_succeeded_unstarted: i64,
    /// Records ever settled as failed (absent from older servers: 0).
    #[cfg_attr(feature = "openapi", schema(required = true))]
    #[serde(default)]
    pub total_failed: i64,
    /// Records ever cancelled by their caller (absent from older servers: 0).
    #[cfg_attr(feature = "openapi", schema(required = true))]
    #[serde(default)]
    pub total_cancelled: i64,
    /// Records in flight now, queued and direct.
    pub total_in_flight: i64,
    /// Completions within the window.
    pub total_recent_completions: i64,
    /// Records that ended reaped, ever.
    pub total_reaped: i64,
    /// Of those, records reaped because their owner's lease ran out.
    pub total_reaped_owner_lost: i64,
    /// Settles absorbed after a reap, ever.
    pub total_late_settles: i64,
    /// Abandoned records started after all, ever.
    pub total_resurrections: i64,
    /// What this read's own reap found past its bound.
    pub reaped_this_read: ReapCounts,
    /// In-flight records, oldest first.
    pub in_flight: Vec<InFlightRecord>,
    /// Records settled within the window, newest first.
    pub recent_completions: Vec<ActivityRecord>,
    /// Records reaped within the window, newest first.
    pub reaped: Vec<ReapedRecord>,
    /// More in-flight records exist than listed.
    pub in_flight_truncated: bool,
    /// More completions exist than listed.
    pub recent_completions_truncated: bool,
    /// More reaped records exist than listed.
    pub reaped_truncated: bool,
    /// Counters per aggregate, for those in flight or seen within the window.
    pub aggregates: Vec<Aggregate>,
    /// Every live owner, and the owners lost or released within the window.
    pub owners: Vec<Owner>,
    /// What the server's configuration and the calls within the window do
    /// not match, for an operator to fix; empty when none (absent from
    /// older servers: empty).
    #[cfg_attr(feature = "openapi", schema(required = true))]
    #[serde(default)]
    pub warnings: Vec<SnapshotWarning>,
}

/// A warning of the snapshot: a stable `code` and a human `message`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotWarning {
    /// What kind: `lane_unused_near_miss` (a configured lane has no calls
    /// while a lane one or two edits away has: one of them is most likely
    /// misspelled) or `unknown_class` (calls of a class the configuration
    /// does not know, which get the widest bound). A client should show a
    /// code it does not know as it shows any other.
    pub code: String,
    /// What, and what to check.
    pub message: String,
}

impl Snapshot {
    /// The lane keyed `service::provider`, if it shows one.
    pub fn lane(&self, key: &str) -> Option<&Lane> {
        self.native_admission.get(key)
    }
}

/// `GET /healthz`'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// Always `ok`.
    pub status: HealthStatus,
}
