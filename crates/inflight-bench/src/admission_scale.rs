//! `admission_scale`: an admission decision's cost on a capped lane as the
//! settled history grows; `budget_admission_scale`: the same on a lane
//! with a token budget, whose decision also reads the token window and the
//! estimates waiting ahead.

use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use inflight::{ActivityId, ErrorKind, FakeClock, Ledger, LedgerConfig, SnapshotOptions};
use serde_json::json;

use crate::report::{human_count, round, spread, Case, Target};
use crate::sqlite_env::{
    flush_page_cache, long_lived, multi_thread, now_ms, populate_in_flight, spec, sqlite_ledger,
    sqlite_ledger_with, TempDir, LONG_DEADLINE,
};
use crate::Plan;

/// The capped lane of `admission_scale` (the lane of `spec()`), its cap, and
/// the records in flight on it: half executing, half waiting.
const ADMISSION_LANE: &str = "knowledge-base::ollama";
const ADMISSION_CAP: u32 = 1_000;
const ADMISSION_IN_FLIGHT: usize = 1_000;
/// Every record in flight is estimated at this many tokens. The budgeted
/// ledger's cap leaves slots free, so its decision goes on to the budget:
/// 500 reserved and 500 waiting ahead make 10,000, one more than its
/// budget, so every sample is refused `budget_exhausted`.
const ESTIMATE: i64 = 10;
const BUDGET_CAP: u32 = 2_000;
const BUDGET: i64 = 9_999;
/// Pairs of decisions discarded before measuring, and the fewest measured
/// pairs even once the time budget ran out.
const ADMISSION_WARM_UP: usize = 5;
const ADMISSION_MIN_PAIRS: usize = 11;

/// Moves every other seeded history record (by `completed_at`) from the
/// loader's lane `bench-history::ollama` to the capped lane, with its share
/// of the counters, so that the capped lane has settled history of its own,
/// interleaved with the other lane's: the rows a plan that misses the lane's
/// partial index reads. Returns how many records moved.
fn move_half_history_to_lane(path: &Path) -> Result<usize> {
    let mut conn = rusqlite::Connection::open(path).context("open the seeded file")?;
    let tx = conn.transaction()?;
    let moved = tx.execute(
        "UPDATE activities SET service = 'knowledge-base' \
         WHERE service = 'bench-history' AND completed_at % 2 = 0",
        [],
    )?;
    let n = i64::try_from(moved)?;
    // `seed_history` counts every record alike (one success, the same
    // waits), so the moved share of each sum is `sum / succeeded * n`
    // (an aggregate's calls are no longer stored: migration 8).
    tx.execute(
        "INSERT INTO aggregates (service, operation_stage, class, provider, model, priority, admission, \
           succeeded, queue_wait_count, queue_wait_sum_ms, queue_wait_max_ms, \
           execution_count, execution_sum_ms, execution_max_ms, last_seen_at) \
         SELECT 'knowledge-base', operation_stage, class, provider, model, priority, admission, \
           ?1, ?1, queue_wait_sum_ms / succeeded * ?1, queue_wait_max_ms, \
           ?1, execution_sum_ms / succeeded * ?1, execution_max_ms, last_seen_at \
         FROM aggregates WHERE service = 'bench-history'",
        [n],
    )?;
    tx.execute(
        "UPDATE aggregates SET succeeded = succeeded - ?1, \
           queue_wait_count = queue_wait_count - ?1, \
           queue_wait_sum_ms = queue_wait_sum_ms - queue_wait_sum_ms / succeeded * ?1, \
           execution_count = execution_count - ?1, \
           execution_sum_ms = execution_sum_ms - execution_sum_ms / succeeded * ?1 \
         WHERE service = 'bench-history'",
        [n],
    )?;
    tx.commit()?;
    Ok(moved)
}

