//! Every reap is one structured `tracing` event at INFO (target
//! `inflight::reap`) with the activity id, lane, class, disposition,
//! reason, age and bound; a command that reaps several records also logs
//! one summary line. On every store: SQLite's and PostgreSQL's are
//! published by their writer threads once the transaction committed, so the
//! subscriber is global.
//!
//! One test, run in sequence: the events of one scenario are told apart
//! from another's by draining the capture between them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use inflight::stats::REAP_TARGET;
use inflight::{ActivitySpec, FakeClock, Ledger, LedgerConfig, Settings};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

const T0: i64 = 1_786_622_400_000;

type Fields = BTreeMap<String, String>;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Fields>>>);

impl Capture {
    /// The reap events captured since the last call.
    fn drain(&self) -> Vec<Fields> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

struct Fielded<'a>(&'a mut Fields);

impl Visit for Fielded<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
}

impl<S: Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        if meta.target() != REAP_TARGET {
            return;
        }
        let mut fields = Fields::new();
        fields.insert("level".to_owned(), meta.level().to_string());
        event.record(&mut Fielded(&mut fields));
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(fields);
    }
}

fn capture() -> Capture {
    static CAPTURE: OnceLock<Capture> = OnceLock::new();
    CAPTURE
        .get_or_init(|| {
            let capture = Capture::default();
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
                .expect("the only subscriber of this test binary");
            capture
        })
        .clone()
}

/// Embedding: bound 2 min executing, 1 min waiting.
fn config() -> LedgerConfig {
    Settings::from_toml(
        "[reap]\nfactor = 2\n[classes.embedding]\ndeadline = \"1m\"\nmax_queue_wait = \"30s\"\n",
    )
    .unwrap()
    .ledger
}

fn spec() -> ActivitySpec {
    ActivitySpec::new("kb", "ollama").class("embedding")
}

async fn scenario(store_url: &str, events: &Capture) {
    let clock = FakeClock::at(inflight::Timestamp::from_millis(T0));
    let ledger = Ledger::builder(config())
        .store_url(store_url)
        .clock(clock.clone())
        .build()
        .unwrap();
    events.drain();

    // One reap, on a read: one event, no summary.
    let lone = ledger.begin_record(spec()).await.unwrap();
    clock.advance(Duration::from_secs(61));
    let read = ledger.get(lone.activity_id).await.unwrap();
    assert_eq!(read.state.as_str(), "reaped");
    let seen = events.drain();
    assert_eq!(seen.len(), 1, "{store_url}: {seen:?}");
    let event = &seen[0];
    let expected = [
        ("level", "INFO"),
        ("activity_id", &lone.activity_id.to_string()),
        ("lane", "kb::ollama"),
        ("class", "embedding"),
        ("disposition", "abandoned"),
        ("reason", "deadline"),
        ("age_ms", "61000"),
        ("bound_ms", "60000"),
    ];
    for (field, value) in expected {
        assert_eq!(
            event.get(field).map(String::as_str),
            Some(value),
            "{store_url}: {field} of {event:?}"
        );
    }
    assert!(event["message"].contains("reaped activity"), "{event:?}");

    // Three at once in one pass: three events and one summary.
    let mut ids = Vec::new();
    for _ in 0..2 {
        ids.push(ledger.begin_record(spec()).await.unwrap().activity_id);
    }
    let started = ledger
        .begin_record(spec().started_at(ledger.now()))
        .await
        .unwrap();
    ids.push(started.activity_id);
    clock.advance(Duration::from_secs(3 * 60));
    let counts = ledger.reap().await.unwrap();
    assert_eq!((counts.abandoned, counts.unsettled), (2, 1));
    let seen = events.drain();
    let reaps: Vec<&Fields> = seen.iter().filter(|e| e.contains_key("activity_id")).collect();
    let summaries: Vec<&Fields> = seen.iter().filter(|e| e.contains_key("reaped")).collect();
    assert_eq!(reaps.len(), 3, "{store_url}: {seen:?}");
    assert_eq!(summaries.len(), 1, "{store_url}: {seen:?}");
    let mut logged: Vec<String> = reaps.iter().map(|e| e["activity_id"].clone()).collect();
    let mut expected: Vec<String> = ids.iter().map(ToString::to_string).collect();
    logged.sort();
    expected.sort();
    assert_eq!(logged, expected);
    let unsettled = reaps
        .iter()
        .find(|e| e["activity_id"] == started.activity_id.to_string())
        .unwrap();
    assert_eq!(unsettled["disposition"], "unsettled");
    assert_eq!(
        (unsettled["age_ms"].as_str(), unsettled["bound_ms"].as_str()),
        ("180000", "120000")
    );
    let summary = summaries[0];
    assert_eq!(summary["reaped"], "3");
    assert_eq!(summary["abandoned"], "2");
    assert_eq!(summary["unsettled"], "1");
    assert_eq!(summary["owner_lost"], "0");
    assert_eq!(summary["level"], "INFO");

    // An owner lost: its record is reaped `owner-lost`, well within its bound.
    let owner = ledger
        .register_owner("worker", Duration::from_secs(1))
        .await
        .unwrap();
    let owned = ledger
        .begin_record(spec().started_at(ledger.now()).owner(&owner.owner_id))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(2));
    ledger.reap().await.unwrap();
    let seen = events.drain();
    assert_eq!(seen.len(), 1, "{store_url}: {seen:?}");
    assert_eq!(seen[0]["activity_id"], owned.activity_id.to_string());
    assert_eq!(seen[0]["reason"], "owner-lost");
    assert_eq!(seen[0]["disposition"], "unsettled");
    assert_eq!(
        (seen[0]["age_ms"].as_str(), seen[0]["bound_ms"].as_str()),
        ("2000", "120000")
    );

    // A read with nothing due logs nothing.
    ledger.reap().await.unwrap();
    assert!(events.drain().is_empty());
    ledger.close().await.unwrap();
}

#[tokio::test]
async fn every_reap_is_one_info_event_and_a_pass_that_reaps_several_adds_a_summary() {
    let events = capture();
    assert!(tracing::enabled!(target: REAP_TARGET, Level::INFO));
    scenario("memory:", &events).await;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("reaps.db").display());
    scenario(&url, &events).await;
    // PostgreSQL's "now" is the database's clock, overridden per
    // transaction by the ledger's `FakeClock`.
    #[cfg(feature = "postgres")]
    {
        let database = inflight_pg_testing::TestDatabase::new();
        scenario(&database.store_url(""), &events).await;
    }
}
