//! `[otel]` from the real binary: a collector here receives OTLP over HTTP
//! and decodes it with the OpenTelemetry protobuf definitions. Each record
//! that ends gives one span (a success, a failure, a cancel, both reaps, a
//! record reaped `abandoned` and then started and settled), a begin's
//! `traceparent` makes the span its child, and both GenAI metrics arrive.
//! A collector that is not there costs requests nothing: what cannot be
//! sent is dropped, counted and logged once.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::Router;
use common::{config_file, Launch, Server, PATIENCE};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use opentelemetry_proto::tonic::metrics::v1::Metric;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;
use tokio::process::Command;

/// What the collector received.
#[derive(Default)]
struct Received {
    spans: Vec<Span>,
    /// Each span's resource `service.name`, in the same order.
    services: Vec<String>,
    metrics: Vec<Metric>,
}

type Collector = Arc<Mutex<Received>>;

fn lock(collector: &Collector) -> std::sync::MutexGuard<'_, Received> {
    collector.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn traces(State(collector): State<Collector>, body: Bytes) -> &'static str {
    let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
    let mut received = lock(&collector);
    for resource in request.resource_spans {
        let service = resource
            .resource
            .as_ref()
            .and_then(|r| text(&r.attributes, "service.name"))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                received.services.push(service.clone());
                received.spans.push(span);
            }
        }
    }
    ""
}

async fn metrics(State(collector): State<Collector>, body: Bytes) -> &'static str {
    let request = ExportMetricsServiceRequest::decode(body).expect("OTLP protobuf");
    let mut received = lock(&collector);
    for resource in request.resource_metrics {
        for scope in resource.scope_metrics {
            received.metrics.extend(scope.metrics);
        }
    }
    ""
}

/// A collector on a free port: its base URL.
async fn collector() -> (String, Collector) {
    let collector = Collector::default();
    let app = Router::new()
        .route("/v1/traces", axum::routing::post(traces))
        .route("/v1/metrics", axum::routing::post(metrics))
        .with_state(Arc::clone(&collector));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), collector)
}

fn value(attributes: &[KeyValue], key: &str) -> Option<Any> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.clone())
}

fn text(attributes: &[KeyValue], key: &str) -> Option<String> {
    match value(attributes, key)? {
        Any::StringValue(text) => Some(text),
        other => panic!("{key} is not a string: {other:?}"),
    }
}

