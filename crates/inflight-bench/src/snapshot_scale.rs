//! `snapshot_scale`: a snapshot's latency as the settled history grows.

use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use inflight::{FakeClock, Ledger, SnapshotOptions};
use serde_json::{json, Value};

use crate::report::{human_count, ms, round, spread, Case, Target};
use crate::sqlite_env::{
    flush_page_cache, long_lived, multi_thread, now_ms, populate_in_flight, sqlite_ledger, TempDir,
};
use crate::Plan;

pub(crate) fn snapshot_scale(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let t0 = now_ms();
    let options = SnapshotOptions::default();
    // One store per scale, all open at once, so that samples can alternate
    // between scales and share whatever noise the machine makes.
    let mut stores: Vec<(usize, TempDir, Ledger)> = Vec::new();
    for &scale in &plan.snapshot_scales {
        let tmp = TempDir::new(dir, &format!("snapshot-{scale}"))?;
        let path = tmp.file("ours.db");
        // The hidden bulk loader: `scale` settled records over the hour
        // before t0, with their counters, all inside the 24 h window.
        let loading = Instant::now();
        inflight::store::sqlite::seed_history(&path, scale, inflight::Timestamp::from_millis(t0))
            .context("seed_history")?;
        eprintln!(
            "  snapshot_scale: seeded {scale} history rows in {:.1}s",
            loading.elapsed().as_secs_f64()
        );
        let ledger = sqlite_ledger(&path, Some(FakeClock::at(inflight::Timestamp::from_millis(t0))))?;
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
        stores.push((scale, tmp, ledger));
    }
    // Seeding leaves hundreds of megabytes dirty in the page cache; written
    // back in the background, they would compete with the samples for the
    // two cores. Written back now, every sample reads a quiet machine.
    flush_page_cache();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); stores.len()];
    runtime.block_on(async {
        for round in 0..plan.snapshot_samples + 3 {
            for (index, (_, _, ledger)) in stores.iter().enumerate() {
                let started = Instant::now();
                black_box(ledger.snapshot(options).await?);
                if round >= 3 {
                    samples[index].push(ms(started.elapsed()));
                }
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let mut latencies: Vec<(usize, f64)> = Vec::new();
    for ((scale, _, _), samples) in stores.iter().zip(&samples) {
        let (min, median, max) = spread(samples);
        eprintln!(
            "  snapshot_scale: {scale} history rows: median {median:.3} ms (min {min:.3}, max {max:.3})"
        );
        latencies.push((*scale, median));
    }
    drop(stores);
    let (small_scale, small) = latencies[0];
    let (large_scale, large) = *latencies.last().expect("a scale");
    // Every round samples each scale once, smallest first, so the smallest
    // and the largest scale's samples of a round form a pair that saw the
    // same machine; the ratio is the median of the pairs' ratios.
    let ratios: Vec<f64> = samples[0]
        .iter()
        .zip(samples.last().expect("a scale"))
        .map(|(s, l)| l / s)
        .collect();
    let pairs = ratios.len();
    let (r_min, ratio, r_max) = spread(&ratios);
    eprintln!(
        "  snapshot_scale: {pairs} pairs ({} vs {} rows); per-pair ratio median {ratio:.2}x (min {r_min:.2}, \
         max {r_max:.2}); ratio of medians {:.2}x",
        human_count(large_scale),
        human_count(small_scale),
        large / small
    );
    let per_scale = latencies
        .iter()
        .map(|(scale, ms)| format!("{}: {ms:.3} ms", human_count(*scale)))
        .collect::<Vec<_>>()
        .join(", ");
    let quick_note = if plan.snapshot_scales.len() < 3 {
        "; quick mode: 10k vs 100k only, the full run adds 1M"
    } else {
        ""
    };
    Ok(vec![Case {
        name: "snapshot_scale".into(),
        ours: large,
        baseline: Some(small),
        unit: "ms/snapshot",
        // Issue 28: flat, and at most 2 ms at the largest history.
        target: Target::Bounded {
            ratio: 1.5,
            ceiling: 2.0,
        },
        paired_ratio: Some(ratio),
        note: format!(
            "1,000 in flight; history {per_scale}; ours = {} rows, baseline = {} rows; median of {}; \
             default options (limit 100, since 24h); ratio = median of {pairs} interleaved pairs' ratios \
             (ratio of medians {:.2}x){quick_note}",
            human_count(large_scale),
            human_count(small_scale),
            plan.snapshot_samples,
            large / small
        ),
        extra: serde_json::Map::from_iter([
            (
                "latency_ms_by_history".to_owned(),
                Value::Object(
                    latencies
                        .iter()
                        .map(|(scale, ms)| (scale.to_string(), json!(round(*ms))))
                        .collect(),
                ),
            ),
            ("pairs".to_owned(), json!(pairs)),
            ("ratio_of_medians".to_owned(), json!(round(large / small))),
            ("ratio_min".to_owned(), json!(round(r_min))),
            ("ratio_max".to_owned(), json!(round(r_max))),
        ]),
    }])
}
