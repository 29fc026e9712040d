//! The route handlers: read the request as its wire type, call the ledger,
//! answer with the wire type of what it returned.

use std::time::Duration;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::Json;

use super::auth::check_service;
use super::auth::Grant;
use super::body::{parse_wait, NotingBody, OptionalBody, QueryString, RequiredBody};
use super::error::ApiError;
use super::AppState;
use inflight::domain::owner::{self, OwnerId, DEFAULT_TTL_MS};
use inflight::domain::record::ActivityId;
use inflight::domain::snapshot::{Since, SnapshotOptions};
use inflight::domain::trace::TraceParent;
use inflight::error::LedgerError;
use inflight::wire::{self as convert, ToApi};
use inflight_api as api;

type Answer<T> = Result<T, ApiError>;

/// About the size of a record's JSON, so that writing it takes one buffer:
/// axum's `Json` starts at 128 bytes and grew three times for a record, a
/// quarter of the cost of the answer (docs/performance.md, "HTTP").
const RECORD_JSON_BYTES: usize = 1024;

/// A record as the JSON body of an answer.
pub(super) struct RecordJson(api::ActivityRecord);

impl IntoResponse for RecordJson {
    fn into_response(self) -> axum::response::Response {
        json_in(self.0, RECORD_JSON_BYTES)
    }
}

/// A snapshot's answer, written into one buffer of about its size: a
/// default snapshot is about 110 kB, which axum's `Json` reached by
/// doubling from 128 bytes, ten copies.
pub(super) struct SnapshotJson(api::Snapshot);

impl IntoResponse for SnapshotJson {
    fn into_response(self) -> axum::response::Response {
        let snapshot = &self.0;
        let records = snapshot.in_flight.len() + snapshot.recent_completions.len() + snapshot.reaped.len();
        let rest = snapshot.aggregates.len() + snapshot.owners.len() + snapshot.native_admission.len();
        json_in(self.0, 4096 + records * RECORD_JSON_BYTES + rest * 512)
    }
}

/// `value` as a JSON answer written into one buffer of `bytes` to start.
fn json_in<T: serde::Serialize>(value: T, bytes: usize) -> axum::response::Response {
    let mut body = Vec::with_capacity(bytes);
    match serde_json::to_writer(&mut body, &value) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        // Cannot happen (an answer is strings, numbers and booleans);
        // axum's own answer to a failed serialization, if it did.
        Err(_) => Json(value).into_response(),
    }
}

/// The `{id}` of an activity route, for the OpenAPI document.
#[derive(utoipa::IntoParams)]
#[into_params(names("id"), parameter_in = Path)]
#[allow(dead_code)]
struct ActivityIdParam(
    /// The activity's id (a UUID, as `activityId` gives it).
    #[param(pattern = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")]
    String,
);

/// The `{id}` of an owner route, for the OpenAPI document.
#[derive(utoipa::IntoParams)]
#[into_params(names("id"), parameter_in = Path)]
#[allow(dead_code)]
struct OwnerIdParam(
    /// The owner's id (a UUID, as `ownerId` gives it).
    #[param(pattern = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")]
    String,
);

/// `GET /healthz`.
#[utoipa::path(get, path = "/healthz", operation_id = "healthz", tag = "meta",
    summary = "Whether the server answers; never behind the token",
    responses((status = 200, description = "The server answers", body = api::Health)))]
pub(super) async fn healthz() -> Json<api::Health> {
    Json(api::Health {
        status: api::HealthStatus::Ok,
    })
}

/// Refuses an action on record `id` when the request's token is bound to
/// services and the record belongs to another. A record's service never
/// changes, so reading it first leaves no window; the read is paid only by
/// bound tokens.
async fn check_record(state: &AppState, grant: &Grant, id: ActivityId, route: &str) -> Answer<()> {
    if !grant.is_bound() {
        return Ok(());
    }
    let record = state.ledger().get(id).await?;
    check_service(grant, record.labels.service.as_str(), route)
}

/// The activity id in the path.
fn activity_id(path: Result<Path<String>, PathRejection>) -> Answer<ActivityId> {
    let Path(raw) = path.map_err(|rejection| ApiError::invalid(format!("bad path: {rejection}")))?;
    raw.parse()
        .map_err(|_| ApiError::invalid(format!("{raw:?} is not an activity id (a UUID)")))
}

