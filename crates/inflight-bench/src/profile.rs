//! The hidden modes: `--profile-lifecycles` for a profiler (in process, or
//! over HTTP against a server run under one with `--drive-http`) and
//! `--count-lifecycles` for an instruction counter.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use inflight::store::Synchronous;
use inflight::{Ledger, LedgerConfig};

use crate::http_lifecycle::{clients, drive, Requests, HTTP_CLIENTS};
use crate::memory_lifecycle::HandLedger;
use crate::sqlite_env::{
    baseline_lifecycle, ledger_lifecycle, multi_thread, sqlite_ledger_at, Pragmas, TempDir, BASELINE_TABLE,
};

/// `--profile-lifecycles N --drive-http URL`: 16 clients doing `n`
/// lifecycles each, spelled in `requests` requests (3 or 2), against the
/// server at `url`, after a warm-up of `n / 10` each; for a profiler
/// watching the server.
pub(crate) fn drive_http(url: &str, n: usize, requests: u8) -> Result<()> {
    let requests = match requests {
        3 => Requests::Three,
        2 => Requests::Two,
        other => bail!("--drive-requests {other}: 3 or 2"),
    };
    let base = url.trim_end_matches('/');
    let runtime = multi_thread()?;
    runtime.block_on(async {
        let mut clients = clients(base, HTTP_CLIENTS).await?;
        // Bounded by the count, not by time.
        let forever = std::time::Duration::from_secs(24 * 3600);
        drive(&mut clients, requests, forever, Some(n / 10)).await?;
        let (mut latencies, lifecycles, elapsed) = drive(&mut clients, requests, forever, Some(n)).await?;
        latencies.sort_by(f64::total_cmp);
        println!(
            "{lifecycles} lifecycles in {:.3}s ({:.0}/s) in {requests:?} requests; per request p50 {:.2} ms, p99 {:.2} ms",
            elapsed.as_secs_f64(),
            lifecycles as f64 / elapsed.as_secs_f64(),
            crate::report::percentile(&latencies, 50.0),
            crate::report::percentile(&latencies, 99.0),
        );
        Ok(())
    })
}

/// `--profile-lifecycles`: `n` lifecycles with one caller on `side`, after
/// a warm-up of `n / 10`, and nothing else.
pub(crate) fn profile_lifecycles(dir: &Path, n: usize, side: &str, synchronous: Synchronous) -> Result<()> {
    let tmp = TempDir::new(dir, "profile")?;
    let started;
    match side {
        "ours" => {
            let runtime = multi_thread()?;
            let ledger = sqlite_ledger_at(&tmp.file("ours.db"), synchronous)?;
            runtime.block_on(async {
                for _ in 0..n / 10 {
                    ledger_lifecycle(&ledger).await?;
                }
                Ok::<_, anyhow::Error>(())
            })?;
            started = Instant::now();
            runtime.block_on(async {
                for _ in 0..n {
                    ledger_lifecycle(&ledger).await?;
                }
                Ok::<_, anyhow::Error>(())
            })?;
        }
        "baseline" => {
            let pragmas = Pragmas::load(synchronous);
            let conn = pragmas.connect(&tmp.file("baseline.db"))?;
            conn.execute_batch(BASELINE_TABLE)?;
            for _ in 0..n / 10 {
                baseline_lifecycle(&conn)?;
            }
            started = Instant::now();
            for _ in 0..n {
                baseline_lifecycle(&conn)?;
            }
        }
        other => bail!("--profile-side {other:?}: ours or baseline"),
    }
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "{side}, synchronous={synchronous}: {n} lifecycles in {elapsed:.3}s, {:.0}/s, {:.1} us each",
        n as f64 / elapsed,
        elapsed * 1e6 / n as f64
    );
    Ok(())
}

/// `n` ledger lifecycles, on their own, for an instruction counter
/// (`valgrind --tool=callgrind`): the inclusive cost of this function
/// divided by `n` is the instructions of one lifecycle.
#[inline(never)]
fn count_ours(runtime: &tokio::runtime::Runtime, ledger: &Ledger, n: usize) -> Result<()> {
    runtime.block_on(async {
        for _ in 0..n {
            ledger_lifecycle(ledger).await?;
        }
        Ok(())
    })
}

/// `n` baseline lifecycles, as [`count_ours`] does ours.
#[inline(never)]
fn count_baseline(runtime: &tokio::runtime::Runtime, hand: &HandLedger, n: usize) -> Result<()> {
    runtime.block_on(async {
        for _ in 0..n {
            hand.lifecycle().await?;
        }
        Ok(())
    })
}

/// The hidden `--count-lifecycles N` mode: `memory_lifecycle`'s set-up and
/// warm-up, then each side `n` times in its own function.
pub(crate) fn count_lifecycles(n: usize) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let ledger = runtime.block_on(async {
        Ledger::builder(LedgerConfig::default())
            .store_url("memory:")
            .build()
    })?;
    let hand = HandLedger::new();
    runtime.block_on(async {
        for _ in 0..n / 4 {
            ledger_lifecycle(&ledger).await?;
            hand.lifecycle().await?;
        }
        Ok::<_, anyhow::Error>(())
    })?;
    count_ours(&runtime, &ledger, n)?;
    count_baseline(&runtime, &hand, n)?;
    eprintln!("{n} lifecycles a side after a warm-up of {}", n / 4);
    Ok(())
}
