//! `inflight-bench`: each case measured next to its baseline in the same run.
//!
//! ```sh
//! cargo run --release --bin inflight-bench -- --quick      # < 90 s on 2 cores
//! cargo run --release --bin inflight-bench                 # the full run
//! cargo run --release --bin inflight-bench -- --case memory_lifecycle
//! ```
//!
//! One human line per case (name, ours, baseline, ratio, target, ok/FAIL),
//! then one final line holding a single JSON object `{"cases": [...]}`.
//! Figures are medians of several repetitions after a warm-up. Nothing here
//! asserts timings: the binary reports, `docs/performance.md` explains.
//!
//! The harness lives in this crate on purpose: the library carries no
//! benchmark code except the hidden bulk loader
//! `inflight::store::sqlite::seed_history`. This file holds the arguments,
//! the plan, the order of the cases and the final JSON line; each case has
//! its own module, `report` and `sqlite_env` what they share, `profile` the
//! hidden modes.

mod admission_scale;
mod group_baseline;
mod http_lifecycle;
mod memory_lifecycle;
mod otel_overhead;
mod postgres;
mod profile;
mod proxy_overhead;
mod ranked_admission;
mod reap_scale;
mod redis_slots;
mod report;
mod snapshot_scale;
mod snapshot_under_load;
mod sqlite_env;
mod sqlite_lifecycle;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use inflight::store::Synchronous;
use serde_json::json;

use crate::admission_scale::admission_scale;
use crate::http_lifecycle::http_lifecycle;
use crate::memory_lifecycle::memory_lifecycle;
use crate::otel_overhead::otel_overhead;
use crate::postgres::{postgres_lifecycle, postgres_snapshot_scale, postgres_two_instances};
use crate::profile::{count_lifecycles, drive_http, profile_lifecycles};
use crate::proxy_overhead::proxy_overhead;
use crate::ranked_admission::ranked_admission;
use crate::reap_scale::reap_scale;
use crate::redis_slots::redis_slots;
use crate::report::Case;
use crate::snapshot_scale::snapshot_scale;
use crate::snapshot_under_load::snapshot_under_load;
use crate::sqlite_env::Pragmas;
use crate::sqlite_lifecycle::sqlite_lifecycle;

/// The cases, in the order they run.
const CASES: &[&str] = &[
    "memory_lifecycle",
    "sqlite_lifecycle",
    "snapshot_scale",
    "reap_scale",
    "admission_scale",
    "ranked_admission",
    "http_lifecycle",
    "proxy_overhead",
    "otel_overhead",
    "snapshot_under_load",
    "redis_slots",
    "postgres_lifecycle",
    "postgres_snapshot_scale",
    "postgres_two_instances",
];

/// Benchmarks of the inflight ledger against hand-written baselines.
#[derive(Debug, Parser)]
#[command(name = "inflight-bench", version)]
struct Args {
    /// Smaller counts and scales, same comparisons: finishes within 90 s on
    /// a 2-core machine.
    #[arg(long)]
    quick: bool,
    /// Run only this case (repeatable): memory_lifecycle, sqlite_lifecycle,
    /// snapshot_scale, reap_scale, admission_scale, http_lifecycle (with
    /// http_lifecycle_two_requests), proxy_overhead, otel_overhead, snapshot_under_load (with
    /// snapshot_under_load_p99), redis_slots (on the Redis server
    /// INFLIGHT_BENCH_REDIS_URL names, by default redis://127.0.0.1:6379/),
    /// postgres_lifecycle, postgres_snapshot_scale, postgres_two_instances
    /// (these three on the PostgreSQL server INFLIGHT_TEST_POSTGRES_URL names,
    /// by default postgres@127.0.0.1:5432).
    #[arg(long = "case", value_name = "NAME")]
    cases: Vec<String>,
    /// Where the temporary SQLite files go (default: the system temp dir).
    /// Use a disk-backed directory: on tmpfs an fsync costs nothing.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Instead of the cases: run this many lifecycles with one caller on
    /// one side only, for a profiler (`valgrind --tool=callgrind`, `perf`).
    #[arg(long, value_name = "N", hide = true)]
    profile_lifecycles: Option<usize>,
    /// The side `--profile-lifecycles` runs: `ours` or `baseline`.
    #[arg(long, value_name = "SIDE", default_value = "ours", hide = true)]
    profile_side: String,
    /// The durability `--profile-lifecycles` runs under.
    #[arg(long, value_name = "SYNC", default_value = "normal", hide = true)]
    profile_synchronous: Synchronous,
    /// With `--profile-lifecycles N`: instead of a ledger in process, drive
    /// the `inflight serve` at this base URL (run under a profiler) with 16
    /// clients doing N lifecycles each over HTTP.
    #[arg(long, value_name = "URL", hide = true)]
    drive_http: Option<String>,
    /// With `--drive-http`: a lifecycle in 3 requests or 2 (`?start=now`).
    #[arg(long, value_name = "N", default_value_t = 3, hide = true)]
    drive_requests: u8,
    /// Instead of the cases: run `memory_lifecycle`'s two sides N times
    /// each, untimed, in the functions `count_ours` and `count_baseline`,
    /// for an instruction counter to read (see docs/performance.md).
    #[arg(long, value_name = "N", hide = true)]
    count_lifecycles: Option<usize>,
}