fn int(attributes: &[KeyValue], key: &str) -> Option<i64> {
    match value(attributes, key)? {
        Any::IntValue(n) => Some(n),
        other => panic!("{key} is not an integer: {other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

/// `chat` calls have minutes; `embedding` calls are reaped a second past
/// their start or their enqueue.
const CONFIG: &str = "[reap]\nfactor = 1\n[classes.chat]\ndeadline = \"10m\"\n\
     [classes.embedding]\ndeadline = \"1s\"\nmax_queue_wait = \"1s\"\n";

async fn begin(server: &Server, query: &str, traceparent: Option<&str>) -> String {
    begin_in(server, "chat", query, traceparent).await
}

async fn begin_in(server: &Server, class: &str, query: &str, traceparent: Option<&str>) -> String {
    let mut request = server
        .request(reqwest::Method::POST, &format!("/v1/activities{query}"))
        .json(&json!({"service": "kb", "provider": "openai", "class": class, "model": "gpt-4o-mini"}));
    if let Some(parent) = traceparent {
        request = request.header("traceparent", parent);
    }
    let answer = request.send().await.unwrap();
    assert_eq!(answer.status(), 201);
    let record: serde_json::Value = answer.json().await.unwrap();
    record["activityId"].as_str().unwrap().to_owned()
}

async fn ok(server: &Server, path: &str, body: serde_json::Value) {
    let (status, answer) = server.post(path, body).await;
    assert_eq!(status, 200, "{path}: {answer}");
}

/// Starts the record `id` and settles it a success.
async fn start_and_succeed(server: &Server, id: &str) {
    ok(server, &format!("/v1/activities/{id}/start"), json!({})).await;
    ok(
        server,
        &format!("/v1/activities/{id}/settle"),
        json!({"success": true}),
    )
    .await;
}

/// Waits (bounded) until the collector holds `count` spans.
async fn spans_arrive(collector: &Collector, count: usize) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while lock(collector).spans.len() < count {
        assert!(
            tokio::time::Instant::now() < deadline,
            "fewer than {count} spans arrived"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGTERM, and the exit: a graceful shutdown sends what is left.
async fn stop(mut server: Server) {
    let pid = server.child.id().unwrap().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().await.unwrap();
    let status = tokio::time::timeout(PATIENCE, server.child.wait())
        .await
        .expect("the server stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn each_ended_record_is_one_genai_span_and_the_metrics_arrive() {
    let (base, collector) = collector().await;
    let dir = tempfile::tempdir().unwrap();
    let settings = format!(
        "{CONFIG}[otel]\nendpoint = \"{base}\"\nservice_name = \"llm-gateway\"\nhold_abandoned = \"1m\"\n"
    );
    let server = Server::start(Launch {
        store: Some(common::sqlite(&dir.path().join("ledger.db"), None)),
        args: config_file(&dir, &settings),
        env: vec![("OTEL_METRIC_EXPORT_INTERVAL", "500".to_owned())],
        ..Launch::default()
    })
    .await;

    let traced = begin(&server, "?start=now", Some(&format!("00-{TRACE}-{PARENT}-01"))).await;
    ok(
        &server,
        &format!("/v1/activities/{traced}/settle"),
        json!({"success": true, "usage": {"inputTokens": 11, "outputTokens": 7}}),
    )
    .await;
    let failed = begin(&server, "?start=now", None).await;
    ok(
        &server,
        &format!("/v1/activities/{failed}/settle"),
        json!({"success": false, "failureStage": "provider"}),
    )
    .await;
    let cancelled = begin(&server, "", None).await;
    ok(
        &server,
        &format!("/v1/activities/{cancelled}/cancel"),
        json!({"reason": "user left"}),
    )
    .await;
    // Its caller did not sample: no span.
    let unsampled = begin(&server, "?start=now", Some(&format!("00-{TRACE}-{PARENT}-00"))).await;
    ok(
        &server,
        &format!("/v1/activities/{unsampled}/settle"),
        json!({"success": true}),
    )
    .await;

    let unsettled = begin_in(&server, "embedding", "?start=now", None).await;
    let abandoned = begin_in(&server, "embedding", "", None).await;
    let revived = begin_in(&server, "embedding", "", None).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (status, reaped) = server.post("/v1/reap", json!({})).await;
    assert_eq!(status, 200, "{reaped}");
    assert_eq!(
        (reaped["abandoned"].as_i64(), reaped["unsettled"].as_i64()),
        (Some(2), Some(1))
    );
    start_and_succeed(&server, &revived).await;

    // Sent within a second or so, while the server runs.
    spans_arrive(&collector, 5).await;
    let (_, scrape) = {
        let answer = server
            .request(reqwest::Method::GET, "/metrics")
            .send()
            .await
            .unwrap();
        (answer.status(), answer.text().await.unwrap())
    };
    assert!(
        scrape.contains("inflight_otel_exported_spans_total 5"),
        "{scrape}"
    );
    assert!(scrape.contains("inflight_otel_dropped_total 0"), "{scrape}");
    // The abandoned record is held for a late start until the shutdown.
    stop(server).await;

    let received = lock(&collector);
    let by_id: BTreeMap<String, &Span> = received
        .spans
        .iter()
        .map(|span| (text(&span.attributes, "inflight.activity_id").unwrap(), span))
        .collect();
    assert_eq!(by_id.len(), received.spans.len(), "one span per record");
    let mut ids: Vec<&str> = by_id.keys().map(String::as_str).collect();
    let mut expected = vec![
        &*traced,
        &*failed,
        &*cancelled,
        &*unsettled,
        &*abandoned,
        &*revived,
    ];
    ids.sort_unstable();
    expected.sort_unstable();
    assert_eq!(ids, expected, "every end once, the unsampled one not at all");
    assert!(
        received.services.iter().all(|s| s == "llm-gateway"),
        "{:?}",
        received.services
    );

    let span = by_id[&traced];
    assert_eq!(span.name, "chat gpt-4o-mini");
    assert_eq!(span.kind, 3, "CLIENT");
    assert_eq!(hex(&span.trace_id), TRACE, "joins the caller's trace");
    assert_eq!(hex(&span.parent_span_id), PARENT, "as a child of its span");
    let a = &span.attributes;
    assert_eq!(text(a, "gen_ai.operation.name").as_deref(), Some("chat"));
    assert_eq!(text(a, "gen_ai.provider.name").as_deref(), Some("openai"));
    assert_eq!(text(a, "gen_ai.request.model").as_deref(), Some("gpt-4o-mini"));
    assert_eq!(
        (
            int(a, "gen_ai.usage.input_tokens"),
            int(a, "gen_ai.usage.output_tokens")
        ),
        (Some(11), Some(7))
    );
    assert_eq!(text(a, "inflight.lane").as_deref(), Some("kb::openai"));
    assert_eq!(text(a, "inflight.class").as_deref(), Some("chat"));
    assert_eq!(int(a, "inflight.queue_wait_ms"), Some(0));
    assert_eq!(text(a, "error.type"), None);
    assert_eq!(span.events[0].name, "inflight.queue_wait");
    assert_eq!(
        span.events[0].time_unix_nano, span.start_time_unix_nano,
        "at its start"
    );
    assert!(span.end_time_unix_nano >= span.start_time_unix_nano);
    assert_eq!(span.status.as_ref().map_or(0, |s| s.code), 0, "unset");

    let error = |id: &str| text(&by_id[id].attributes, "error.type");
    let status = |id: &str| by_id[id].status.as_ref().map_or(0, |s| s.code);
    assert_eq!(error(&failed).as_deref(), Some("provider"));
    assert_eq!(error(&cancelled).as_deref(), Some("cancelled"));
    assert_eq!(
        text(&by_id[&*cancelled].attributes, "inflight.cancel_reason").as_deref(),
        Some("user left")
    );
    assert_eq!(error(&unsettled).as_deref(), Some("unsettled"));
    assert_eq!(error(&abandoned).as_deref(), Some("abandoned"));
    for id in [&failed, &cancelled, &unsettled, &abandoned] {
        assert_eq!(status(id), 2, "ERROR");
    }
    let reap = &by_id[&*unsettled].attributes;
    assert_eq!(text(reap, "inflight.disposition").as_deref(), Some("unsettled"));
    assert_eq!(text(reap, "inflight.reap_reason").as_deref(), Some("deadline"));
    assert_ne!(hex(&by_id[&*failed].trace_id), TRACE, "a trace of its own");
    assert!(by_id[&*failed].parent_span_id.is_empty());
    // Never started: its span runs from its enqueue.
    assert!(by_id[&*abandoned].events.is_empty());

    // Reaped, then started and settled: one span, the reap an event.
    let span = by_id[&revived];
    assert_eq!(span.name, "embeddings gpt-4o-mini");
    assert_eq!(error(&revived), None);
    assert_eq!(
        text(&span.attributes, "inflight.state").as_deref(),
        Some("succeeded")
    );
    let names: Vec<&str> = span.events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["inflight.queue_wait", "inflight.reaped"]);
    let reaped_event = &span.events[1];
    assert_eq!(
        text(&reaped_event.attributes, "inflight.disposition").as_deref(),
        Some("abandoned")
    );
    assert!(int(&span.attributes, "inflight.queue_wait_ms").unwrap() >= 1000);

    // The metrics: the conventions' names, units and buckets.
    let metric = |name: &str| {
        received
            .metrics
            .iter()
            .rev()
            .find(|m| m.name == name)
            .unwrap_or_else(|| {
                panic!(
                    "no {name} among {:?}",
                    received.metrics.iter().map(|m| &m.name).collect::<Vec<_>>()
                )
            })
    };
    let duration = metric("gen_ai.client.operation.duration");
    assert_eq!(duration.unit, "s");
    let Some(Data::Histogram(histogram)) = &duration.data else {
        panic!("{duration:?}")
    };
    let point = histogram
        .data_points
        .iter()
        .find(|p| {
            text(&p.attributes, "error.type").is_none()
                && text(&p.attributes, "gen_ai.operation.name").as_deref() == Some("chat")
        })
        .expect("the chat successes' point");
    assert_eq!(point.explicit_bounds[0], 0.01);
    assert_eq!(point.explicit_bounds.len(), 14);
    assert_eq!(point.count, 2, "the traced and unsampled successes");
    assert!(histogram
        .data_points
        .iter()
        .any(|p| text(&p.attributes, "error.type").as_deref() == Some("provider")));
    let tokens = metric("gen_ai.client.token.usage");
    assert_eq!(tokens.unit, "{token}");
    let Some(Data::Histogram(histogram)) = &tokens.data else {
        panic!("{tokens:?}")
    };
    let sum = |kind: &str| {
        histogram
            .data_points
            .iter()
            .filter(|p| text(&p.attributes, "gen_ai.token.type").as_deref() == Some(kind))
            .map(|p| p.sum.unwrap_or_default())
            .sum::<f64>()
    };
    assert_eq!((sum("input"), sum("output")), (11.0, 7.0));
    assert_eq!(histogram.data_points[0].explicit_bounds[1], 4.0);
}

#[tokio::test]
async fn a_record_brought_back_by_another_process_gives_no_abandoned_span() {
    let (base, collector) = collector().await;
    let dir = tempfile::tempdir().unwrap();
    let store = common::sqlite(&dir.path().join("shared.db"), None);
    // Two servers on one SQLite file; only the first exports.
    let exporting = Server::start(Launch {
        store: Some(store.clone()),
        args: config_file(
            &dir,
            &format!("{CONFIG}[otel]\nendpoint = \"{base}\"\nhold_abandoned = \"2s\"\n"),
        ),
        ..Launch::default()
    })
    .await;
    let other_dir = tempfile::tempdir().unwrap();
    let other = Server::start(Launch {
        store: Some(store),
        args: config_file(&other_dir, CONFIG),
        ..Launch::default()
    })
    .await;
    let left = begin_in(&exporting, "embedding", "", None).await;
    let back = begin_in(&exporting, "embedding", "", None).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (status, reaped) = exporting.post("/v1/reap", json!({})).await;
    assert_eq!((status, reaped["abandoned"].as_i64()), (200, Some(2)), "{reaped}");
    // The other brings one back while the first holds both.
    start_and_succeed(&other, &back).await;
    // Past the hold, the one still abandoned goes out.
    spans_arrive(&collector, 1).await;
    stop(exporting).await;
    stop(other).await;
    let received = lock(&collector);
    let ids: Vec<String> = received
        .spans
        .iter()
        .map(|span| text(&span.attributes, "inflight.activity_id").unwrap())
        .collect();
    assert_eq!(
        ids,
        [left],
        "the record brought back elsewhere is not exported as abandoned here"
    );
}

#[tokio::test]
async fn a_collector_that_is_not_there_costs_calls_nothing_and_is_logged_once() {
    // A port nothing listens on.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let dir = tempfile::tempdir().unwrap();
    let settings = format!("[otel]\nendpoint = \"{base}\"\ntimeout = \"1s\"\n");
    let mut server = Server::start(Launch {
        args: config_file(&dir, &settings),
        store: Some("memory:".to_owned()),
        // Metrics exported every 300 ms fail as often as the spans.
        env: vec![("OTEL_METRIC_EXPORT_INTERVAL", "300".to_owned())],
        ..Launch::default()
    })
    .await;
    for _ in 0..3 {
        for _ in 0..5 {
            let id = begin(&server, "?start=now", None).await;
            ok(
                &server,
                &format!("/v1/activities/{id}/settle"),
                json!({"success": true}),
            )
            .await;
        }
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    // One warning for the spans and one for the metrics, in either order.
    let mut warnings = std::collections::BTreeMap::new();
    while warnings.len() < 2 {
        let warned = server
            .wait_for_log("the export's warnings", |line| {
                line["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("OpenTelemetry: cannot export"))
            })
            .await;
        let message = warned["fields"]["message"].as_str().unwrap().to_owned();
        assert_eq!(warned["level"], "WARN", "{warned}");
        assert!(warnings.insert(message, warned).is_none(), "logged twice");
    }
    assert!(
        warnings
            .keys()
            .any(|m| m.starts_with("OpenTelemetry: cannot export spans"))
            && warnings
                .keys()
                .any(|m| m.starts_with("OpenTelemetry: cannot export metrics")),
        "{warnings:?}"
    );
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let scrape = server
            .request(reqwest::Method::GET, "/metrics")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let failed_metric_exports = scrape
            .lines()
            .find_map(|line| line.strip_prefix("inflight_otel_failed_metric_exports_total "))
            .and_then(|count| count.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no failed metric exports counted: {scrape}"));
        // Three seconds of exports every 300 ms: several failed.
        if scrape.contains("inflight_otel_dropped_total 15") && failed_metric_exports >= 3 {
            assert!(
                scrape.contains("inflight_otel_exported_spans_total 0"),
                "{scrape}"
            );
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{scrape}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Several failed exports, one warning.
    let pid = server.child.id().unwrap().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().await.unwrap();
    let mut more = 0;
    while let Ok(Some(line)) = tokio::time::timeout(PATIENCE, server_log(&mut server)).await {
        if line["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("OpenTelemetry: cannot export"))
        {
            more += 1;
        }
    }
    assert_eq!(more, 0, "logged once a minute, not per export");
}

/// The next line of `server`'s log; `None` once it exited.
async fn server_log(server: &mut Server) -> Option<serde_json::Value> {
    server.next_log().await
}
