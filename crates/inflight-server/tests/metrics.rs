//! `/metrics` after a scripted sequence: every series of docs/api.md, with
//! the value the sequence implies. In process, on the memory store and a
//! fake clock; tokio's paused clock runs the `?wait=` and the reaper.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use inflight::{FakeClock, Ledger, Settings};
use inflight_server::http::{app, AppState, MetricsOptions};
use serde_json::{json, Value};
use tower::ServiceExt;

/// 2026-08-13T12:00:00.000Z.
const T0: i64 = 1_786_622_400_000;

/// Embedding calls: bound 2 min executing, 1 min waiting; chat: 2 min.
const CONFIG: &str = r#"
[reap]
factor = 2
[classes.embedding]
deadline = "1m"
max_queue_wait = "30s"
[classes.chat]
deadline = "1m"
[lanes."kb::ollama"]
cap = 1
tokens_per_minute = 100000
[providers.openai]
tokens_per_minute = 50000
"#;

struct Api {
    router: Router,
    clock: FakeClock,
}

impl Api {
    fn new(options: MetricsOptions) -> (Self, Ledger) {
        let clock = FakeClock::at(inflight::Timestamp::from_millis(T0));
        let settings = Settings::from_toml(CONFIG).unwrap();
        let ledger = Ledger::builder(settings.ledger)
            .store_url("memory:")
            .clock(clock.clone())
            .build()
            .unwrap();
        let router = app(AppState::new(ledger.clone()).with_metrics(options));
        (Self { router, clock }, ledger)
    }

