//! The PostgreSQL cases, each on a fresh schema of the test server
//! (`INFLIGHT_TEST_POSTGRES_URL`, by default postgres@127.0.0.1:5432, or a
//! private cluster started for the run when nothing answers there):
//!
//! - `postgres_lifecycle`: lifecycles per second through the PostgreSQL
//!   ledger (`INFLIGHT_BENCH_PG_POOL` writers, two by default, with group
//!   commit) against a hand-written group commit on plain `tokio-postgres`
//!   with as many writers (`group_baseline`), on a table with the columns a
//!   lifecycle writes; 8 and 64 callers.
//! - `postgres_snapshot_scale`: a snapshot's latency with a large settled
//!   history against a small one.
//! - `postgres_two_instances`: two ledgers on one database sharing a cap-4
//!   lane under 32 callers: grants per second, and the wake-up latency from
//!   a settle on one instance to the grant it frees on the other.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use inflight::{ActivitySpec, Ledger, LedgerConfig, Outcome, SnapshotOptions};
use inflight_pg_testing::TestDatabase;
use serde_json::json;

use tokio::sync::mpsc;

use crate::group_baseline::{self, answer, baseline_rate, next_batch, Queue, Step};
use crate::report::{human_count, ms, percentile, round, spread, Case, Pairs, Target};
use crate::sqlite_env::{ledger_lifecycle, long_lived, multi_thread, now_ms, populate_in_flight};
use crate::Plan;

/// The baseline's table: the columns a lifecycle writes, keyed by id.
const BASELINE_TABLE: &str = "CREATE TABLE calls (
    id           TEXT PRIMARY KEY,
    service      TEXT NOT NULL,
    provider     TEXT NOT NULL,
    class        TEXT NOT NULL,
    model        TEXT NOT NULL,
    state        TEXT NOT NULL,
    enqueued_at  BIGINT NOT NULL,
    started_at   BIGINT,
    completed_at BIGINT,
    success      BOOLEAN
)";
/// A batch of transitions in one statement: an upsert by id, as ours writes
/// its records, so that every row is found through the primary key (an
/// `UPDATE ... FROM unnest` planned on the empty table scans it for the rest
/// of the run, "Experiments that lost" in docs/performance.md). Each row is
/// an id, the state it moves to and its time; it returns how many rows it
/// wrote, which must be the batch's length.
const BASELINE_BATCH: &str = "WITH w AS (\
     INSERT INTO calls AS c (id, service, provider, class, model, state, enqueued_at) \
     SELECT id, 'knowledge-base', 'ollama', 'embedding', 'nomic-embed-text', state, at \
     FROM unnest($1::text[], $2::text[], $3::bigint[]) AS u(id, state, at) \
     ON CONFLICT (id) DO UPDATE SET state = excluded.state, \
        started_at = CASE WHEN excluded.state = 'executing' THEN excluded.enqueued_at ELSE c.started_at END, \
        completed_at = CASE WHEN excluded.state = 'succeeded' THEN excluded.enqueued_at ELSE c.completed_at END, \
        success = CASE WHEN excluded.state = 'succeeded' THEN true ELSE c.success END \
     RETURNING 1) \
     SELECT count(*) FROM w";

/// A ledger on `database`'s schema, on the system clock (the database's).
fn ledger_on(database: &TestDatabase, config: LedgerConfig, extra: &str) -> Result<Ledger> {
    Ledger::builder(config)
        .store_url(database.store_url(extra))
        .build()
        .context("open the PostgreSQL ledger")
}

/// A plain connection for the baseline, in the schema.
async fn baseline_client(database: &TestDatabase) -> Result<tokio_postgres::Client> {
    let url = database.store_url("");
    let (base, query) = url.split_once('?').expect("a schema parameter");
    let schema = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("schema="))
        .expect("a schema parameter");
    let (client, connection) = tokio_postgres::connect(base, tokio_postgres::NoTls)
        .await
        .context("connect the baseline")?;
    tokio::spawn(connection);
    client
        .batch_execute(&format!("SET search_path TO \"{schema}\""))
        .await?;
    Ok(client)
}