/// `POST /v1/activities[?start=now[&wait=DURATION]]`.
#[utoipa::path(post, path = "/v1/activities", operation_id = "beginActivity", tag = "activities",
    summary = "Begin a record, or begin it started (`?start=now`)",
    description = "A record begun without `startedAt` is `waiting` and never refused for capacity; \
        one begun with `startedAt` is `executing`, an admission decision on a capped lane. \
        With `start=now`, the server stamps the start with its own clock; with `wait` too, the request \
        holds until the lane admits the record or the wait ends (then the record is cancelled and the \
        answer is 429): a lifecycle in two requests, this one and the settle.",
    params(api::BeginQuery,
        ("Idempotency-Key" = Option<String>, Header, description = "1 to 255 printable ASCII characters. A repeat \
            with the same key and the same request (fields, `start` and `wait`) answers 200 with the record the \
            first made, as it stands now, and records nothing; with `start=now&wait=` a repeat whose record still \
            waits waits for it. The same key with a different request is 409 `idempotency_conflict`. Keys are \
            kept as long as their records."),
        ("traceparent" = Option<String>, Header, description = "A W3C trace context \
            (`00-<trace id>-<span id>-<flags>`): kept with the record, whose span `[otel]` exports when it ends as \
            a child of this span. Not part of an idempotent begin's request. A malformed one is 400.")),
    request_body = api::BeginRequest,
    responses(
        (status = 200, description = "A repeat of a begin with the same `Idempotency-Key`: the record the first \
            made, as it stands now (it may have ended)", body = api::ActivityRecord,
            headers(("Idempotent-Replayed" = String, description = "`true`"))),
        (status = 201, description = "The record begun (`executing` with `start=now`)", body = api::ActivityRecord,
            headers(("Location" = String, description = "`/v1/activities/{id}`")),
            links(
                ("getActivity" = (operation_id = "getActivity", parameters(("id" = "$response.body#/activityId")))),
                ("startActivity" = (operation_id = "startActivity", parameters(("id" = "$response.body#/activityId")))),
                ("settleActivity" = (operation_id = "settleActivity", parameters(("id" = "$response.body#/activityId")))),
                ("cancelActivity" = (operation_id = "cancelActivity", parameters(("id" = "$response.body#/activityId")))),
                ("refineActivity" = (operation_id = "refineActivity", parameters(("id" = "$response.body#/activityId")))),
            )),
        (status = 400, description = "A missing or invalid field, label, timestamp or `ownerId`; a bad `start` or \
            `wait`, `wait` without `start=now`, or `startedAt` with `start=now`", body = api::ErrorBody),
        (status = 409, description = "The owner is lost or released (`conflict`), or the `Idempotency-Key` was \
            first sent with a different request (`idempotency_conflict`)", body = api::ErrorBody),
        (status = 429, description = "Begun started on a lane at its cap (after the `wait`, if any). Nothing holds \
            a slot or a place in line: without `wait` nothing is recorded; after a `wait` the record is \
            recorded `cancelled`", body = api::ErrorBody,
            headers(("Retry-After" = String, description = "`1`: a hint, capacity may come back sooner"))),
    ))]
pub(super) async fn begin(
    State(state): State<AppState>,
    grant: Grant,
    QueryString(query): QueryString<api::BeginQuery>,
    headers: HeaderMap,
    NotingBody(request, ignored_fields): NotingBody<api::BeginRequest>,
) -> Answer<impl IntoResponse> {
    check_service(&grant, &request.service, "POST /v1/activities")?;
    let start_now = begin_starts_now(&query, &request)?;
    let key = idempotency_key(&headers)?;
    let parent = trace_parent(&headers)?;
    let mut spec = convert::activity_spec(request);
    if let Some(key) = key {
        spec = spec.idempotency_key(key);
    }
    if let Some(parent) = parent {
        spec = spec.trace_parent(parent);
    }
    let begun = state.ledger().begin_idempotent(spec, start_now).await?;
    let mut record = begun.record.to_api();
    record.ignored_fields = ignored_fields;
    let location = HeaderValue::try_from(format!("/v1/activities/{}", record.activity_id))
        .map_err(|_| ApiError::internal())?;
    let mut answer = (StatusCode::CREATED, RecordJson(record)).into_response();
    answer.headers_mut().insert(header::LOCATION, location);
    if begun.replayed {
        *answer.status_mut() = StatusCode::OK;
        answer
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(answer)
}

/// Says that a begin's answer is a repeat's: the record an earlier begin
/// with the same `Idempotency-Key` made.
const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The header `name` (spelled `shown` in errors), if sent: at most once,
/// and printable ASCII.
fn single_header<'a>(headers: &'a HeaderMap, name: &str, shown: &str) -> Answer<Option<&'a str>> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::invalid(format!("{shown}: sent more than once")));
    }
    let text = value
        .to_str()
        .map_err(|_| ApiError::invalid(format!("{shown}: must be printable ASCII")))?;
    Ok(Some(text))
}

