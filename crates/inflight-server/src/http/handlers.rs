//! The route handlers: read the request as its wire type, call the ledger,
//! answer with the wire type of what it returned.

use std::time::Duration;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;

use super::body::{OptionalBody, QueryString, RequiredBody};
use super::error::ApiError;
use super::AppState;
use inflight::domain::owner::{self, OwnerId, DEFAULT_TTL_MS};
use inflight::domain::record::ActivityId;
use inflight::domain::snapshot::{Since, SnapshotOptions};
use inflight::error::LedgerError;
use inflight::wire::{self as convert, ToApi};
use inflight::MAX_START_WAIT;
use inflight_api as api;

type Answer<T> = Result<T, ApiError>;

/// `GET /healthz`.
pub(super) async fn healthz() -> Json<api::Health> {
    Json(api::Health {
        status: api::HealthStatus::Ok,
    })
}

/// The activity id in the path.
fn activity_id(path: Result<Path<String>, PathRejection>) -> Answer<ActivityId> {
    let Path(raw) = path.map_err(|rejection| ApiError::invalid(format!("bad path: {rejection}")))?;
    raw.parse()
        .map_err(|_| ApiError::invalid(format!("{raw:?} is not an activity id (a UUID)")))
}

/// `POST /v1/activities`.
pub(super) async fn begin(
    State(state): State<AppState>,
    RequiredBody(request): RequiredBody<api::BeginRequest>,
) -> Answer<impl IntoResponse> {
    let record = state
        .ledger()
        .begin_record(convert::activity_spec(request))
        .await?
        .to_api();
    let location = format!("/v1/activities/{}", record.activity_id);
    Ok((StatusCode::CREATED, [(header::LOCATION, location)], Json(record)))
}

/// `GET /v1/activities/{id}`.
pub(super) async fn get(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Answer<Json<api::ActivityRecord>> {
    let id = activity_id(path)?;
    Ok(Json(state.ledger().get(id).await?.to_api()))
}

/// `POST /v1/activities/{id}/start[?wait=DURATION]`: an admission decision.
/// With `wait`, the request holds until the record's turn comes or the wait
/// ends (then 429 `lane_full`).
pub(super) async fn start(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    QueryString(query): QueryString<api::StartQuery>,
    OptionalBody(request): OptionalBody<api::StartRequest>,
) -> Answer<Json<api::ActivityRecord>> {
    let id = activity_id(path)?;
    let wait = query.wait.as_deref().map(parse_wait).transpose()?;
    let started_at = request.started_at;
    let record = match wait {
        Some(wait) => state.ledger().start_waiting(id, started_at, Some(wait)).await?,
        None => state.ledger().start(id, started_at).await?,
    };
    Ok(Json(record.to_api()))
}

/// `wait`: a duration of at most 30 s.
fn parse_wait(text: &str) -> Answer<Duration> {
    let wait = humantime::parse_duration(text.trim()).map_err(|_| {
        ApiError::invalid(format!(
            "`wait` must be a duration such as \"5s\" or \"500ms\", got {text:?}"
        ))
    })?;
    if wait > MAX_START_WAIT {
        return Err(ApiError::invalid(format!(
            "`wait` must be at most {}, got {text:?}",
            humantime::format_duration(MAX_START_WAIT)
        )));
    }
    Ok(wait)
}

/// The owner id in the path.
fn owner_id(path: Result<Path<String>, PathRejection>) -> Answer<OwnerId> {
    let Path(raw) = path.map_err(|rejection| ApiError::invalid(format!("bad path: {rejection}")))?;
    raw.parse()
        .map_err(|err: inflight::domain::ParseError| ApiError::invalid(err.to_string()))
}

/// `POST /v1/owners`: registers an owner with a lease.
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
pub(super) async fn renew_owner(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Answer<Json<api::Owner>> {
    let id = owner_id(path)?;
    Ok(Json(state.ledger().renew_owner(&id).await?.to_api()))
}

/// `DELETE /v1/owners/{id}`: a clean shutdown; cancels its in-flight
/// records and answers how many (`cancelledRecords`).
pub(super) async fn release_owner(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Answer<Json<api::Owner>> {
    let id = owner_id(path)?;
    Ok(Json(state.ledger().release_owner(&id).await?.to_api()))
}

/// `POST /v1/activities/{id}/settle`.
pub(super) async fn settle(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    RequiredBody(request): RequiredBody<api::SettleRequest>,
) -> Answer<Json<api::ActivityRecord>> {
    let id = activity_id(path)?;
    let settlement = convert::settlement(&request);
    Ok(Json(state.ledger().settle(id, settlement).await?.to_api()))
}

/// `POST /v1/activities/{id}/cancel`.
pub(super) async fn cancel(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    OptionalBody(request): OptionalBody<api::CancelRequest>,
) -> Answer<Json<api::ActivityRecord>> {
    let id = activity_id(path)?;
    Ok(Json(state.ledger().cancel(id, request.reason).await?.to_api()))
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
pub(super) async fn snapshot(
    State(state): State<AppState>,
    QueryString(query): QueryString<api::SnapshotQuery>,
) -> Answer<Json<api::Snapshot>> {
    let options = snapshot_options(&query)?;
    Ok(Json(state.ledger().snapshot(options).await?.to_api()))
}

/// `GET /metrics`: the snapshot over the whole history, as OpenMetrics
/// text. Like every read, it reaps first.
pub(super) async fn metrics(State(state): State<AppState>) -> Answer<impl IntoResponse> {
    let options = SnapshotOptions::default()
        .with_since(Since::At(inflight::Timestamp::MIN))
        .with_limit(1)
        .map_err(ApiError::invalid)?;
    let snapshot = state.ledger().snapshot(options).await?;
    Ok((
        [(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)],
        super::metrics::render(&snapshot),
    ))
}

/// `POST /v1/reap`.
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
