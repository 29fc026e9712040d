//! The wire, byte for byte: what the server answers for a scripted history
//! on a fake clock, compared with the exact text `docs/api.md` documents
//! (ids replaced by their names). A change of a field's name, order or
//! shape fails here. Each answer also reads back as its `inflight_api`
//! type, which writes it again byte for byte.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use inflight::{FakeClock, Ledger, LedgerConfig};
use inflight_api as api;
use inflight_server::http::{app, AppState};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tower::ServiceExt;

/// 2026-08-13T12:00:00.000Z.
const T0: i64 = 1_786_622_400_000;

struct Wire {
    router: Router,
    clock: FakeClock,
    /// Ids seen so far and the names they are shown under.
    names: Vec<(String, String)>,
}

impl Wire {
    fn new() -> Self {
        let clock = FakeClock::at(inflight::Timestamp::from_millis(T0));
        let config = LedgerConfig::default()
            .with_lane_cap("knowledge-base::ollama", 4)
            .unwrap();
        let ledger = Ledger::builder(config)
            .store_url("memory:")
            .clock(clock.clone())
            .build()
            .unwrap();
        Self {
            router: app(AppState::new(ledger)),
            clock,
            names: Vec::new(),
        }
    }

    /// The status and the body's text, every known id replaced by its name.
    async fn send(&self, method: Method, uri: &str, body: Option<&str>) -> (StatusCode, String) {
        let uri = self
            .names
            .iter()
            .fold(uri.to_owned(), |uri, (id, name)| uri.replace(name, id));
        let body = body.map(|body| {
            self.names
                .iter()
                .fold(body.to_owned(), |b, (id, name)| b.replace(name, id))
        });
        let request = Request::builder()
            .method(method)
            .uri(uri)
            .body(body.map_or_else(Body::empty, Body::from))
            .unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        if status.is_client_error() || status.is_server_error() {
            assert_eq!(
                response.headers().get(header::CONTENT_TYPE).unwrap(),
                "application/json"
            );
        }
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        let text = self
            .names
            .iter()
            .fold(text, |text, (id, name)| text.replace(id, name));
        (status, text)
    }

    /// Remembers the id in `text` after `"{key}":"` under `name`; `text`
    /// with it replaced.
    fn name(&mut self, text: &str, key: &str, name: &str) -> String {
        let start = text.find(&format!("\"{key}\":\"")).unwrap() + key.len() + 4;
        let id = text[start..start + 36].to_owned();
        let name = format!("<{name}>");
        let text = text.replace(&id, &name);
        self.names.push((id, name));
        text
    }
}

/// Asserts the answer, and that it reads back as the wire type `T`, which
/// writes it again byte for byte.
fn assert_text<T: DeserializeOwned + Serialize>(
    status: StatusCode,
    text: &str,
    want_status: StatusCode,
    want: &str,
) {
    assert_eq!(status, want_status, "{text}");
    assert_eq!(text, want, "\n got: {text}\nwant: {want}");
    let typed: T = serde_json::from_str(text).unwrap_or_else(|err| panic!("{err}: {text}"));
    assert_eq!(serde_json::to_string(&typed).unwrap(), text);
}