/// The begin's `Idempotency-Key`, if sent (the ledger checks its length and
/// characters, naming the header).
fn idempotency_key(headers: &HeaderMap) -> Answer<Option<String>> {
    Ok(single_header(headers, "idempotency-key", "Idempotency-Key")?.map(str::to_owned))
}

/// The begin's `traceparent`, if sent: checked, and named when malformed.
/// The caller sent it to this API on purpose, so a bad one is refused
/// rather than dropped as a propagating hop would (the proxy does that).
fn trace_parent(headers: &HeaderMap) -> Answer<Option<TraceParent>> {
    match single_header(headers, "traceparent", "traceparent")? {
        None => Ok(None),
        Some(text) => Ok(Some(TraceParent::parse(text).map_err(LedgerError::from)?)),
    }
}

/// Whether a begin asks to be started now (`start=now`), and then how long
/// it may wait in line (zero when `wait` is unset).
fn begin_starts_now(query: &api::BeginQuery, request: &api::BeginRequest) -> Answer<Option<Duration>> {
    match query.start.as_deref() {
        None => {
            if query.wait.is_some() {
                return Err(ApiError::invalid(
                    "`wait` needs `start=now`: without it a begin does not start the record",
                ));
            }
            Ok(None)
        }
        Some("now") => {
            if request.started_at.is_some() {
                return Err(ApiError::invalid(
                    "`startedAt`: leave it out with `start=now`, which stamps the start with the server's clock",
                ));
            }
            let wait = query.wait.as_deref().map(parse_wait).transpose()?;
            Ok(Some(wait.unwrap_or(Duration::ZERO)))
        }
        Some(other) => Err(ApiError::invalid(format!(
            "`start` must be \"now\" (or left out), got {other:?}"
        ))),
    }
}

/// `GET /v1/activities/{id}`.
#[utoipa::path(get, path = "/v1/activities/{id}", operation_id = "getActivity", tag = "activities",
    summary = "Read a record (reaped first if it is past its bound)",
    params(ActivityIdParam),
    responses(
        (status = 200, description = "The record", body = api::ActivityRecord),
        (status = 400, description = "The id is not a UUID", body = api::ErrorBody),
        (status = 404, description = "No such activity", body = api::ErrorBody),
    ))]
pub(super) async fn get(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Answer<RecordJson> {
    let id = activity_id(path)?;
    Ok(RecordJson(state.ledger().get(id).await?.to_api()))
}

/// `POST /v1/activities/{id}/start[?wait=DURATION]`: an admission decision.
/// With `wait`, the request holds until the record's turn comes or the wait
/// ends (then 429 `lane_full`).
#[utoipa::path(post, path = "/v1/activities/{id}/start", operation_id = "startActivity", tag = "activities",
    summary = "Start a record: an admission decision on a capped lane",
    description = "Starting an executing record is a harmless retry; starting an `abandoned` reaped record \
        resurrects it. With `wait`, the request holds until the record is admitted or the wait ends.",
    params(ActivityIdParam, api::StartQuery),
    request_body(content = Option<api::StartRequest>, description = "Optional: an empty body is the same as `{}`"),
    responses(
        (status = 200, description = "The record, executing", body = api::ActivityRecord),
        (status = 400, description = "A bad id, `wait` or `startedAt`", body = api::ErrorBody),
        (status = 404, description = "No such activity", body = api::ErrorBody),
        (status = 409, description = "The record is settled, or reaped `unsettled`", body = api::ErrorBody),
        (status = 429, description = "The lane is at its cap for this record, which keeps its place in line",
            body = api::ErrorBody,
            headers(("Retry-After" = String, description = "`1`: a hint, capacity may come back sooner"))),
    ))]