/// Starts the group-commit baseline's `pool` writers, each on its own
/// connection, taking batches from one queue.
async fn group_writers(database: &TestDatabase, pool: usize) -> Result<Queue> {
    let (queue, jobs) = mpsc::unbounded_channel();
    let jobs = Arc::new(tokio::sync::Mutex::new(jobs));
    for _ in 0..pool {
        let client = baseline_client(database).await?;
        let statement = client.prepare(BASELINE_BATCH).await?;
        let jobs = Arc::clone(&jobs);
        tokio::spawn(async move {
            loop {
                // One writer waits for the next batch while the others commit.
                let Some(batch) = next_batch(&mut *jobs.lock().await).await else {
                    return;
                };
                let ids: Vec<&str> = batch.iter().map(|job| job.id.as_str()).collect();
                let states: Vec<&str> = batch
                    .iter()
                    .map(|job| match job.step {
                        Step::Begin => "waiting",
                        Step::Start => "executing",
                        Step::Settle => "succeeded",
                    })
                    .collect();
                let times: Vec<i64> = batch.iter().map(|job| job.at).collect();
                let written = client
                    .query_one(&statement, &[&ids, &states, &times])
                    .await
                    .map_err(|err| err.to_string())
                    .and_then(|row| match row.get::<_, i64>(0) {
                        count if count == batch.len() as i64 => Ok(()),
                        count => Err(format!("wrote {count} rows of {}", batch.len())),
                    });
                drop(ids);
                drop(states);
                answer(batch, &written);
            }
        });
    }
    Ok(queue)
}

/// The caller counts of `postgres_lifecycle`.
const CALLERS: [usize; 2] = [8, 64];

pub(crate) fn postgres_lifecycle(plan: &Plan) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let mut cases = Vec::new();
    for callers in CALLERS {
        let database = TestDatabase::new();
        let pool = std::env::var("INFLIGHT_BENCH_PG_POOL")
            .unwrap_or_else(|_| inflight::store::postgres::DEFAULT_POOL.to_string());
        let ledger = ledger_on(&database, LedgerConfig::default(), &format!("pool={pool}"))?;
        let pairs = runtime.block_on(async {
            baseline_client(&database)
                .await?
                .batch_execute(BASELINE_TABLE)
                .await?;
            let writers = pool.parse().context("INFLIGHT_BENCH_PG_POOL")?;
            let queue = group_writers(&database, writers).await?;
            let ours_rate = |window| {
                let ledger = ledger.clone();
                group_baseline::rate(callers, window, move || {
                    let ledger = ledger.clone();
                    async move { ledger_lifecycle(&ledger).await }
                })
            };
            let warm = plan.sqlite_window / 2;
            baseline_rate(&queue, callers, warm).await?;
            ours_rate(warm).await?;
            let mut pairs = Pairs::default();
            for _ in 0..plan.postgres_pairs {
                let b = baseline_rate(&queue, callers, plan.sqlite_window).await?;
                let o = ours_rate(plan.sqlite_window).await?;
                pairs.push(b, o);
            }
            Ok::<_, anyhow::Error>(pairs)
        })?;
        drop(ledger);
        let name = format!("postgres_lifecycle_{callers}");
        cases.push(pairs.case(
            name,
            "lifecycles/s",
            // Issue 28: at least half of a hand-written batcher.
            Target::AtLeast(0.5),
            plan.sqlite_window,
            &format!(
                "{callers} callers (ours: tokio tasks, writer connections: {pool}, group commit; baseline: \
                 callers queue each transition and wait for its commit, {pool} tokio-postgres writers each \
                 commit whatever is queued (up to 256) as one upsert over arrays); synchronous_commit on"
            ),
            serde_json::Map::from_iter([
                ("callers".to_owned(), json!(callers)),
                ("pool".to_owned(), json!(pool)),
            ]),
        ));
    }
    Ok(cases)
}

