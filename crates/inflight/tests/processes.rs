//! Several real OS processes sharing one SQLite file.
//!
//! The children are this test binary run again with one `#[ignore]`d test
//! selected and its role in the environment; run by hand they do nothing.
//! These tests run on the wall clock because the processes do; every wait is
//! bounded.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inflight::{ActivitySpec, Ledger, LedgerConfig, Outcome, ReapReason, Settings, SnapshotOptions, State};

const ROLE: &str = "INFLIGHT_TEST_ROLE";
const DB: &str = "INFLIGHT_TEST_DB";
const LANE: &str = "knowledge-base::ollama";
const LEASE_TTL: Duration = Duration::from_millis(1500);
const REAP_INTERVAL: Duration = Duration::from_millis(500);

fn config(cap: u32) -> LedgerConfig {
    let text = format!(
        "[reap]\nfactor = 4\ninterval = \"{}ms\"\n[classes.embedding]\ndeadline = \"10m\"\n[lanes.\"{LANE}\"]\ncap = {cap}\n",
        REAP_INTERVAL.as_millis()
    );
    Settings::from_toml(&text).unwrap().ledger
}

fn ledger(path: &str, cap: u32) -> Ledger {
    Ledger::builder(config(cap))
        .store_url(format!("sqlite://{path}"))
        .build()
        .unwrap()
}

fn spec() -> ActivitySpec {
    ActivitySpec::new("knowledge-base", "ollama").class("embedding")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn spawn_child(test: &str, role: &str, db: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--ignored", "--nocapture", "--test-threads", "1"])
        .env(ROLE, role)
        .env(DB, db)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Child: joins as an owner, takes the only slot, says so, and waits to be
/// killed.
#[test]
#[ignore = "a child process of a_killed_owners_slot_is_reclaimed_through_its_lease"]
fn child_holds_the_only_slot() {
    let (Ok(role), Ok(db)) = (std::env::var(ROLE), std::env::var(DB)) else {
        return;
    };
    assert_eq!(role, "holder");
    runtime().block_on(async {
        let ledger = ledger(&db, 1);
        let _lease = ledger.join_as_owner("process-a", LEASE_TTL).await.unwrap();
        let permit = ledger.admit(spec()).await.unwrap();
        println!("HOLDING {}", permit.id());
        tokio::time::sleep(Duration::from_secs(120)).await;
        drop(permit);
    });
}

#[test]
fn a_killed_owners_slot_is_reclaimed_through_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("shared.db").display().to_string();
    // Create the schema before the child races us to it.
    drop(ledger(&db, 1));

    let mut holder = spawn_child("child_holds_the_only_slot", "holder", &db);
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    let held = loop {
        let line = lines.next().expect("the holder exited early").unwrap();
        // libtest prints `test NAME ... ` on the same line first.
        if let Some((_, id)) = line.split_once("HOLDING ") {
            break id.trim().to_owned();
        }
    };
    holder.kill().unwrap(); // SIGKILL: no drop, no release, no settle
    holder.wait().unwrap();

    runtime().block_on(async {
        let b = ledger(&db, 1);
        let _reaper = b.spawn_reaper();
        // Through the lease (1.5 s, then a reap pass), never the record's
        // own bound (40 minutes): admitted well within a minute.
        let permit = tokio::time::timeout(Duration::from_secs(60), b.admit(spec()))
            .await
            .expect("B admitted")
            .unwrap();

        let observer = ledger(&db, 1);
        let snap = observer.snapshot(SnapshotOptions::default()).await.unwrap();
        let lane = snap.lane(LANE).unwrap();
        assert_eq!(
            (lane.cap, lane.executing),
            (Some(1), 1),
            "B, not A and B, not zero"
        );
        assert_eq!(lane.reaped_owner_lost, 1);
        let a = observer.get(held.parse().unwrap()).await.unwrap();
        assert_eq!(a.state, State::Reaped);
        assert_eq!(a.reap_reason, Some(ReapReason::OwnerLost));
        assert_eq!(snap.in_flight[0].record.activity_id, permit.id());
        permit.settle(Outcome::Success).await.unwrap();
    });
}

fn timeline(records: &[inflight::ActivityRecord]) -> String {
    let mut lines: Vec<_> = records
        .iter()
        .map(|r| {
            format!(
                "{} enqueued {} started {} completed {}",
                r.activity_id,
                r.enqueued_at,
                r.started_at.unwrap_or(inflight::Timestamp::MIN),
                r.completed_at.unwrap_or(inflight::Timestamp::MIN)
            )
        })
        .collect();
    lines.sort();
    lines.join("\n")
}

/// Child: four concurrent starters, each checking the cap at its admission.
#[test]
#[ignore = "a child process of eight_starters_in_two_processes_never_exceed_the_cap_and_keep_the_line"]
fn child_runs_four_starters() {
    let (Ok(role), Ok(db)) = (std::env::var(ROLE), std::env::var(DB)) else {
        return;
    };
    runtime().block_on(async {
        let ledger = ledger(&db, 2);
        let mut tasks = Vec::new();
        for i in 0..4_u64 {
            let ledger = ledger.clone();
            let role = role.clone();
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(7 * i)).await;
                let permit = ledger
                    .admit(spec().operation_stage(format!("{role}-{i}")))
                    .await
                    .unwrap();
                // Checked at every admission, not only at the end.
                let snap = ledger.snapshot(SnapshotOptions::default()).await.unwrap();
                let executing = snap.lane(LANE).unwrap().executing;
                assert!(executing <= 2, "{executing} executing on a cap-2 lane");
                tokio::time::sleep(Duration::from_millis(60)).await;
                permit.settle(Outcome::Success).await.unwrap();
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
    });
    println!("STARTERS DONE");
}

#[test]
fn eight_starters_in_two_processes_never_exceed_the_cap_and_keep_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("shared.db").display().to_string();
    drop(ledger(&db, 2));
    let children: Vec<Child> = ["p1", "p2"]
        .iter()
        .map(|role| spawn_child("child_runs_four_starters", role, &db))
        .collect();
    for child in children {
        let output = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("STARTERS DONE"),
            "{stdout}"
        );
    }

    runtime().block_on(async {
        let observer = ledger(&db, 2);
        let snap = observer.snapshot(SnapshotOptions::default()).await.unwrap();
        assert_eq!(snap.total_activities, 8);
        assert_eq!(snap.total_recent_completions, 8);
        assert_eq!(snap.total_reaped, 0);
        let lane = snap.lane(LANE).unwrap();
        assert_eq!((lane.executing, lane.waiting), (0, 0));
        let records = &snap.recent_completions;
        for r in records {
            let started = r.started_at.unwrap();
            let completed = r.completed_at.unwrap();
            // Timestamps have millisecond resolution: events within the same
            // millisecond as this admission are left out both ways.
            let overlapping = records
                .iter()
                .filter(|o| o.activity_id != r.activity_id)
                .filter(|o| o.started_at.unwrap() < started && o.completed_at.unwrap() > started)
                .count();
            assert!(
                overlapping < 2,
                "{} ran beside {overlapping} others",
                r.activity_id
            );
            // First come, first served: executing plus those still waiting
            // ahead of it stayed below the cap when it was admitted.
            let ahead_waiting = records
                .iter()
                .filter(|o| o.enqueued_at < r.enqueued_at && o.started_at.unwrap() > started)
                .count();
            assert!(
                overlapping + ahead_waiting < 2,
                "{} overtook the line: {overlapping} executing, {ahead_waiting} waiting ahead\n{}",
                r.activity_id,
                timeline(records)
            );
            assert!(completed >= started);
        }
    });
}

