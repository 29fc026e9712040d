//! `/proxy/NAME/...` against a fake upstream in this process: what passes,
//! what is recorded, and how every end of a call settles it.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::{stream, StreamExt as _};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use inflight::{ActivityId, Ledger, Settings, SnapshotOptions, State as RecordState};
use inflight_server::http::AppState;
use inflight_server::proxy::Routes;

/// What the fake upstream saw and did.
#[derive(Default)]
struct Seen {
    /// Each request's path and headers, in order.
    requests: Mutex<Vec<(String, HeaderMap)>>,
    /// Calls being answered now, and the most at once.
    now: AtomicUsize,
    most: AtomicUsize,
    /// Streams whose reader went away before they ended.
    dropped: AtomicUsize,
}

struct Upstream {
    addr: SocketAddr,
    seen: Arc<Seen>,
}

async fn note(State(seen): State<Arc<Seen>>, request: Request, next: axum::middleware::Next) -> Response {
    let path = request.uri().path().to_owned();
    seen.requests
        .lock()
        .unwrap()
        .push((path, request.headers().clone()));
    next.run(request).await
}

fn json_answer(value: Value) -> Response {
    ([("content-type", "application/json")], value.to_string()).into_response()
}

/// A streamed answer of `lines`, each sent as its own chunk; the body
/// ends 200 ms after the last, as a slow upstream's might, so that a client
/// that stops reading at the answer's own end marker has gone by then.
fn streamed(content_type: &'static str, lines: Vec<String>) -> Response {
    let chunks = stream::iter(
        lines
            .into_iter()
            .map(|line| Ok::<_, Infallible>(Bytes::from(line))),
    );
    let late_end = stream::once(async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        Ok(Bytes::new())
    });
    (
        [("content-type", content_type)],
        Body::from_stream(chunks.chain(late_end)),
    )
        .into_response()
}

async fn chat_completions(body: axum::Json<Value>) -> Response {
    if body["stream"] == json!(true) {
        let mut lines: Vec<String> = ["Hel", "lo"]
            .iter()
            .map(|text| {
                format!(
                    "data: {}\n\n",
                    json!({"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o-mini-2024-07-18",
                        "choices": [{"index": 0, "delta": {"content": text}}], "usage": null})
                )
            })
            .collect();
        lines.push(format!(
            "data: {}\n\n",
            json!({"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o-mini-2024-07-18",
                "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}})
        ));
        lines.push("data: [DONE]\n\n".to_owned());
        return streamed("text/event-stream", lines);
    }
    json_answer(json!({
        "id": "c1", "object": "chat.completion", "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    }))
}

async fn ollama_chat() -> Response {
    let mut lines: Vec<String> = ["Hel", "lo"]
        .iter()
        .map(|text| {
            format!(
                "{}\n",
                json!({"model": "llama3.2", "message": {"role": "assistant", "content": text}, "done": false})
            )
        })
        .collect();
    lines.push(format!(
        "{}\n",
        json!({"model": "llama3.2", "done": true, "done_reason": "stop", "prompt_eval_count": 26, "eval_count": 290})
    ));
    streamed("application/x-ndjson", lines)
}

async fn gemini(Path(call): Path<String>) -> Response {
    assert!(call.ends_with(":generateContent"), "{call}");
    json_answer(json!({
        "candidates": [{"content": {"parts": [{"text": "Hello"}], "role": "model"}}],
        "usageMetadata": {"promptTokenCount": 9, "candidatesTokenCount": 4, "thoughtsTokenCount": 2, "totalTokenCount": 15},
        "modelVersion": "gemini-2.0-flash-001"
    }))
}

/// Answers after `ms` milliseconds, counting the calls answered at once.
async fn hold(State(seen): State<Arc<Seen>>) -> Response {
    let now = seen.now.fetch_add(1, Ordering::SeqCst) + 1;
    seen.most.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(30)).await;
    seen.now.fetch_sub(1, Ordering::SeqCst);
    json_answer(json!({"model": "m", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}))
}

/// Counts a stream dropped before its end.
struct Watched(Arc<Seen>);

impl Drop for Watched {
    fn drop(&mut self) {
        self.0.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

/// A chunk every 20 ms, never ending.
async fn forever(State(seen): State<Arc<Seen>>) -> Response {
    let chunks = stream::unfold(Watched(seen), |watched| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        Some((Ok::<_, Infallible>(Bytes::from_static(b"data: {}\n\n")), watched))
    });
    ([("content-type", "text/event-stream")], Body::from_stream(chunks)).into_response()
}

/// Two chunks, then the upstream breaks off (after a pause, so that its
/// head and chunks have left).
async fn cut() -> Response {
    let chunks = stream::unfold(0, |sent| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let next = match sent {
            0 | 1 => Ok(Bytes::from_static(b"{\"model\":\"m\",\"done\":false}\n")),
            2 => Err(std::io::Error::other("the upstream broke off")),
            _ => return None,
        };
        Some((next, sent + 1))
    });
    (
        [("content-type", "application/x-ndjson")],
        Body::from_stream(chunks),
    )
        .into_response()
}

/// A 429 with `Retry-After` whose body breaks off.
async fn refuse_cut() -> Response {
    let chunks = stream::unfold(0, |sent| async move {
        // Apart, so that the head and the first bytes go out first.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let next = match sent {
            0 => Ok(Bytes::from_static(b"slow")),
            1 => Err(std::io::Error::other("the upstream broke off")),
            _ => return None,
        };
        Some((next, sent + 1))
    });
    (
        StatusCode::TOO_MANY_REQUESTS,
        [("retry-after", "7")],
        Body::from_stream(chunks),
    )
        .into_response()
}

async fn upstream() -> Upstream {
    let seen = Arc::new(Seen::default());
    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route(
            "/v1/embeddings",
            post(|| async {
                json_answer(json!({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                    "model": "text-embedding-3-small", "usage": {"prompt_tokens": 5, "total_tokens": 5}}))
            }),
        )
        .route("/v1/models", get(|| async { json_answer(json!({"object": "list", "data": []})) }))
        .route("/api/chat", post(ollama_chat))
        .route("/v1beta/models/{call}", post(gemini))
        .route(
            "/refuse",
            post(|| async { (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "7")], "slow down").into_response() }),
        )
        .route("/fail", post(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response() }))
        .route("/refuse-cut", post(refuse_cut))
        .route(
            "/slow",
            post(|| async {
                tokio::time::sleep(Duration::from_secs(10)).await;
                "late"
            }),
        )
        .route("/no-content", post(|| async { StatusCode::NO_CONTENT }))
        .route(
            "/huge-usage",
            post(|| async {
                json_answer(json!({"model": "m", "usage": {"prompt_tokens": 2_000_000_000_i64, "completion_tokens": 3}}))
            }),
        )
        .route("/hold", post(hold))
        .route("/forever", post(forever))
        .route("/cut", post(cut))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&seen), note))
        .with_state(Arc::clone(&seen));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Upstream { addr, seen }
}