pub(crate) fn postgres_snapshot_scale(plan: &Plan) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let t0 = now_ms();
    let options = SnapshotOptions::default();
    let (small, large) = plan.postgres_snapshot_scales;
    let mut stores = Vec::new();
    for scale in [small, large] {
        let database = TestDatabase::new();
        let loading = Instant::now();
        inflight::store::postgres::seed_history(
            &database.store_url("listen=false"),
            scale,
            inflight::Timestamp::from_millis(t0),
        )
        .context("seed_history")?;
        eprintln!(
            "  postgres_snapshot_scale: seeded {scale} history rows in {:.1}s",
            loading.elapsed().as_secs_f64()
        );
        let ledger = ledger_on(&database, LedgerConfig::default(), "listen=false")?;
        runtime.block_on(async {
            populate_in_flight(&ledger, 1_000, long_lived(t0)).await?;
            let check = ledger.snapshot(options).await?;
            if check.total_in_flight != 1_000 || check.total_recent_completions < scale as i64 {
                bail!(
                    "snapshot at scale {scale} sees {} in flight and {} recent completions",
                    check.total_in_flight,
                    check.total_recent_completions
                );
            }
            Ok(())
        })?;
        stores.push((scale, database, ledger));
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); 2];
    runtime.block_on(async {
        for round in 0..plan.snapshot_samples + 3 {
            for (index, (_, _, ledger)) in stores.iter().enumerate() {
                let started = Instant::now();
                black_box(ledger.snapshot(options).await?);
                // The first rounds warm the caches.
                if round >= 3 {
                    samples[index].push(ms(started.elapsed()));
                }
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let ratios: Vec<f64> = samples[1]
        .iter()
        .zip(&samples[0])
        .map(|(large, small)| large / small)
        .collect();
    let (_, small_ms, _) = spread(&samples[0]);
    let (_, large_ms, _) = spread(&samples[1]);
    let (r_min, ratio, r_max) = spread(&ratios);
    Ok(vec![Case {
        name: "postgres_snapshot_scale".to_owned(),
        ours: large_ms,
        baseline: Some(small_ms),
        unit: "ms",
        target: Target::Bounded {
            ratio: 1.5,
            ceiling: 10.0,
        },
        paired_ratio: Some(ratio),
        note: format!(
            "median snapshot latency with {} settled records of history (ours) against {} (baseline), \
             1,000 in flight in both, {} interleaved samples; ratio = median of the pairs' ratios \
             (min {r_min:.2}x, max {r_max:.2}x)",
            human_count(large),
            human_count(small),
            plan.snapshot_samples,
        ),
        extra: serde_json::Map::from_iter([
            ("history_large".to_owned(), json!(large)),
            ("history_small".to_owned(), json!(small)),
        ]),
    }])
}

/// What the two-instance load records: grants and settles, by instance.
#[derive(Default)]
struct Timeline {
    /// (when, instance) of each settle that freed a slot.
    settles: Vec<(Instant, usize)>,
    /// (when, instance) of each grant that had to wait in line.
    waited_grants: Vec<(Instant, usize)>,
}

pub(crate) fn postgres_two_instances(plan: &Plan) -> Result<Vec<Case>> {
    const CALLERS: usize = 32;
    const CAP: u32 = 4;
    const HOLD: Duration = Duration::from_millis(5);
    /// The wake-up across instances that the case aims under, at p99.
    const WAKE_P99_AIM_MS: f64 = 20.0;
    let runtime = multi_thread()?;
    let database = TestDatabase::new();
    let config = || LedgerConfig::default().with_lane_cap("knowledge-base::ollama", CAP);
    let ledgers = [
        ledger_on(&database, config()?, "")?,
        ledger_on(&database, config()?, "")?,
    ];
    let spec = || {
        ActivitySpec::new("knowledge-base", "ollama")
            .class("embedding")
            .model("nomic-embed-text")
    };
    let timeline = Arc::new(Mutex::new(Timeline::default()));
    let grants = Arc::new(AtomicU64::new(0));
    let window = plan.http_window;
    let elapsed = runtime.block_on(async {
        // A short warm-up: connections, statements, the lane's row.
        for ledger in &ledgers {
            ledger.admit(spec()).await?.settle(Outcome::Success).await?;
        }
        let started = Instant::now();
        let until = started + window;
        let mut tasks = Vec::new();
        for caller in 0..CALLERS {
            let instance = caller % 2;
            let ledger = ledgers[instance].clone();
            let (timeline, grants) = (Arc::clone(&timeline), Arc::clone(&grants));
            tasks.push(tokio::spawn(async move {
                while Instant::now() < until {
                    let asked = Instant::now();
                    let permit = ledger.admit(spec()).await?;
                    let granted = Instant::now();
                    grants.fetch_add(1, Ordering::Relaxed);
                    // Waited in line rather than admitted on arrival.
                    if granted - asked > Duration::from_millis(2) {
                        timeline.lock().unwrap().waited_grants.push((granted, instance));
                    }
                    // A short call holding the slot.
                    tokio::time::sleep(HOLD).await;
                    permit.settle(Outcome::Success).await?;
                    timeline.lock().unwrap().settles.push((Instant::now(), instance));
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        for task in tasks {
            task.await??;
        }
        Ok::<_, anyhow::Error>(started.elapsed())
    })?;
    let rate = grants.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64();
    // The lane's own ceiling: every slot always held, each for one call.
    let ideal = f64::from(CAP) / HOLD.as_secs_f64();
    // A grant was freed by the other instance when the last settle before
    // it, on either instance, was on the other one: its latency is from
    // that settle's acknowledgement to the grant.
    let timeline = timeline.lock().unwrap();
    let mut settles = timeline.settles.clone();
    settles.sort_by_key(|(at, _)| *at);
    let mut latencies: Vec<f64> = timeline
        .waited_grants
        .iter()
        .filter_map(|(granted, instance)| {
            let last = settles.partition_point(|(at, _)| at <= granted);
            let (settled, by) = settles.get(last.checked_sub(1)?)?;
            (by != instance).then(|| ms(*granted - *settled))
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    if latencies.is_empty() {
        bail!("no grant was freed by the other instance");
    }
    let (p50, p99) = (percentile(&latencies, 50.0), percentile(&latencies, 99.0));
    eprintln!(
        "  postgres_two_instances: {rate:.0} grants/s; wake-up across instances p50 {p50:.1} ms, p99 {p99:.1} ms \
         ({} samples)",
        latencies.len()
    );
    Ok(vec![
        Case {
            name: "postgres_two_instances".to_owned(),
            ours: rate,
            baseline: Some(ideal),
            unit: "grants/s",
            // A grant costs two commits (the admission and the settle) and
            // a wake-up across instances: a quarter of the lane's ceiling.
            target: Target::AtLeast(0.25),
            paired_ratio: None,
            note: format!(
                "two ledgers on one database, a cap-{CAP} lane, {CALLERS} callers (half on each) admitting, \
                 holding the slot 5 ms and settling, for {:.0}s; baseline = the lane's ceiling ({CAP} slots \
                 always held, {ideal:.0} grants/s); wake-up across instances p50 {p50:.1} ms, \
                 p99 {p99:.1} ms over {} grants freed by the other instance",
                window.as_secs_f64(),
                latencies.len()
            ),
            extra: serde_json::Map::from_iter([
                ("wake_p50_ms".to_owned(), json!(round(p50))),
                ("wake_p99_ms".to_owned(), json!(round(p99))),
                ("wake_samples".to_owned(), json!(latencies.len())),
            ]),
        },
        Case {
            name: "postgres_two_instances_wake_p99".to_owned(),
            ours: p99,
            baseline: None,
            unit: "ms",
            target: Target::Aim {
                met: p99 <= WAKE_P99_AIM_MS,
            },
            paired_ratio: None,
            note: format!(
                "p99 of the wake-up latency above (p50 {p50:.1} ms); aim: at most {WAKE_P99_AIM_MS} ms"
            ),
            extra: serde_json::Map::new(),
        },
    ])
}