#[tokio::test]
async fn every_answer_is_byte_for_byte_what_the_documentation_says() {
    let mut wire = Wire::new();

    let (status, text) = wire.send(Method::GET, "/healthz", None).await;
    assert_text::<api::Health>(status, &text, StatusCode::OK, r#"{"status":"ok"}"#);

    let (status, text) = wire
        .send(
            Method::POST,
            "/v1/owners",
            Some(r#"{"name":"worker-a","ttlMs":30000}"#),
        )
        .await;
    let text = wire.name(&text, "ownerId", "owner");
    assert_text::<api::Owner>(
        status,
        &text,
        StatusCode::CREATED,
        concat!(
            r#"{"ownerId":"<owner>","name":"worker-a","ttlMs":30000,"registeredAt":"2026-08-13T12:00:00.000Z","#,
            r#""renewedAt":"2026-08-13T12:00:00.000Z","expiresAt":"2026-08-13T12:00:30.000Z","state":"live","#,
            r#""endedAt":null,"reapedRecords":0,"cancelledRecords":0}"#
        ),
    );

    let (status, text) = wire
        .send(
            Method::POST,
            "/v1/activities",
            Some(concat!(
                r#"{"service":"knowledge-base","provider":"ollama","class":"embedding","#,
                r#""operationStage":"kb-ingest","model":"nomic-embed-text","priority":"batch","ownerId":"<owner>"}"#
            )),
        )
        .await;
    let text = wire.name(&text, "activityId", "a");
    assert_text::<api::ActivityRecord>(
        status,
        &text,
        StatusCode::CREATED,
        concat!(
            r#"{"activityId":"<a>","service":"knowledge-base","provider":"ollama","class":"embedding","#,
            r#""operationStage":"kb-ingest","model":"nomic-embed-text","priority":"batch","admission":"queued","#,
            r#""state":"waiting","disposition":null,"reapReason":null,"ownerId":"<owner>","#,
            r#""enqueuedAt":"2026-08-13T12:00:00.000Z","startedAt":null,"completedAt":null,"reapedAt":null,"#,
            r#""deadlineMs":300000,"reapableAt":"2026-08-13T12:20:00.000Z","queueWaitMs":null,"#,
            r#""executionMs":null,"success":null,"failureStage":null,"lateSettle":false,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null}"#
        ),
    );

    wire.clock.advance(Duration::from_secs(2));
    let (status, text) = wire.send(Method::POST, "/v1/activities/<a>/start", None).await;
    assert_text::<api::ActivityRecord>(
        status,
        &text,
        StatusCode::OK,
        concat!(
            r#"{"activityId":"<a>","service":"knowledge-base","provider":"ollama","class":"embedding","#,
            r#""operationStage":"kb-ingest","model":"nomic-embed-text","priority":"batch","admission":"queued","#,
            r#""state":"executing","disposition":null,"reapReason":null,"ownerId":"<owner>","#,
            r#""enqueuedAt":"2026-08-13T12:00:00.000Z","startedAt":"2026-08-13T12:00:02.000Z","#,
            r#""completedAt":null,"reapedAt":null,"deadlineMs":300000,"#,
            r#""reapableAt":"2026-08-13T12:20:02.000Z","queueWaitMs":2000,"executionMs":null,"#,
            r#""success":null,"failureStage":null,"lateSettle":false,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null}"#
        ),
    );

    let (_, text) = wire
        .send(
            Method::POST,
            "/v1/activities",
            Some(r#"{"service":"bot","provider":"openai","class":"chat","admission":"direct","enqueuedAt":1786622399000,"startedAt":"2026-08-13T12:00:01Z","deadlineMs":1000}"#),
        )
        .await;
    let _ = wire.name(&text, "activityId", "b");
    let (status, text) = wire
        .send(
            Method::POST,
            "/v1/activities/<b>/settle",
            Some(r#"{"success":false,"failureStage":"provider"}"#),
        )
        .await;
    assert_text::<api::ActivityRecord>(
        status,
        &text,
        StatusCode::OK,
        concat!(
            r#"{"activityId":"<b>","service":"bot","provider":"openai","class":"chat","#,
            r#""operationStage":"unknown","model":"unknown","priority":"unknown","admission":"direct","#,
            r#""state":"failed","disposition":null,"reapReason":null,"ownerId":null,"#,
            r#""enqueuedAt":"2026-08-13T11:59:59.000Z","startedAt":"2026-08-13T12:00:01.000Z","#,
            r#""completedAt":"2026-08-13T12:00:02.000Z","reapedAt":null,"deadlineMs":1000,"#,
            r#""reapableAt":null,"queueWaitMs":2000,"executionMs":1000,"success":false,"#,
            r#""failureStage":"provider","lateSettle":false,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null}"#
        ),
    );

    let (_, text) = wire
        .send(
            Method::POST,
            "/v1/activities",
            Some(r#"{"service":"knowledge-base","provider":"ollama","model":"sk-secret"}"#),
        )
        .await;
    let _ = wire.name(&text, "activityId", "c");
    let (status, text) = wire
        .send(
            Method::POST,
            "/v1/activities/<c>/cancel",
            Some(r#"{"reason":"client went away"}"#),
        )
        .await;
    assert_text::<api::ActivityRecord>(
        status,
        &text,
        StatusCode::OK,
        concat!(
            r#"{"activityId":"<c>","service":"knowledge-base","provider":"ollama","class":"unknown","#,
            r#""operationStage":"unknown","model":"redacted","priority":"unknown","admission":"queued","#,
            r#""state":"cancelled","disposition":null,"reapReason":null,"ownerId":null,"#,
            r#""enqueuedAt":"2026-08-13T12:00:02.000Z","startedAt":null,"#,
            r#""completedAt":"2026-08-13T12:00:02.000Z","reapedAt":null,"deadlineMs":600000,"#,
            r#""reapableAt":null,"queueWaitMs":null,"executionMs":null,"success":null,"#,
            r#""failureStage":null,"lateSettle":false,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null,"cancelReason":"client went away"}"#
        ),
    );

    // <d> waits and is abandoned; <a>'s owner stops renewing.
    let (_, text) = wire
        .send(
            Method::POST,
            "/v1/activities",
            Some(r#"{"service":"knowledge-base","provider":"ollama","class":"embedding"}"#),
        )
        .await;
    let _ = wire.name(&text, "activityId", "d");
    wire.clock.advance(Duration::from_secs(29));
    let (_, text) = wire.send(Method::GET, "/v1/activities/<a>", None).await;
    assert!(text.contains(r#""reapReason":"owner-lost""#), "{text}");
    wire.clock.advance(Duration::from_secs(21 * 60));
    let (_, text) = wire
        .send(
            Method::POST,
            "/v1/activities",
            Some(r#"{"service":"knowledge-base","provider":"ollama","class":"embedding","startedAt":1786623660000}"#),
        )
        .await;
    let _ = wire.name(&text, "activityId", "e");

    let (status, text) = wire
        .send(
            Method::POST,
            "/v1/activities/<a>/settle",
            Some(r#"{"success":true}"#),
        )
        .await;
    assert_text::<api::ActivityRecord>(
        status,
        &text,
        StatusCode::OK,
        concat!(
            r#"{"activityId":"<a>","service":"knowledge-base","provider":"ollama","class":"embedding","#,
            r#""operationStage":"kb-ingest","model":"nomic-embed-text","priority":"batch","admission":"queued","#,
            r#""state":"reaped","disposition":"unsettled","reapReason":"owner-lost","ownerId":"<owner>","#,
            r#""enqueuedAt":"2026-08-13T12:00:00.000Z","startedAt":"2026-08-13T12:00:02.000Z","#,
            r#""completedAt":null,"reapedAt":"2026-08-13T12:00:31.000Z","deadlineMs":300000,"#,
            r#""reapableAt":null,"queueWaitMs":2000,"executionMs":null,"success":null,"#,
            r#""failureStage":null,"lateSettle":true,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null}"#
        ),
    );

    let (status, text) = wire
        .send(Method::GET, "/v1/snapshot?limit=5&since=1h", None)
        .await;
    assert_text::<api::Snapshot>(
        status,
        &text,
        StatusCode::OK,
        concat!(
            r#"{"status":"degraded","at":"2026-08-13T12:21:31.000Z","since":"2026-08-13T11:21:31.000Z","#,
            r#""nativeAdmission":{"knowledge-base::ollama":{"service":"knowledge-base","provider":"ollama","#,
            r#""cap":4,"executing":1,"waiting":0,"reaped":{"abandoned":1,"unsettled":1},"#,
            r#""reapedOwnerLost":1,"lateSettles":1,"resurrections":0,"longestWaitMs":0,"effectiveCap":4,"#,
            r#""coolingUntil":null,"cooldowns":0,"byPriority":{"interactive":{"executing":0,"waiting":0},"#,
            r#""batch":{"executing":0,"waiting":0},"unknown":{"executing":1,"waiting":0}},"tokensLastMinute":0,"tokensReserved":0,"tokensPerMinute":null,"providerTokensPerMinute":null}},"#,
            r#""totalActivities":5,"totalSucceeded":0,"totalSucceededUnstarted":0,"totalFailed":1,"totalCancelled":1,"totalInFlight":1,"totalRecentCompletions":2,"totalReaped":2,"#,
            r#""totalReapedOwnerLost":1,"totalLateSettles":1,"totalResurrections":0,"#,
            r#""reapedThisRead":{"abandoned":0,"unsettled":0},"inFlight":[{"activityId":"<e>","#,
            r#""service":"knowledge-base","provider":"ollama","class":"embedding","#,
            r#""operationStage":"unknown","model":"unknown","priority":"unknown","admission":"queued","#,
            r#""state":"executing","disposition":null,"reapReason":null,"ownerId":null,"#,
            r#""enqueuedAt":"2026-08-13T12:21:00.000Z","startedAt":"2026-08-13T12:21:00.000Z","#,
            r#""completedAt":null,"reapedAt":null,"deadlineMs":300000,"#,
            r#""reapableAt":"2026-08-13T12:41:00.000Z","queueWaitMs":0,"executionMs":null,"success":null,"#,
            r#""failureStage":null,"lateSettle":false,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null,"elapsedMs":31000}],"#,
            r#""recentCompletions":[{"activityId":"<c>","service":"knowledge-base","provider":"ollama","#,
            r#""class":"unknown","operationStage":"unknown","model":"redacted","priority":"unknown","#,
            r#""admission":"queued","state":"cancelled","disposition":null,"reapReason":null,"#,
            r#""ownerId":null,"enqueuedAt":"2026-08-13T12:00:02.000Z","startedAt":null,"#,
            r#""completedAt":"2026-08-13T12:00:02.000Z","reapedAt":null,"deadlineMs":600000,"#,
            r#""reapableAt":null,"queueWaitMs":null,"executionMs":null,"success":null,"failureStage":null,"#,
            r#""lateSettle":false,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null,"cancelReason":"client went away"},{"activityId":"<b>","service":"bot","#,
            r#""provider":"openai","class":"chat","operationStage":"unknown","model":"unknown","#,
            r#""priority":"unknown","admission":"direct","state":"failed","disposition":null,"#,
            r#""reapReason":null,"ownerId":null,"enqueuedAt":"2026-08-13T11:59:59.000Z","#,
            r#""startedAt":"2026-08-13T12:00:01.000Z","completedAt":"2026-08-13T12:00:02.000Z","#,
            r#""reapedAt":null,"deadlineMs":1000,"reapableAt":null,"queueWaitMs":2000,"executionMs":1000,"#,
            r#""success":false,"failureStage":"provider","lateSettle":false,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null}],"#,
            r#""reaped":[{"activityId":"<d>","service":"knowledge-base","provider":"ollama","#,
            r#""class":"embedding","operationStage":"unknown","model":"unknown","priority":"unknown","#,
            r#""admission":"queued","state":"reaped","disposition":"abandoned","reapReason":"deadline","#,
            r#""ownerId":null,"enqueuedAt":"2026-08-13T12:00:02.000Z","startedAt":null,"completedAt":null,"#,
            r#""reapedAt":"2026-08-13T12:21:31.000Z","deadlineMs":300000,"reapableAt":null,"#,
            r#""queueWaitMs":null,"executionMs":null,"success":null,"failureStage":null,"lateSettle":false,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null,"#,
            r#""ageMs":1289000},{"activityId":"<a>","service":"knowledge-base","provider":"ollama","#,
            r#""class":"embedding","operationStage":"kb-ingest","model":"nomic-embed-text","#,
            r#""priority":"batch","admission":"queued","state":"reaped","disposition":"unsettled","#,
            r#""reapReason":"owner-lost","ownerId":"<owner>","enqueuedAt":"2026-08-13T12:00:00.000Z","#,
            r#""startedAt":"2026-08-13T12:00:02.000Z","completedAt":null,"#,
            r#""reapedAt":"2026-08-13T12:00:31.000Z","deadlineMs":300000,"reapableAt":null,"#,
            r#""queueWaitMs":2000,"executionMs":null,"success":null,"failureStage":null,"lateSettle":true,"unstartedSuccess":false,"refined":false,"inputTokens":null,"outputTokens":null,"maxTokens":null,"#,
            r#""ageMs":1291000}],"inFlightTruncated":false,"recentCompletionsTruncated":false,"#,
            r#""reapedTruncated":false,"aggregates":[{"service":"bot","operationStage":"unknown","#,
            r#""class":"chat","provider":"openai","model":"unknown","priority":"unknown","#,
            r#""admission":"direct","calls":1,"successes":0,"successesUnstarted":0,"failures":1,"cancelled":0,"#,
            r#""reaped":{"abandoned":0,"unsettled":0},"lateSettles":0,"inFlight":0,"avgQueueWaitMs":2000,"#,
            r#""maxQueueWaitMs":2000,"avgExecutionMs":1000,"maxExecutionMs":1000,"#,
            r#""lastSeenAt":"2026-08-13T12:00:02.000Z","inputTokens":0,"outputTokens":0},{"service":"knowledge-base","#,
            r#""operationStage":"kb-ingest","class":"embedding","provider":"ollama","#,
            r#""model":"nomic-embed-text","priority":"batch","admission":"queued","calls":1,"successes":0,"successesUnstarted":0,"#,
            r#""failures":0,"cancelled":0,"reaped":{"abandoned":0,"unsettled":1},"lateSettles":1,"#,
            r#""inFlight":0,"avgQueueWaitMs":2000,"maxQueueWaitMs":2000,"avgExecutionMs":null,"#,
            r#""maxExecutionMs":null,"lastSeenAt":"2026-08-13T12:21:31.000Z","inputTokens":0,"outputTokens":0},{"service":"knowledge-base","#,
            r#""operationStage":"unknown","class":"embedding","provider":"ollama","model":"unknown","#,
            r#""priority":"unknown","admission":"queued","calls":2,"successes":0,"successesUnstarted":0,"failures":0,"#,
            r#""cancelled":0,"reaped":{"abandoned":1,"unsettled":0},"lateSettles":0,"inFlight":1,"#,
            r#""avgQueueWaitMs":null,"maxQueueWaitMs":null,"avgExecutionMs":null,"maxExecutionMs":null,"#,
            r#""lastSeenAt":"2026-08-13T12:21:00.000Z","inputTokens":0,"outputTokens":0},{"service":"knowledge-base","#,
            r#""operationStage":"unknown","class":"unknown","provider":"ollama","model":"redacted","#,
            r#""priority":"unknown","admission":"queued","calls":1,"successes":0,"successesUnstarted":0,"failures":0,"#,
            r#""cancelled":1,"reaped":{"abandoned":0,"unsettled":0},"lateSettles":0,"inFlight":0,"#,
            r#""avgQueueWaitMs":null,"maxQueueWaitMs":null,"avgExecutionMs":null,"maxExecutionMs":null,"#,
            r#""lastSeenAt":"2026-08-13T12:00:02.000Z","inputTokens":0,"outputTokens":0}],"owners":[{"ownerId":"<owner>","name":"worker-a","#,
            r#""ttlMs":30000,"registeredAt":"2026-08-13T12:00:00.000Z","#,
            r#""renewedAt":"2026-08-13T12:00:00.000Z","expiresAt":"2026-08-13T12:00:30.000Z","#,
            r#""state":"lost","endedAt":"2026-08-13T12:00:31.000Z","reapedRecords":1,"#,
            r#""cancelledRecords":0}],"warnings":[]}"#,
        ),
    );

    let (status, text) = wire.send(Method::POST, "/v1/reap", None).await;
    assert_text::<api::ReapCounts>(status, &text, StatusCode::OK, r#"{"abandoned":0,"unsettled":0}"#);

    let (status, text) = wire.send(Method::GET, "/v1/nowhere", None).await;
    assert_text::<api::ErrorBody>(
        status,
        &text,
        StatusCode::NOT_FOUND,
        r#"{"error":{"code":"not_found","message":"no route /v1/nowhere; see docs/api.md"}}"#,
    );
    let (status, text) = wire.send(Method::POST, "/v1/activities/<b>/cancel", None).await;
    assert_text::<api::ErrorBody>(
        status,
        &text,
        StatusCode::CONFLICT,
        r#"{"error":{"code":"conflict","message":"activity <b> already settled as failed; refusing cancelled"}}"#,
    );
    let (status, text) = wire.send(Method::PUT, "/v1/snapshot", None).await;
    assert_text::<api::ErrorBody>(
        status,
        &text,
        StatusCode::METHOD_NOT_ALLOWED,
        r#"{"error":{"code":"method_not_allowed","message":"this method is not allowed on this route; see docs/api.md"}}"#,
    );
    let (status, text) = wire.send(Method::POST, "/v1/activities", None).await;
    assert_text::<api::ErrorBody>(
        status,
        &text,
        StatusCode::BAD_REQUEST,
        r#"{"error":{"code":"invalid_request","message":"the request body must be a JSON object; it was empty"}}"#,
    );
    let (status, text) = wire
        .send(Method::POST, "/v1/activities/<e>/settle", Some("[true]"))
        .await;
    assert_text::<api::ErrorBody>(
        status,
        &text,
        StatusCode::BAD_REQUEST,
        r#"{"error":{"code":"invalid_request","message":"the request body must be a JSON object, got an array"}}"#,
    );
    let big = format!(
        r#"{{"service":"kb","provider":"o","padding":"{}"}}"#,
        "x".repeat(64 * 1024)
    );
    let (status, text) = wire.send(Method::POST, "/v1/activities", Some(&big)).await;
    assert_text::<api::ErrorBody>(
        status,
        &text,
        StatusCode::PAYLOAD_TOO_LARGE,
        r#"{"error":{"code":"payload_too_large","message":"the request body exceeds the limit of 65536 bytes"}}"#,
    );
}

#[tokio::test]
async fn a_missing_token_answers_the_documented_error() {
    let ledger = Ledger::builder(LedgerConfig::default())
        .store_url("memory:")
        .build()
        .unwrap();
    let router = app(AppState::new(ledger).with_token(Some("s3cret".to_owned())));
    let request = Request::builder()
        .uri("/v1/snapshot")
        .body(Body::empty())
        .unwrap();
    let response = router.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        response.headers().get(header::WWW_AUTHENTICATE).unwrap(),
        "Bearer"
    );
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        &bytes[..],
        concat!(
            r#"{"error":{"code":"unauthorized","message":"this route requires a token: "#,
            r#"send the header `Authorization: Bearer <token>`"}}"#
        )
        .as_bytes()
    );
}