pub(super) async fn start(
    State(state): State<AppState>,
    grant: Grant,
    path: Result<Path<String>, PathRejection>,
    QueryString(query): QueryString<api::StartQuery>,
    OptionalBody(request): OptionalBody<api::StartRequest>,
) -> Answer<RecordJson> {
    let id = activity_id(path)?;
    let wait = query.wait.as_deref().map(parse_wait).transpose()?;
    let started_at = request.started_at;
    check_record(&state, &grant, id, "POST /v1/activities/{id}/start").await?;
    let record = match wait {
        Some(wait) => state.ledger().start_waiting(id, started_at, Some(wait)).await?,
        None => state.ledger().start(id, started_at).await?,
    };
    Ok(RecordJson(record.to_api()))
}

/// The owner id in the path.
fn owner_id(path: Result<Path<String>, PathRejection>) -> Answer<OwnerId> {
    let Path(raw) = path.map_err(|rejection| ApiError::invalid(format!("bad path: {rejection}")))?;
    raw.parse()
        .map_err(|err: inflight::domain::ParseError| ApiError::invalid(err.to_string()))
}

/// `POST /v1/owners`: registers an owner with a lease.
#[utoipa::path(post, path = "/v1/owners", operation_id = "registerOwner", tag = "owners",
    summary = "Register an owner with a lease",
    request_body = api::RegisterOwnerRequest,
    responses(
        (status = 201, description = "The owner registered", body = api::Owner,
            headers(("Location" = String, description = "`/v1/owners/{id}`")),
            links(
                ("renewOwner" = (operation_id = "renewOwner", parameters(("id" = "$response.body#/ownerId")))),
                ("releaseOwner" = (operation_id = "releaseOwner", parameters(("id" = "$response.body#/ownerId")))),
            )),
        (status = 400, description = "A missing or bad `name`, or a `ttlMs` out of range", body = api::ErrorBody),
    ))]
pub(super) async fn register_owner(
    State(state): State<AppState>,
    RequiredBody(request): RequiredBody<api::RegisterOwnerRequest>,
) -> Answer<impl IntoResponse> {
    // Checked by the domain's rule before it becomes a `Duration`, so that
    // a negative value is named as sent.
    let ttl_ms = owner::check_ttl(request.ttl_ms.unwrap_or(DEFAULT_TTL_MS)).map_err(LedgerError::from)?;
    let owner = state
        .ledger()
        .register_owner(&request.name, Duration::from_millis(ttl_ms.unsigned_abs()))
        .await?
        .to_api();
    let location = format!("/v1/owners/{}", owner.owner_id);
    Ok((StatusCode::CREATED, [(header::LOCATION, location)], Json(owner)))
}

/// `POST /v1/owners/{id}/renew`.
#[utoipa::path(post, path = "/v1/owners/{id}/renew", operation_id = "renewOwner", tag = "owners",
    summary = "Renew an owner's lease (no body)",
    params(OwnerIdParam),
    responses(
        (status = 200, description = "The owner, renewed", body = api::Owner),
        (status = 400, description = "The id is not a UUID", body = api::ErrorBody),
        (status = 404, description = "No such owner", body = api::ErrorBody),
        (status = 409, description = "The owner is lost or released", body = api::ErrorBody),
    ))]
pub(super) async fn renew_owner(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Answer<Json<api::Owner>> {
    let id = owner_id(path)?;
    Ok(Json(state.ledger().renew_owner(&id).await?.to_api()))
}

/// `DELETE /v1/owners/{id}`: a clean shutdown; cancels its in-flight
/// records and answers how many (`cancelledRecords`).
#[utoipa::path(delete, path = "/v1/owners/{id}", operation_id = "releaseOwner", tag = "owners",
    summary = "Release an owner: a clean shutdown that cancels its in-flight records",
    params(OwnerIdParam),
    responses(
        (status = 200, description = "The owner, released (again: unchanged)", body = api::Owner),
        (status = 400, description = "The id is not a UUID", body = api::ErrorBody),
        (status = 404, description = "No such owner", body = api::ErrorBody),
        (status = 409, description = "The owner is lost", body = api::ErrorBody),
    ))]
