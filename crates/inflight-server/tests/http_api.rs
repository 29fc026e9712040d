//! The HTTP API, in process: every route and every error code, against the
//! router with `tower::ServiceExt::oneshot`, on the memory store and a fake
//! clock (nothing here sleeps).

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use http_body_util::BodyExt;
use inflight::{ErrorKind, FakeClock, Ledger, LedgerConfig, LedgerError, Settings};
use std::num::NonZeroUsize;

use inflight_server::http::auth::token_specs;
use inflight_server::http::{app, ApiError, AppState, Tokens};
use inflight_server::Limits;
use serde_json::{json, Value};
use tower::ServiceExt;

/// 2026-08-13T12:00:00.000Z.
const T0: i64 = 1_786_622_400_000;

struct Api {
    router: Router,
    clock: FakeClock,
    token: Option<&'static str>,
}

fn api() -> Api {
    api_with(LedgerConfig::default(), None)
}

fn api_with(config: LedgerConfig, token: Option<&'static str>) -> Api {
    api_over(config, token, |state| state.with_token(token.map(str::to_owned)))
}

/// The API over a memory ledger on a fake clock, with `state`'s tokens;
/// requests carry `token` unless they say otherwise.
fn api_over(
    config: LedgerConfig,
    token: Option<&'static str>,
    state: impl FnOnce(AppState) -> AppState,
) -> Api {
    let clock = FakeClock::at(inflight::Timestamp::from_millis(T0));
    let ledger = Ledger::builder(config)
        .store_url("memory:")
        .clock(clock.clone())
        .build()
        .expect("memory ledger");
    Api {
        router: app(state(AppState::new(ledger))),
        clock,
        token,
    }
}

/// The legacy `admin` token, a `reader` and a `kb-writer` bound to
/// `knowledge-base`, as a configuration file gives them.
fn scoped_api() -> Api {
    let settings = Settings::from_toml(
        "token = \"admin\"\n\
         [[tokens]]\ntoken = \"reader\"\nscope = \"read\"\n\
         [[tokens]]\ntoken = \"kb-writer\"\nscope = \"write\"\nservices = [\"knowledge-base\"]\n",
    )
    .expect("valid settings");
    let specs = token_specs(settings.token.as_deref(), &settings.tokens).expect("valid tokens");
    let tokens = Tokens::load(specs).expect("inline tokens");
    api_over(LedgerConfig::default(), Some("admin"), |state| {
        state.with_tokens(tokens)
    })
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Value,
}

impl Reply {
    fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("<no error code>")
    }

    /// Asserts an error reply of `status` and `code`, in the JSON shape.
    fn assert_error(&self, status: StatusCode, code: &str, what: &str) {
        assert_eq!(self.status, status, "{what}: {}", self.body);
        assert_eq!(self.code(), code, "{what}: {}", self.body);
        assert!(
            self.body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}: an error carries a message: {}",
            self.body
        );
        assert_eq!(
            self.headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
            Some("application/json"),
            "{what}: errors are JSON"
        );
    }
}

impl Api {
    async fn raw(&self, request: Request<Body>) -> Reply {
        let response = self.router.clone().oneshot(request).await.expect("infallible");
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.expect("body").to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|err| {
                panic!(
                    "{status}: not JSON ({err}): {:?}",
                    String::from_utf8_lossy(&bytes)
                )
            })
        };
        Reply {
            status,
            headers,
            body,
        }
    }

    async fn send(&self, method: Method, uri: &str, body: Option<&str>) -> Reply {
        self.send_with(method, uri, body, self.token).await
    }

    async fn send_with(&self, method: Method, uri: &str, body: Option<&str>, token: Option<&str>) -> Reply {
        let mut request = Request::builder().method(method).uri(uri);
        if let Some(token) = token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let body = body.map_or_else(Body::empty, |b| Body::from(b.to_owned()));
        self.raw(request.body(body).unwrap()).await
    }

    async fn post(&self, uri: &str, body: &str) -> Reply {
        self.send(Method::POST, uri, Some(body)).await
    }

    /// A begin with the `Idempotency-Key` header `key`.
    async fn begin_keyed(&self, uri: &str, body: &Value, key: &[u8]) -> Reply {
        let request = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .header(
                "Idempotency-Key",
                axum::http::HeaderValue::from_bytes(key).unwrap(),
            );
        self.raw(request.body(Body::from(body.to_string())).unwrap())
            .await
    }

    async fn get(&self, uri: &str) -> Reply {
        self.send(Method::GET, uri, None).await
    }

    /// Begins a record; returns its id.
    async fn begin(&self, body: Value) -> String {
        let reply = self.post("/v1/activities", &body.to_string()).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
        reply.body["activityId"].as_str().unwrap().to_owned()
    }

    async fn snapshot(&self) -> Value {
        let reply = self.get("/v1/snapshot").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        reply.body
    }
}

fn kb() -> Value {
    json!({"service": "knowledge-base", "provider": "ollama", "class": "embedding"})
}

/// What a rejected request must leave unchanged.
fn counts(snapshot: &Value) -> Value {
    json!({
        "totalActivities": snapshot["totalActivities"],
        "totalInFlight": snapshot["totalInFlight"],
        "totalRecentCompletions": snapshot["totalRecentCompletions"],
        "totalReaped": snapshot["totalReaped"],
        "totalLateSettles": snapshot["totalLateSettles"],
        "nativeAdmission": snapshot["nativeAdmission"],
    })
}

#[tokio::test]
async fn healthz_answers_ok_without_the_token() {
    let api = api_with(LedgerConfig::default(), Some("s3cret"));
    let reply = api.send_with(Method::GET, "/healthz", None, None).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, json!({"status": "ok"}));
}

#[tokio::test]
async fn the_dashboard_is_served_without_the_token_and_only_runs_its_own_script() {
    let api = api_with(LedgerConfig::default(), Some("s3cret"));
    for (path, content_type) in [
        ("/", "text/html; charset=utf-8"),
        ("/dashboard.js", "text/javascript; charset=utf-8"),
        ("/dashboard.css", "text/css; charset=utf-8"),
    ] {
        let request = Request::get(path).body(Body::empty()).unwrap();
        let response = api.router.clone().oneshot(request).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        let header = |name| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(header(header::CONTENT_TYPE), content_type, "{path}");
        let policy = header(header::CONTENT_SECURITY_POLICY);
        assert!(policy.contains("script-src 'self'"), "{path}: {policy}");
        assert!(policy.contains("connect-src 'self'"), "{path}: {policy}");
        assert_eq!(header(header::X_CONTENT_TYPE_OPTIONS), "nosniff", "{path}");
        let body = response.into_body().collect().await.expect("body").to_bytes();
        assert!(!body.is_empty(), "{path}");
    }
    // The data behind it still needs the token.
    let reply = api.send_with(Method::GET, "/v1/snapshot", None, None).await;
    reply.assert_error(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "snapshot without the token",
    );
}

