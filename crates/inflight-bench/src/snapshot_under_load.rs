//! `snapshot_under_load` and `snapshot_under_load_p99`: a snapshot's
//! latency over HTTP (`GET /v1/snapshot`, default options) on the real
//! server, SQLite `synchronous=normal`, while 8 writer clients run
//! lifecycles (the two-request spelling) paced to 2,000 a second in all,
//! against the same snapshot with the writers stopped. One sampler client
//! of its own asks for snapshots back to back; idle and loaded windows
//! alternate on the same server.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use inflight::store::Synchronous;
use serde_json::json;

use crate::http_lifecycle::{clients, Client, PacedLoad, Server};
use crate::report::{percentile, round, spread, Case, Target};
use crate::sqlite_env::{long_lived, multi_thread, now_ms, populate_in_flight, sqlite_ledger_at, TempDir};
use crate::Plan;

/// Writer clients, each a connection of its own, one lifecycle a tick.
const WRITERS: usize = 8;
/// Lifecycles a second each writer asks for: 2,000 a second in all.
const WRITER_RATE: u32 = 250;
/// Below this share of the asked rate, a loaded window is not the load
/// the case names: the run fails.
const MIN_ACHIEVED: f64 = 0.9;
/// Records begun and never settled before the first sample, with a
/// deadline of a year, so that no snapshot is trivially empty.
const IN_FLIGHT: usize = 100;
/// The absolute aim for the loaded p50, in ms.
const P50_AIM_MS: f64 = 1.0;
/// The snapshot every sample asks for: the default answer size.
const SNAPSHOT: &str = "/v1/snapshot";
/// Samples a window takes at least, however slow they are: with three
/// pairs of windows, 300 a side for the p99.
const MIN_SAMPLES_PER_WINDOW: usize = 100;
/// The pause before an idle window, for what the writers left behind.
const QUIET: Duration = Duration::from_millis(100);

fn asked_rate() -> f64 {
    f64::from(WRITER_RATE) * WRITERS as f64
}

/// What one window's samples were.
struct Window {
    /// Latency of each snapshot, in ms.
    samples: Vec<f64>,
    /// The size of the last answer, in bytes.
    answer_bytes: usize,
}

/// Snapshots back to back on `sampler` for `window`, and at least
/// [`MIN_SAMPLES_PER_WINDOW`] of them.
async fn sample(sampler: &mut Client, window: Duration) -> Result<Window> {
    let until = Instant::now() + window;
    let (mut samples, mut answer_bytes) = (Vec::new(), 0);
    while Instant::now() < until || samples.len() < MIN_SAMPLES_PER_WINDOW {
        let (body, t) = sampler.get(SNAPSHOT).await?;
        samples.push(t);
        answer_bytes = body.len();
    }
    Ok(Window {
        samples,
        answer_bytes,
    })
}

/// A window with the writers running, paced: the samples, the lifecycles
/// the writers did and for how long they ran. The writers come back for
/// the next window.
async fn loaded(
    writers: &mut Vec<Client>,
    sampler: &mut Client,
    window: Duration,
) -> Result<(Window, u64, Duration)> {
    let load = PacedLoad::start(std::mem::take(writers), WRITER_RATE);
    let sampled = sample(sampler, window).await;
    let (back, lifecycles, elapsed) = load.stop().await?;
    *writers = back;
    Ok((sampled?, lifecycles, elapsed))
}

/// The in-flight count a snapshot reports.
async fn in_flight(sampler: &mut Client) -> Result<i64> {
    let (body, _) = sampler.get(SNAPSHOT).await?;
    let snapshot: serde_json::Value = serde_json::from_slice(&body).context("read a snapshot")?;
    snapshot["totalInFlight"]
        .as_i64()
        .context("no totalInFlight in a snapshot")
}

/// One side's samples over all its windows, with each window's p50.
#[derive(Default)]
struct Side {
    samples: Vec<f64>,
    window_p50s: Vec<f64>,
    answer_bytes: usize,
}