/// One side of `admission_scale`: `history` settled records (half on the
/// capped lane, half on another), 500 records executing and 500 waiting on
/// the capped lane, and the record whose start is measured, waiting behind
/// them all. Two ledgers on the file, each with a clock stopped at `t0`,
/// so nothing ever becomes due: one with the lane's cap, one with a wider
/// cap and a token budget; the id is the measured record's.
fn admission_store(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    history: usize,
    t0: i64,
) -> Result<(TempDir, Ledger, Ledger, ActivityId)> {
    let tmp = TempDir::new(dir, &format!("admission-{history}"))?;
    let path = tmp.file("ours.db");
    let loading = Instant::now();
    // Settled over the hour before t0.
    inflight::store::sqlite::seed_history(&path, history, inflight::Timestamp::from_millis(t0))
        .context("seed_history")?;
    let on_lane = move_half_history_to_lane(&path)?;
    eprintln!(
        "  admission_scale: seeded {history} history rows ({on_lane} of them on {ADMISSION_LANE}) in {:.1}s",
        loading.elapsed().as_secs_f64()
    );
    // Populated through a ledger without the cap: beginning an executing
    // record on a capped lane is itself an admission decision, and setting
    // up must not cost what is measured.
    {
        let ledger = sqlite_ledger(&path, Some(FakeClock::at(inflight::Timestamp::from_millis(t0))))?;
        runtime.block_on(async {
            let executing = move || long_lived(t0)().max_tokens(ESTIMATE);
            populate_in_flight(&ledger, ADMISSION_IN_FLIGHT / 2, executing).await?;
            // Waiting since a second before the measured record.
            let waiting = move || {
                spec()
                    .deadline(LONG_DEADLINE)
                    .enqueued_at(inflight::Timestamp::from_millis(t0 - 1_000))
                    .max_tokens(ESTIMATE)
            };
            populate_in_flight(&ledger, ADMISSION_IN_FLIGHT / 2, waiting).await
        })?;
    }
    let config = LedgerConfig::default().with_lane_cap(ADMISSION_LANE, ADMISSION_CAP)?;
    let ledger = sqlite_ledger_with(
        &path,
        config,
        Some(FakeClock::at(inflight::Timestamp::from_millis(t0))),
    )?;
    let budgeted = LedgerConfig::default()
        .with_lane_cap(ADMISSION_LANE, BUDGET_CAP)?
        .with_lane_budget(ADMISSION_LANE, BUDGET)?;
    let budgeted = sqlite_ledger_with(
        &path,
        budgeted,
        Some(FakeClock::at(inflight::Timestamp::from_millis(t0))),
    )?;
    let asker = runtime.block_on(async {
        let record = ledger
            .begin_record(
                spec()
                    .deadline(LONG_DEADLINE)
                    .enqueued_at(inflight::Timestamp::from_millis(t0)),
            )
            .await?;
        let snapshot = ledger.snapshot(SnapshotOptions::default()).await?;
        let lane = snapshot
            .lane(ADMISSION_LANE)
            .ok_or_else(|| anyhow!("the snapshot shows no lane {ADMISSION_LANE}"))?;
        let expected = ADMISSION_IN_FLIGHT as i64 / 2;
        if (lane.executing, lane.waiting) != (expected, expected + 1)
            || snapshot.total_activities != (history + ADMISSION_IN_FLIGHT + 1) as i64
        {
            bail!(
                "admission store at {history}: lane {} executing, {} waiting, {} activities in all",
                lane.executing,
                lane.waiting,
                snapshot.total_activities
            );
        }
        Ok::<_, anyhow::Error>(record.activity_id)
    })?;
    Ok((tmp, ledger, budgeted, asker))
}

/// One admission decision: a start of the waiting record `id`, refused
/// `lane_full` (here 500 executing plus 500 waiting ahead of it reach the
/// cap), so nothing changes and every sample decides the same lane. Its
/// time in microseconds.
pub(crate) async fn refused_start(ledger: &Ledger, id: ActivityId) -> Result<f64> {
    refused_as(ledger, id, ErrorKind::LaneFull).await
}

/// A start of `id` refused as `kind`: its time in microseconds.
async fn refused_as(ledger: &Ledger, id: ActivityId, kind: ErrorKind) -> Result<f64> {
    let started = Instant::now();
    let decided = ledger.start(id, None).await;
    let elapsed = started.elapsed().as_secs_f64() * 1e6;
    match decided {
        Err(err) if err.kind() == kind => Ok(elapsed),
        Err(err) => Err(err.into()),
        Ok(record) => bail!("the start of {id} was admitted ({:?}), not refused", record.state),
    }
}

/// Pairs of decisions (`pair` makes one: small, then large) until the
/// plan's samples are taken, or its time budget ran out past the fewest
/// pairs; the warm-up pairs left out.
async fn sample_pairs<S, L>(plan: &Plan, pair: impl Fn() -> (S, L)) -> Result<(Vec<f64>, Vec<f64>)>
where
    S: std::future::Future<Output = Result<f64>>,
    L: std::future::Future<Output = Result<f64>>,
{
    let (mut small_us, mut large_us) = (Vec::new(), Vec::new());
    let sampling = Instant::now();
    for round in 0..ADMISSION_WARM_UP + plan.admission_samples {
        let (small, large) = pair();
        let s = small.await?;
        let l = large.await?;
        if round >= ADMISSION_WARM_UP {
            small_us.push(s);
            large_us.push(l);
            if small_us.len() >= ADMISSION_MIN_PAIRS && sampling.elapsed() >= plan.admission_budget {
                break;
            }
        }
    }
    Ok((small_us, large_us))
}