#[tokio::test]
async fn begin_answers_201_with_the_whole_record() {
    let api = api();
    let reply = api
        .post(
            "/v1/activities",
            &json!({
                "service": "knowledge-base", "provider": "ollama", "class": "embedding",
                "operationStage": "kb-tenant-ingestion-embedding", "model": "nomic-embed-text",
                "priority": "batch", "admission": "queued"
            })
            .to_string(),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    let record = &reply.body;
    for field in [
        "activityId",
        "service",
        "provider",
        "class",
        "operationStage",
        "model",
        "priority",
        "admission",
        "state",
        "disposition",
        "enqueuedAt",
        "startedAt",
        "completedAt",
        "reapedAt",
        "deadlineMs",
        "reapableAt",
        "queueWaitMs",
        "executionMs",
        "success",
        "failureStage",
        "lateSettle",
    ] {
        assert!(
            record.get(field).is_some(),
            "the record carries {field}: {record}"
        );
    }
    assert_eq!(record["state"], "waiting");
    assert_eq!(record["disposition"], Value::Null);
    assert_eq!(record["priority"], "batch");
    assert_eq!(record["enqueuedAt"], "2026-08-13T12:00:00.000Z");
    assert_eq!(record["deadlineMs"], 300_000);
    assert_eq!(record["reapableAt"], "2026-08-13T12:20:00.000Z");
    assert_eq!(record["lateSettle"], false);
    let id = record["activityId"].as_str().unwrap();
    assert_eq!(
        reply.headers.get(header::LOCATION).unwrap(),
        &format!("/v1/activities/{id}")
    );
}

#[tokio::test]
async fn begin_accepts_defaults_timestamps_as_millis_or_rfc3339_and_already_started() {
    let api = api();
    let minimal = api
        .post("/v1/activities", r#"{"service":"kb","provider":"ollama"}"#)
        .await;
    assert_eq!(minimal.status, StatusCode::CREATED, "{}", minimal.body);
    assert_eq!(minimal.body["class"], "unknown");
    assert_eq!(minimal.body["admission"], "queued");
    assert_eq!(minimal.body["priority"], "unknown");

    let started = api
        .post(
            "/v1/activities",
            &json!({
                "service": "kb", "provider": "ollama", "class": "chat", "admission": "direct",
                "enqueuedAt": T0 - 2_000, "startedAt": "2026-08-13T11:59:59.000Z", "deadlineMs": 1_000
            })
            .to_string(),
        )
        .await;
    assert_eq!(started.status, StatusCode::CREATED, "{}", started.body);
    let record = &started.body;
    assert_eq!(record["state"], "executing");
    assert_eq!(record["admission"], "direct");
    assert_eq!(record["enqueuedAt"], "2026-08-13T11:59:58.000Z");
    assert_eq!(record["queueWaitMs"], 1_000);
    assert_eq!(record["deadlineMs"], 1_000);
}

#[tokio::test]
async fn unknown_fields_are_ignored() {
    let api = api();
    let reply = api
        .post(
            "/v1/activities",
            r#"{"service":"kb","provider":"ollama","fromTheFuture":{"x":[1,2]},"tenant":"t-1"}"#,
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    assert_eq!(reply.body["ignoredFields"], json!(["fromTheFuture", "tenant"]));
    let id = reply.body["activityId"].as_str().unwrap();
    let settled = api
        .post(
            &format!("/v1/activities/{id}/settle"),
            r#"{"success":true,"extra":1}"#,
        )
        .await;
    assert_eq!(settled.status, StatusCode::OK, "{}", settled.body);
    assert!(
        settled.body.get("ignoredFields").is_none(),
        "a begin's answer only"
    );
}

#[tokio::test]
async fn a_begin_keeps_its_traceparent_and_a_malformed_one_is_refused_naming_it() {
    let api = api();
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let begin = |traceparent: &'static str| {
        Request::builder()
            .method(Method::POST)
            .uri("/v1/activities")
            .header(header::CONTENT_TYPE, "application/json")
            .header("traceparent", traceparent)
            .body(Body::from(r#"{"service":"kb","provider":"ollama"}"#))
            .unwrap()
    };
    let begun = api.raw(begin(parent)).await;
    assert_eq!(begun.status, StatusCode::CREATED, "{}", begun.body);
    assert_eq!(begun.body["traceparent"], parent);
    let id = begun.body["activityId"].as_str().unwrap();
    let read = api.get(&format!("/v1/activities/{id}")).await;
    assert_eq!(read.body["traceparent"], parent, "kept with the record");
    let plain = api.begin(json!({"service": "kb", "provider": "ollama"})).await;
    let read = api.get(&format!("/v1/activities/{plain}")).await;
    assert!(read.body.get("traceparent").is_none(), "{}", read.body);

    let before = api.snapshot().await["totalActivities"].clone();
    assert_eq!(before, 2);
    for bad in [
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ] {
        let refused = api.raw(begin(bad)).await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(refused.body["error"]["code"], "invalid_request");
        let message = refused.body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("traceparent: "), "{message}");
    }
    assert_eq!(
        api.snapshot().await["totalActivities"],
        before,
        "a refused begin records nothing"
    );
}

#[tokio::test]
async fn a_begin_answers_the_fields_it_ignored() {
    let api = api();
    let misspelled = api
        .post(
            "/v1/activities",
            r#"{"service":"kb","provider":"ollama","clas":"embedding","modle":"x"}"#,
        )
        .await;
    assert_eq!(misspelled.status, StatusCode::CREATED, "{}", misspelled.body);
    assert_eq!(misspelled.body["class"], "unknown");
    assert_eq!(misspelled.body["ignoredFields"], json!(["clas", "modle"]));
    let started = api
        .post(
            "/v1/activities?start=now",
            r#"{"service":"kb","provider":"ollama","class":"embedding","Model":"x"}"#,
        )
        .await;
    assert_eq!(
        started.body["ignoredFields"],
        json!(["Model"]),
        "{}",
        started.body
    );
    let spelled = api
        .post(
            "/v1/activities",
            r#"{"service":"kb","provider":"ollama","class":"embedding","model":"x","enqueuedAt":null}"#,
        )
        .await;
    assert!(spelled.body.get("ignoredFields").is_none(), "{}", spelled.body);
    let fields: Vec<String> = (0..100)
        .map(|i| format!("\"{}{i}\": 1", "y".repeat(200)))
        .collect();
    let hostile = api
        .post(
            "/v1/activities",
            &format!("{{\"service\":\"kb\",\"provider\":\"o\",{}}}", fields.join(",")),
        )
        .await;
    let ignored = hostile.body["ignoredFields"].as_array().unwrap();
    assert_eq!(ignored.len(), 16, "bounded");
    assert!(ignored.iter().all(|name| name.as_str().unwrap().len() == 64));
}

#[tokio::test]
async fn epoch_seconds_are_refused_naming_the_field_and_saying_so() {
    let api = api();
    let seconds = T0 / 1000;
    let begun = api
        .post("/v1/activities", r#"{"service":"kb","provider":"o"}"#)
        .await;
    let id = begun.body["activityId"].as_str().unwrap().to_owned();
    for (path, body, field) in [
        (
            "/v1/activities".to_owned(),
            json!({"service": "kb", "provider": "o", "enqueuedAt": seconds}),
            "enqueuedAt",
        ),
        (
            "/v1/activities".to_owned(),
            json!({"service": "kb", "provider": "o", "startedAt": seconds}),
            "startedAt",
        ),
        (
            format!("/v1/activities/{id}/start"),
            json!({"startedAt": seconds}),
            "startedAt",
        ),
        (
            format!("/v1/activities/{id}/settle"),
            json!({"success": true, "completedAt": seconds}),
            "completedAt",
        ),
        // The last instant refused, and an RFC 3339 time as early.
        (
            "/v1/activities".to_owned(),
            json!({"service": "kb", "provider": "o", "enqueuedAt": 999_999_999_999_i64}),
            "enqueuedAt",
        ),
        (
            "/v1/activities".to_owned(),
            json!({"service": "kb", "provider": "o", "enqueuedAt": "1999-12-31T23:59:59Z"}),
            "enqueuedAt",
        ),
    ] {
        let reply = api.post(&path, &body.to_string()).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", &body.to_string());
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(&format!("`{field}`: ")), "{body}: {message}");
        assert!(
            message.contains("looks like epoch seconds") && message.contains("multiply by 1000"),
            "{message}"
        );
        // A time sent as text is shown as the time it is, not as a number.
        if let Some(text) = body[field].as_str() {
            assert!(message.contains(&text[..10]), "{message}");
        }
    }
    let snapshot = api.get("/v1/snapshot").await;
    assert_eq!(snapshot.body["totalActivities"], 1, "only the first begin landed");
    assert_eq!(snapshot.body["status"], "ok", "nothing reaped on arrival");
    let earliest = api
        .post(
            "/v1/activities",
            &json!({"service": "kb", "provider": "o", "enqueuedAt": 1_000_000_000_000_i64}).to_string(),
        )
        .await;
    assert_eq!(earliest.status, StatusCode::CREATED, "{}", earliest.body);
}

#[tokio::test]
async fn the_snapshot_warns_of_a_misspelled_lane_and_an_unknown_class() {
    let config = LedgerConfig::default()
        .with_lane_cap("knowledge-base::olama", 4)
        .unwrap();
    let api = api_with(config, None);
    let quiet = api.get("/v1/snapshot").await;
    assert_eq!(quiet.body["warnings"], json!([]), "none before any call");
    let mut ids = Vec::new();
    for _ in 0..4 {
        let begun = api
            .post(
                "/v1/activities?start=now",
                r#"{"service":"knowledge-base","provider":"ollama","class":"embeding"}"#,
            )
            .await;
        assert_eq!(begun.status, StatusCode::CREATED, "{}", begun.body);
        ids.push(begun.body["activityId"].as_str().unwrap().to_owned());
    }
    let snapshot = api.get("/v1/snapshot").await;
    let warnings = snapshot.body["warnings"].as_array().unwrap();
    let codes: Vec<&str> = warnings.iter().map(|w| w["code"].as_str().unwrap()).collect();
    assert_eq!(codes, ["lane_unused_near_miss", "unknown_class"], "{warnings:?}");
    let lane = warnings[0]["message"].as_str().unwrap();
    assert!(
        lane.starts_with("lane knowledge-base::olama is capped at 4 but has no calls since ")
            && lane.contains("while knowledge-base::ollama (one or two edits away) has"),
        "{lane}"
    );
    let class = warnings[1]["message"].as_str().unwrap();
    assert!(
        class.starts_with("class embeding (did you mean embedding?) is not configured, and calls use it (4 in all, seen since "),
        "{class}"
    );
    // Settled and past the window, the calls no longer count, nor their
    // warnings (calls in flight always do).
    for id in &ids {
        api.post(&format!("/v1/activities/{id}/settle"), r#"{"success":true}"#)
            .await;
    }
    api.clock.advance(Duration::from_secs(60));
    let later = api.get("/v1/snapshot?since=30s").await;
    assert_eq!(later.body["warnings"], json!([]), "{}", later.body["warnings"]);
}

#[tokio::test]
async fn begin_refuses_each_invalid_input_with_400_and_records_nothing() {
    let api = api();
    let future = T0 + 6 * 60 * 1000;
    let cases: Vec<(&str, String)> = vec![
        ("malformed JSON", "{\"service\": \"kb\",".to_owned()),
        ("not an object", "[1, 2]".to_owned()),
        ("a JSON string", "\"kb\"".to_owned()),
        ("empty body", String::new()),
        ("missing service", json!({"provider": "ollama"}).to_string()),
        ("missing provider", json!({"service": "kb"}).to_string()),
        (
            "null service",
            json!({"service": null, "provider": "ollama"}).to_string(),
        ),
        (
            "service not a string",
            json!({"service": 7, "provider": "ollama"}).to_string(),
        ),
        (
            "bad service label",
            json!({"service": "knowledge base", "provider": "ollama"}).to_string(),
        ),
        (
            "empty provider label",
            json!({"service": "kb", "provider": ""}).to_string(),
        ),
        (
            "overlong label",
            json!({"service": "k".repeat(65), "provider": "ollama"}).to_string(),
        ),
        (
            "bad class label",
            json!({"service": "kb", "provider": "o", "class": "a/b"}).to_string(),
        ),
        (
            "bad stage label",
            json!({"service": "kb", "provider": "o", "operationStage": "x y"}).to_string(),
        ),
        (
            "unknown admission",
            json!({"service": "kb", "provider": "o", "admission": "vip"}).to_string(),
        ),
        (
            "admission not a string",
            json!({"service": "kb", "provider": "o", "admission": true}).to_string(),
        ),
        (
            "unknown priority",
            json!({"service": "kb", "provider": "o", "priority": "urgent"}).to_string(),
        ),
        (
            "bad timestamp text",
            json!({"service": "kb", "provider": "o", "enqueuedAt": "yesterday"}).to_string(),
        ),
        (
            "timestamp as float",
            json!({"service": "kb", "provider": "o", "enqueuedAt": 1.5}).to_string(),
        ),
        (
            "negative timestamp",
            json!({"service": "kb", "provider": "o", "enqueuedAt": -1}).to_string(),
        ),
        (
            "huge timestamp",
            json!({"service": "kb", "provider": "o", "startedAt": i64::MAX}).to_string(),
        ),
        (
            "timestamp as bool",
            json!({"service": "kb", "provider": "o", "startedAt": true}).to_string(),
        ),
        (
            "enqueuedAt in the future",
            json!({"service": "kb", "provider": "o", "enqueuedAt": future}).to_string(),
        ),
        (
            "startedAt in the future",
            json!({"service": "kb", "provider": "o", "startedAt": future}).to_string(),
        ),
        (
            "startedAt before enqueuedAt",
            json!({"service": "kb", "provider": "o", "enqueuedAt": T0, "startedAt": T0 - 1}).to_string(),
        ),
        (
            "zero deadline",
            json!({"service": "kb", "provider": "o", "deadlineMs": 0}).to_string(),
        ),
        (
            "negative estimate",
            json!({"service": "kb", "provider": "o", "maxTokens": -1}).to_string(),
        ),
        (
            "estimate past 10^9",
            json!({"service": "kb", "provider": "o", "maxTokens": 1_000_000_001_i64}).to_string(),
        ),
        (
            "estimate as a fraction",
            json!({"service": "kb", "provider": "o", "maxTokens": 1.5}).to_string(),
        ),
        (
            "deadline as text",
            json!({"service": "kb", "provider": "o", "deadlineMs": "5m"}).to_string(),
        ),
    ];
    for (what, body) in &cases {
        let reply = api.send(Method::POST, "/v1/activities", Some(body)).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", what);
    }
    let snapshot = api.snapshot().await;
    assert_eq!(snapshot["totalActivities"], 0, "a rejected begin records nothing");
}

#[tokio::test]
async fn get_answers_the_record_404_for_an_unknown_id_and_400_for_a_malformed_one() {
    let api = api();
    let id = api.begin(kb()).await;
    let reply = api.get(&format!("/v1/activities/{id}")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body["activityId"], id.as_str());

    let unknown = api
        .get("/v1/activities/6f1c1a3e-7d35-4e1b-9a3c-2f1f0f6a9b10")
        .await;
    unknown.assert_error(StatusCode::NOT_FOUND, "not_found", "unknown id");
    for bad in ["not-a-uuid", "123", "%FF%FE"] {
        let reply = api.get(&format!("/v1/activities/{bad}")).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", bad);
        for action in ["start", "settle", "cancel", "refine"] {
            let reply = api.post(&format!("/v1/activities/{bad}/{action}"), "{}").await;
            reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", action);
        }
    }
    for action in ["start", "settle", "cancel"] {
        let reply = api
            .post(
                &format!("/v1/activities/6f1c1a3e-7d35-4e1b-9a3c-2f1f0f6a9b10/{action}"),
                r#"{"success": true}"#,
            )
            .await;
        reply.assert_error(StatusCode::NOT_FOUND, "not_found", action);
    }
}

#[tokio::test]
async fn start_is_200_a_retry_is_harmless_and_a_settled_record_is_409() {
    let api = api();
    let id = api.begin(kb()).await;
    api.clock.advance(Duration::from_secs(2));
    let empty_body = api
        .send(Method::POST, &format!("/v1/activities/{id}/start"), None)
        .await;
    assert_eq!(
        empty_body.status,
        StatusCode::OK,
        "an empty body is `{{}}`: {}",
        empty_body.body
    );
    assert_eq!(empty_body.body["state"], "executing");
    assert_eq!(empty_body.body["queueWaitMs"], 2_000);

    api.clock.advance(Duration::from_secs(1));
    let retry = api.post(&format!("/v1/activities/{id}/start"), "{}").await;
    assert_eq!(retry.status, StatusCode::OK);
    assert_eq!(retry.body, empty_body.body, "a retried start changes nothing");

    let other = api.begin(kb()).await;
    let at = api
        .post(
            &format!("/v1/activities/{other}/start"),
            r#"{"startedAt": "2026-08-13T12:00:04.000Z"}"#,
        )
        .await;
    assert_eq!(at.status, StatusCode::OK, "{}", at.body);
    assert_eq!(at.body["startedAt"], "2026-08-13T12:00:04.000Z");

    let bad = api.begin(kb()).await;
    for (what, body) in [
        ("malformed", "{"),
        ("bad startedAt", r#"{"startedAt": "soon"}"#),
        (
            "startedAt before enqueuedAt",
            &*format!(r#"{{"startedAt": {}}}"#, T0 - 1),
        ),
    ] {
        let reply = api.post(&format!("/v1/activities/{bad}/start"), body).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", what);
    }
    assert_eq!(
        api.get(&format!("/v1/activities/{bad}")).await.body["state"],
        "waiting"
    );

    api.post(&format!("/v1/activities/{id}/settle"), r#"{"success": true}"#)
        .await;
    let conflict = api.post(&format!("/v1/activities/{id}/start"), "{}").await;
    conflict.assert_error(StatusCode::CONFLICT, "conflict", "start after settle");
}

#[tokio::test]
async fn settle_is_200_a_repeat_is_harmless_and_a_different_outcome_is_409() {
    let api = api();
    let id = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{id}/start"), "{}").await;
    api.clock.advance(Duration::from_millis(1_500));
    let settled = api
        .post(
            &format!("/v1/activities/{id}/settle"),
            r#"{"success": false, "failureStage": "provider"}"#,
        )
        .await;
    assert_eq!(settled.status, StatusCode::OK, "{}", settled.body);
    assert_eq!(settled.body["state"], "failed");
    assert_eq!(settled.body["success"], false);
    assert_eq!(settled.body["failureStage"], "provider");
    assert_eq!(settled.body["executionMs"], 1_500);
    assert_eq!(settled.body["reapableAt"], Value::Null);

    let repeat = api
        .post(
            &format!("/v1/activities/{id}/settle"),
            r#"{"success": false, "failureStage": "provider"}"#,
        )
        .await;
    assert_eq!(repeat.status, StatusCode::OK);
    assert_eq!(repeat.body, settled.body, "a repeated settle changes nothing");

    let before = counts(&api.snapshot().await);
    let different = api
        .post(&format!("/v1/activities/{id}/settle"), r#"{"success": true}"#)
        .await;
    different.assert_error(StatusCode::CONFLICT, "conflict", "a different outcome");
    assert_eq!(api.get(&format!("/v1/activities/{id}")).await.body, settled.body);
    assert_eq!(counts(&api.snapshot().await), before);

    let with_time = api.begin(kb()).await;
    let reply = api
        .post(
            &format!("/v1/activities/{with_time}/settle"),
            &json!({"success": true, "completedAt": "2026-08-13T12:00:02.000Z"}).to_string(),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["completedAt"], "2026-08-13T12:00:02.000Z");
}

#[tokio::test]
async fn settle_refuses_each_malformed_body_with_400_and_changes_nothing() {
    let api = api();
    let id = api.begin(kb()).await;
    let before = api.get(&format!("/v1/activities/{id}")).await.body;
    let counts_before = counts(&api.snapshot().await);
    for (what, body) in [
        ("empty body", ""),
        ("malformed JSON", "{\"success\": tru"),
        ("missing success", r#"{"failureStage": "provider"}"#),
        ("success as a string", r#"{"success": "true"}"#),
        ("success as a number", r#"{"success": 1}"#),
        ("success null", r#"{"success": null}"#),
        (
            "unknown failureStage",
            r#"{"success": false, "failureStage": "network"}"#,
        ),
        ("bad completedAt", r#"{"success": true, "completedAt": "noon"}"#),
        (
            "completedAt before enqueuedAt",
            &*format!(r#"{{"success": true, "completedAt": {}}}"#, T0 - 1),
        ),
        (
            "completedAt in the future",
            &*format!(r#"{{"success": true, "completedAt": {}}}"#, T0 + 600_000),
        ),
    ] {
        let reply = api.post(&format!("/v1/activities/{id}/settle"), body).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", what);
    }
    assert_eq!(api.get(&format!("/v1/activities/{id}")).await.body, before);
    assert_eq!(counts(&api.snapshot().await), counts_before);
}

#[tokio::test]
async fn cancel_is_200_and_a_cancel_of_a_success_is_409() {
    let api = api();
    let id = api.begin(kb()).await;
    let cancelled = api
        .post(
            &format!("/v1/activities/{id}/cancel"),
            r#"{"reason": "client went away"}"#,
        )
        .await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    assert_eq!(cancelled.body["state"], "cancelled");
    assert_eq!(cancelled.body["success"], Value::Null);

    let bare = api.begin(kb()).await;
    let reply = api
        .send(Method::POST, &format!("/v1/activities/{bare}/cancel"), None)
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);

    let bad_reason = api.begin(kb()).await;
    let reply = api
        .post(
            &format!("/v1/activities/{bad_reason}/cancel"),
            r#"{"reason": 42}"#,
        )
        .await;
    reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", "reason not a string");

    let done = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{done}/settle"), r#"{"success": true}"#)
        .await;
    let conflict = api.post(&format!("/v1/activities/{done}/cancel"), "{}").await;
    conflict.assert_error(StatusCode::CONFLICT, "conflict", "cancel after success");
}

#[tokio::test]
async fn a_settle_carries_usage_and_bad_usage_is_a_400_naming_the_field_that_changes_nothing() {
    let api = api();
    let id = api.begin(kb()).await;
    let path = format!("/v1/activities/{id}/settle");
    let before = api.get(&format!("/v1/activities/{id}")).await.body;
    for (what, body, field) in [
        (
            "negative",
            r#"{"success": true, "usage": {"inputTokens": -1}}"#,
            "usage.inputTokens",
        ),
        (
            "past 10^9",
            r#"{"success": true, "usage": {"outputTokens": 1000000001}}"#,
            "usage.outputTokens",
        ),
        (
            "a fraction",
            r#"{"success": true, "usage": {"inputTokens": 1.5}}"#,
            "usage.inputTokens",
        ),
        (
            "a string",
            r#"{"success": true, "usage": {"inputTokens": "12"}}"#,
            "usage.inputTokens",
        ),
        (
            "misspelled",
            r#"{"success": true, "usage": {"input_tokens": 12}}"#,
            "input_tokens",
        ),
        ("not an object", r#"{"success": true, "usage": 12}"#, "usage"),
    ] {
        let reply = api.post(&path, body).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", what);
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{what}: {message}");
    }
    assert_eq!(api.get(&format!("/v1/activities/{id}")).await.body, before);

    let settled = api
        .post(
            &path,
            r#"{"success": true, "usage": {"inputTokens": 812, "outputTokens": 64}}"#,
        )
        .await;
    assert_eq!(settled.status, StatusCode::OK, "{}", settled.body);
    assert_eq!(
        (
            settled.body["inputTokens"].clone(),
            settled.body["outputTokens"].clone()
        ),
        (json!(812), json!(64))
    );
    let snap = api.snapshot().await;
    let aggregate = &snap["aggregates"][0];
    assert_eq!(
        (
            aggregate["inputTokens"].clone(),
            aggregate["outputTokens"].clone()
        ),
        (json!(812), json!(64))
    );
}

/// The issue's scenario over HTTP: `tokens_per_minute = 1000`, three
/// begins of `maxTokens` 400; the third start is a 429 `budget_exhausted`
/// with its `Retry-After`, and keeps its place; an estimate over the whole
/// budget is a 400 naming it, recording nothing.
#[tokio::test]
async fn a_start_over_the_token_budget_is_429_budget_exhausted_with_retry_after() {
    let config = LedgerConfig::default()
        .with_lane_budget("kb::openai", 1_000)
        .unwrap();
    let api = api_with(config, None);
    let call = json!({"service": "kb", "provider": "openai", "class": "chat", "maxTokens": 400});
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(api.begin(call.clone()).await);
    }
    for id in &ids[..2] {
        let started = api.post(&format!("/v1/activities/{id}/start"), "").await;
        assert_eq!(started.status, StatusCode::OK, "{}", started.body);
    }
    let refused = api.post(&format!("/v1/activities/{}/start", ids[2]), "").await;
    refused.assert_error(
        StatusCode::TOO_MANY_REQUESTS,
        "budget_exhausted",
        "the third start",
    );
    assert_eq!(
        refused
            .headers
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()),
        Some("60"),
        "only a settle makes room: a window's length"
    );
    let message = refused.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("tokens_per_minute 1000"), "{message}");
    let third = api.get(&format!("/v1/activities/{}", ids[2])).await.body;
    assert_eq!(third["state"], "waiting");
    let lane = api.snapshot().await["nativeAdmission"]["kb::openai"].clone();
    assert_eq!(
        (
            lane["tokensReserved"].clone(),
            lane["tokensPerMinute"].clone(),
            lane["cap"].clone()
        ),
        (json!(800), json!(1000), Value::Null)
    );

    // The first spends 100: room comes back at once, and the window then
    // names when the rest rolls off.
    api.clock.advance(std::time::Duration::from_millis(500));
    let settled = api
        .post(
            &format!("/v1/activities/{}/settle", ids[0]),
            r#"{"success": true, "usage": {"inputTokens": 80, "outputTokens": 20}}"#,
        )
        .await;
    assert_eq!(settled.status, StatusCode::OK, "{}", settled.body);
    let started = api.post(&format!("/v1/activities/{}/start", ids[2]), "").await;
    assert_eq!(started.status, StatusCode::OK, "{}", started.body);
    let fourth = api
        .begin(json!({"service": "kb", "provider": "openai", "maxTokens": 200}))
        .await;
    let refused = api.post(&format!("/v1/activities/{fourth}/start"), "").await;
    refused.assert_error(
        StatusCode::TOO_MANY_REQUESTS,
        "budget_exhausted",
        "the fourth start",
    );
    let message = refused.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(": 900 tokens were spent"),
        "100 charged and 800 reserved: {message}"
    );
    // Charged at 0.5 s into its second: it leaves the window 60.5 s later.
    assert_eq!(
        refused
            .headers
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()),
        Some("61")
    );

    let before = api.snapshot().await["totalActivities"].clone();
    let over = api
        .post(
            "/v1/activities",
            &json!({"service": "kb", "provider": "openai", "maxTokens": 1001}).to_string(),
        )
        .await;
    over.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "an estimate over the budget",
    );
    let message = over.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("tokens_per_minute = 1000"), "{message}");
    assert_eq!(
        api.snapshot().await["totalActivities"],
        before,
        "nothing recorded"
    );
}

#[tokio::test]
async fn refine_sets_the_model_once_folds_a_second_to_unknown_and_409s_when_ended() {
    let api = api();
    let id = api.begin(kb()).await;
    let path = format!("/v1/activities/{id}/refine");
    let first = api.post(&path, r#"{"model": "llama3.1:8b"}"#).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    assert_eq!(
        (first.body["model"].clone(), first.body["refined"].clone()),
        (json!("llama3.1:8b"), json!(true))
    );
    let again = api.post(&path, r#"{"model": "llama3.1:8b"}"#).await;
    assert_eq!(again.body, first.body, "the same model again changes nothing");
    let folded = api.post(&path, r#"{"model": "qwen2.5:7b"}"#).await;
    assert_eq!(folded.status, StatusCode::OK);
    assert_eq!(folded.body["model"], "unknown");

    // The snapshot attributes the call to its final model, totals unchanged.
    let snap = api.snapshot().await;
    assert_eq!(snap["totalActivities"], 1);
    let models: Vec<_> = snap["aggregates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["model"].as_str().unwrap().to_owned(),
                a["calls"].as_i64().unwrap(),
            )
        })
        .collect();
    assert!(models.contains(&("unknown".to_owned(), 1)), "{models:?}");
    assert!(!models.iter().any(|(_, calls)| *calls > 1), "{models:?}");

    let before = api.get(&format!("/v1/activities/{id}")).await.body;
    for (what, body) in [
        ("empty body", ""),
        ("malformed JSON", "{\"model\": "),
        ("missing model", "{}"),
        ("model not a string", r#"{"model": 7}"#),
        ("empty model", r#"{"model": "  "}"#),
    ] {
        let reply = api.post(&path, body).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", what);
    }
    assert_eq!(api.get(&format!("/v1/activities/{id}")).await.body, before);

    api.post(&format!("/v1/activities/{id}/settle"), r#"{"success": true}"#)
        .await;
    let ended = api.post(&path, r#"{"model": "llama3.1:8b"}"#).await;
    ended.assert_error(StatusCode::CONFLICT, "conflict", "refine after settle");
    let missing = api
        .post(
            "/v1/activities/6f1c1a3e-7d35-4e1b-9a3c-2f1f0f6a9b10/refine",
            r#"{"model": "m"}"#,
        )
        .await;
    missing.assert_error(StatusCode::NOT_FOUND, "not_found", "unknown id");
}

#[tokio::test]
async fn a_repeated_begin_with_its_idempotency_key_is_200_with_the_same_record() {
    let api = api();
    let first = api.begin_keyed("/v1/activities", &kb(), b"retry-1").await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert!(!first.headers.contains_key("idempotent-replayed"));
    api.clock.advance(Duration::from_secs(1));
    let again = api.begin_keyed("/v1/activities", &kb(), b"retry-1").await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(again.headers[header::LOCATION], first.headers[header::LOCATION]);
    assert_eq!(again.body, first.body, "the record as it stands");
    assert_eq!(api.snapshot().await["totalActivities"], 1);

    // The same key with another request: 409, and nothing recorded.
    let before = counts(&api.snapshot().await);
    let other = json!({"service": "knowledge-base", "provider": "ollama", "class": "chat"});
    let conflict = api.begin_keyed("/v1/activities", &other, b"retry-1").await;
    conflict.assert_error(StatusCode::CONFLICT, "idempotency_conflict", "another body");
    let started = api
        .begin_keyed("/v1/activities?start=now", &kb(), b"retry-1")
        .await;
    started.assert_error(StatusCode::CONFLICT, "idempotency_conflict", "another query");
    for (what, key) in [
        ("empty", &b""[..]),
        ("too long", &[b'k'; 256][..]),
        ("not ASCII", "cl\u{e9}".as_bytes()),
        ("a control character", b"tab\tkey"),
    ] {
        let reply = api.begin_keyed("/v1/activities", &kb(), key).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", what);
        assert!(
            reply.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Idempotency-Key"),
            "{what}: names the header: {}",
            reply.body
        );
    }
    assert_eq!(counts(&api.snapshot().await), before);

    // Started now: a repeat answers the executing record; once it ended,
    // the ended one.
    let executing = api
        .begin_keyed("/v1/activities?start=now&wait=1s", &kb(), b"started")
        .await;
    assert_eq!(executing.status, StatusCode::CREATED, "{}", executing.body);
    let id = executing.body["activityId"].as_str().unwrap().to_owned();
    api.post(&format!("/v1/activities/{id}/settle"), r#"{"success": true}"#)
        .await;
    let ended = api
        .begin_keyed("/v1/activities?start=now&wait=1s", &kb(), b"started")
        .await;
    assert_eq!(ended.status, StatusCode::OK, "{}", ended.body);
    assert_eq!(ended.body["activityId"], id.as_str());
    assert_eq!(ended.body["state"], "succeeded");
}

#[tokio::test]
async fn a_settle_or_cancel_after_the_reap_is_200_late_settle_and_never_a_completion() {
    let api = api();
    let started = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{started}/start"), "{}").await;
    let waiting = api.begin(kb()).await;
    // embedding: deadline 5 min, factor 4: reapable 20 min after the start.
    api.clock.advance(Duration::from_secs(20 * 60 + 1));

    let late = api
        .post(
            &format!("/v1/activities/{started}/settle"),
            r#"{"success": true}"#,
        )
        .await;
    assert_eq!(late.status, StatusCode::OK, "{}", late.body);
    assert_eq!(late.body["state"], "reaped");
    assert_eq!(late.body["disposition"], "unsettled");
    assert_eq!(late.body["lateSettle"], true);
    assert_eq!(late.body["success"], Value::Null);

    let late_cancel = api.post(&format!("/v1/activities/{waiting}/cancel"), "{}").await;
    assert_eq!(late_cancel.status, StatusCode::OK, "{}", late_cancel.body);
    assert_eq!(late_cancel.body["state"], "reaped");
    assert_eq!(late_cancel.body["disposition"], "abandoned");
    assert_eq!(late_cancel.body["lateSettle"], true);

    let snapshot = api.snapshot().await;
    assert_eq!(snapshot["totalRecentCompletions"], 0);
    assert_eq!(snapshot["totalReaped"], 2);
    assert_eq!(snapshot["totalLateSettles"], 2);
    let lane = &snapshot["nativeAdmission"]["knowledge-base::ollama"];
    assert_eq!(lane["executing"], 0);
    assert_eq!(lane["reaped"], json!({"abandoned": 1, "unsettled": 1}));
}

#[tokio::test]
async fn snapshot_reports_lanes_and_honours_limit_and_since() {
    let mut config_text = String::from("[lanes.\"knowledge-base::ollama\"]\ncap = 4\n");
    config_text.push_str("[classes.embedding]\ndeadline = \"5m\"\n");
    let settings = Settings::from_toml(&config_text).unwrap();
    let api = api_with(settings.ledger, None);
    for _ in 0..3 {
        let id = api.begin(kb()).await;
        api.post(&format!("/v1/activities/{id}/start"), "{}").await;
    }
    api.begin(kb()).await;
    let done = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{done}/settle"), r#"{"success": true}"#)
        .await;

    let snapshot = api.snapshot().await;
    assert_eq!(snapshot["status"], "ok");
    let lane = &snapshot["nativeAdmission"]["knowledge-base::ollama"];
    assert_eq!(lane["cap"], 4);
    assert_eq!(lane["executing"], 3);
    assert_eq!(lane["waiting"], 1);
    assert_eq!(snapshot["totalActivities"], 5);
    assert_eq!(snapshot["totalInFlight"], 4);
    assert_eq!(snapshot["inFlight"].as_array().unwrap().len(), 4);

    let limited = api.get("/v1/snapshot?limit=2&since=1h").await;
    assert_eq!(limited.status, StatusCode::OK, "{}", limited.body);
    assert_eq!(limited.body["inFlight"].as_array().unwrap().len(), 2);
    assert_eq!(limited.body["inFlightTruncated"], true);
    assert_eq!(limited.body["since"], "2026-08-13T11:00:00.000Z");

    let at = api.get("/v1/snapshot?since=2026-08-13T12:00:00.001Z").await;
    assert_eq!(at.status, StatusCode::OK, "{}", at.body);
    assert_eq!(
        at.body["totalRecentCompletions"], 0,
        "the completion is before the window"
    );

    for (what, query) in [
        ("limit 0", "limit=0"),
        ("limit too big", "limit=10001"),
        ("limit negative", "limit=-3"),
        ("limit not a number", "limit=ten"),
        ("since not a duration", "since=yesterday"),
        ("since empty", "since="),
    ] {
        let reply = api.get(&format!("/v1/snapshot?{query}")).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", what);
    }
}

#[tokio::test]
async fn reap_answers_what_this_call_reaped() {
    let api = api();
    let started = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{started}/start"), "{}").await;
    api.begin(kb()).await;
    let nothing = api.post("/v1/reap", "").await;
    assert_eq!(nothing.status, StatusCode::OK);
    assert_eq!(nothing.body, json!({"abandoned": 0, "unsettled": 0}));

    api.clock.advance(Duration::from_secs(20 * 60 + 1));
    let reaped = api.send(Method::POST, "/v1/reap", None).await;
    assert_eq!(reaped.status, StatusCode::OK);
    assert_eq!(reaped.body, json!({"abandoned": 1, "unsettled": 1}));
    let again = api.post("/v1/reap", "{}").await;
    assert_eq!(again.body, json!({"abandoned": 0, "unsettled": 0}));
}

#[tokio::test]
async fn with_a_token_every_v1_route_and_metrics_answer_401_without_it() {
    let api = api_with(LedgerConfig::default(), Some("s3cret"));
    let id = api.begin(kb()).await; // with the token
    let routes = [
        (Method::POST, "/v1/activities".to_owned()),
        (Method::GET, format!("/v1/activities/{id}")),
        (Method::POST, format!("/v1/activities/{id}/start")),
        (Method::POST, format!("/v1/activities/{id}/settle")),
        (Method::POST, format!("/v1/activities/{id}/cancel")),
        (Method::GET, "/v1/snapshot".to_owned()),
        (Method::POST, "/v1/reap".to_owned()),
        (Method::GET, "/metrics".to_owned()),
        (Method::GET, "/v1/unknown".to_owned()),
    ];
    for (method, uri) in &routes {
        for token in [None, Some("wrong"), Some("s3cre"), Some("s3cret-and-more")] {
            let reply = api.send_with(method.clone(), uri, Some("{}"), token).await;
            reply.assert_error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                &format!("{method} {uri} {token:?}"),
            );
            assert!(reply.headers.contains_key(header::WWW_AUTHENTICATE));
        }
    }
    assert_eq!(
        api.get(&format!("/v1/activities/{id}")).await.body["state"],
        "waiting"
    );
    let snapshot = api.snapshot().await;
    assert_eq!(
        snapshot["totalActivities"], 1,
        "unauthorized requests change nothing"
    );
}

#[tokio::test]
async fn a_missing_token_and_a_wrong_one_are_told_apart() {
    let api = api_with(LedgerConfig::default(), Some("s3cret"));
    let missing = api.send_with(Method::GET, "/v1/snapshot", None, None).await;
    let wrong = api
        .send_with(Method::GET, "/v1/snapshot", None, Some("guess"))
        .await;
    missing.assert_error(StatusCode::UNAUTHORIZED, "unauthorized", "no token");
    wrong.assert_error(StatusCode::UNAUTHORIZED, "unauthorized", "a wrong token");
    let message = |reply: &Reply| reply.body["error"]["message"].as_str().unwrap().to_owned();
    assert!(message(&missing).contains("requires a token"), "{}", missing.body);
    assert!(
        message(&wrong).contains("not one of the server's tokens"),
        "{}",
        wrong.body
    );
}

#[tokio::test]
async fn a_read_token_reads_everything_and_writes_nothing() {
    let api = scoped_api();
    let id = api.begin(kb()).await; // as admin
    let owner = api.post("/v1/owners", r#"{"name": "worker-a"}"#).await.body["ownerId"]
        .as_str()
        .unwrap()
        .to_owned();
    let before = counts(&api.snapshot().await);
    for uri in [format!("/v1/activities/{id}"), "/v1/snapshot".to_owned()] {
        let reply = api.send_with(Method::GET, &uri, None, Some("reader")).await;
        assert_eq!(reply.status, StatusCode::OK, "GET {uri}: {}", reply.body);
    }
    let scrape = Request::get("/metrics")
        .header(header::AUTHORIZATION, "Bearer reader")
        .body(Body::empty())
        .unwrap();
    let scrape = api.router.clone().oneshot(scrape).await.expect("infallible");
    assert_eq!(scrape.status(), StatusCode::OK, "a read token scrapes /metrics");
    let writes = [
        (Method::POST, "/v1/activities".to_owned(), kb().to_string()),
        (
            Method::POST,
            format!("/v1/activities/{id}/start"),
            "{}".to_owned(),
        ),
        (
            Method::POST,
            format!("/v1/activities/{id}/settle"),
            r#"{"success": true}"#.to_owned(),
        ),
        (
            Method::POST,
            format!("/v1/activities/{id}/cancel"),
            "{}".to_owned(),
        ),
        (Method::POST, "/v1/reap".to_owned(), String::new()),
        (
            Method::POST,
            "/v1/owners".to_owned(),
            r#"{"name": "x"}"#.to_owned(),
        ),
        (Method::POST, format!("/v1/owners/{owner}/renew"), String::new()),
        (Method::DELETE, format!("/v1/owners/{owner}"), String::new()),
    ];
    for (method, uri, body) in &writes {
        let body = (!body.is_empty()).then_some(body.as_str());
        let reply = api.send_with(method.clone(), uri, body, Some("reader")).await;
        reply.assert_error(StatusCode::FORBIDDEN, "forbidden", &format!("{method} {uri}"));
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("read") && message.contains("write token"),
            "{message}"
        );
    }
    assert_eq!(
        counts(&api.snapshot().await),
        before,
        "refused writes change nothing"
    );
    assert_eq!(
        api.get(&format!("/v1/activities/{id}")).await.body["state"],
        "waiting"
    );
    let owners = api.get("/v1/snapshot").await.body["owners"].clone();
    assert!(
        !owners.to_string().contains("released"),
        "the owner was not released: {owners}"
    );
}

#[tokio::test]
async fn a_token_bound_to_services_acts_only_for_them() {
    let api = scoped_api();
    let billing = json!({"service": "billing", "provider": "ollama", "class": "embedding"});
    let theirs = api.begin(billing.clone()).await; // as admin
    let bound = Some("kb-writer");

    // A begin for another service is refused, naming what the token lacks.
    let reply = api
        .send_with(Method::POST, "/v1/activities", Some(&billing.to_string()), bound)
        .await;
    reply.assert_error(StatusCode::FORBIDDEN, "forbidden", "a begin for billing");
    let message = reply.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("knowledge-base") && message.contains("billing"),
        "{message}"
    );
    let refused_started = api
        .send_with(
            Method::POST,
            "/v1/activities?start=now",
            Some(&billing.to_string()),
            bound,
        )
        .await;
    refused_started.assert_error(StatusCode::FORBIDDEN, "forbidden", "a started begin for billing");

    // Every action on another service's record is refused and changes it not.
    let before = counts(&api.snapshot().await);
    for (action, body) in [
        ("start", "{}"),
        ("settle", r#"{"success": true}"#),
        ("cancel", "{}"),
        ("refine", r#"{"model": "bge-m3"}"#),
    ] {
        let uri = format!("/v1/activities/{theirs}/{action}");
        let reply = api.send_with(Method::POST, &uri, Some(body), bound).await;
        reply.assert_error(StatusCode::FORBIDDEN, "forbidden", &uri);
    }
    assert_eq!(counts(&api.snapshot().await), before);
    assert_eq!(
        api.get(&format!("/v1/activities/{theirs}")).await.body["state"],
        "waiting"
    );

    // Its own service's records go through their whole lifecycle.
    let reply = api
        .send_with(Method::POST, "/v1/activities", Some(&kb().to_string()), bound)
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    let ours = reply.body["activityId"].as_str().unwrap().to_owned();
    for (action, body, state) in [
        ("start", "{}", "executing"),
        ("refine", r#"{"model": "bge-m3"}"#, "executing"),
        ("settle", r#"{"success": true}"#, "succeeded"),
    ] {
        let uri = format!("/v1/activities/{ours}/{action}");
        let reply = api.send_with(Method::POST, &uri, Some(body), bound).await;
        assert_eq!(reply.status, StatusCode::OK, "{uri}: {}", reply.body);
        assert_eq!(reply.body["state"], state);
    }
    let cancelled = api.begin(kb()).await;
    let uri = format!("/v1/activities/{cancelled}/cancel");
    assert_eq!(
        api.send_with(Method::POST, &uri, Some("{}"), bound).await.status,
        StatusCode::OK
    );

    // Reads, reaping and owner leases are open to any write token; an
    // unknown record is still 404.
    assert_eq!(
        api.send_with(Method::GET, &format!("/v1/activities/{theirs}"), None, bound)
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        api.send_with(Method::POST, "/v1/reap", None, bound).await.status,
        StatusCode::OK
    );
    let owner = api
        .send_with(
            Method::POST,
            "/v1/owners",
            Some(r#"{"name": "kb-worker"}"#),
            bound,
        )
        .await;
    assert_eq!(owner.status, StatusCode::CREATED, "{}", owner.body);
    let missing = "/v1/activities/6f1c1a3e-7d35-4e1b-9a3c-2f1f0f6a9b10/settle";
    api.send_with(Method::POST, missing, Some(r#"{"success": true}"#), bound)
        .await
        .assert_error(StatusCode::NOT_FOUND, "not_found", "an unknown record");
}

#[tokio::test]
async fn unknown_routes_are_404_and_wrong_methods_405_in_json() {
    let api = api();
    for uri in [
        "/index.html",
        "/v1",
        "/v2/activities",
        "/v1/activities/x/y/z",
        "/metricsz",
    ] {
        let reply = api.get(uri).await;
        reply.assert_error(StatusCode::NOT_FOUND, "not_found", uri);
    }
    for (method, uri) in [
        (Method::DELETE, "/v1/activities"),
        (Method::GET, "/v1/activities"),
        (Method::GET, "/v1/reap"),
        (Method::POST, "/v1/snapshot"),
        (Method::POST, "/healthz"),
        (Method::PUT, "/v1/activities/6f1c1a3e-7d35-4e1b-9a3c-2f1f0f6a9b10"),
        (
            Method::GET,
            "/v1/activities/6f1c1a3e-7d35-4e1b-9a3c-2f1f0f6a9b10/settle",
        ),
    ] {
        let reply = api.send(method.clone(), uri, None).await;
        reply.assert_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            &format!("{method} {uri}"),
        );
    }
}

#[tokio::test]
async fn bodies_over_64_kib_are_413_and_record_nothing() {
    let api = api();
    let padding = "x".repeat(64 * 1024);
    let big = json!({"service": "kb", "provider": "ollama", "padding": padding}).to_string();
    let reply = api.post("/v1/activities", &big).await;
    reply.assert_error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        "64 KiB + a little",
    );

    // Without a Content-Length (streamed), the limit holds too.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = vec![Ok(big.clone().into_bytes())];
    let request = Request::builder()
        .method(Method::POST)
        .uri("/v1/activities")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    api.raw(request)
        .await
        .assert_error(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", "streamed");

    let just_under = json!({"service": "kb", "provider": "ollama", "padding": "x".repeat(60 * 1024)});
    let reply = api.post("/v1/activities", &just_under.to_string()).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    assert_eq!(api.snapshot().await["totalActivities"], 1);
}

#[tokio::test]
async fn rejected_requests_change_nothing() {
    let api = api();
    let executing = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{executing}/start"), "{}").await;
    let succeeded = api.begin(kb()).await;
    api.post(
        &format!("/v1/activities/{succeeded}/settle"),
        r#"{"success": true}"#,
    )
    .await;
    let waiting = api.begin(kb()).await;

    let snapshot_before = counts(&api.snapshot().await);
    let records_before = [
        api.get(&format!("/v1/activities/{executing}")).await.body,
        api.get(&format!("/v1/activities/{succeeded}")).await.body,
        api.get(&format!("/v1/activities/{waiting}")).await.body,
    ];
    let rejected = [
        (
            "/v1/activities".to_owned(),
            r#"{"service": "a b", "provider": "o"}"#.to_owned(),
        ),
        (
            "/v1/activities".to_owned(),
            r#"{"service": "kb", "provider": "o", "admission": "x"}"#.to_owned(),
        ),
        (
            format!("/v1/activities/{succeeded}/settle"),
            r#"{"success": false}"#.to_owned(),
        ),
        (format!("/v1/activities/{succeeded}/cancel"), "{}".to_owned()),
        (format!("/v1/activities/{succeeded}/start"), "{}".to_owned()),
        (
            format!("/v1/activities/{executing}/settle"),
            r#"{"success": "yes"}"#.to_owned(),
        ),
        (
            format!("/v1/activities/{executing}/settle"),
            r#"{"success": true, "failureStage": "?"}"#.to_owned(),
        ),
        (
            format!("/v1/activities/{waiting}/start"),
            format!(r#"{{"startedAt": {}}}"#, T0 + 3_600_000),
        ),
        (
            format!("/v1/activities/{waiting}/cancel"),
            r#"{"reason": ["no"]}"#.to_owned(),
        ),
    ];
    for (uri, body) in &rejected {
        let reply = api.post(uri, body).await;
        assert!(reply.status.is_client_error(), "{uri} {body}: {}", reply.body);
    }
    assert_eq!(counts(&api.snapshot().await), snapshot_before);
    let records_after = [
        api.get(&format!("/v1/activities/{executing}")).await.body,
        api.get(&format!("/v1/activities/{succeeded}")).await.body,
        api.get(&format!("/v1/activities/{waiting}")).await.body,
    ];
    assert_eq!(records_after, records_before);
}

#[tokio::test]
async fn no_input_gets_a_5xx() {
    let api = api();
    let id = api.begin(kb()).await;
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let deep_object = format!("{}1{}", "{\"a\":".repeat(5_000), "}".repeat(5_000));
    let bodies: Vec<Vec<u8>> = vec![
        b"\x00\xff\xfe garbage".to_vec(),
        deep.into_bytes(),
        deep_object.into_bytes(),
        br#"{"service": "\ud800", "provider": "o"}"#.to_vec(),
        "{\"service\": \"kb\u{0}\", \"provider\": \"ollama\"}"
            .as_bytes()
            .to_vec(),
        "{\"service\": \"ünïcödé\", \"provider\": \"ollama\"}"
            .as_bytes()
            .to_vec(),
        br#"{"service": "kb", "provider": "o", "deadlineMs": 9223372036854775807}"#.to_vec(),
        br#"{"service": "kb", "provider": "o", "deadlineMs": 18446744073709551615}"#.to_vec(),
        br#"{"service": "kb", "provider": "o", "enqueuedAt": 0, "startedAt": 0}"#.to_vec(),
        br#"{"service": "kb", "provider": "o", "enqueuedAt": "0000-01-01T00:00:00Z"}"#.to_vec(),
        br#"{"service": "kb", "provider": "o", "model": "sk-secret /home/me/.ssh"}"#.to_vec(),
        br#"{"success": true, "completedAt": 1e300}"#.to_vec(),
        br#"{"startedAt": "9999-12-31T23:59:59.999Z"}"#.to_vec(),
        br#"{"reason": "x"}"#.to_vec(),
        b"1e999999".to_vec(),
        b"{}".to_vec(),
    ];
    let uris = [
        "/v1/activities".to_owned(),
        format!("/v1/activities/{id}/start"),
        format!("/v1/activities/{id}/settle"),
        format!("/v1/activities/{id}/cancel"),
        "/v1/reap".to_owned(),
    ];
    for uri in &uris {
        for body in &bodies {
            let request = Request::builder()
                .method(Method::POST)
                .uri(uri)
                .body(Body::from(body.clone()))
                .unwrap();
            let reply = api.raw(request).await;
            assert!(
                !reply.status.is_server_error(),
                "{uri} {:?}: {} {}",
                String::from_utf8_lossy(body),
                reply.status,
                reply.body
            );
        }
    }
    for query in [
        "limit=%FF",
        "since=%",
        "limit=1&limit=2",
        "since=9999999999999999999d",
        "since=-1h",
    ] {
        let reply = api.get(&format!("/v1/snapshot?{query}")).await;
        assert!(!reply.status.is_server_error(), "{query}: {}", reply.body);
    }
}

#[tokio::test]
async fn library_errors_map_to_their_codes_and_internals_never_leak() {
    let cases = [
        (
            ErrorKind::InvalidInput,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (ErrorKind::NotFound, StatusCode::NOT_FOUND, "not_found"),
        (ErrorKind::Conflict, StatusCode::CONFLICT, "conflict"),
        (ErrorKind::LaneFull, StatusCode::TOO_MANY_REQUESTS, "lane_full"),
        (ErrorKind::Closed, StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        (ErrorKind::Storage, StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        (
            ErrorKind::Unavailable,
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
        ),
    ];
    for (kind, status, code) in cases {
        let error = ApiError::from(LedgerError::new(kind, "disk /var/lib/secret.db is corrupt"));
        assert_eq!(error.status(), status);
        assert_eq!(error.code(), code);
        let response = error.into_response();
        assert_eq!(response.status(), status);
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body["error"]["code"], code);
        if status.is_server_error() {
            let message = body["error"]["message"].as_str().unwrap();
            assert!(!message.contains("secret"), "internals leak: {message}");
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(response_retry_after(kind).await.as_deref(), Some("1"));
        }
    }
}

/// The `Retry-After` header of the answer to an error of `kind`.
async fn response_retry_after(kind: ErrorKind) -> Option<String> {
    let response = ApiError::from(LedgerError::new(kind, "down")).into_response();
    response
        .headers()
        .get(axum::http::header::RETRY_AFTER)
        .map(|value| value.to_str().unwrap().to_owned())
}

fn capped_api(cap: u32) -> Api {
    let config = LedgerConfig::default()
        .with_lane_cap("knowledge-base::ollama", cap)
        .unwrap();
    api_with(config, None)
}

#[tokio::test(start_paused = true)]
async fn start_on_a_full_lane_is_429_with_retry_after_and_wait_holds_until_the_turn_comes() {
    let api = capped_api(1);
    let first = api.begin(kb()).await;
    api.clock.advance(Duration::from_millis(1));
    let second = api.begin(kb()).await;
    assert_eq!(
        api.post(&format!("/v1/activities/{first}/start"), "{}")
            .await
            .status,
        StatusCode::OK
    );

    let full = api.post(&format!("/v1/activities/{second}/start"), "{}").await;
    full.assert_error(
        StatusCode::TOO_MANY_REQUESTS,
        "lane_full",
        "second start on a cap-1 lane",
    );
    assert_eq!(full.headers.get(header::RETRY_AFTER).unwrap(), "1");
    let waited = api
        .post(&format!("/v1/activities/{second}/start?wait=2s"), "{}")
        .await;
    waited.assert_error(StatusCode::TOO_MANY_REQUESTS, "lane_full", "the wait ended first");
    for bad in ["31s", "soon"] {
        let reply = api
            .post(&format!("/v1/activities/{second}/start?wait={bad}"), "{}")
            .await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", bad);
    }

    // A held start is admitted as soon as the slot comes back.
    let router = api.router.clone();
    let held = tokio::spawn(async move {
        let request = Request::builder()
            .method(Method::POST)
            .uri(format!("/v1/activities/{second}/start?wait=30s"))
            .body(Body::from("{}"))
            .unwrap();
        router.oneshot(request).await.unwrap().status()
    });
    tokio::task::yield_now().await;
    let settled = api
        .post(&format!("/v1/activities/{first}/settle"), r#"{"success": true}"#)
        .await;
    assert_eq!(settled.status, StatusCode::OK);
    assert_eq!(held.await.unwrap(), StatusCode::OK);
    let snapshot = api.snapshot().await;
    let lane = &snapshot["nativeAdmission"]["knowledge-base::ollama"];
    assert_eq!(
        (lane["cap"].as_i64(), lane["executing"].as_i64()),
        (Some(1), Some(1))
    );
}

/// The record a `start=now` begin answered, asserting 201 and `executing`
/// since the server's clock.
fn started_now(reply: &Reply, what: &str) -> String {
    assert_eq!(reply.status, StatusCode::CREATED, "{what}: {}", reply.body);
    assert_eq!(reply.body["state"], "executing", "{what}");
    // Stamped with the server's clock, which also stamped `enqueuedAt`.
    assert_eq!(reply.body["startedAt"], reply.body["enqueuedAt"], "{what}");
    let id = reply.body["activityId"].as_str().unwrap().to_owned();
    assert_eq!(
        reply.headers.get(header::LOCATION).unwrap(),
        &format!("/v1/activities/{id}"),
        "{what}"
    );
    id
}

#[tokio::test(start_paused = true)]
async fn begin_with_start_now_is_admitted_at_once_when_the_lane_has_room() {
    let api = capped_api(2);
    for wait in ["", "&wait=5s"] {
        let reply = api
            .post(&format!("/v1/activities?start=now{wait}"), &kb().to_string())
            .await;
        started_now(&reply, wait);
    }
    let snapshot = api.snapshot().await;
    let lane = &snapshot["nativeAdmission"]["knowledge-base::ollama"];
    assert_eq!(
        (lane["executing"].as_i64(), lane["waiting"].as_i64()),
        (Some(2), Some(0))
    );
    // Full now, and no wait: refused at once, nothing recorded.
    let full = api.post("/v1/activities?start=now", &kb().to_string()).await;
    full.assert_error(
        StatusCode::TOO_MANY_REQUESTS,
        "lane_full",
        "start=now on a full lane",
    );
    assert_eq!(full.headers.get(header::RETRY_AFTER).unwrap(), "1");
    assert_eq!(api.snapshot().await["totalActivities"], 2);
}

#[tokio::test(start_paused = true)]
async fn begin_with_start_now_and_wait_is_admitted_when_a_settle_frees_the_slot() {
    let api = capped_api(1);
    let first = started_now(
        &api.post("/v1/activities?start=now", &kb().to_string()).await,
        "first",
    );
    let router = api.router.clone();
    let held = tokio::spawn(async move {
        let request = Request::post("/v1/activities?start=now&wait=30s")
            .body(Body::from(kb().to_string()))
            .unwrap();
        let response = router.oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice::<Value>(&bytes).unwrap())
    });
    // The held begin waits in line: recorded `waiting`, first in line.
    let mut waiting = 0;
    for _ in 0..100 {
        tokio::task::yield_now().await;
        let snapshot = api.snapshot().await;
        waiting = snapshot["nativeAdmission"]["knowledge-base::ollama"]["waiting"]
            .as_i64()
            .unwrap();
        if waiting == 1 {
            break;
        }
    }
    assert_eq!(waiting, 1, "the held begin is recorded waiting");
    api.clock.advance(Duration::from_millis(250));
    let settled = api
        .post(&format!("/v1/activities/{first}/settle"), r#"{"success": true}"#)
        .await;
    assert_eq!(settled.status, StatusCode::OK);
    let (status, record) = held.await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "{record}");
    assert_eq!(record["state"], "executing");
    assert_eq!(record["queueWaitMs"].as_i64(), Some(250), "{record}");
}

#[tokio::test(start_paused = true)]
async fn begin_with_start_now_whose_wait_ends_is_429_and_its_record_is_cancelled() {
    let api = capped_api(1);
    started_now(
        &api.post("/v1/activities?start=now", &kb().to_string()).await,
        "first",
    );
    let started = tokio::time::Instant::now();
    let refused = api
        .post("/v1/activities?start=now&wait=2s", &kb().to_string())
        .await;
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(2),
        "it held the request for the wait"
    );
    refused.assert_error(StatusCode::TOO_MANY_REQUESTS, "lane_full", "the wait ended first");
    assert_eq!(refused.headers.get(header::RETRY_AFTER).unwrap(), "1");
    let message = refused.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("cancelled") && message.contains("2s"),
        "{message}"
    );
    // The record begun for the wait is cancelled: it holds no place in line.
    let id = message
        .split_whitespace()
        .nth(message.split_whitespace().position(|w| w == "activity").unwrap() + 1)
        .unwrap();
    let record = api.get(&format!("/v1/activities/{id}")).await;
    assert_eq!(record.status, StatusCode::OK, "{}", record.body);
    assert_eq!(record.body["state"], "cancelled");
    assert_eq!(record.body["cancelReason"], "wait ended");
    let lane = &api.snapshot().await["nativeAdmission"]["knowledge-base::ollama"];
    assert_eq!(
        (lane["executing"].as_i64(), lane["waiting"].as_i64()),
        (Some(1), Some(0))
    );
}

#[tokio::test(start_paused = true)]
async fn begin_with_start_now_whose_request_ends_while_waiting_cancels_its_record() {
    let api = capped_api(1);
    started_now(
        &api.post("/v1/activities?start=now", &kb().to_string()).await,
        "first",
    );
    let router = api.router.clone();
    let held = tokio::spawn(async move {
        let request = Request::post("/v1/activities?start=now&wait=30s")
            .body(Body::from(kb().to_string()))
            .unwrap();
        router.oneshot(request).await.unwrap().status()
    });
    let waiting = |snapshot: &Value| {
        snapshot["nativeAdmission"]["knowledge-base::ollama"]["waiting"]
            .as_i64()
            .unwrap()
    };
    let mut snapshot = api.snapshot().await;
    for _ in 0..100 {
        if waiting(&snapshot) == 1 {
            break;
        }
        tokio::task::yield_now().await;
        snapshot = api.snapshot().await;
    }
    assert_eq!(waiting(&snapshot), 1, "the held begin is recorded waiting");
    // The client goes away: the request's future is dropped mid-wait.
    held.abort();
    let _ = held.await;
    for _ in 0..100 {
        snapshot = api.snapshot().await;
        if waiting(&snapshot) == 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(
        waiting(&snapshot),
        0,
        "nothing is left waiting in line: {snapshot}"
    );
    assert_eq!(snapshot["totalActivities"], 2);
    assert_eq!(snapshot["totalInFlight"], 1, "only the first, executing");
}

#[tokio::test]
async fn begin_with_start_now_refuses_bad_parameters_naming_them_and_records_nothing() {
    let api = capped_api(1);
    let started = json!({"service": "knowledge-base", "provider": "ollama", "startedAt": T0});
    for (uri, body, field) in [
        ("/v1/activities?start=later", kb(), "`start`"),
        ("/v1/activities?start=", kb(), "`start`"),
        ("/v1/activities?wait=5s", kb(), "`wait`"),
        ("/v1/activities?start=now&wait=31s", kb(), "`wait`"),
        ("/v1/activities?start=now&wait=soon", kb(), "`wait`"),
        ("/v1/activities?start=now&start=now", kb(), "start"),
        ("/v1/activities?start=now", started, "`startedAt`"),
    ] {
        let reply = api.post(uri, &body.to_string()).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", uri);
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{uri}: {message}");
    }
    assert_eq!(api.snapshot().await["totalActivities"], 0);
}

#[tokio::test]
async fn begin_with_start_now_on_a_lane_without_a_cap_is_never_refused() {
    let api = api();
    for _ in 0..3 {
        let reply = api
            .post("/v1/activities?start=now&wait=5s", &kb().to_string())
            .await;
        started_now(&reply, "uncapped");
    }
    assert_eq!(api.snapshot().await["totalInFlight"], 3);
}

#[tokio::test]
async fn owners_register_renew_release_and_tag_their_records() {
    let api = capped_api(4);
    let created = api
        .post("/v1/owners", r#"{"name": "worker-a", "ttlMs": 30000}"#)
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let owner = created.body["ownerId"].as_str().unwrap().to_owned();
    assert!(created.body["expiresAt"].as_str().unwrap().ends_with('Z'));
    assert_eq!(created.body["state"], "live");

    let mut body = kb();
    body["ownerId"] = json!(owner);
    let id = api.begin(body.clone()).await;
    let record = api.get(&format!("/v1/activities/{id}")).await;
    assert_eq!(record.body["ownerId"], json!(owner));
    assert!(record.body["reapReason"].is_null());

    api.clock.advance(Duration::from_secs(20));
    let renewed = api.post(&format!("/v1/owners/{owner}/renew"), "").await;
    assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.body);

    let released = api
        .send(Method::DELETE, &format!("/v1/owners/{owner}"), None)
        .await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.body);
    assert_eq!(released.body["cancelledRecords"], 1);
    assert_eq!(released.body["state"], "released");
    assert_eq!(
        api.get(&format!("/v1/activities/{id}")).await.body["state"],
        "cancelled"
    );

    api.post(&format!("/v1/owners/{owner}/renew"), "")
        .await
        .assert_error(StatusCode::CONFLICT, "conflict", "renew after release");
    api.post("/v1/activities", &body.to_string()).await.assert_error(
        StatusCode::CONFLICT,
        "conflict",
        "begin for a released owner",
    );
    body["ownerId"] = json!(inflight::OwnerId::new().to_string());
    api.post("/v1/activities", &body.to_string()).await.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "begin for an unknown owner",
    );
    api.post(&format!("/v1/owners/{}/renew", inflight::OwnerId::new()), "")
        .await
        .assert_error(StatusCode::NOT_FOUND, "not_found", "renew an unknown owner");
    api.post("/v1/owners/not-a-uuid/renew", "").await.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "malformed owner id",
    );
    for bad in [
        r#"{"ttlMs": 1000}"#,
        r#"{"name": "a b"}"#,
        r#"{"name": "w", "ttlMs": 5}"#,
        r#"{"name": "w", "ttlMs": "x"}"#,
    ] {
        api.post("/v1/owners", bad)
            .await
            .assert_error(StatusCode::BAD_REQUEST, "invalid_request", bad);
    }
}

#[tokio::test]
async fn an_owner_that_stops_renewing_loses_its_records_as_owner_lost() {
    let api = capped_api(1);
    let created = api
        .post("/v1/owners", r#"{"name": "worker-b", "ttlMs": 5000}"#)
        .await;
    let owner = created.body["ownerId"].as_str().unwrap().to_owned();
    let mut body = kb();
    body["ownerId"] = json!(owner);
    body["startedAt"] = json!(T0);
    let held = api.begin(body).await;
    api.clock.advance(Duration::from_millis(5001));
    let snapshot = api.snapshot().await;
    let lost = snapshot["owners"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["ownerId"] == json!(owner))
        .unwrap();
    assert_eq!(lost["state"], "lost");
    assert_eq!(lost["reapedRecords"], 1);
    let record = api.get(&format!("/v1/activities/{held}")).await;
    assert_eq!(record.body["reapReason"], "owner-lost");
    assert_eq!(record.body["disposition"], "unsettled");
    let lane = &snapshot["nativeAdmission"]["knowledge-base::ollama"];
    assert_eq!(lane["executing"], 0);
    assert_eq!(lane["reapedOwnerLost"], 1);
}

#[tokio::test]
async fn metrics_expose_lanes_reaps_and_outcomes_in_openmetrics_text() {
    let api = capped_api(4);
    let leaked = api
        .begin(
            json!({"service": "knowledge-base", "provider": "ollama", "class": "embedding", "startedAt": T0}),
        )
        .await;
    let done = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{done}/settle"), r#"{"success": true}"#)
        .await;
    api.clock.advance(Duration::from_secs(21 * 60));
    let live = api.begin(json!({"service": "knowledge-base", "provider": "ollama", "class": "embedding", "startedAt": T0 + 21 * 60_000})).await;

    let response = api
        .router
        .clone()
        .oneshot(Request::builder().uri("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let content_type = response.headers()[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let lane = r#"service="knowledge-base",provider="ollama""#;
    for line in [
        format!(r#"inflight_in_flight{{{lane},state="executing"}} 1"#),
        format!("inflight_lane_cap{{{lane}}} 4"),
        format!(r#"inflight_reaped_total{{{lane},disposition="unsettled",reason="deadline"}} 1"#),
        format!(r#"inflight_reaped_total{{{lane},disposition="abandoned",reason="deadline"}} 0"#),
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    assert!(text.contains(r#"outcome="succeeded"} 1"#), "{text}");
    assert!(text.trim_end().ends_with("# EOF"), "{text}");
    assert_eq!(
        api.get(&format!("/v1/activities/{leaked}")).await.body["state"],
        "reaped"
    );
    assert_eq!(
        api.get(&format!("/v1/activities/{live}")).await.body["state"],
        "executing"
    );
}

/// The skew a begin accepts (timestamps up to 5 minutes ahead) never makes
/// a later command fail, and a release is all or nothing.
#[tokio::test]
async fn releasing_an_owner_with_future_stamped_work_cancels_all_of_it() {
    let api = api();
    let created = api.post("/v1/owners", r#"{"name": "worker-a"}"#).await;
    let owner = created.body["ownerId"].as_str().unwrap().to_owned();
    let mut body = kb();
    body["ownerId"] = json!(owner);
    let a = api.begin(body.clone()).await;
    let ahead = T0 + 60_000;
    body["enqueuedAt"] = json!(ahead);
    body["startedAt"] = json!(ahead);
    let b = api.begin(body).await;

    let released = api
        .send(Method::DELETE, &format!("/v1/owners/{owner}"), None)
        .await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.body);
    assert_eq!(released.body["state"], "released");
    assert_eq!(released.body["cancelledRecords"], 2);
    for id in [&a, &b] {
        let record = api.get(&format!("/v1/activities/{id}")).await.body;
        assert_eq!(record["state"], "cancelled", "{record}");
    }
    // Never completed before it started: the record's own instant is the floor.
    let b = api.get(&format!("/v1/activities/{b}")).await.body;
    assert_eq!(b["completedAt"], b["startedAt"]);
    assert_eq!(b["executionMs"], 0);
}

#[tokio::test]
async fn a_settle_or_cancel_of_a_future_stamped_record_never_fails() {
    let api = api();
    let ahead = T0 + 4 * 60_000;
    let mut body = kb();
    body["enqueuedAt"] = json!(ahead);
    let waiting = api.begin(body.clone()).await;
    let started = api.post(&format!("/v1/activities/{waiting}/start"), "{}").await;
    assert_eq!(started.status, StatusCode::OK, "{}", started.body);
    assert_eq!(started.body["queueWaitMs"], 0);
    let settled = api
        .post(
            &format!("/v1/activities/{waiting}/settle"),
            r#"{"success": true}"#,
        )
        .await;
    assert_eq!(settled.status, StatusCode::OK, "{}", settled.body);
    assert_eq!(settled.body["completedAt"], settled.body["startedAt"]);

    body["startedAt"] = json!(ahead);
    let executing = api.begin(body).await;
    let cancelled = api
        .post(&format!("/v1/activities/{executing}/cancel"), "{}")
        .await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    assert_eq!(cancelled.body["state"], "cancelled");

    // A caller's own completedAt before its startedAt is still refused.
    let mut body = kb();
    body["startedAt"] = json!(T0);
    let id = api.begin(body).await;
    api.post(
        &format!("/v1/activities/{id}/settle"),
        &json!({"success": true, "completedAt": T0 - 1}).to_string(),
    )
    .await
    .assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "completedAt before startedAt",
    );
}

#[tokio::test]
async fn a_begin_started_without_enqueued_at_is_enqueued_when_it_started() {
    let api = api();
    // A client whose clock runs a few milliseconds behind the server's.
    let mut body = kb();
    body["startedAt"] = json!(T0 - 3);
    let behind = api.begin(body).await;
    let record = api.get(&format!("/v1/activities/{behind}")).await.body;
    assert_eq!(record["enqueuedAt"], record["startedAt"]);
    assert_eq!(record["queueWaitMs"], 0);
    // One running ahead: enqueued now, started when it says.
    let mut body = kb();
    body["startedAt"] = json!(T0 + 3);
    let ahead = api.begin(body).await;
    let record = api.get(&format!("/v1/activities/{ahead}")).await.body;
    assert_eq!(record["queueWaitMs"], 3);
}

#[tokio::test]
async fn an_owner_ttl_out_of_range_is_named_as_sent() {
    let api = api();
    let reply = api.post("/v1/owners", r#"{"name": "w", "ttlMs": -5}"#).await;
    reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", "negative ttl");
    assert!(
        reply.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("got -5"),
        "{}",
        reply.body
    );
}

#[tokio::test]
async fn each_refusal_names_the_field_at_fault() {
    let api = api();
    let id = api.begin(kb()).await;
    let cases = [
        ("/v1/activities", r#"{"provider": "o"}"#, "`service`"),
        (
            "/v1/activities",
            r#"{"service": 7, "provider": "o"}"#,
            "`service`",
        ),
        (
            "/v1/activities",
            r#"{"service": "a b", "provider": "o"}"#,
            "service",
        ),
        (
            "/v1/activities",
            r#"{"service": "kb", "provider": "o", "class": "a/b"}"#,
            "class",
        ),
        (
            "/v1/activities",
            r#"{"service": "kb", "provider": "o", "priority": "urgent"}"#,
            "`priority`",
        ),
        (
            "/v1/activities",
            r#"{"service": "kb", "provider": "o", "admission": true}"#,
            "`admission`",
        ),
        (
            "/v1/activities",
            r#"{"service": "kb", "provider": "o", "enqueuedAt": "yesterday"}"#,
            "`enqueuedAt`",
        ),
        (
            "/v1/activities",
            r#"{"service": "kb", "provider": "o", "startedAt": 1.5}"#,
            "`startedAt`",
        ),
        (
            "/v1/activities",
            r#"{"service": "kb", "provider": "o", "deadlineMs": "5m"}"#,
            "`deadlineMs`",
        ),
        (
            "/v1/activities",
            r#"{"service": "kb", "provider": "o", "deadlineMs": 0}"#,
            "deadlineMs",
        ),
        (
            "/v1/activities",
            r#"{"service": "kb", "provider": "o", "ownerId": 5}"#,
            "`ownerId`",
        ),
        ("/v1/owners", r#"{"ttlMs": 1000}"#, "`name`"),
        ("/v1/owners", r#"{"name": "w", "ttlMs": "x"}"#, "`ttlMs`"),
        ("/v1/owners", r#"{"name": "w", "ttlMs": 5}"#, "ttlMs"),
    ];
    let uri = |path: &str| path.replace("{id}", &id);
    let actions = [
        ("/v1/activities/{id}/settle", r#"{"success": "yes"}"#, "`success`"),
        ("/v1/activities/{id}/settle", r#"{"success": null}"#, "`success`"),
        (
            "/v1/activities/{id}/settle",
            r#"{"failureStage": "provider"}"#,
            "`success`",
        ),
        (
            "/v1/activities/{id}/settle",
            r#"{"success": false, "failureStage": "network"}"#,
            "`failureStage`",
        ),
        (
            "/v1/activities/{id}/settle",
            r#"{"success": true, "completedAt": "noon"}"#,
            "`completedAt`",
        ),
        (
            "/v1/activities/{id}/start",
            r#"{"startedAt": "soon"}"#,
            "`startedAt`",
        ),
        ("/v1/activities/{id}/start", r#"{"startedAt": -1}"#, "`startedAt`"),
        ("/v1/activities/{id}/cancel", r#"{"reason": 42}"#, "`reason`"),
        (
            "/v1/activities/{id}/settle",
            r#"{"success": true, "success": false}"#,
            "`success`",
        ),
    ];
    for (path, body, field) in cases.into_iter().chain(actions) {
        let reply = api.post(&uri(path), body).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", body);
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{path} {body}: {message}");
    }
    // The documented example, word for word.
    let reply = api
        .post(&uri("/v1/activities/{id}/settle"), r#"{"success": "yes"}"#)
        .await;
    assert_eq!(
        reply.body["error"]["message"],
        "`success`: invalid type: string \"yes\", expected a boolean"
    );
    for (query, field) in [
        ("/v1/snapshot?limit=ten", "`limit`"),
        ("/v1/snapshot?limit=0", "limit"),
        ("/v1/snapshot?since=yesterday", "`since`"),
        ("/v1/snapshot?limit=1&limit=2", "`limit`"),
    ] {
        let reply = api.get(query).await;
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request", query);
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{query}: {message}");
    }
    let reply = api.post(&uri("/v1/activities/{id}/start?wait=soon"), "{}").await;
    let message = reply.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("`wait`"), "{message}");
    assert_eq!(
        api.get(&format!("/v1/activities/{id}")).await.body["state"],
        "waiting",
        "no refusal changed the record"
    );
}

fn limited_api(limits: Limits) -> Api {
    let clock = FakeClock::at(inflight::Timestamp::from_millis(T0));
    let config = LedgerConfig::default()
        .with_lane_cap("knowledge-base::ollama", 1)
        .unwrap();
    let ledger = Ledger::builder(config)
        .store_url("memory:")
        .clock(clock.clone())
        .build()
        .expect("memory ledger");
    let state = AppState::new(ledger).with_limits(limits);
    Api {
        router: app(state),
        clock,
        token: None,
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_past_max_requests_is_503_with_retry_after_and_healthz_still_answers() {
    let api = limited_api(Limits::default().with_max_requests(NonZeroUsize::new(1).unwrap()));
    let first = api.begin(kb()).await;
    api.clock.advance(Duration::from_millis(1));
    let second = api.begin(kb()).await;
    assert_eq!(
        api.post(&format!("/v1/activities/{first}/start"), "{}")
            .await
            .status,
        StatusCode::OK
    );
    // The second start waits in line, holding the one permit.
    let router = api.router.clone();
    let waiting = tokio::spawn(async move {
        let request = Request::post(format!("/v1/activities/{second}/start?wait=30s"))
            .body(Body::empty())
            .unwrap();
        router.oneshot(request).await.expect("infallible").status()
    });
    tokio::task::yield_now().await;
    let refused = api.get("/v1/snapshot").await;
    refused.assert_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        "a request past the limit",
    );
    assert_eq!(
        refused
            .headers
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    assert_eq!(api.get("/healthz").await.status, StatusCode::OK);
    // The permit comes back when the waiting request ends.
    assert_eq!(
        api.post(&format!("/v1/activities/{first}/settle"), r#"{"success":true}"#)
            .await
            .status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    waiting.abort();
    let _ = waiting.await;
    assert_eq!(api.get("/v1/snapshot").await.status, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_body_that_never_arrives_is_408_after_the_body_timeout_and_records_nothing() {
    let api = limited_api(
        Limits::default()
            .with_body_timeout(Duration::from_secs(2))
            .unwrap(),
    );
    let never = futures_util::stream::pending::<Result<Vec<u8>, std::io::Error>>();
    let request = Request::post("/v1/activities")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(never))
        .unwrap();
    let started = tokio::time::Instant::now();
    let reply = api.raw(request).await;
    reply.assert_error(
        StatusCode::REQUEST_TIMEOUT,
        "request_timeout",
        "a body that never arrives",
    );
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    assert_eq!(api.snapshot().await["totalActivities"], 0);
}
