//! `ranked_admission`: an admission decision on a ranked lane (priority
//! with one overtake, and a `batch_cap`) with both priorities waiting,
//! side by side with the same decision on a plain lane of the same store.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use inflight::{ActivityId, ActivitySpec, FakeClock, Ledger, LedgerConfig, Priority};
use serde_json::json;

use crate::admission_scale::refused_start;
use crate::report::{round, spread, Case, Target};
use crate::sqlite_env::{
    multi_thread, now_ms, populate_in_flight, sqlite_ledger, sqlite_ledger_with, TempDir, LONG_DEADLINE,
};
use crate::Plan;

/// Each lane's cap; on each, half of it executing and as many waiting
/// ahead of the measured record, half interactive and half batch.
const CAP: u32 = 200;
const RANKED: (&str, &str) = ("ranked", "ollama");
const PLAIN: (&str, &str) = ("plain", "ollama");
const WARM_UP: usize = 5;

fn on((service, provider): (&'static str, &'static str), priority: Priority) -> ActivitySpec {
    ActivitySpec::new(service, provider)
        .class("embedding")
        .priority(priority)
        .deadline(LONG_DEADLINE)
}

/// A store with both lanes loaded alike, and the measured record of each:
/// interactive, waiting behind everyone.
fn store(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    t0: i64,
) -> Result<(TempDir, Ledger, [ActivityId; 2])> {
    let tmp = TempDir::new(dir, "ranked-admission")?;
    let path = tmp.file("ours.db");
    let at = |ms: i64| inflight::Timestamp::from_millis(ms);
    {
        // Loaded without caps: a start on a capped lane is a decision.
        let ledger = sqlite_ledger(&path, Some(FakeClock::at(at(t0))))?;
        runtime.block_on(async {
            for lane in [RANKED, PLAIN] {
                for priority in [Priority::Interactive, Priority::Batch] {
                    let executing = move || on(lane, priority).started_at(at(t0 - 2_000));
                    populate_in_flight(&ledger, CAP as usize / 4, executing).await?;
                    let waiting = move || on(lane, priority).enqueued_at(at(t0 - 1_000));
                    populate_in_flight(&ledger, CAP as usize / 4, waiting).await?;
                }
            }
            Ok::<_, anyhow::Error>(())
        })?;
    }
    let ranked = format!("{}::{}", RANKED.0, RANKED.1);
    let config = LedgerConfig::default()
        .with_lane_cap(&ranked, CAP)?
        .with_lane_ranking(&ranked, Some(CAP * 3 / 4), Some(1))?
        .with_lane_cap(&format!("{}::{}", PLAIN.0, PLAIN.1), CAP)?;
    let ledger = sqlite_ledger_with(&path, config, Some(FakeClock::at(at(t0))))?;
    let askers = runtime.block_on(async {
        let mut ids = [ActivityId::new(); 2];
        for (slot, lane) in ids.iter_mut().zip([RANKED, PLAIN]) {
            *slot = ledger
                .begin_record(on(lane, Priority::Interactive).enqueued_at(at(t0)))
                .await?
                .activity_id;
        }
        Ok::<_, anyhow::Error>(ids)
    })?;
    Ok((tmp, ledger, askers))
}

pub(crate) fn ranked_admission(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let (_tmp, ledger, [ranked, plain]) = store(&runtime, dir, now_ms())?;
    let (mut ranked_us, mut plain_us, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let sampling = Instant::now();
    runtime.block_on(async {
        for round in 0..WARM_UP + plan.admission_samples {
            // Alternating which goes first, so neither always has the
            // warmer cache.
            let (r, p) = if round % 2 == 0 {
                let r = refused_start(&ledger, ranked).await?;
                (r, refused_start(&ledger, plain).await?)
            } else {
                let p = refused_start(&ledger, plain).await?;
                (refused_start(&ledger, ranked).await?, p)
            };
            if round >= WARM_UP {
                ranked_us.push(r);
                plain_us.push(p);
                ratios.push(r / p);
                if ratios.len() >= 11 && sampling.elapsed() >= plan.admission_budget {
                    break;
                }
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let pairs = ratios.len();
    let (r_min, ranked_med, r_max) = spread(&ranked_us);
    let (p_min, plain_med, p_max) = spread(&plain_us);
    let (q_min, ratio, q_max) = spread(&ratios);
    eprintln!("  ranked_admission: ranked lane median {ranked_med:.1} us (min {r_min:.1}, max {r_max:.1})");
    eprintln!("  ranked_admission: plain lane median {plain_med:.1} us (min {p_min:.1}, max {p_max:.1})");
    eprintln!("  ranked_admission: {pairs} pairs; per-pair ratio median {ratio:.2}x (min {q_min:.2}, max {q_max:.2})");
    Ok(vec![Case {
        name: "ranked_admission".into(),
        ours: ranked_med,
        baseline: Some(plain_med),
        unit: "us/decision",
        target: Target::Bounded {
            ratio: 2.0,
            ceiling: 400.0,
        },
        paired_ratio: Some(ratio),
        note: format!(
            "a start refused lane_full on a lane capped at {CAP} with {} executing and {} waiting ahead, half \
             interactive and half batch: ranked (max_overtakes 1, batch_cap {}) vs the same lane plain, in one \
             SQLite store; ratio = median of {pairs} interleaved pairs' ratios",
            CAP / 2,
            CAP / 2,
            CAP * 3 / 4
        ),
        extra: serde_json::Map::from_iter([("pairs".to_owned(), json!(pairs)), ("ratio_of_medians".to_owned(), json!(round(ranked_med / plain_med)))]),
    }])
}