/// A proxy in front of `upstream`, configured by `extra` beside its routes.
struct Proxy {
    ledger: Ledger,
    running: support::Running,
    upstream: Upstream,
}

/// The configuration every test starts from: a capped lane, short
/// deadlines, and three routes to the one upstream.
const CONFIG: &str = r#"
[classes.chat]
deadline = "1s"
[classes.embedding]
deadline = "1s"
[lanes."oa::openai"]
cap = 2
[lanes."solo::openai"]
cap = 1
"#;

async fn proxy_with(extra: &str, token: Option<&str>) -> Proxy {
    let upstream = upstream().await;
    let url = format!("http://{}", upstream.addr);
    let text = format!(
        "{CONFIG}{extra}\n[proxy.oa]\nupstream = \"{url}\"\nprovider = \"openai\"\nmax_wait = \"5s\"\n\
         [proxy.ollama]\nupstream = \"{url}\"\nprovider = \"ollama\"\nservice = \"kb\"\nmax_body_bytes = 4096\n\
         [proxy.gemini]\nupstream = \"{url}/v1beta\"\nprovider = \"gemini\"\n\
         [proxy.closed]\nupstream = \"http://127.0.0.1:9\"\nprovider = \"openai\"\n"
    );
    let (ledger, running) = serve(&text, token).await;
    Proxy {
        ledger,
        running,
        upstream,
    }
}

/// A server on a memory ledger, configured by `text` (its lanes, proxy
/// routes and `[[tokens]]`), requiring `token` too if given.
async fn serve(text: &str, token: Option<&str>) -> (Ledger, support::Running) {
    let settings = Settings::from_toml(text).unwrap();
    let routes = Routes::from_tables(&settings.proxy, &mut Vec::new()).unwrap();
    let ledger = Ledger::builder(settings.ledger)
        .store_url("memory:")
        .build()
        .unwrap();
    let specs = inflight_server::http::auth::token_specs(token, &settings.tokens).unwrap();
    let state = AppState::new(ledger.clone())
        .with_tokens(inflight_server::http::Tokens::load(specs).unwrap())
        .with_proxies(routes);
    let running = support::start(|listener, stopped| {
        inflight_server::serve_state(listener, state, async {
            let _ = stopped.await;
        })
    })
    .await;
    (ledger, running)
}

