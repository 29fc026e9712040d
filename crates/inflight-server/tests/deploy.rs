//! `deploy/`: the Grafana dashboard is well-formed JSON, and every metric
//! name in its queries and in the Prometheus alert rules is one the server
//! exports (checked against a real scrape). `promtool check rules` and
//! `promtool test rules` run in `.ci/run`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use inflight::{FakeClock, Ledger, Settings};
use inflight_server::http::{app, AppState, MetricsOptions};
use serde_json::{json, Value};
use tower::ServiceExt;

fn deploy(path: &str) -> String {
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(path);
    std::fs::read_to_string(&file).unwrap_or_else(|err| panic!("{}: {err}", file.display()))
}

/// Every `inflight_...` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("inflight_") {
        let preceded = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        if !preceded {
            names.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    names
}

/// The sample names of a real scrape in which every family has a series,
/// and the names of its histograms.
async fn exported() -> BTreeSet<String> {
    let clock = FakeClock::at(inflight::Timestamp::from_millis(1_786_622_400_000));
    let settings = Settings::from_toml(
        "[lanes.\"kb::ollama\"]\ncap = 1\ntokens_per_minute = 1000\n[providers.ollama]\ntokens_per_minute = 5000\n",
    )
    .unwrap();
    let ledger = Ledger::builder(settings.ledger)
        .store_url("memory:")
        .clock(clock.clone())
        .build()
        .unwrap();
    let router = app(AppState::new(ledger).with_metrics(MetricsOptions { aggregates: true }));
    let call = |method: Method, uri: String, body: Value| {
        let router = router.clone();
        async move {
            let request = Request::builder()
                .method(method)
                .uri(uri)
                .body(Body::from(body.to_string()))
                .unwrap();
            let response = router.oneshot(request).await.unwrap();
            let status = response.status();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8(bytes.to_vec()).unwrap())
        }
    };
    let kb = json!({"service": "kb", "provider": "ollama", "class": "embedding"});
    let (_, begun) = call(Method::POST, "/v1/activities".into(), kb.clone()).await;
    let id = serde_json::from_str::<Value>(&begun).unwrap()["activityId"]
        .as_str()
        .unwrap()
        .to_owned();
    call(Method::POST, format!("/v1/activities/{id}/start"), json!({})).await;
    clock.advance(Duration::from_secs(1));
    call(
        Method::POST,
        format!("/v1/activities/{id}/settle"),
        json!({"success": true}),
    )
    .await;
    // One executing, one waiting and refused.
    for _ in 0..2 {
        let (_, begun) = call(Method::POST, "/v1/activities".into(), kb.clone()).await;
        let id = serde_json::from_str::<Value>(&begun).unwrap()["activityId"]
            .as_str()
            .unwrap()
            .to_owned();
        call(Method::POST, format!("/v1/activities/{id}/start"), json!({})).await;
    }
    let (status, text) = call(Method::GET, "/metrics".into(), Value::Null).await;
    assert_eq!(status, StatusCode::OK);
    let mut names: BTreeSet<String> = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .map(|line| line.split(['{', ' ']).next().unwrap().to_owned())
        .collect();
    // A histogram's own name, as prose names it (`inflight_execution_seconds`).
    names.extend(text.lines().filter_map(|line| {
        let family = line.strip_prefix("# TYPE ")?.strip_suffix(" histogram")?;
        Some(family.to_owned())
    }));
    names
}

/// The series of issue 13, item 1 (histograms by their buckets).
const SERIES: &[&str] = &[
    "inflight_in_flight",
    "inflight_lane_cap",
    "inflight_lane_longest_wait_seconds",
    "inflight_owners",
    "inflight_reaped_total",
    "inflight_settled_total",
    "inflight_late_settles_total",
    "inflight_resurrections_total",
    "inflight_tokens_total",
    "inflight_admission_rejected_total",
    "inflight_reaper_runs_total",
    "inflight_queue_wait_seconds_bucket",
    "inflight_execution_seconds_bucket",
    "inflight_reap_duration_seconds_bucket",
    "inflight_http_request_duration_seconds_bucket",
];

#[tokio::test]
async fn the_dashboard_is_well_formed_and_queries_only_exported_series() {
    let exported = exported().await;
    for series in SERIES {
        assert!(
            exported.contains(*series),
            "the scrape lacks {series}: {exported:?}"
        );
    }
    let dashboard: Value = serde_json::from_str(&deploy("grafana/inflight.json")).expect("valid JSON");
    assert!(dashboard["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(dashboard["uid"].as_str().is_some_and(|u| !u.is_empty()));
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut queried = BTreeSet::new();
    for panel in panels {
        let title = panel["title"].as_str().expect("every panel has a title");
        assert!(
            ids.insert(panel["id"].as_u64().expect("a numeric id")),
            "{title}: duplicate id"
        );
        for key in ["h", "w", "x", "y"] {
            assert!(panel["gridPos"][key].is_u64(), "{title}: gridPos.{key}");
        }
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            let expr = target["expr"].as_str().expect("a PromQL expr");
            assert!(target["refId"].is_string(), "{title}: refId");
            assert_eq!(
                expr.matches('(').count(),
                expr.matches(')').count(),
                "{title}: unbalanced {expr}"
            );
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{title}: {expr} reads no inflight series");
            for name in names {
                assert!(exported.contains(&name), "{title}: {name} is not exported");
                queried.insert(name);
            }
        }
    }
    for series in SERIES {
        assert!(queried.contains(*series), "the dashboard never shows {series}");
    }
}

#[tokio::test]
async fn the_alert_rules_read_only_exported_series() {
    let exported = exported().await;
    let rules = deploy("prometheus/alerts.yml");
    let names = metric_names(&rules);
    assert!(names.len() >= 6, "{names:?}");
    for name in &names {
        assert!(
            exported.contains(name),
            "alerts.yml reads {name}, which is not exported"
        );
    }
    for alert in [
        "InflightLaneSaturated",
        "InflightReapsRising",
        "InflightOwnerLost",
        "InflightWaitingNearBound",
        "InflightReaperNotRunning",
    ] {
        assert!(rules.contains(&format!("alert: {alert}")), "{alert}");
        assert!(
            deploy("prometheus/alerts_test.yml").contains(&format!("alertname: {alert}")),
            "{alert} is not unit-tested"
        );
    }
}
