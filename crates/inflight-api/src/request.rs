//! What a client sends: request bodies and query strings.
//!
//! Bodies are JSON objects. Unknown fields are ignored, so older servers
//! accept newer clients, and a field set to `null` is the same as a missing
//! one. Serializing leaves out every field that is not set.
//!
//! With the `openapi` feature, the schemas carry the bounds the server
//! checks that a schema can say (the label pattern, `ttlMs`, `deadlineMs`,
//! `limit`); the rest (the 5-minute skew, a `startedAt` before
//! `enqueuedAt`, `wait` and `since` as durations) the server answers with a
//! 400 naming the field, as `docs/api.md` says.

use serde::{Deserialize, Serialize};

use crate::values::{whole_number, Admission, FailureStage, Priority, Timestamp};

/// `POST /v1/activities`: begins a record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BeginRequest {
    /// The calling service: a label, required.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9._-]{1,64}$"))]
    pub service: String,
    /// The provider called: a label, required.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9._-]{1,64}$"))]
    pub provider: String,
    /// The deadline class its bounds derive from: a label (default `unknown`,
    /// which gets the widest class's deadline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9._-]{1,64}$"))]
    pub class: Option<String>,
    /// The caller's stage: a label (default `unknown`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9._-]{1,64}$"))]
    pub operation_stage: Option<String>,
    /// The model: free text, kept only when it looks like a model identifier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The caller's priority (default `unknown`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// Queued (the default) or direct.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<Admission>,
    /// When it was enqueued (default: now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::values::timestamp_input))]
    pub enqueued_at: Option<Timestamp>,
    /// When it started: the record is begun already executing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::values::timestamp_input))]
    pub started_at: Option<Timestamp>,
    /// The call's own execution deadline, in milliseconds (positive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub deadline_ms: Option<i64>,
    /// The `ownerId` of a registered, live owner, as registration returned it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_id: Option<String>,
    /// The tokens the call is estimated to spend, prompt and answer, 0 to
    /// 1,000,000,000: executing, it reserves them in its lane's token
    /// window; ended without reported usage after running, it charges
    /// them. Default: its class's `tokens`, else none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 1_000_000_000))]
    pub max_tokens: Option<i64>,
}

impl BeginRequest {
    /// A call from `service` to `provider`, every other field unset.
    pub fn new(service: impl Into<String>, provider: impl Into<String>) -> Self {
        Self {
            service: service.into(),
            provider: provider.into(),
            ..Self::default()
        }
    }
}

/// `POST /v1/activities/{id}/start`; an empty body is the same as `{}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StartRequest {
    /// When it started (default: now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::values::timestamp_input))]
    pub started_at: Option<Timestamp>,
}

/// `POST /v1/activities/{id}/settle`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SettleRequest {
    /// Whether the call succeeded: `true` or `false`, required.
    pub success: bool,
    /// Where a failure happened (default `unknown` for a failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_stage: Option<FailureStage>,
    /// When it completed (default: now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::values::timestamp_input))]
    pub completed_at: Option<Timestamp>,
    /// A failure the provider refused (429, 503) with `Retry-After`: its
    /// value in milliseconds, 1 to 3,600,000. The lane grants no new slot
    /// until `completedAt` plus it, at most the lane's `max_cooldown`.
    /// Only with `success: false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 3_600_000))]
    pub retry_after_ms: Option<i64>,
    /// The tokens the call spent, as the provider reported them; with a
    /// success or a failure, and counted on a late settle too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// The tokens a call spent. Each count is a whole number from 0 to
/// 1,000,000,000; one not given stays unset. Another field is refused (a
/// 400 naming it), so that a misspelled count is never silently lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Usage {
    /// Tokens of the prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 1_000_000_000))]
    pub input_tokens: Option<i64>,
    /// Tokens of the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 1_000_000_000))]
    pub output_tokens: Option<i64>,
}

/// `POST /v1/activities/{id}/cancel`; an empty body is the same as `{}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CancelRequest {
    /// Why the caller cancelled (kept only when it carries no credential,
    /// endpoint or path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `POST /v1/activities/{id}/refine`: the model the call was dispatched to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RefineRequest {
    /// The model, required and not empty; redacted and kept within the
    /// label limits as a begin's is.
    pub model: String,
}

/// `POST /v1/owners`: registers an owner with a lease.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RegisterOwnerRequest {
    /// What the owner calls itself: a label, required.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9._-]{1,64}$"))]
    pub name: String,
    /// The lease's time-to-live in milliseconds, 100 to 3600000 (default
    /// 30000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 100, maximum = 3_600_000))]
    pub ttl_ms: Option<i64>,
}

/// The query string of `POST /v1/activities`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
pub struct BeginQuery {
    /// `now`: begin the record started, stamped with the server's clock (do
    /// not send `startedAt` with it). On a capped lane this is an admission
    /// decision. Unset: the record is begun as the body says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", param(example = "now"))]
    pub start: Option<String>,
    /// With `start=now`: how long to hold the request for the record's turn
    /// on a full lane, a duration (`500ms`, `5s`) of at most `30s`. When it
    /// ends first the record is cancelled and the answer is 429. Unset:
    /// answer at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", param(example = "5s"))]
    pub wait: Option<String>,
}

/// The query string of `POST /v1/activities/{id}/start`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
pub struct StartQuery {
    /// How long to hold the request for the record's turn on a full lane: a
    /// duration (`500ms`, `5s`), at most `30s`. Unset: answer at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", param(example = "5s"))]
    pub wait: Option<String>,
}

/// The query string of `GET /v1/snapshot`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
pub struct SnapshotQuery {
    /// Records listed per section, 1 to 10000 (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "whole_number")]
    #[cfg_attr(feature = "openapi", param(minimum = 1, maximum = 10000))]
    pub limit: Option<u32>,
    /// The start of the history window for completions and reaps: a duration
    /// before now (`90m`, `24h`) or an RFC 3339 time (default `24h`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", param(example = "24h"))]
    pub since: Option<String>,
}