async fn proxy() -> Proxy {
    proxy_with("", None).await
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

impl Proxy {
    fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &Value,
    ) -> hyper::Request<Full<Bytes>> {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.running.addr))
            .header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let body = if body.is_null() {
            Bytes::new()
        } else {
            Bytes::from(body.to_string())
        };
        request.body(Full::new(body)).unwrap()
    }

    /// POSTs `body` to `path` and reads the answer's head only.
    async fn open(&self, path: &str, headers: &[(&str, &str)], body: Value) -> Open {
        let answer = client()
            .request(self.request("POST", path, headers, &body))
            .await
            .unwrap();
        let (head, body) = answer.into_parts();
        Open {
            id: activity_id(&head.headers),
            headers: head.headers,
            body,
        }
    }

    /// A chat call on the `oa` lane, which waits for nothing: refused while
    /// the lane cools down.
    async fn a_call_refused_cooling(&self) -> Reply {
        let reply = self
            .post(
                "/proxy/oa/v1/chat/completions",
                &[("x-inflight-max-wait", "0s")],
                json!({"model": "gpt-4o-mini"}),
            )
            .await;
        assert_eq!((reply.status, reply.code().as_str()), (429, "lane_cooling"));
        reply
    }

    /// Sends a request and reads its answer whole.
    async fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Value) -> Reply {
        let answer = client()
            .request(self.request(method, path, headers, &body))
            .await
            .unwrap();
        let (head, body) = answer.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Reply {
            status: head.status.as_u16(),
            headers: head.headers,
            body,
        }
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: Value) -> Reply {
        self.send("POST", path, headers, body).await
    }

    async fn record(&self, reply: &Reply) -> Arc<inflight::ActivityRecord> {
        self.ledger.get(reply.activity_id()).await.unwrap()
    }

    async fn snapshot(&self) -> inflight::Snapshot {
        self.ledger.snapshot(SnapshotOptions::default()).await.unwrap()
    }

    /// Waits (in real time, at most 5 s) until `done` holds of a snapshot.
    async fn until(&self, what: &str, done: impl Fn(&inflight::Snapshot) -> bool) {
        for _ in 0..500 {
            if done(&self.snapshot().await) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not within 5 s: {what}: {:#?}", self.snapshot().await);
    }

    fn last_request_headers(&self) -> HeaderMap {
        self.upstream
            .seen
            .requests
            .lock()
            .unwrap()
            .last()
            .unwrap()
            .1
            .clone()
    }
}

/// The tokens a record's settle reported: input, output.
fn tokens(record: &inflight::ActivityRecord) -> (Option<i64>, Option<i64>) {
    (record.usage.input_tokens, record.usage.output_tokens)
}

/// The id in an answer's `X-Inflight-Activity-Id`.
fn activity_id(headers: &HeaderMap) -> ActivityId {
    headers["x-inflight-activity-id"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// An answer whose body is still to be read.
struct Open {
    headers: HeaderMap,
    id: ActivityId,
    body: hyper::body::Incoming,
}

struct Reply {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("JSON: {:?}", self.body))
    }

    fn activity_id(&self) -> ActivityId {
        activity_id(&self.headers)
    }

    fn code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap().to_owned()
    }
}

/// A caller's trace context.
const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test]
async fn a_chat_call_passes_through_and_settles_with_its_usage_and_served_model() {
    let p = proxy().await;
    let reply = p
        .post(
            "/proxy/oa/v1/chat/completions",
            &[
                ("authorization", "Bearer sk-upstream"),
                ("idempotency-key", "upstream-key-1"),
                ("x-inflight-stage", "answer"),
                ("traceparent", PARENT),
            ],
            json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["usage"]["total_tokens"], 18, "the body as it came");
    assert_eq!(reply.headers["content-type"], "application/json");
    let record = p.record(&reply).await;
    assert_eq!(
        record.state,
        RecordState::Succeeded,
        "settled before the answer's end reached the client"
    );
    assert_eq!(
        (
            record.labels.service.as_str(),
            record.labels.provider.as_str(),
            record.labels.class.as_str()
        ),
        ("oa", "openai", "chat")
    );
    assert_eq!(record.labels.operation_stage.as_str(), "answer");
    assert_eq!(
        &*record.labels.model, "gpt-4o-mini-2024-07-18",
        "refined from the answer"
    );
    assert_eq!(tokens(&record), (Some(11), Some(7)));
    assert_eq!(
        record.trace_parent.as_deref().map(ToString::to_string).as_deref(),
        Some(PARENT),
        "the caller's trace context is kept with the record"
    );
    let seen = p.last_request_headers();
    assert_eq!(seen["traceparent"], PARENT, "and passed on upstream");
    assert_eq!(
        seen["authorization"], "Bearer sk-upstream",
        "the upstream's own key passes"
    );
    assert_eq!(
        seen["idempotency-key"], "upstream-key-1",
        "the upstream's, untouched"
    );
    assert_eq!(seen["host"], p.upstream.addr.to_string().as_str());
    assert_eq!(seen["accept-encoding"], "identity");
    assert!(
        seen.keys().all(|name| !name.as_str().starts_with("x-inflight-")),
        "{seen:?}"
    );
}