impl Side {
    fn add(&mut self, mut window: Window) {
        window.samples.sort_by(f64::total_cmp);
        self.window_p50s.push(percentile(&window.samples, 50.0));
        self.samples.extend(window.samples);
        self.answer_bytes = window.answer_bytes;
    }

    /// p50 and p99 over every window's samples.
    fn percentiles(&mut self) -> (f64, f64) {
        self.samples.sort_by(f64::total_cmp);
        (percentile(&self.samples, 50.0), percentile(&self.samples, 99.0))
    }
}

pub(crate) fn snapshot_under_load(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let tmp = TempDir::new(dir, "snapshot-load")?;
    let ledger = sqlite_ledger_at(&tmp.file("ours.db"), Synchronous::Normal)?;
    let window = plan.snapshot_load_window;
    let (mut idle, mut load, lifecycles, writing, rates) = runtime.block_on(async {
        populate_in_flight(&ledger, IN_FLIGHT, long_lived(now_ms())).await?;
        let server = Server::start(ledger).await?;
        let mut writers = clients(&server.base, WRITERS).await?;
        let mut sampler = Client::connect(&server.base).await?;
        let seen = in_flight(&mut sampler).await?;
        if seen < IN_FLIGHT as i64 {
            bail!("the snapshot sees {seen} in flight, not the {IN_FLIGHT} begun");
        }
        // Warm-up, loaded first: after it, the settled history fills the
        // answer's completions in every measured window alike.
        loaded(&mut writers, &mut sampler, window / 4).await?;
        tokio::time::sleep(QUIET).await;
        sample(&mut sampler, window / 4).await?;
        let (mut idle, mut load) = (Side::default(), Side::default());
        let (mut lifecycles, mut writing, mut rates) = (0_u64, Duration::ZERO, Vec::new());
        for _ in 0..plan.snapshot_load_pairs {
            tokio::time::sleep(QUIET).await;
            idle.add(sample(&mut sampler, window).await?);
            let (samples, n, elapsed) = loaded(&mut writers, &mut sampler, window).await?;
            load.add(samples);
            lifecycles += n;
            writing += elapsed;
            rates.push(n as f64 / elapsed.as_secs_f64());
        }
        let seen = in_flight(&mut sampler).await?;
        if seen < IN_FLIGHT as i64 {
            bail!("after the windows the snapshot sees {seen} in flight, fewer than the {IN_FLIGHT} begun");
        }
        server.stop().await?;
        Ok::<_, anyhow::Error>((idle, load, lifecycles, writing, rates))
    })?;
    let achieved = lifecycles as f64 / writing.as_secs_f64();
    let per_window: Vec<String> = rates.iter().map(|r| format!("{r:.0}")).collect();
    if achieved < MIN_ACHIEVED * asked_rate() {
        bail!(
            "the writers achieved {achieved:.0} lifecycles/s of the {:.0} asked ({} in {:.1}s; windows {}): \
             below {:.0}%, the loaded windows are not the load this case names",
            asked_rate(),
            lifecycles,
            writing.as_secs_f64(),
            per_window.join(", "),
            MIN_ACHIEVED * 100.0
        );
    }
    let (idle_p50, idle_p99) = idle.percentiles();
    let (load_p50, load_p99) = load.percentiles();
    let ratios: Vec<f64> = load
        .window_p50s
        .iter()
        .zip(&idle.window_p50s)
        .map(|(l, i)| l / i)
        .collect();
    let pairs = ratios.len();
    let (r_min, ratio, r_max) = spread(&ratios);
    let met = load_p50 <= P50_AIM_MS;
    eprintln!(
        "  snapshot_under_load: idle p50 {idle_p50:.3} ms, p99 {idle_p99:.3} ms ({} samples); loaded p50 \
         {load_p50:.3} ms, p99 {load_p99:.3} ms ({} samples); per-pair p50 ratio median {ratio:.2}x (min \
         {r_min:.2}, max {r_max:.2}); writers {achieved:.0}/s of {:.0} asked (windows {})",
        idle.samples.len(),
        load.samples.len(),
        asked_rate(),
        per_window.join(", "),
    );
    let load_note = format!(
        "{WRITERS} writers paced to {:.0} lifecycles/s in all (begin with ?start=now&wait=5s, settle), \
         achieved {achieved:.0}/s ({lifecycles} lifecycles in {:.1}s; windows {}/s)",
        asked_rate(),
        writing.as_secs_f64(),
        per_window.join(", "),
    );
    let setting = format!(
        "GET {SNAPSHOT} (limit 100, since 24h, answers of about {} kB) back to back from one client of its \
         own, {IN_FLIGHT} records in flight throughout; SQLite synchronous=normal; {pairs} pairs of {:.1}s \
         windows, idle then loaded",
        load.answer_bytes.max(idle.answer_bytes) / 1024,
        window.as_secs_f64(),
    );
    let figures = serde_json::Map::from_iter([
        ("idle_p50_ms".to_owned(), json!(round(idle_p50))),
        ("idle_p99_ms".to_owned(), json!(round(idle_p99))),
        ("loaded_p50_ms".to_owned(), json!(round(load_p50))),
        ("loaded_p99_ms".to_owned(), json!(round(load_p99))),
        ("idle_samples".to_owned(), json!(idle.samples.len())),
        ("loaded_samples".to_owned(), json!(load.samples.len())),
        ("writers".to_owned(), json!(WRITERS)),
        ("asked_rate".to_owned(), json!(asked_rate())),
        ("achieved_rate".to_owned(), json!(round(achieved))),
        ("in_flight".to_owned(), json!(IN_FLIGHT)),
    ]);
    let mut extra = figures.clone();
    extra.extend([
        ("p50_ms_aim".to_owned(), json!(P50_AIM_MS)),
        ("p50_aim_met".to_owned(), json!(met)),
        ("pairs".to_owned(), json!(pairs)),
        ("ratio_of_medians".to_owned(), json!(round(load_p50 / idle_p50))),
        ("ratio_min".to_owned(), json!(round(r_min))),
        ("ratio_max".to_owned(), json!(round(r_max))),
    ]);
    Ok(vec![
        Case {
            name: "snapshot_under_load".to_owned(),
            ours: load_p50,
            baseline: Some(idle_p50),
            unit: "ms",
            // Issue 28: at most 1.5x idle, and 1 ms, at the default size.
            target: Target::Bounded {
                ratio: 1.5,
                ceiling: P50_AIM_MS,
            },
            paired_ratio: Some(ratio),
            note: format!(
                "p50 of a snapshot under load (ours) against idle (baseline): loaded p50 {load_p50:.3} ms, \
                 p99 {load_p99:.3} ms ({} samples); idle p50 {idle_p50:.3} ms, p99 {idle_p99:.3} ms ({} \
                 samples); the issue's aim (loaded p50 <= {P50_AIM_MS} ms) {}; {load_note}; {setting}; ratio \
                 = median of the {pairs} pairs' ratios of window p50s (min {r_min:.2}x, max {r_max:.2}x; \
                 ratio of p50s {:.2}x); client, writers and server share the machine",
                load.samples.len(),
                idle.samples.len(),
                if met { "met" } else { "not met" },
                load_p50 / idle_p50,
            ),
            extra,
        },
        Case {
            name: "snapshot_under_load_p99".to_owned(),
            ours: load_p99,
            baseline: Some(idle_p99),
            unit: "ms",
            // The tail may spread more than the median, not without bound.
            target: Target::AtMost(2.0),
            paired_ratio: None,
            note: format!(
                "p99 of the snapshots above: loaded {load_p99:.3} ms against idle {idle_p99:.3} ms (p50 \
                 {load_p50:.3} against {idle_p50:.3} ms); {load_note}"
            ),
            extra: figures,
        },
    ])
}