/// How much each case does.
#[derive(Debug, Clone)]
struct Plan {
    /// Lifecycles per repetition of `memory_lifecycle`.
    memory_ops: usize,
    /// Repetitions of the repeated cases (the median is reported).
    reps: usize,
    /// How long each `sqlite_lifecycle` repetition runs.
    sqlite_window: Duration,
    /// Interleaved pairs of windows (baseline, ours) per configuration.
    sqlite_pairs: usize,
    /// The same for `postgres_lifecycle`, whose pairs spread most (1.4x to
    /// 3.9x within one quick run): its median needs more of them to hold
    /// from one run to the next.
    postgres_pairs: usize,
    /// Completed records of history in `snapshot_scale`.
    snapshot_scales: Vec<usize>,
    snapshot_samples: usize,
    /// In-flight records in `reap_scale`: small, large.
    reap_scales: (usize, usize),
    reap_samples: usize,
    /// History records in `admission_scale`: baseline, ours.
    admission_scales: (usize, usize),
    /// Measured pairs of decisions in `admission_scale`, and the time after
    /// which it stops taking more (a slow decision must not stall the run).
    admission_samples: usize,
    admission_budget: Duration,
    /// How long `http_lifecycle` runs after its warm-up (and
    /// `postgres_two_instances`).
    http_window: Duration,
    /// Pairs of calls (direct, proxied) per store setting in
    /// `proxy_overhead`.
    proxy_pairs: usize,
    /// Settled history in `postgres_snapshot_scale`: small, large.
    postgres_snapshot_scales: (usize, usize),
    /// Pairs of windows (idle, loaded) in `snapshot_under_load`, and how
    /// long each samples (at least 100 snapshots).
    snapshot_load_pairs: usize,
    snapshot_load_window: Duration,
    /// Interleaved pairs of windows (baseline, ours) in `redis_slots`, and
    /// how long each runs.
    redis_pairs: usize,
    redis_window: Duration,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                memory_ops: 20_000,
                reps: 5,
                sqlite_window: Duration::from_millis(300),
                sqlite_pairs: 5,
                postgres_pairs: 11,
                snapshot_scales: vec![10_000, 100_000],
                snapshot_samples: 51,
                reap_scales: (1_000, 100_000),
                reap_samples: 15,
                admission_scales: (10_000, 1_000_000),
                admission_samples: 2_001,
                admission_budget: Duration::from_secs(10),
                http_window: Duration::from_secs(3),
                proxy_pairs: 2_000,
                postgres_snapshot_scales: (10_000, 100_000),
                snapshot_load_pairs: 3,
                snapshot_load_window: Duration::from_secs(1),
                redis_pairs: 5,
                redis_window: Duration::from_millis(500),
            }
        } else {
            Self {
                memory_ops: 50_000,
                reps: 9,
                sqlite_window: Duration::from_secs(1),
                sqlite_pairs: 9,
                postgres_pairs: 11,
                snapshot_scales: vec![10_000, 100_000, 1_000_000],
                snapshot_samples: 201,
                reap_scales: (1_000, 100_000),
                reap_samples: 41,
                admission_scales: (10_000, 1_000_000),
                admission_samples: 10_001,
                admission_budget: Duration::from_secs(30),
                http_window: Duration::from_secs(10),
                proxy_pairs: 10_000,
                postgres_snapshot_scales: (10_000, 1_000_000),
                snapshot_load_pairs: 9,
                snapshot_load_window: Duration::from_secs(2),
                redis_pairs: 9,
                redis_window: Duration::from_secs(1),
            }
        }
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split_once(':'))
                .map(|(_, model)| model.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

// ---------------------------------------------------------------------------

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(n) = args.count_lifecycles {
        return count_lifecycles(n);
    }
    for case in &args.cases {
        if !CASES.contains(&case.as_str()) {
            bail!("unknown case {case:?}; the cases are {}", CASES.join(", "));
        }
    }
    let selected = |name: &str| args.cases.is_empty() || args.cases.iter().any(|c| c == name);
    let plan = Plan::new(args.quick);
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    if let (Some(n), Some(url)) = (args.profile_lifecycles, &args.drive_http) {
        return drive_http(url, n, args.drive_requests);
    }
    if let Some(n) = args.profile_lifecycles {
        return profile_lifecycles(&dir, n, &args.profile_side, args.profile_synchronous);
    }
    let pragmas = Pragmas::load(Synchronous::default());
    let started = Instant::now();

    println!(
        "inflight-bench {} ({} mode)",
        env!("CARGO_PKG_VERSION"),
        if args.quick { "quick" } else { "full" }
    );
    println!(
        "machine: {} cores (available_parallelism), CPU {}",
        std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get),
        cpu_model()
    );
    println!(
        "sqlite {}: {} (read from {}; the sqlite_lifecycle cases run under both settings); files under {}",
        rusqlite::version(),
        pragmas.describe(),
        pragmas.source,
        dir.display()
    );

    let mut cases: Vec<Case> = Vec::new();
    type Runner<'a> = Box<dyn Fn() -> Result<Vec<Case>> + 'a>;
    let runners: Vec<(&str, Runner<'_>)> = vec![
        ("memory_lifecycle", Box::new(|| memory_lifecycle(&plan))),
        ("sqlite_lifecycle", Box::new(|| sqlite_lifecycle(&plan, &dir))),
        ("snapshot_scale", Box::new(|| snapshot_scale(&plan, &dir))),
        ("reap_scale", Box::new(|| reap_scale(&plan, &dir))),
        ("admission_scale", Box::new(|| admission_scale(&plan, &dir))),
        ("ranked_admission", Box::new(|| ranked_admission(&plan, &dir))),
        ("http_lifecycle", Box::new(|| http_lifecycle(&plan, &dir))),
        ("proxy_overhead", Box::new(|| proxy_overhead(&plan, &dir))),
        ("otel_overhead", Box::new(|| otel_overhead(&plan, &dir))),
        (
            "snapshot_under_load",
            Box::new(|| snapshot_under_load(&plan, &dir)),
        ),
        ("redis_slots", Box::new(|| redis_slots(&plan, &dir))),
        ("postgres_lifecycle", Box::new(|| postgres_lifecycle(&plan))),
        (
            "postgres_snapshot_scale",
            Box::new(|| postgres_snapshot_scale(&plan)),
        ),
        (
            "postgres_two_instances",
            Box::new(|| postgres_two_instances(&plan)),
        ),
    ];
    for (name, run) in runners {
        if !selected(name) {
            continue;
        }
        let case_started = Instant::now();
        let results = run().with_context(|| format!("case {name}"))?;
        for case in results {
            println!("{}", case.human());
            cases.push(case);
        }
        eprintln!("  ({name} took {:.1}s)", case_started.elapsed().as_secs_f64());
    }
    eprintln!("  (total {:.1}s)", started.elapsed().as_secs_f64());
    println!(
        "{}",
        json!({ "cases": cases.iter().map(Case::json).collect::<Vec<_>>() })
    );
    Ok(())
}
