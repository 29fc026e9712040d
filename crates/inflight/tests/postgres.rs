//! What only the PostgreSQL store does: migrations several instances run at
//! once, a schema newer than the build refused, the one SQL clock, and
//! notifications that wake another instance's waiters. (The acceptance
//! suite and the differential test run on it too; two real servers are in
//! the root `tests/postgres_instances.rs`.)
#![cfg(feature = "postgres")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inflight::store::{self, Store};
use inflight::{ActivitySpec, ErrorKind, Ledger, LedgerConfig, Outcome, SystemClock};
use inflight_pg_testing::TestDatabase;

fn open(url: &str) -> Result<Arc<dyn Store>, inflight::LedgerError> {
    store::open(url, Arc::new(LedgerConfig::default()), Arc::new(SystemClock))
}

#[test]
fn instances_starting_together_migrate_once() {
    let database = TestDatabase::new();
    let url = database.store_url("listen=false");
    let opened: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4).map(|_| scope.spawn(|| open(&url).map(|_| ()))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for result in opened {
        result.unwrap();
    }
    let mut client = database.client();
    let versions: i64 = client
        .query_one("SELECT COUNT(*) FROM inflight_schema", &[])
        .unwrap()
        .get(0);
    // The schema, owner-lost reaps split by disposition, one index fewer on
    // records in flight, counter rows per writer, the check that fails a
    // group's writes when one missed, refinement, idempotency keys,
    // successes without a start, lane states, tokens, the lane index's
    // rank and estimate, and the trace context.
    assert_eq!(versions, 12, "each migration recorded once");
}

#[test]
fn a_schema_newer_than_the_build_is_refused_with_a_clear_message() {
    let database = TestDatabase::new();
    let url = database.store_url("listen=false");
    drop(open(&url).unwrap());
    database
        .client()
        .batch_execute("INSERT INTO inflight_schema (version) VALUES (999)")
        .unwrap();
    let err = open(&url).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Storage);
    assert!(
        err.message()
            .contains("schema version 999 is newer than this build"),
        "{err}"
    );
}

#[test]
fn waiters_poll_each_second_with_a_listener_and_every_50_ms_without() {
    let database = TestDatabase::new();
    let listening = open(&database.store_url("")).unwrap();
    assert_eq!(listening.recheck_within(), store::RECHECK_HEARD);
    assert_eq!(store::RECHECK_HEARD, Duration::from_secs(1));
    let polling = open(&database.store_url("listen=false")).unwrap();
    assert_eq!(polling.recheck_within(), store::RECHECK_UNHEARD);
    assert_eq!(store::RECHECK_UNHEARD, Duration::from_millis(50));
}

#[test]
fn an_unreachable_server_is_unavailable_not_a_hang() {
    // Nothing listens on port 1.
    let started = Instant::now();
    let err = open("postgres://postgres@127.0.0.1:1/postgres").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn now_is_the_database_clock_unless_a_transaction_overrides_it() {
    let database = TestDatabase::new();
    drop(open(&database.store_url("listen=false")).unwrap());
    let mut client = database.client();
    let wall = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    let before = wall();
    let now: i64 = client.query_one("SELECT inflight_now()", &[]).unwrap().get(0);
    // Same machine: the database's clock is the host's, give or take.
    assert!((now - before).abs() < 1_000, "{now} vs {before}");
    let mut tx = client.transaction().unwrap();
    tx.batch_execute("SET LOCAL inflight.now_ms = '42'").unwrap();
    let overridden: i64 = tx.query_one("SELECT inflight_now()", &[]).unwrap().get(0);
    assert_eq!(overridden, 42);
    tx.commit().unwrap();
    let after: i64 = client.query_one("SELECT inflight_now()", &[]).unwrap().get(0);
    assert!(after >= now, "the override ended with its transaction");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_freed_by_one_instance_wakes_the_watchers_of_another() {
    let database = TestDatabase::new();
    let config = LedgerConfig::default().with_lane_cap("kb::ollama", 1).unwrap();
    // The watcher: a store of its own, listening.
    let watcher = open(&database.store_url("")).unwrap();
    let woken = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&woken);
    let lanes = Arc::new(Mutex::new(Vec::new()));
    let named = Arc::clone(&lanes);
    watcher.watch_capacity(Arc::new(move |lane| {
        named.lock().unwrap().push(lane.map(ToString::to_string));
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    // Once connected, the listener wakes its watchers once (for what it
    // may have missed): wait for that, then count from there.
    let give_up = Instant::now() + Duration::from_secs(10);
    while woken.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < give_up, "the listener never connected");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = woken.load(Ordering::SeqCst);
    let other = Ledger::builder(config)
        .store_url(database.store_url("listen=false"))
        .build()
        .unwrap();
    let permit = other
        .try_admit(ActivitySpec::new("kb", "ollama").class("embedding"))
        .await
        .unwrap();
    permit.settle(Outcome::Success).await.unwrap();
    let give_up = Instant::now() + Duration::from_secs(5);
    while woken.load(Ordering::SeqCst) == before {
        assert!(Instant::now() < give_up, "no notification reached the watcher");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The notifications (the grant's, the settle's) name the lane, so that
    // only its waiters are woken.
    let lanes = lanes.lock().unwrap();
    assert!(
        lanes[before..]
            .iter()
            .all(|lane| lane.as_deref() == Some("kb::ollama")),
        "{lanes:?}"
    );
}