#[tokio::test]
async fn a_streamed_chat_passes_chunk_by_chunk_and_reads_usage_from_its_last_chunk() {
    let p = proxy().await;
    let chat = json!({"model": "gpt-4o-mini", "stream": true, "stream_options": {"include_usage": true}});
    let Open {
        headers,
        id,
        mut body,
    } = p.open("/proxy/oa/v1/chat/completions", &[], chat).await;
    assert_eq!(headers["content-type"], "text/event-stream");
    let mut frames = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            frames.push(data);
        }
    }
    assert!(frames.len() >= 4, "chunk by chunk: {frames:?}");
    assert!(frames.concat().ends_with(b"data: [DONE]\n\n"));
    let record = p.ledger.get(id).await.unwrap();
    assert_eq!(record.state, RecordState::Succeeded);
    assert_eq!(tokens(&record), (Some(12), Some(2)));
}

/// Reads `path`'s streamed answer until a frame holds `end`, then hangs
/// up, as the `openai` package does on `data: [DONE]`; the record's id.
async fn read_until_then_hang_up(p: &Proxy, path: &str, body: Value, end: &[u8]) -> ActivityId {
    let Open { id, mut body, .. } = p.open(path, &[], body).await;
    let mut seen = Vec::new();
    while !seen.windows(end.len()).any(|window| window == end) {
        let frame = body.frame().await.expect("more").unwrap();
        seen.extend_from_slice(&frame.into_data().unwrap_or_default());
    }
    drop(body);
    id
}

