//! `sqlite_lifecycle`: lifecycles per second through the SQLite ledger against
//! plain rusqlite, under both durability settings and several caller counts.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use inflight::store::Synchronous;
use inflight::Ledger;
use serde_json::json;

use crate::report::{round, spread, Case, Target};
use crate::sqlite_env::{
    baseline_lifecycle, ledger_lifecycle, multi_thread, sqlite_ledger_at, Pragmas, TempDir, BASELINE_TABLE,
};
use crate::Plan;

/// Lifecycles per second through the SQLite ledger with `callers` tasks.
fn ours_sqlite_rate(
    runtime: &tokio::runtime::Runtime,
    ledger: &Ledger,
    callers: usize,
    window: Duration,
) -> Result<f64> {
    runtime.block_on(async {
        let done = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let until = started + window;
        let mut tasks = Vec::new();
        for _ in 0..callers {
            let ledger = ledger.clone();
            let done = Arc::clone(&done);
            tasks.push(tokio::spawn(async move {
                while Instant::now() < until {
                    ledger_lifecycle(&ledger).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        for task in tasks {
            task.await??;
        }
        Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
    })
}

/// Lifecycles per second of plain rusqlite with `callers` OS threads, each
/// with its own connection.
fn baseline_sqlite_rate(path: &Path, pragmas: &Pragmas, callers: usize, window: Duration) -> Result<f64> {
    let barrier = Arc::new(Barrier::new(callers + 1));
    let done = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Mutex::new(None::<Instant>));
    let mut threads = Vec::new();
    for _ in 0..callers {
        let (barrier, done, start) = (Arc::clone(&barrier), Arc::clone(&done), Arc::clone(&start));
        let (path, pragmas) = (path.to_path_buf(), pragmas.clone());
        threads.push(std::thread::spawn(move || -> Result<()> {
            let conn = pragmas.connect(&path);
            barrier.wait();
            let conn = conn?;
            let until = start.lock().expect("poisoned").expect("set before the barrier") + window;
            while Instant::now() < until {
                baseline_lifecycle(&conn).context("baseline lifecycle")?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    let started = Instant::now();
    *start.lock().expect("poisoned") = Some(started);
    barrier.wait();
    for thread in threads {
        thread
            .join()
            .map_err(|_| anyhow!("a baseline thread panicked"))??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// The caller counts of `sqlite_lifecycle`, each under both settings.
const SQLITE_CALLERS: [usize; 3] = [1, 8, 64];

/// The target of `sqlite_lifecycle` with `callers` under `synchronous`.
fn sqlite_target(synchronous: Synchronous, callers: usize) -> Target {
    match (synchronous, callers) {
        (_, 1) => Target::AtLeast(0.8),
        (Synchronous::Full, 8) => Target::AtLeast(4.0),
        (Synchronous::Full, _) => Target::AtLeast(10.0),
        (Synchronous::Normal, 64) => Target::AtLeast(2.0),
        _ => Target::Report,
    }
}

pub(crate) fn sqlite_lifecycle(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let mut cases = Vec::new();
    for synchronous in [Synchronous::Full, Synchronous::Normal] {
        let pragmas = Pragmas::load(synchronous);
        for callers in SQLITE_CALLERS {
            let tmp = TempDir::new(dir, &format!("sqlite-{synchronous}-{callers}"))?;
            let ledger = sqlite_ledger_at(&tmp.file("ours.db"), synchronous)?;
            let base_path = tmp.file("baseline.db");
            pragmas.connect(&base_path)?.execute_batch(BASELINE_TABLE)?;
            // Warm-up: page cache, statement caches, the WAL file.
            let warm = plan.sqlite_window / 2;
            baseline_sqlite_rate(&base_path, &pragmas, callers, warm)?;
            ours_sqlite_rate(&runtime, &ledger, callers, warm)?;
            // Pairs of windows, baseline then ours, so that a slow spell of
            // the shared machine hits both sides of a pair alike; the ratio
            // is the median of the pairs' ratios.
            let (mut ours, mut base, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..plan.sqlite_pairs {
                let b = baseline_sqlite_rate(&base_path, &pragmas, callers, plan.sqlite_window)?;
                let o = ours_sqlite_rate(&runtime, &ledger, callers, plan.sqlite_window)?;
                base.push(b);
                ours.push(o);
                ratios.push(o / b);
            }
            drop(ledger);
            let name = format!("sqlite_lifecycle_{synchronous}_{callers}");
            let (o_min, ours, o_max) = spread(&ours);
            let (b_min, base, b_max) = spread(&base);
            let (r_min, ratio, r_max) = spread(&ratios);
            eprintln!(
                "  {name}: ours median {ours:.0}/s (min {o_min:.0}, max {o_max:.0}); baseline median \
                 {base:.0}/s (min {b_min:.0}, max {b_max:.0}); per-pair ratio median {ratio:.2}x \
                 (min {r_min:.2}, max {r_max:.2})"
            );
            let noun = if callers == 1 { "caller" } else { "callers" };
            cases.push(Case {
                name,
                ours,
                baseline: Some(base),
                unit: "lifecycles/s",
                target: sqlite_target(synchronous, callers),
                paired_ratio: Some(ratio),
                note: format!(
                    "synchronous={synchronous}, {callers} {noun} (ours: tokio tasks; baseline: OS threads, own \
                     connections, one autocommit statement per transition); ratio = median of {} interleaved \
                     pairs of {:.1}s windows (min {r_min:.2}x, max {r_max:.2}x)",
                    plan.sqlite_pairs,
                    plan.sqlite_window.as_secs_f64(),
                ),
                extra: serde_json::Map::from_iter([
                    ("callers".to_owned(), json!(callers)),
                    ("synchronous".to_owned(), json!(synchronous.as_str())),
                    ("pairs".to_owned(), json!(plan.sqlite_pairs)),
                    ("ratio_min".to_owned(), json!(round(r_min))),
                    ("ratio_max".to_owned(), json!(round(r_max))),
                ]),
            });
        }
    }
    Ok(cases)
}