/// How many lifecycles each of the four processes runs.
const LIFECYCLES: usize = 1_000;

/// Child: a thousand lifecycles through the library, eight at a time on a
/// lane capped at four across all processes, with its own reaper running;
/// any error fails it.
#[test]
#[ignore = "a child process of four_processes_with_their_own_reapers_end_with_exact_totals"]
fn child_runs_a_thousand_lifecycles() {
    let (Ok(role), Ok(db)) = (std::env::var(ROLE), std::env::var(DB)) else {
        return;
    };
    runtime().block_on(async {
        let ledger = ledger(&db, 4);
        let _reaper = ledger.spawn_reaper();
        let mut tasks = Vec::new();
        for worker in 0..8 {
            let ledger = ledger.clone();
            let role = role.clone();
            tasks.push(tokio::spawn(async move {
                for i in (worker..LIFECYCLES).step_by(8) {
                    // Waits its turn on the cap-4 lane the four processes share.
                    let permit = ledger
                        .admit(spec().operation_stage(role.clone()))
                        .await
                        .unwrap_or_else(|err| panic!("admit {i}: {err}"));
                    permit
                        .settle(Outcome::Success)
                        .await
                        .unwrap_or_else(|err| panic!("settle {i}: {err}"));
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
    });
    println!("LIFECYCLES DONE");
}

#[test]
fn four_processes_with_their_own_reapers_end_with_exact_totals() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("shared.db").display().to_string();
    drop(ledger(&db, 4));
    let started = Instant::now();
    let children: Vec<Child> = ["p1", "p2", "p3", "p4"]
        .iter()
        .map(|role| spawn_child("child_runs_a_thousand_lifecycles", role, &db))
        .collect();
    for child in children {
        let output = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("LIFECYCLES DONE"),
            "a process failed (a `database is locked` would be an error here): {stdout}"
        );
    }
    eprintln!(
        "4 processes x {LIFECYCLES} lifecycles on one SQLite file in {:?}",
        started.elapsed()
    );
    runtime().block_on(async {
        let observer = ledger(&db, 4);
        let snap = observer.snapshot(SnapshotOptions::default()).await.unwrap();
        let all = i64::try_from(4 * LIFECYCLES).unwrap();
        assert_eq!(snap.total_activities, all);
        assert_eq!(snap.total_succeeded, all);
        assert_eq!(
            (snap.total_failed, snap.total_cancelled, snap.total_reaped),
            (0, 0, 0)
        );
        assert_eq!(snap.total_in_flight, 0);
        for aggregate in &snap.aggregates {
            assert_eq!(
                aggregate.calls,
                i64::try_from(LIFECYCLES).unwrap(),
                "{aggregate:?}"
            );
        }
        let lane = snap.lane(LANE).unwrap();
        assert_eq!((lane.executing, lane.waiting), (0, 0));
    });
}