#[tokio::test]
async fn a_client_that_hangs_up_at_the_answers_own_end_has_its_call_succeed() {
    let p = proxy().await;
    let chat = json!({"model": "gpt-4o-mini", "stream": true, "stream_options": {"include_usage": true}});
    let id = read_until_then_hang_up(&p, "/proxy/oa/v1/chat/completions", chat, b"data: [DONE]\n").await;
    let record = p.ledger.get(id).await.unwrap();
    assert_eq!(
        record.state,
        RecordState::Succeeded,
        "settled before [DONE] was handed on"
    );
    assert_eq!(tokens(&record), (Some(12), Some(2)));
    assert_eq!(&*record.labels.model, "gpt-4o-mini-2024-07-18");

    let done = b"\"prompt_eval_count\":26}\n";
    let id = read_until_then_hang_up(&p, "/proxy/ollama/api/chat", json!({"model": "llama3.2"}), done).await;
    let record = p.ledger.get(id).await.unwrap();
    assert_eq!(record.state, RecordState::Succeeded);
    assert_eq!(tokens(&record), (Some(26), Some(290)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let snap = p.snapshot().await;
    assert_eq!(
        (snap.total_succeeded, snap.total_cancelled, snap.total_in_flight),
        (2, 0, 0)
    );
}

#[tokio::test]
async fn tokens_are_read_from_ollama_gemini_and_openai_embeddings() {
    let p = proxy().await;
    let reply = p
        .post(
            "/proxy/ollama/api/chat",
            &[],
            json!({"model": "llama3.2", "messages": []}),
        )
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body.iter().filter(|byte| **byte == b'\n').count(), 3);
    let record = p.record(&reply).await;
    assert_eq!(
        (record.labels.service.as_str(), record.labels.class.as_str()),
        ("kb", "chat")
    );
    assert_eq!(tokens(&record), (Some(26), Some(290)));
    assert_eq!(&*record.labels.model, "llama3.2");

    let reply = p
        .post(
            "/proxy/gemini/models/gemini-2.0-flash:generateContent",
            &[],
            json!({"contents": []}),
        )
        .await;
    assert_eq!(reply.status, 200);
    let record = p.record(&reply).await;
    assert_eq!(
        (record.labels.provider.as_str(), record.labels.class.as_str()),
        ("gemini", "chat")
    );
    assert_eq!(
        &*record.labels.model, "gemini-2.0-flash-001",
        "named by the path, refined by the answer"
    );
    assert_eq!(tokens(&record), (Some(9), Some(6)));

    let reply = p
        .post(
            "/proxy/oa/v1/embeddings",
            &[],
            json!({"model": "text-embedding-3-small", "input": "hi"}),
        )
        .await;
    let record = p.record(&reply).await;
    assert_eq!(record.labels.class.as_str(), "embedding");
    assert_eq!(tokens(&record), (Some(5), None));
}

#[tokio::test]
async fn a_429_with_retry_after_fails_the_call_and_cools_its_lane() {
    let p = proxy().await;
    let reply = p
        .post("/proxy/oa/refuse", &[("x-inflight-class", "chat")], json!({}))
        .await;
    assert_eq!(
        (reply.status, &reply.body[..]),
        (429, &b"slow down"[..]),
        "the upstream's answer, as it came"
    );
    let record = p.record(&reply).await;
    assert_eq!(record.state, RecordState::Failed);
    assert_eq!(record.failure_stage, Some(inflight::FailureStage::Provider));
    // The lane now grants no slot until the cooldown ends.
    let reply = p.a_call_refused_cooling().await;
    let retry: u64 = reply.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((6..=7).contains(&retry), "{retry}");
    assert_eq!(
        p.upstream.seen.requests.lock().unwrap().len(),
        1,
        "the cooled call never reached the upstream"
    );
}

#[tokio::test]
async fn a_429_whose_body_breaks_off_still_cools_its_lane() {
    let p = proxy().await;
    let Open { id, body, .. } = p
        .open("/proxy/oa/refuse-cut", &[("x-inflight-class", "chat")], json!({}))
        .await;
    assert!(body.collect().await.is_err(), "the answer is cut");
    p.until("the call settled", |snap| snap.total_failed == 1).await;
    assert_eq!(p.ledger.get(id).await.unwrap().state, RecordState::Failed);
    p.a_call_refused_cooling().await;
}

#[tokio::test]
async fn a_500_a_refused_connection_and_a_slow_upstream_are_provider_failures() {
    let p = proxy().await;
    let reply = p
        .post("/proxy/oa/fail", &[("x-inflight-class", "chat")], json!({}))
        .await;
    assert_eq!((reply.status, &reply.body[..]), (500, &b"boom"[..]));
    assert_eq!(p.record(&reply).await.state, RecordState::Failed);

    let reply = p
        .post("/proxy/closed/v1/chat/completions", &[], json!({"model": "x"}))
        .await;
    assert_eq!(
        (reply.status, reply.code().as_str()),
        (502, "upstream_unreachable")
    );
    let message = reply.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("\"closed\""), "{message}");
    // The proxy's own answer names the record it made, as an upstream's does.
    let record = p.record(&reply).await;
    assert_eq!(record.state, RecordState::Failed);
    assert!(message.contains(&record.activity_id.to_string()), "{message}");

    let reply = p
        .post("/proxy/oa/slow", &[("x-inflight-class", "chat")], json!({}))
        .await;
    assert_eq!((reply.status, reply.code().as_str()), (504, "upstream_timeout"));
    assert_eq!(p.record(&reply).await.state, RecordState::Failed);
    let snap = p.snapshot().await;
    assert_eq!(snap.total_failed, 3, "{:#?}", snap.aggregates);
    assert_eq!(snap.total_in_flight, 0);
}