pub(super) async fn release_owner(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Answer<Json<api::Owner>> {
    let id = owner_id(path)?;
    Ok(Json(state.ledger().release_owner(&id).await?.to_api()))
}

/// `POST /v1/activities/{id}/settle`.
#[utoipa::path(post, path = "/v1/activities/{id}/settle", operation_id = "settleActivity", tag = "activities",
    summary = "Settle a record: succeeded or failed",
    description = "Repeating the settle that landed is a harmless retry. A settle for a reaped record \
        is absorbed: 200 with the record, still `reaped`, and `lateSettle: true`.",
    params(ActivityIdParam),
    request_body = api::SettleRequest,
    responses(
        (status = 200, description = "The record, settled (or reaped, with `lateSettle`)", body = api::ActivityRecord),
        (status = 400, description = "A bad id, `success`, `failureStage` or `completedAt`", body = api::ErrorBody),
        (status = 404, description = "No such activity", body = api::ErrorBody),
        (status = 409, description = "A different outcome than the one that landed", body = api::ErrorBody),
    ))]
pub(super) async fn settle(
    State(state): State<AppState>,
    grant: Grant,
    path: Result<Path<String>, PathRejection>,
    RequiredBody(request): RequiredBody<api::SettleRequest>,
) -> Answer<RecordJson> {
    let id = activity_id(path)?;
    let settlement = convert::settlement(&request);
    check_record(&state, &grant, id, "POST /v1/activities/{id}/settle").await?;
    Ok(RecordJson(state.ledger().settle(id, settlement).await?.to_api()))
}

/// `POST /v1/activities/{id}/refine`.
#[utoipa::path(post, path = "/v1/activities/{id}/refine", operation_id = "refineActivity", tag = "activities",
    summary = "Refine a record's model to the one its call was dispatched to",
    description = "Only a record in flight (waiting or executing) can be refined. The first refinement \
        replaces the begin's model; the same model again changes nothing, so a retry is harmless; a \
        different model folds it to `unknown`, for good. The model is redacted and kept within the label \
        limits as a begin's is, and the call counts in the aggregate of its final model.",
    params(ActivityIdParam),
    request_body = api::RefineRequest,
    responses(
        (status = 200, description = "The record, with `refined: true`", body = api::ActivityRecord),
        (status = 400, description = "A bad id or `model`", body = api::ErrorBody),
        (status = 404, description = "No such activity", body = api::ErrorBody),
        (status = 409, description = "The record is no longer in flight", body = api::ErrorBody),
    ))]
pub(super) async fn refine(
    State(state): State<AppState>,
    grant: Grant,
    path: Result<Path<String>, PathRejection>,
    RequiredBody(request): RequiredBody<api::RefineRequest>,
) -> Answer<RecordJson> {
    let id = activity_id(path)?;
    check_record(&state, &grant, id, "POST /v1/activities/{id}/refine").await?;
    Ok(RecordJson(
        state.ledger().refine(id, request.model).await?.to_api(),
    ))
}

/// `POST /v1/activities/{id}/cancel`.
#[utoipa::path(post, path = "/v1/activities/{id}/cancel", operation_id = "cancelActivity", tag = "activities",
    summary = "Cancel a record: an abort the ledger observed",
    params(ActivityIdParam),
    request_body(content = Option<api::CancelRequest>, description = "Optional: an empty body is the same as `{}`"),
    responses(
        (status = 200, description = "The record, cancelled (or reaped, with `lateSettle`)", body = api::ActivityRecord),
        (status = 400, description = "A bad id or `reason`", body = api::ErrorBody),
        (status = 404, description = "No such activity", body = api::ErrorBody),
        (status = 409, description = "The record succeeded or failed", body = api::ErrorBody),
    ))]
pub(super) async fn cancel(
    State(state): State<AppState>,
    grant: Grant,
    path: Result<Path<String>, PathRejection>,
    OptionalBody(request): OptionalBody<api::CancelRequest>,
) -> Answer<RecordJson> {
    let id = activity_id(path)?;
    check_record(&state, &grant, id, "POST /v1/activities/{id}/cancel").await?;
    Ok(RecordJson(
        state.ledger().cancel(id, request.reason).await?.to_api(),
    ))
}