    async fn send(&self, method: Method, uri: &str, body: Option<Value>) -> (StatusCode, String) {
        let body = body.map_or_else(Body::empty, |body| Body::from(body.to_string()));
        let request = Request::builder().method(method).uri(uri).body(body).unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    async fn post(&self, uri: &str, body: Value) -> Value {
        let (status, text) = self.send(Method::POST, uri, Some(body)).await;
        assert!(status.is_success(), "{uri}: {status} {text}");
        serde_json::from_str(&text).unwrap()
    }

    async fn refused(&self, uri: &str) -> Value {
        let (status, text) = self.send(Method::POST, uri, Some(json!({}))).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{uri}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    async fn begin(&self, body: Value) -> String {
        let record = self.post("/v1/activities", body).await;
        record["activityId"].as_str().unwrap().to_owned()
    }

    fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// The scrape, checked for `# HELP` and `# TYPE` on every family, as
    /// sample line (`name{labels}`) to value.
    async fn metrics(&self) -> (String, BTreeMap<String, String>) {
        let (status, text) = self.send(Method::GET, "/metrics", None).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
        let mut samples = BTreeMap::new();
        for line in text.lines().filter(|line| !line.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            samples.insert(series.to_owned(), value.to_owned());
        }
        for series in samples.keys() {
            let name = series.split('{').next().unwrap();
            let family = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .filter(|family| text.contains(&format!("# TYPE {family} ")))
                .unwrap_or(name);
            assert!(
                text.contains(&format!("# HELP {family} ")),
                "no HELP for {family}"
            );
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "no TYPE for {family}"
            );
        }
        (text, samples)
    }
}

fn kb() -> Value {
    json!({"service": "kb", "provider": "ollama", "class": "embedding"})
}

const KB: &str = r#"service="kb",provider="ollama""#;
const CHAT: &str = r#"service="chat",provider="openai""#;

fn expect(samples: &BTreeMap<String, String>, text: &str, series: &str, value: &str) {
    assert_eq!(
        samples.get(series).map(String::as_str),
        Some(value),
        "{series} in\n{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn metrics_after_a_scripted_sequence_have_every_series_with_its_value() {
    let (api, ledger) = Api::new(MetricsOptions::default());

    // One background reaper pass, then the reaper stops: one run.
    let mut reaper = ledger.spawn_reaper();
    reaper.wait_for_passes(1).await;
    drop(reaper);

    // begin, start after 2 s in line, settle after 3 s of execution.
    let a = api.begin(kb()).await;
    api.advance(Duration::from_secs(2));
    api.post(&format!("/v1/activities/{a}/start"), json!({})).await;
    api.advance(Duration::from_secs(3));
    api.post(
        &format!("/v1/activities/{a}/settle"),
        json!({"success": true, "usage": {"inputTokens": 120, "outputTokens": 30}}),
    )
    .await;

    // cancel: a waiting record, never started.
    let b = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{b}/cancel"), json!({})).await;

    // leak: started, never settled; past its 2 min bound it is reaped.
    let c = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{c}/start"), json!({})).await;
    api.advance(Duration::from_secs(3 * 60));
    let reaped = api.post("/v1/reap", json!({})).await;
    assert_eq!(reaped, json!({"abandoned": 0, "unsettled": 1}));

    // late settle: the call ran, so its tokens count.
    let late = api
        .post(
            &format!("/v1/activities/{c}/settle"),
            json!({"success": true, "usage": {"inputTokens": 5}}),
        )
        .await;
    assert_eq!(late["lateSettle"], true);
    assert_eq!(late["inputTokens"], 5);

    // resurrection: reaped abandoned past its 1 min wait bound, then started.
    let d = api.begin(kb()).await;
    api.advance(Duration::from_secs(61));
    api.post("/v1/reap", json!({})).await;
    let resurrected = api.post(&format!("/v1/activities/{d}/start"), json!({})).await;
    assert_eq!(resurrected["state"], "executing");

    // an owner lost: its executing record is reaped `owner-lost`.
    let owner = api
        .post("/v1/owners", json!({"name": "worker", "ttlMs": 1000}))
        .await;
    let f = api
        .begin(json!({"service": "chat", "provider": "openai", "class": "chat", "ownerId": owner["ownerId"]}))
        .await;
    api.post(&format!("/v1/activities/{f}/start"), json!({})).await;
    api.advance(Duration::from_secs(2));
    let reaped = api.post("/v1/reap", json!({})).await;
    assert_eq!(reaped, json!({"abandoned": 0, "unsettled": 1}));

    // a start refused as lane_full (d holds the only slot), then a
    // `?wait=` that times out.
    let e = api.begin(kb()).await;
    let refused = api.refused(&format!("/v1/activities/{e}/start")).await;
    assert_eq!(refused["error"]["code"], "lane_full");
    api.refused(&format!("/v1/activities/{e}/start?wait=1s")).await;
    api.advance(Duration::from_secs(10));

    let (text, samples) = api.metrics().await;
    let expect = |series: &str, value: &str| expect(&samples, &text, series, value);

    // Gauges.
    expect(&format!(r#"inflight_in_flight{{{KB},state="executing"}}"#), "1");
    expect(&format!(r#"inflight_in_flight{{{KB},state="waiting"}}"#), "1");
    expect(&format!("inflight_lane_cap{{{KB}}}"), "1");
    expect(&format!("inflight_lane_longest_wait_seconds{{{KB}}}"), "10.0");
    expect(&format!("inflight_lane_waiting_reap_in_seconds{{{KB}}}"), "50.0");
    // The token window: a's 150 and c's late 5 have left the last minute.
    expect(&format!("inflight_lane_tokens_last_minute{{{KB}}}"), "0");
    expect(&format!("inflight_lane_tokens_reserved{{{KB}}}"), "0");
    expect(&format!("inflight_lane_token_budget{{{KB}}}"), "100000");
    expect(r#"inflight_provider_token_budget{provider="openai"}"#, "50000");
    assert!(!text.contains(r#"inflight_provider_token_budget{provider="ollama"}"#));
    expect(r#"inflight_owners{state="live"}"#, "0");
    expect(r#"inflight_owners{state="lost"}"#, "1");
    expect(r#"inflight_owners{state="released"}"#, "0");

    // Counters from the store.
    for (disposition, reason, value) in [
        ("abandoned", "deadline", "1"),
        ("unsettled", "deadline", "1"),
        ("abandoned", "owner-lost", "0"),
        ("unsettled", "owner-lost", "0"),
    ] {
        expect(
            &format!(r#"inflight_reaped_total{{{KB},disposition="{disposition}",reason="{reason}"}}"#),
            value,
        );
    }
    expect(
        &format!(r#"inflight_reaped_total{{{CHAT},disposition="unsettled",reason="owner-lost"}}"#),
        "1",
    );
    expect(
        &format!(r#"inflight_reaped_total{{{CHAT},disposition="unsettled",reason="deadline"}}"#),
        "0",
    );
    for (outcome, value) in [("succeeded", "1"), ("failed", "0"), ("cancelled", "1")] {
        expect(
            &format!(r#"inflight_settled_total{{{KB},outcome="{outcome}"}}"#),
            value,
        );
    }
    expect(&format!("inflight_late_settles_total{{{KB}}}"), "1");
    expect(&format!("inflight_resurrections_total{{{KB}}}"), "1");
    expect(&format!("inflight_resurrections_total{{{CHAT}}}"), "0");
    expect(&format!(r#"inflight_tokens_total{{{KB},type="input"}}"#), "125");
    expect(&format!(r#"inflight_tokens_total{{{KB},type="output"}}"#), "30");
    expect(&format!(r#"inflight_tokens_total{{{CHAT},type="input"}}"#), "0");

    // Per instance.
    expect(
        &format!(r#"inflight_admission_rejected_total{{{KB},reason="lane_full"}}"#),
        "1",
    );
    expect(
        &format!(r#"inflight_admission_rejected_total{{{KB},reason="wait_timeout"}}"#),
        "1",
    );
    expect("inflight_reaper_runs_total", "1");
    expect("inflight_reap_duration_seconds_count", "1");

    // Queue waits: a (2 s), c (0 s), d (61 s, its resurrection).
    let kb_class = format!(r#"{KB},class="embedding""#);
    expect(&format!("inflight_queue_wait_seconds_count{{{kb_class}}}"), "3");
    expect(&format!("inflight_queue_wait_seconds_sum{{{kb_class}}}"), "63.0");
    expect(
        &format!(r#"inflight_queue_wait_seconds_bucket{{le="0.005",{kb_class}}}"#),
        "1",
    );
    expect(
        &format!(r#"inflight_queue_wait_seconds_bucket{{le="2.5",{kb_class}}}"#),
        "2",
    );
    expect(
        &format!(r#"inflight_queue_wait_seconds_bucket{{le="60.0",{kb_class}}}"#),
        "2",
    );
    expect(
        &format!(r#"inflight_queue_wait_seconds_bucket{{le="120.0",{kb_class}}}"#),
        "3",
    );
    expect(
        &format!(r#"inflight_queue_wait_seconds_bucket{{le="+Inf",{kb_class}}}"#),
        "3",
    );
    // Execution: a (3 s); the cancel, the leak and the owner-lost record
    // never completed a run.
    expect(&format!("inflight_execution_seconds_count{{{kb_class}}}"), "1");
    expect(&format!("inflight_execution_seconds_sum{{{kb_class}}}"), "3.0");
    expect(
        &format!(r#"inflight_execution_seconds_bucket{{le="2.5",{kb_class}}}"#),
        "0",
    );
    expect(
        &format!(r#"inflight_execution_seconds_bucket{{le="5.0",{kb_class}}}"#),
        "1",
    );
    let chat_class = format!(r#"{CHAT},class="chat""#);
    expect(&format!("inflight_queue_wait_seconds_count{{{chat_class}}}"), "1");
    assert!(
        !text.contains(&format!("inflight_execution_seconds_count{{{chat_class}}}")),
        "{text}"
    );

    // The old names are gone, and the aggregates are off by default.
    for gone in [
        "inflight_lane_executing{",
        "inflight_lane_waiting{",
        "owner_lost_total",
        "milliseconds",
        "inflight_aggregate_",
    ] {
        assert!(!text.contains(gone), "{gone} in\n{text}");
    }
}

#[tokio::test]
async fn calls_of_classes_not_configured_are_counted_per_class_and_bounded() {
    let (api, _ledger) = Api::new(MetricsOptions::default());
    for class in ["embeding", "embeding", "chatt"] {
        api.begin(json!({"service": "kb", "provider": "ollama", "class": class}))
            .await;
    }
    api.begin(json!({"service": "kb", "provider": "ollama"})).await;
    api.begin(kb()).await;
    let (text, samples) = api.metrics().await;
    expect(
        &samples,
        &text,
        r#"inflight_unknown_class_total{class="embeding"}"#,
        "2",
    );
    expect(
        &samples,
        &text,
        r#"inflight_unknown_class_total{class="chatt"}"#,
        "1",
    );
    assert!(
        !text.contains(r#"unknown_class_total{class="unknown"}"#),
        "no class is no mistake"
    );
    assert!(
        !text.contains(r#"unknown_class_total{class="embedding"}"#),
        "{text}"
    );
    for i in 0..40 {
        api.begin(json!({"service": "kb", "provider": "ollama", "class": format!("typo-{i:02}")}))
            .await;
    }
    let (text, samples) = api.metrics().await;
    let series = samples
        .keys()
        .filter(|series| series.starts_with("inflight_unknown_class_total"))
        .count();
    assert_eq!(series, 17, "16 classes by name, the rest in other:\n{text}");
    // chatt, embeding and typo-00 to typo-13 by name; typo-14 to typo-39.
    expect(
        &samples,
        &text,
        r#"inflight_unknown_class_total{class="other"}"#,
        "26",
    );
}

#[tokio::test]
async fn a_scrape_reaps_first_like_every_read() {
    let (api, _ledger) = Api::new(MetricsOptions::default());
    let leaked = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{leaked}/start"), json!({}))
        .await;
    api.advance(Duration::from_secs(3 * 60));
    // No reap has run: the scrape's own reap finds the leak.
    let (text, samples) = api.metrics().await;
    expect(
        &samples,
        &text,
        &format!(r#"inflight_in_flight{{{KB},state="executing"}}"#),
        "0",
    );
    expect(
        &samples,
        &text,
        &format!(r#"inflight_reaped_total{{{KB},disposition="unsettled",reason="deadline"}}"#),
        "1",
    );
}

#[tokio::test]
async fn the_series_per_aggregate_are_there_when_asked_for() {
    let (api, _ledger) = Api::new(MetricsOptions { aggregates: true });
    let id = api
        .begin(json!({"service": "kb", "provider": "ollama", "class": "embedding", "model": "nomic-embed-text", "operationStage": "ingest"}))
        .await;
    api.post(&format!("/v1/activities/{id}/start"), json!({})).await;
    let (text, samples) = api.metrics().await;
    let labels = r#"service="kb",operation_stage="ingest",class="embedding",provider="ollama",model="nomic-embed-text",priority="unknown",admission="queued""#;
    // A call counts when it ends, under its final model.
    expect(
        &samples,
        &text,
        &format!("inflight_aggregate_calls_total{{{labels}}}"),
        "0",
    );
    expect(
        &samples,
        &text,
        &format!("inflight_aggregate_in_flight{{{labels}}}"),
        "1",
    );
    expect(
        &samples,
        &text,
        &format!(r#"inflight_aggregate_settled_total{{{labels},outcome="succeeded"}}"#),
        "0",
    );
    expect(
        &samples,
        &text,
        &format!(r#"inflight_aggregate_reaped_total{{{labels},disposition="abandoned",reason="deadline"}}"#),
        "0",
    );
    api.post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
        .await;
    let (text, samples) = api.metrics().await;
    expect(
        &samples,
        &text,
        &format!("inflight_aggregate_calls_total{{{labels}}}"),
        "1",
    );
}

/// A client that sends a new `service` on every call (the incident in issue
/// 15: 20,000 of them left 20,000 lanes and a 30 MB scrape) leaves at most
/// the configured lanes, and a scrape that stays small.
#[tokio::test]
async fn twenty_thousand_distinct_services_leave_the_scrape_bounded() {
    const CALLS: usize = 20_000;
    let clock = FakeClock::at(inflight::Timestamp::from_millis(T0));
    let settings = Settings::from_toml("[labels]\nmax_lanes = 50\n").unwrap();
    let ledger = Ledger::builder(settings.ledger)
        .store_url("memory:")
        .clock(clock.clone())
        .build()
        .unwrap();
    let api = Api {
        router: app(AppState::new(ledger.clone())),
        clock,
    };
    for i in 0..CALLS {
        let id = api
            .begin(json!({"service": format!("tenant-{i}"), "provider": "ollama", "class": "embedding"}))
            .await;
        api.post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
            .await;
    }
    let (text, samples) = api.metrics().await;
    let lanes: std::collections::BTreeSet<_> = samples
        .keys()
        .filter(|series| series.starts_with("inflight_settled_total{"))
        .filter_map(|series| series.split("service=\"").nth(1)?.split('"').next())
        .collect();
    eprintln!(
        "{CALLS} distinct services: {} lanes in the scrape, {} bytes",
        lanes.len(),
        text.len()
    );
    assert!(lanes.len() <= 51, "{} lanes", lanes.len());
    assert!(
        lanes.contains("other"),
        "the folded calls are counted under other"
    );
    // About 1.3 kB a lane (its reaps, settles, tokens, ...) for 51 lanes:
    // bounded by the lane limit, whatever the number of services called.
    assert!(text.len() < 80 * 1024, "a scrape of {} bytes", text.len());
    expect(
        &samples,
        &text,
        "inflight_labels_folded_total",
        &(CALLS - 50).to_string(),
    );
    let snapshot = api.send(Method::GET, "/v1/snapshot", None).await.1;
    let snapshot: Value = serde_json::from_str(&snapshot).unwrap();
    assert_eq!(snapshot["totalSucceeded"], CALLS);
}

#[tokio::test]
async fn series_come_in_the_order_of_their_labels_and_histograms_stay_whole() {
    let (api, _ledger) = Api::new(MetricsOptions::default());
    // Lanes begun out of order, each started and settled, so that every
    // family (histograms included) has a series per lane.
    let services = ["zeta", "alpha", "mu", "beta", "omega", "kappa", "delta", "sigma"];
    for service in services {
        let id = api
            .begin(json!({"service": service, "provider": "ollama", "class": "chat"}))
            .await;
        api.post(&format!("/v1/activities/{id}/start"), json!({})).await;
        api.advance(Duration::from_millis(5));
        api.post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
            .await;
    }
    let (text, _) = api.metrics().await;
    let mut sorted_services: Vec<&str> = services.to_vec();
    sorted_services.sort_unstable();
    let service_of = |line: &str| {
        line.split("service=\"")
            .nth(1)
            .map(|rest| rest.split('"').next().unwrap().to_owned())
    };
    // The settle counter of one outcome: one line per lane (the declared
    // `kb::ollama` too), in order.
    let mut lanes = sorted_services.clone();
    lanes.push("kb");
    lanes.sort_unstable();
    let settled: Vec<String> = text
        .lines()
        .filter(|line| line.starts_with("inflight_settled_total{") && line.contains("outcome=\"succeeded\""))
        .filter_map(service_of)
        .collect();
    assert_eq!(settled, lanes, "{text}");
    // A histogram's lines stay together per series, buckets ascending.
    let histogram: Vec<&str> = text
        .lines()
        .filter(|line| line.starts_with("inflight_execution_seconds"))
        .collect();
    let mut seen: Vec<String> = Vec::new();
    let mut last_le = f64::NEG_INFINITY;
    for line in &histogram {
        let service = service_of(line).expect("a lane's histogram");
        if seen.last() != Some(&service) {
            assert!(
                !seen.contains(&service),
                "{service}'s lines are split: {histogram:#?}"
            );
            seen.push(service);
            last_le = f64::NEG_INFINITY;
        }
        if let Some(le) = line.split("le=\"").nth(1) {
            let le = le.split('"').next().unwrap();
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap()
            };
            assert!(le > last_le, "buckets out of order: {histogram:#?}");
            last_le = le;
        }
    }
    assert_eq!(seen, sorted_services, "{histogram:#?}");
}

#[tokio::test]
async fn each_request_is_timed_by_its_route_and_method() {
    let (api, _ledger) = Api::new(MetricsOptions::default());
    let id = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{id}/start?wait=1s"), json!({}))
        .await;
    api.post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
        .await;
    let second = api.begin(kb()).await;
    api.post(&format!("/v1/activities/{second}/cancel"), json!({}))
        .await;
    let (status, _) = api.send(Method::GET, "/v1/no-such-route", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (text, samples) = api.metrics().await;
    let count = |method: &str, route: &str, waits: bool| {
        format!(
            r#"inflight_http_request_duration_seconds_count{{method="{method}",route="{route}",waits="{waits}"}}"#
        )
    };
    expect(&samples, &text, &count("POST", "/v1/activities", false), "2");
    // By the route's template, never by the id: the series stay few.
    expect(
        &samples,
        &text,
        &count("POST", "/v1/activities/{id}/start", true),
        "1",
    );
    expect(
        &samples,
        &text,
        &count("POST", "/v1/activities/{id}/settle", false),
        "1",
    );
    expect(
        &samples,
        &text,
        &count("POST", "/v1/activities/{id}/cancel", false),
        "1",
    );
    expect(&samples, &text, &count("GET", "unmatched", false), "1");
    assert!(!text.contains(&id), "an id in a label:\n{text}");
    // The scrape is answered before it is timed: it counts in the next.
    assert!(!samples.contains_key(&count("GET", "/metrics", false)), "{text}");
    let (text, samples) = api.metrics().await;
    expect(&samples, &text, &count("GET", "/metrics", false), "1");
}