#[tokio::test]
async fn a_stream_cut_by_the_client_is_cancelled_and_its_upstream_dropped() {
    let p = proxy().await;
    let chat = [("x-inflight-class", "chat")];
    let Open { id, mut body, .. } = p.open("/proxy/oa/forever", &chat, json!({})).await;
    for _ in 0..2 {
        body.frame().await.unwrap().unwrap();
    }
    drop(body);
    p.until("the record cancelled", |snap| snap.total_cancelled == 1)
        .await;
    let record = p.ledger.get(id).await.unwrap();
    assert_eq!(record.state, RecordState::Cancelled);
    assert_eq!(record.cancel_reason.as_deref(), Some("client-disconnected"));
    for _ in 0..500 {
        if p.upstream.seen.dropped.load(Ordering::SeqCst) == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the upstream's stream was not dropped");
}

#[tokio::test]
async fn a_client_gone_while_waiting_in_line_is_cancelled() {
    let p = proxy().await;
    let solo = [("x-inflight-class", "chat"), ("x-inflight-service", "solo")];
    let request = p.request("POST", "/proxy/oa/forever", &solo, &json!({}));
    let holder = client().request(request).await.unwrap();
    let request = p.request("POST", "/proxy/oa/hold", &solo, &json!({}));
    let waiter = tokio::spawn(client().request(request));
    p.until("the second call waits", |snap| {
        snap.lane("solo::openai").is_some_and(|lane| lane.waiting == 1)
    })
    .await;
    waiter.abort();
    p.until("the waiter cancelled", |snap| snap.total_cancelled == 1)
        .await;
    let snap = p.snapshot().await;
    let cancelled = snap
        .recent_completions
        .iter()
        .find(|record| record.state == RecordState::Cancelled)
        .unwrap();
    assert_eq!(cancelled.cancel_reason.as_deref(), Some("client-disconnected"));
    drop(holder);
    p.until("the holder cancelled", |snap| {
        snap.total_cancelled == 2 && snap.total_in_flight == 0
    })
    .await;
}

#[tokio::test]
async fn a_call_past_its_max_wait_gets_our_429_and_its_record_is_cancelled() {
    let p = proxy().await;
    let solo = [("x-inflight-class", "chat"), ("x-inflight-service", "solo")];
    let holder = p.open("/proxy/oa/forever", &solo, json!({})).await;
    let waited = [
        ("x-inflight-class", "chat"),
        ("x-inflight-service", "solo"),
        ("x-inflight-max-wait", "200ms"),
    ];
    let reply = p.post("/proxy/oa/hold", &waited, json!({})).await;
    assert_eq!((reply.status, reply.code().as_str()), (429, "lane_full"));
    assert_eq!(reply.headers["retry-after"], "1");
    let message = reply.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("within 200ms") && message.contains("recorded cancelled"),
        "{message}"
    );
    let snap = p.snapshot().await;
    let cancelled: Vec<_> = snap
        .recent_completions
        .iter()
        .filter(|record| record.state == RecordState::Cancelled)
        .collect();
    assert_eq!(cancelled.len(), 1);
    assert_eq!(cancelled[0].cancel_reason.as_deref(), Some("wait ended"));
    assert_eq!(
        p.upstream.seen.requests.lock().unwrap().len(),
        1,
        "only the holder reached the upstream"
    );
    drop(holder);
}

#[tokio::test]
async fn a_stream_cut_by_the_upstream_fails_and_the_client_sees_it_cut() {
    let p = proxy().await;
    let chat = [("x-inflight-class", "chat")];
    let Open { id, body, .. } = p.open("/proxy/ollama/cut", &chat, json!({})).await;
    assert!(body.collect().await.is_err(), "the client's answer is cut too");
    p.until("the record failed", |snap| snap.total_failed == 1).await;
    assert_eq!(p.ledger.get(id).await.unwrap().state, RecordState::Failed);
}

#[tokio::test]
async fn a_cap_of_two_holds_under_twenty_concurrent_proxied_calls() {
    let p = Arc::new(proxy().await);
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let p = Arc::clone(&p);
            tokio::spawn(async move {
                p.post("/proxy/oa/hold", &[("x-inflight-class", "chat")], json!({}))
                    .await
                    .status
            })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap(), 200);
    }
    assert_eq!(
        p.upstream.seen.most.load(Ordering::SeqCst),
        2,
        "never more than the cap at the upstream"
    );
    let snap = p.snapshot().await;
    assert_eq!((snap.total_succeeded, snap.total_in_flight), (20, 0));
}

#[tokio::test]
async fn what_is_not_a_call_passes_unrecorded_and_an_empty_answer_settles_at_once() {
    let p = proxy().await;
    let reply = p.send("GET", "/proxy/oa/v1/models", &[], Value::Null).await;
    assert_eq!(reply.status, 200);
    assert!(!reply.headers.contains_key("x-inflight-activity-id"));
    assert_eq!(p.snapshot().await.total_succeeded, 0);

    let reply = p
        .post("/proxy/oa/no-content", &[("x-inflight-class", "chat")], json!({}))
        .await;
    assert_eq!(reply.status, 204);
    assert_eq!(p.record(&reply).await.state, RecordState::Succeeded);
}

/// An answer that ends with trailers is settled as it ended: hyper drops
/// the body once it has written them, without polling it to its end.
#[tokio::test]
async fn an_answer_ending_with_trailers_is_settled_not_cancelled() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    // An upstream that ends its chunked answers with trailers, asked for
    // or not (hyper sends them only to a client that asks).
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0_u8; 4096];
                while !request.windows(4).any(|end| end == b"\r\n\r\n") {
                    let Ok(read @ 1..) = stream.read(&mut buffer).await else {
                        return;
                    };
                    request.extend_from_slice(&buffer[..read]);
                }
                let body = br#"{"model":"m","usage":{"prompt_tokens":4,"completion_tokens":2}}"#;
                let mut answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n",
                    body.len()
                )
                .into_bytes();
                answer.extend_from_slice(body);
                answer.extend_from_slice(b"\r\n0\r\nx-checksum: abc\r\n\r\n");
                let _ = stream.write_all(&answer).await;
            });
        }
    });
    let p = proxy_with(
        &format!("[proxy.trailing]\nupstream = \"http://{addr}\"\nprovider = \"openai\"\n"),
        None,
    )
    .await;
    let reply = p
        .post("/proxy/trailing/v1/chat/completions", &[], json!({"model": "m"}))
        .await;
    assert_eq!(reply.status, 200);
    let record = p.record(&reply).await;
    assert_eq!(record.state, RecordState::Succeeded, "{:?}", record.cancel_reason);
    assert_eq!(
        (record.usage.input_tokens, record.usage.output_tokens),
        (Some(4), Some(2))
    );
}