/// What the snapshot's query string asks for; the ledger bounds `limit`.
fn snapshot_options(query: &api::SnapshotQuery) -> Answer<SnapshotOptions> {
    let mut options = SnapshotOptions::default();
    if let Some(limit) = query.limit {
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        options = options.with_limit(limit).map_err(ApiError::invalid)?;
    }
    if let Some(since) = &query.since {
        options = options.with_since(parse_since(since)?);
    }
    Ok(options)
}

/// `since`: a duration before now (`24h`, `90m`) or an RFC 3339 time.
fn parse_since(text: &str) -> Answer<Since> {
    if let Ok(ago) = humantime::parse_duration(text.trim()) {
        return Ok(Since::Ago(ago));
    }
    text.parse::<api::Timestamp>().map(Since::At).map_err(|_| {
        ApiError::invalid(format!(
            "`since` must be a duration such as \"24h\" or an RFC 3339 time, got {text:?}"
        ))
    })
}

/// `GET /v1/snapshot?limit=&since=`.
#[utoipa::path(get, path = "/v1/snapshot", operation_id = "snapshot", tag = "ledger",
    summary = "Reap, then report the ledger as operators read it",
    params(api::SnapshotQuery),
    responses(
        (status = 200, description = "The snapshot", body = api::Snapshot),
        (status = 400, description = "A bad `limit` or `since`", body = api::ErrorBody),
    ))]
pub(super) async fn snapshot(
    State(state): State<AppState>,
    QueryString(query): QueryString<api::SnapshotQuery>,
) -> Answer<SnapshotJson> {
    let options = snapshot_options(&query)?;
    Ok(SnapshotJson(state.ledger().snapshot(options).await?.to_api()))
}

/// `GET /metrics`: the snapshot over the whole history, as OpenMetrics
/// text. Like every read, it reaps first.
#[utoipa::path(get, path = "/metrics", operation_id = "metrics", tag = "ledger",
    summary = "The ledger for Prometheus (reaps first, like every read)",
    responses(
        (status = 200, description = "OpenMetrics text", body = String,
            content_type = "application/openmetrics-text"),
    ))]
pub(super) async fn metrics(State(state): State<AppState>) -> Answer<impl IntoResponse> {
    let options = SnapshotOptions::default()
        .with_since(Since::At(inflight::Timestamp::MIN))
        .with_limit(1)
        .map_err(ApiError::invalid)?;
    let snapshot = state.ledger().snapshot(options).await?;
    let stats = state.ledger().stats();
    Ok((
        [(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)],
        super::metrics::render(
            &snapshot,
            &stats,
            state.times.snapshot(),
            state.metrics,
            state.otel.as_deref(),
        ),
    ))
}

/// `POST /v1/reap`.
#[utoipa::path(post, path = "/v1/reap", operation_id = "reap", tag = "ledger",
    summary = "Reap every record past its bound now (no body)",
    responses((status = 200, description = "What this call reaped", body = api::ReapCounts)))]
pub(super) async fn reap(State(state): State<AppState>) -> Answer<Json<api::ReapCounts>> {
    Ok(Json(state.ledger().reap().await?.to_api()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_is_a_duration_or_a_time() {
        assert_eq!(
            parse_since("24h").unwrap(),
            Since::Ago(Duration::from_secs(86_400))
        );
        assert_eq!(
            parse_since("1970-01-01T00:00:02Z").unwrap(),
            Since::At(inflight::Timestamp::from_millis(2_000))
        );
        assert!(parse_since("yesterday").is_err());
        assert!(parse_since("").is_err());
    }

    #[test]
    fn wait_is_a_duration_of_at_most_30s() {
        assert_eq!(parse_wait("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_wait("30s").unwrap(), Duration::from_secs(30));
        assert!(parse_wait("31s").is_err());
        assert!(parse_wait("soon").is_err());
    }

    #[test]
    fn limit_is_bounded() {
        let query = |limit: &str| {
            super::super::body::parse_query::<api::SnapshotQuery>(&format!("limit={limit}"))
                .and_then(|query| snapshot_options(&query))
        };
        assert_eq!(query("5").unwrap().limit(), 5);
        for bad in ["0", "10001", "-1", "many", "", "4294967296"] {
            assert!(query(bad).is_err(), "{bad}");
        }
    }
}
