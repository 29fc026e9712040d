//! Crashes under load on PostgreSQL: the server killed with SIGKILL and
//! restarted on the same database; and the database itself restarted twice
//! (a fast shutdown, then a crash) under a server that keeps running. After
//! each: every acknowledged transition is there, each record is counted
//! once, and the records in flight end reaped or settled. While the
//! database is away, calls get 503 `unavailable` with `Retry-After` within
//! 5 s, never another 5xx and never a hang, and the server recovers by
//! itself.
//!
//! The kill test runs on a fresh schema of the test server
//! (`INFLIGHT_TEST_POSTGRES_URL`, by default postgres@127.0.0.1:5432). The
//! restart test cannot restart that server, which others share: it starts
//! a private PostgreSQL cluster of its own (`initdb` into a temporary
//! directory, a free port, `fsync` and `synchronous_commit` on) and tears
//! it down at the end, also when it fails.

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::load::{check_records, kill_9_under_load, Failure, Load, OnFailure, SHORT_BOUNDS};
use common::{config_file, Launch, Server};
use inflight_pg_testing::TestDatabase;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_work_survives_kill_9_under_load_on_postgres() {
    let database = TestDatabase::new();
    let figures = kill_9_under_load(&database.store_url("")).await;
    eprintln!("kill -9 under load (PostgreSQL): {figures}");
}

/// One restart of the database: how long it was away, and what the calls
/// meanwhile got.
struct Gap {
    how: &'static str,
    /// From the stop to the database taking connections again.
    down: Duration,
    /// From then to the first call that succeeded.
    recovered_after: Duration,
    /// Calls that failed, from the stop until the next restart (or the end).
    failures: Vec<Failure>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_under_load_loses_nothing_and_the_gap_gets_503() {
    const PROMPT: Duration = Duration::from_secs(5);
    let cluster = Cluster::start().await;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(Launch {
        store: Some(cluster.url()),
        args: config_file(&dir, SHORT_BOUNDS),
        ..Launch::default()
    })
    .await;
    let load = Load::start(&server.base, 8, OnFailure::Continue);
    load.until_settled(100).await;
    let early = load.failures();
    assert!(early.is_empty(), "calls failed before any restart: {early:#?}");

    let mut gaps = Vec::new();
    for (how, mode) in [("fast shutdown", "fast"), ("crash", "immediate")] {
        let before = load.failures().len();
        let stopped = Instant::now();
        cluster.down(mode).await;
        // Away long enough that every client meets the gap.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        cluster.up().await;
        let back = Instant::now();
        let recovered = load.first_success_after(back, Duration::from_secs(20)).await;
        // More load on the recovered database before the next restart.
        load.until_settled(load.settled() + 100).await;
        let failures = load.failures()[before..].to_vec();
        gaps.push(Gap {
            how,
            down: back - stopped,
            recovered_after: recovered - back,
            failures,
        });
    }
    let (acked, failures) = load.finish().await;

    for gap in &gaps {
        let slowest = gap.failures.iter().map(|f| f.took).max().unwrap_or_default();
        eprintln!(
            "PostgreSQL {} under load: away {:?}, first success {:?} after it was back; \
             {} calls answered 503 unavailable meanwhile, the slowest in {slowest:?}",
            gap.how,
            gap.down,
            gap.recovered_after,
            gap.failures.len(),
        );
        assert!(
            !gap.failures.is_empty(),
            "no call met the {}: the test saw no gap",
            gap.how
        );
    }
    let wrong: Vec<&Failure> = failures
        .iter()
        .filter(|failure| !failure.is_prompt_unavailable(PROMPT))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} failed calls were not a 503 `unavailable` with Retry-After within {PROMPT:?} \
         (status None: no answer): {:#?}",
        wrong.len(),
        failures.len(),
        &wrong[..wrong.len().min(10)]
    );

    let figures = check_records(&server, &acked).await;
    eprintln!("PostgreSQL restarted twice under load: {figures}");
}