/// A token count out of the ledger's range is left out, and the call is
/// still settled as it ended: a settle refused for it would leave the
/// record holding its slot until its bound.
#[tokio::test]
async fn an_answers_token_count_out_of_range_is_left_out_and_the_call_settled() {
    let p = proxy().await;
    let reply = p
        .post("/proxy/oa/huge-usage", &[("x-inflight-class", "chat")], json!({}))
        .await;
    assert_eq!(reply.status, 200);
    let record = p.record(&reply).await;
    assert_eq!(record.state, RecordState::Succeeded);
    assert_eq!(
        (record.usage.input_tokens, record.usage.output_tokens),
        (None, Some(3))
    );
}

/// The upstream's timeout is its class's deadline, however far: a class of
/// a hundred million years arms a timer past tokio's wheel, and still works.
#[tokio::test]
async fn a_class_with_the_farthest_deadline_still_forwards_and_settles() {
    let p = proxy_with("[classes.forever]\ndeadline = \"100000000years\"\n", None).await;
    let reply = p
        .post(
            "/proxy/oa/v1/chat/completions",
            &[("x-inflight-class", "forever")],
            json!({"model": "m"}),
        )
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(p.record(&reply).await.state, RecordState::Succeeded);
}

#[tokio::test]
async fn a_malformed_traceparent_is_passed_on_and_ignored_not_refused() {
    let p = proxy().await;
    let reply = p
        .post(
            "/proxy/oa/v1/chat/completions",
            &[("traceparent", "00-not-a-trace-context")],
            json!({"model": "gpt-4o-mini", "messages": []}),
        )
        .await;
    assert_eq!(reply.status, 200, "a hop ignores what it cannot read (W3C)");
    let record = p.record(&reply).await;
    assert_eq!(record.state, RecordState::Succeeded);
    assert_eq!(record.trace_parent, None);
    assert_eq!(p.last_request_headers()["traceparent"], "00-not-a-trace-context");
}

#[tokio::test]
async fn bad_requests_are_refused_and_record_nothing() {
    let p = proxy().await;
    let chat = "/proxy/oa/v1/chat/completions";
    for (path, headers, status, code) in [
        ("/proxy/nope/v1/chat/completions", &[][..], 404, "not_found"),
        ("/proxy/oa/v1/../admin", &[], 400, "invalid_request"),
        (chat, &[("x-inflight-priority", "urgent")], 400, "invalid_request"),
        (chat, &[("x-inflight-servce", "kb")], 400, "invalid_request"),
        (chat, &[("x-inflight-max-wait", "1h")], 400, "invalid_request"),
    ] {
        let reply = p.post(path, headers, json!({"model": "m"})).await;
        assert_eq!(
            (reply.status, reply.code().as_str()),
            (status, code),
            "{path} {headers:?}"
        );
    }
    let big = json!({"model": "m", "input": "x".repeat(5000)});
    let reply = p.post("/proxy/ollama/api/embed", &[], big).await;
    assert_eq!((reply.status, reply.code().as_str()), (413, "payload_too_large"));
    assert!(
        p.upstream.seen.requests.lock().unwrap().is_empty(),
        "nothing reached the upstream"
    );
    let snap = p.snapshot().await;
    assert_eq!(
        snap.total_in_flight + snap.total_succeeded + snap.total_failed + snap.total_cancelled,
        0
    );

    // An absolute request target never picks the host.
    let mut stream = tokio::net::TcpStream::connect(p.running.addr).await.unwrap();
    let request = support::request(
        "POST",
        "http://evil.example/proxy/oa/v1/chat/completions",
        "",
        b"{}",
    );
    tokio::io::AsyncWriteExt::write_all(&mut stream, &request)
        .await
        .unwrap();
    let answer = support::read_answer(&mut stream).await.unwrap();
    assert_eq!(answer.status, 400);
}