/// The case `name` from the paired samples of a decision at `small` and
/// `large` history rows.
fn scale_case(
    name: &str,
    (small, large): (usize, usize),
    small_us: &[f64],
    large_us: &[f64],
    refused: &str,
    cut_short: &str,
) -> Case {
    let ratios: Vec<f64> = small_us.iter().zip(large_us).map(|(s, l)| l / s).collect();
    let pairs = ratios.len();
    let (s_min, small_med, s_max) = spread(small_us);
    let (l_min, large_med, l_max) = spread(large_us);
    let (r_min, ratio, r_max) = spread(&ratios);
    eprintln!("  {name}: {small} history rows: median {small_med:.1} us (min {s_min:.1}, max {s_max:.1})");
    eprintln!("  {name}: {large} history rows: median {large_med:.1} us (min {l_min:.1}, max {l_max:.1})");
    eprintln!(
        "  {name}: {pairs} pairs; per-pair ratio median {ratio:.2}x (min {r_min:.2}, max {r_max:.2}); \
         ratio of medians {:.2}x",
        large_med / small_med
    );
    Case {
        name: name.into(),
        ours: large_med,
        baseline: Some(small_med),
        unit: "us/decision",
        target: Target::Bounded {
            ratio: 1.5,
            ceiling: 400.0,
        },
        paired_ratio: Some(ratio),
        note: format!(
            "{refused}; history {} (ours) vs {} (baseline) settled records, half on that lane; SQLite, \
             fake clock; ratio = median of {pairs} interleaved pairs' ratios (ratio of medians {:.2}x){cut_short}",
            human_count(large),
            human_count(small),
            large_med / small_med
        ),
        extra: serde_json::Map::from_iter([
            ("pairs".to_owned(), json!(pairs)),
            ("ratio_of_medians".to_owned(), json!(round(large_med / small_med))),
        ]),
    }
}

pub(crate) fn admission_scale(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let t0 = now_ms();
    let (small, large) = plan.admission_scales;
    let small_store = admission_store(&runtime, dir, small, t0)?;
    let large_store = admission_store(&runtime, dir, large, t0)?;
    // As in snapshot_scale: the seeded files written back before sampling.
    flush_page_cache();
    // Pairs of decisions, small then large, so both sides see the same
    // machine; a ratio is the median of its pairs' ratios. The capped
    // ledgers' pairs first, then the budgeted ones': a decision through the
    // other ledger on a file costs the next one its connection's cache
    // (about 2x, measured), so the two are never interleaved.
    let sampling = Instant::now();
    let (small_us, large_us) = runtime.block_on(sample_pairs(plan, || {
        (
            refused_start(&small_store.1, small_store.3),
            refused_start(&large_store.1, large_store.3),
        )
    }))?;
    let budget_exhausted = ErrorKind::BudgetExhausted;
    let (small_budget_us, large_budget_us) = runtime.block_on(sample_pairs(plan, || {
        (
            refused_as(&small_store.2, small_store.3, budget_exhausted),
            refused_as(&large_store.2, large_store.3, budget_exhausted),
        )
    }))?;
    eprintln!(
        "  admission_scale: sampled in {:.1}s",
        sampling.elapsed().as_secs_f64()
    );
    drop((small_store, large_store));
    let pairs = small_us.len();
    let cut_short = if pairs < plan.admission_samples {
        format!(
            "; stopped at the {:.0}s budget after {pairs} of {} pairs",
            plan.admission_budget.as_secs_f64(),
            plan.admission_samples
        )
    } else {
        String::new()
    };
    let half = ADMISSION_IN_FLIGHT / 2;
    Ok(vec![
        scale_case(
            "admission_scale",
            (small, large),
            &small_us,
            &large_us,
            &format!(
                "a start refused lane_full on a lane capped at {} with {half} executing and {half} waiting ahead",
                human_count(ADMISSION_CAP as usize)
            ),
            &cut_short,
        ),
        scale_case(
            "budget_admission_scale",
            (small, large),
            &small_budget_us,
            &large_budget_us,
            &format!(
                "a start refused budget_exhausted on a lane capped at {} with tokens_per_minute {BUDGET}, \
                 {half} executing and {half} waiting ahead, each estimated at {ESTIMATE} tokens",
                human_count(BUDGET_CAP as usize)
            ),
            &cut_short,
        ),
    ])
}
