//! `reap_scale`: a reaper pass's cost as the records in flight grow.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use inflight::{FakeClock, Ledger};
use serde_json::json;

use crate::report::{human_count, ms, round, spread, Case, Target};
use crate::sqlite_env::{long_lived, multi_thread, now_ms, populate_in_flight, spec, sqlite_ledger, TempDir};
use crate::Plan;

/// A store with `in_flight` records in flight that never expire (SQLite,
/// fake clock).
fn reap_store(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    in_flight: usize,
) -> Result<(TempDir, Ledger, FakeClock)> {
    let tmp = TempDir::new(dir, &format!("reap-{in_flight}"))?;
    let t0 = now_ms();
    let clock = FakeClock::at(inflight::Timestamp::from_millis(t0));
    let ledger = sqlite_ledger(&tmp.file("ours.db"), Some(clock.clone()))?;
    let populating = Instant::now();
    runtime.block_on(populate_in_flight(&ledger, in_flight - 10, long_lived(t0)))?;
    eprintln!(
        "  reap_scale: began {} long-lived records in {:.1}s",
        in_flight - 10,
        populating.elapsed().as_secs_f64()
    );
    Ok((tmp, ledger, clock))
}

/// One reaper pass that finds exactly 10 expired records.
async fn reap_ten(ledger: &Ledger, clock: &FakeClock, in_flight: usize) -> Result<f64> {
    // Past the embedding class's queue bound (4 x 5 min), not past a year's.
    let step = Duration::from_secs(21 * 60);
    // 10 records waiting since now, then the clock moves past their bound
    // only.
    populate_in_flight(ledger, 10, spec).await?;
    clock.advance(step);
    let started = Instant::now();
    let reaped = ledger.reap().await?;
    let elapsed = ms(started.elapsed());
    if reaped.total() != 10 {
        bail!(
            "a reap pass among {in_flight} found {} records, not 10",
            reaped.total()
        );
    }
    Ok(elapsed)
}

pub(crate) fn reap_scale(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let (small, large) = plan.reap_scales;
    let small_store = reap_store(&runtime, dir, small)?;
    let large_store = reap_store(&runtime, dir, large)?;
    // Pairs of passes, small then large, so both sides see the same
    // machine; the ratio is the median of the pairs' ratios.
    let (mut small_times, mut large_times, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    runtime.block_on(async {
        for round in 0..plan.reap_samples + 2 {
            let s = reap_ten(&small_store.1, &small_store.2, small).await?;
            let l = reap_ten(&large_store.1, &large_store.2, large).await?;
            if round >= 2 {
                small_times.push(s);
                large_times.push(l);
                ratios.push(l / s);
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    drop((small_store, large_store));
    let (s_min, small_ms, s_max) = spread(&small_times);
    let (l_min, large_ms, l_max) = spread(&large_times);
    eprintln!("  reap_scale: {small} in flight: median {small_ms:.3} ms (min {s_min:.3}, max {s_max:.3})");
    eprintln!("  reap_scale: {large} in flight: median {large_ms:.3} ms (min {l_min:.3}, max {l_max:.3})");
    let (r_min, ratio, r_max) = spread(&ratios);
    let pairs = ratios.len();
    eprintln!(
        "  reap_scale: {pairs} pairs; per-pair ratio median {ratio:.2}x (min {r_min:.2}, max {r_max:.2}); \
         ratio of medians {:.2}x",
        large_ms / small_ms
    );
    Ok(vec![Case {
        name: "reap_scale".into(),
        ours: large_ms,
        baseline: Some(small_ms),
        unit: "ms/pass",
        target: Target::Bounded {
            ratio: 2.0,
            ceiling: 2.0,
        },
        paired_ratio: Some(ratio),
        note: format!(
            "a pass reaping 10 expired among {} in flight (ours) vs among {} (baseline); SQLite, fake clock; \
             median of {}; ratio = median of {pairs} interleaved pairs' ratios (ratio of medians {:.2}x)",
            human_count(large),
            human_count(small),
            plan.reap_samples,
            large_ms / small_ms
        ),
        extra: serde_json::Map::from_iter([
            ("pairs".to_owned(), json!(pairs)),
            ("ratio_of_medians".to_owned(), json!(round(large_ms / small_ms))),
            ("ratio_min".to_owned(), json!(round(r_min))),
            ("ratio_max".to_owned(), json!(round(r_max))),
        ]),
    }])
}