#[tokio::test]
async fn with_a_token_the_proxy_needs_it_in_its_own_header_and_strips_it() {
    let p = proxy_with("", Some("s3cret")).await;
    let chat = "/proxy/oa/v1/chat/completions";
    let reply = p
        .post(chat, &[("authorization", "Bearer s3cret")], json!({"model": "m"}))
        .await;
    assert_eq!(reply.status, 401, "Authorization is the upstream's");
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("X-Inflight-Token"));
    let reply = p
        .post(chat, &[("x-inflight-token", "wrong")], json!({"model": "m"}))
        .await;
    assert_eq!(reply.status, 401);
    let reply = p
        .post(
            chat,
            &[("x-inflight-token", "s3cret"), ("authorization", "Bearer sk-up")],
            json!({"model": "m"}),
        )
        .await;
    assert_eq!(reply.status, 200);
    let seen = p.last_request_headers();
    assert!(!seen.contains_key("x-inflight-token"));
    assert_eq!(seen["authorization"], "Bearer sk-up");
}

/// Serves `app` over TLS with a certificate `ca` issued, on a free port.
async fn serve_tls(app: Router, ca: &support::certs::Ca, dir: &std::path::Path) -> SocketAddr {
    let files = support::certs::files(dir);
    ca.issue(&files);
    let acceptor = {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(&files.key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_https_upstream_is_verified_against_the_routes_ca_file_or_the_systems_roots() {
    let dir = tempfile::tempdir().unwrap();
    let ca = support::certs::Ca::new("inflight test upstream CA");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let app = Router::new().route("/v1/chat/completions", post(chat_completions));
    let addr = serve_tls(app, &ca, dir.path()).await;
    let text = format!(
        "[proxy.private]\nupstream = \"https://localhost:{port}/v1\"\nprovider = \"openai\"\nca_file = {ca_file:?}\n\
         [proxy.public]\nupstream = \"https://localhost:{port}/v1\"\nprovider = \"openai\"\n",
        port = addr.port()
    );
    let (ledger, running) = serve(&text, None).await;
    let post = |route: &str| {
        hyper::Request::post(format!("http://{}/proxy/{route}/chat/completions", running.addr))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(
                json!({"model": "gpt-4o-mini"}).to_string(),
            )))
            .unwrap()
    };
    let answer = client().request(post("private")).await.unwrap();
    assert_eq!(answer.status(), 200);
    let id = activity_id(answer.headers());
    answer.into_body().collect().await.unwrap();
    let record = ledger.get(id).await.unwrap();
    assert_eq!(
        (record.state, record.usage.input_tokens),
        (RecordState::Succeeded, Some(11))
    );

    // The system's roots do not know the test's CA: the call fails, named.
    let answer = client().request(post("public")).await.unwrap();
    assert_eq!(answer.status(), 502);
    let body = answer.into_body().collect().await.unwrap().to_bytes();
    let error: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(error["error"]["code"], "upstream_unreachable");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("certificate") || message.contains("UnknownIssuer"),
        "{message}"
    );
    assert_eq!(
        ledger
            .snapshot(SnapshotOptions::default())
            .await
            .unwrap()
            .total_failed,
        1
    );
}

#[tokio::test]
async fn a_scoped_token_records_only_what_its_scope_and_services_allow() {
    let tokens = "[[tokens]]\ntoken = \"reader\"\nscope = \"read\"\n\
                  [[tokens]]\ntoken = \"kb-writer\"\nscope = \"write\"\nservices = [\"kb\"]\n";
    let p = proxy_with(tokens, None).await;
    let chat = "/proxy/oa/v1/chat/completions";
    let as_reader = [("x-inflight-token", "reader")];
    let reply = p
        .send("GET", "/proxy/oa/v1/models", &as_reader, Value::Null)
        .await;
    assert_eq!(reply.status, 200, "a read token passes a GET through");
    let reply = p.post(chat, &as_reader, json!({"model": "m"})).await;
    assert_eq!((reply.status, reply.code().as_str()), (403, "forbidden"));

    let reply = p
        .post(chat, &[("x-inflight-token", "kb-writer")], json!({"model": "m"}))
        .await;
    assert_eq!(
        (reply.status, reply.code().as_str()),
        (403, "forbidden"),
        "the route's service is oa"
    );
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("\"oa\""));
    let as_kb = [("x-inflight-token", "kb-writer"), ("x-inflight-service", "kb")];
    let reply = p.post(chat, &as_kb, json!({"model": "m"})).await;
    assert_eq!(reply.status, 200);
    assert_eq!(p.record(&reply).await.labels.service.as_str(), "kb");
    let calls = p.upstream.seen.requests.lock().unwrap().len();
    assert_eq!(calls, 2, "the refused calls never reached the upstream");
}
