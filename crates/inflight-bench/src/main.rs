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
//! The harness lives in this file on purpose: the library carries no
//! benchmark code except the hidden bulk loader
//! `inflight::store::sqlite::seed_history`.

use std::collections::HashMap;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use inflight::{
    ActivityId, ActivitySpec, ErrorKind, FakeClock, Ledger, LedgerConfig, Outcome, SnapshotOptions,
};
use serde_json::{json, Value};

/// The cases, in the order they run.
const CASES: &[&str] = &[
    "memory_lifecycle",
    "sqlite_lifecycle",
    "snapshot_scale",
    "reap_scale",
    "admission_scale",
    "http_lifecycle",
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
    /// snapshot_scale, reap_scale, admission_scale, http_lifecycle.
    #[arg(long = "case", value_name = "NAME")]
    cases: Vec<String>,
    /// Where the temporary SQLite files go (default: the system temp dir).
    /// Use a disk-backed directory: on tmpfs an fsync costs nothing.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
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
    sqlite_reps: usize,
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
    /// How long `http_lifecycle` runs after its warm-up.
    http_window: Duration,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                memory_ops: 20_000,
                reps: 5,
                sqlite_window: Duration::from_millis(1_000),
                sqlite_reps: 3,
                snapshot_scales: vec![10_000, 100_000],
                snapshot_samples: 51,
                reap_scales: (1_000, 100_000),
                reap_samples: 15,
                admission_scales: (10_000, 1_000_000),
                admission_samples: 2_001,
                admission_budget: Duration::from_secs(10),
                http_window: Duration::from_secs(3),
            }
        } else {
            Self {
                memory_ops: 50_000,
                reps: 9,
                sqlite_window: Duration::from_secs(3),
                sqlite_reps: 5,
                snapshot_scales: vec![10_000, 100_000, 1_000_000],
                snapshot_samples: 201,
                reap_scales: (1_000, 100_000),
                reap_samples: 41,
                admission_scales: (10_000, 1_000_000),
                admission_samples: 10_001,
                admission_budget: Duration::from_secs(30),
                http_window: Duration::from_secs(10),
            }
        }
    }
}

/// What a case must show.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// `ratio <= x` (ours is a cost).
    AtMost(f64),
    /// `ratio >= x` (ours is a throughput).
    AtLeast(f64),
    /// Reported only.
    Report,
}

impl Target {
    fn label(self) -> String {
        match self {
            Self::AtMost(x) => format!("<= {x}x"),
            Self::AtLeast(x) => format!(">= {x}x"),
            Self::Report => "report".to_owned(),
        }
    }

    fn ok(self, ratio: Option<f64>) -> bool {
        match (self, ratio) {
            (Self::Report, _) => true,
            (Self::AtMost(x), Some(r)) => r <= x,
            (Self::AtLeast(x), Some(r)) => r >= x,
            (_, None) => false,
        }
    }
}

/// One line of the report.
#[derive(Debug)]
struct Case {
    name: String,
    ours: f64,
    baseline: Option<f64>,
    unit: &'static str,
    target: Target,
    /// The ratio when it is not `ours / baseline`: the median of the ratios
    /// of interleaved pairs of samples (`admission_scale`).
    paired_ratio: Option<f64>,
    /// Human detail, also in the JSON as `note`.
    note: String,
    /// Extra machine-readable figures.
    extra: serde_json::Map<String, Value>,
}

impl Case {
    fn ratio(&self) -> Option<f64> {
        match (self.target, self.baseline) {
            (Target::Report, _) | (_, None) => None,
            _ if self.paired_ratio.is_some() => self.paired_ratio,
            (_, Some(base)) if base > 0.0 => Some(self.ours / base),
            _ => None,
        }
    }

    fn ok(&self) -> bool {
        self.target.ok(self.ratio())
    }

    fn human(&self) -> String {
        let baseline = self
            .baseline
            .map_or_else(|| "-".to_owned(), |b| format!("{} {}", fig(b), self.unit));
        let ratio = self
            .ratio()
            .map_or_else(|| "-".to_owned(), |r| format!("{r:.2}x"));
        format!(
            "{:<26} ours {:>12} {:<14} baseline {:>20}  ratio {:>7}  target {:<8} {}  ({})",
            self.name,
            fig(self.ours),
            self.unit,
            baseline,
            ratio,
            self.target.label(),
            if self.ok() { "ok" } else { "FAIL" },
            self.note
        )
    }

    fn json(&self) -> Value {
        let mut object = serde_json::Map::new();
        object.insert("name".into(), json!(self.name));
        object.insert("ours".into(), json!(round(self.ours)));
        object.insert("baseline".into(), json!(self.baseline.map(round)));
        object.insert("unit".into(), json!(self.unit));
        object.insert("ratio".into(), json!(self.ratio().map(round)));
        object.insert("target".into(), json!(self.target.label()));
        object.insert("ok".into(), json!(self.ok()));
        object.insert("note".into(), json!(self.note));
        for (key, value) in &self.extra {
            object.insert(key.clone(), value.clone());
        }
        Value::Object(object)
    }
}

/// A figure with sensible precision.
fn fig(x: f64) -> String {
    if x >= 1000.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else if x >= 0.1 {
        format!("{x:.3}")
    } else {
        format!("{x:.4}")
    }
}

fn round(x: f64) -> f64 {
    if x.abs() >= 100.0 {
        (x * 10.0).round() / 10.0
    } else {
        (x * 10_000.0).round() / 10_000.0
    }
}

fn median(mut samples: Vec<f64>) -> f64 {
    assert!(!samples.is_empty(), "no samples");
    samples.sort_by(f64::total_cmp);
    let mid = samples.len() / 2;
    if samples.len() % 2 == 1 {
        samples[mid]
    } else {
        (samples[mid - 1] + samples[mid]) / 2.0
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The spec every benchmark call uses.
fn spec() -> ActivitySpec {
    ActivitySpec::new("knowledge-base", "ollama")
        .class("embedding")
        .model("nomic-embed-text")
}

/// A deadline so long nothing declared with it expires during a run.
const LONG_DEADLINE: Duration = Duration::from_secs(365 * 24 * 3600);

// ---------------------------------------------------------------------------
// Machine facts and the store's pragmas
// ---------------------------------------------------------------------------

/// The SQLite settings the store applies, read from its source so the
/// baseline always runs with exactly the same ones.
#[derive(Debug, Clone)]
struct Pragmas {
    /// `(name, value)` in the order the store sets them.
    set: Vec<(String, String)>,
    busy_timeout: Duration,
    /// Where they were read from.
    source: String,
}

impl Pragmas {
    /// The store's own settings, as it exports them.
    fn load() -> Self {
        Self {
            set: inflight::store::sqlite::PRAGMAS
                .iter()
                .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
                .collect(),
            busy_timeout: inflight::store::sqlite::BUSY_TIMEOUT,
            source: "inflight::store::sqlite::PRAGMAS".into(),
        }
    }

    fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .set
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        parts.push(format!("busy_timeout={}ms", self.busy_timeout.as_millis()));
        parts.join(", ")
    }

    /// Opens a baseline connection with the store's settings.
    fn connect(&self, path: &Path) -> Result<rusqlite::Connection> {
        let conn = rusqlite::Connection::open(path).context("open the baseline database")?;
        conn.busy_timeout(self.busy_timeout)?;
        for (name, value) in &self.set {
            conn.pragma_update(None, name, value)
                .with_context(|| format!("PRAGMA {name} = {value}"))?;
        }
        Ok(conn)
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
// Temporary directories (no dev-dependencies in a binary)
// ---------------------------------------------------------------------------

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(parent: &Path, label: &str) -> Result<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = parent.join(format!(
            "inflight-bench-{}-{}-{label}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
        Ok(Self(path))
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn sqlite_ledger(path: &Path, clock: Option<FakeClock>) -> Result<Ledger> {
    sqlite_ledger_with(path, LedgerConfig::default(), clock)
}

fn sqlite_ledger_with(path: &Path, config: LedgerConfig, clock: Option<FakeClock>) -> Result<Ledger> {
    let builder = Ledger::builder(config).store_url(format!("sqlite://{}", path.display()));
    let builder = match clock {
        Some(clock) => builder.clock(clock),
        None => builder,
    };
    builder.build().context("open the SQLite ledger")
}

fn multi_thread() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("build a runtime")
}

// ---------------------------------------------------------------------------
// memory_lifecycle
// ---------------------------------------------------------------------------

/// What a user would keep by hand per call: the labels and the timestamps.
#[derive(Debug)]
#[allow(dead_code)] // read through `black_box` only
struct HandCall {
    service: String,
    provider: String,
    class: String,
    model: String,
    enqueued_at: i64,
    started_at: Option<i64>,
    completed_at: Option<i64>,
    success: Option<bool>,
}

/// The hand-written baseline: a semaphore permit plus a map insert and
/// remove per call, the map behind a mutex as it must be once shared.
struct HandLedger {
    permits: tokio::sync::Semaphore,
    calls: Mutex<HashMap<u64, HandCall>>,
    next_id: AtomicU64,
}

impl HandLedger {
    fn new() -> Self {
        Self {
            permits: tokio::sync::Semaphore::new(1024),
            calls: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        }
    }

    async fn lifecycle(&self) -> Result<()> {
        let permit = self.permits.acquire().await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let call = HandCall {
            service: "knowledge-base".to_owned(),
            provider: "ollama".to_owned(),
            class: "embedding".to_owned(),
            model: "nomic-embed-text".to_owned(),
            enqueued_at: now_ms(),
            started_at: None,
            completed_at: None,
            success: None,
        };
        self.calls.lock().expect("poisoned").insert(id, call);
        // start
        if let Some(call) = self.calls.lock().expect("poisoned").get_mut(&id) {
            call.started_at = Some(now_ms());
        }
        // settle
        let mut call = self
            .calls
            .lock()
            .expect("poisoned")
            .remove(&id)
            .ok_or_else(|| anyhow!("lost call"))?;
        call.completed_at = Some(now_ms());
        call.success = Some(true);
        black_box(call);
        drop(permit);
        Ok(())
    }
}

async fn ledger_lifecycle(ledger: &Ledger) -> Result<()> {
    let mut call = ledger.begin(spec()).await?;
    call.start().await?;
    black_box(call.settle(Outcome::Success).await?);
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
fn count_lifecycles(n: usize) -> Result<()> {
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

fn memory_lifecycle(plan: &Plan) -> Result<Vec<Case>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let ledger = Ledger::builder(LedgerConfig::default())
            .store_url("memory:")
            .build()?;
        let hand = HandLedger::new();
        let n = plan.memory_ops;
        // Warm-up: allocator, caches, the map's capacity.
        for _ in 0..n / 4 {
            ledger_lifecycle(&ledger).await?;
            hand.lifecycle().await?;
        }
        let (mut ours, mut base) = (Vec::new(), Vec::new());
        for _ in 0..plan.reps {
            let started = Instant::now();
            for _ in 0..n {
                hand.lifecycle().await?;
            }
            base.push(started.elapsed().as_nanos() as f64 / n as f64);
            let started = Instant::now();
            for _ in 0..n {
                ledger_lifecycle(&ledger).await?;
            }
            ours.push(started.elapsed().as_nanos() as f64 / n as f64);
        }
        let (ours_ns, base_ns) = (median(ours), median(base));
        Ok(vec![Case {
            name: "memory_lifecycle".into(),
            ours: ours_ns / 1e3,
            baseline: Some(base_ns / 1e3),
            unit: "us/lifecycle",
            target: Target::AtMost(3.0),
            paired_ratio: None,
            note: format!(
                "begin+start+settle, 1 task, current-thread runtime; median of {} reps x {n}; \
                 baseline = Semaphore permit + Mutex<HashMap> insert/update/remove",
                plan.reps
            ),
            extra: serde_json::Map::new(),
        }])
    })
}

// ---------------------------------------------------------------------------
// sqlite_lifecycle
// ---------------------------------------------------------------------------

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

const BASELINE_TABLE: &str = "CREATE TABLE IF NOT EXISTS calls (
    id           TEXT PRIMARY KEY NOT NULL,
    service      TEXT NOT NULL,
    provider     TEXT NOT NULL,
    class        TEXT NOT NULL,
    model        TEXT NOT NULL,
    state        TEXT NOT NULL,
    enqueued_at  INTEGER NOT NULL,
    started_at   INTEGER,
    completed_at INTEGER,
    success      INTEGER
) WITHOUT ROWID";

/// One lifecycle the plain way: one autocommit statement per transition.
fn baseline_lifecycle(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    let id = uuid::Uuid::new_v4().to_string();
    conn.prepare_cached(
        "INSERT INTO calls (id, service, provider, class, model, state, enqueued_at) \
         VALUES (?1, 'knowledge-base', 'ollama', 'embedding', 'nomic-embed-text', 'waiting', ?2)",
    )?
    .execute(rusqlite::params![id, now_ms()])?;
    conn.prepare_cached("UPDATE calls SET state = 'executing', started_at = ?2 WHERE id = ?1")?
        .execute(rusqlite::params![id, now_ms()])?;
    conn.prepare_cached(
        "UPDATE calls SET state = 'succeeded', completed_at = ?2, success = 1 WHERE id = ?1",
    )?
    .execute(rusqlite::params![id, now_ms()])?;
    Ok(())
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

fn sqlite_lifecycle(plan: &Plan, dir: &Path, pragmas: &Pragmas) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let mut cases = Vec::new();
    for callers in [1_usize, 8] {
        let tmp = TempDir::new(dir, &format!("sqlite-{callers}"))?;
        let ledger = sqlite_ledger(&tmp.file("ours.db"), None)?;
        let base_path = tmp.file("baseline.db");
        pragmas.connect(&base_path)?.execute_batch(BASELINE_TABLE)?;
        // Warm-up: page cache, statement caches, the WAL file.
        let warm = plan.sqlite_window / 4;
        ours_sqlite_rate(&runtime, &ledger, callers, warm)?;
        baseline_sqlite_rate(&base_path, pragmas, callers, warm)?;
        let (mut ours, mut base) = (Vec::new(), Vec::new());
        for _ in 0..plan.sqlite_reps {
            base.push(baseline_sqlite_rate(
                &base_path,
                pragmas,
                callers,
                plan.sqlite_window,
            )?);
            ours.push(ours_sqlite_rate(&runtime, &ledger, callers, plan.sqlite_window)?);
        }
        let (ours, base) = (median(ours), median(base));
        let noun = if callers == 1 { "caller" } else { "callers" };
        cases.push(Case {
            name: if callers == 8 {
                "sqlite_lifecycle".into()
            } else {
                "sqlite_lifecycle_1caller".into()
            },
            ours,
            baseline: Some(base),
            unit: "lifecycles/s",
            target: if callers == 8 {
                Target::AtLeast(3.0)
            } else {
                Target::Report
            },
            paired_ratio: None,
            note: format!(
                "{callers} {noun} (ours: tokio tasks; baseline: OS threads, own connections, one autocommit \
                 statement per transition); median of {} x {:.1}s; ours/baseline {:.2}x",
                plan.sqlite_reps,
                plan.sqlite_window.as_secs_f64(),
                ours / base
            ),
            extra: serde_json::Map::from_iter([("callers".to_owned(), json!(callers))]),
        });
        drop(ledger);
    }
    Ok(cases)
}

// ---------------------------------------------------------------------------
// Populating through the API, concurrently (group commit makes it fast)
// ---------------------------------------------------------------------------

const POPULATE_TASKS: usize = 64;

/// Begins `count` records that stay in flight (no handle, so nothing
/// cancels them), made with `make`.
async fn populate_in_flight<F>(ledger: &Ledger, count: usize, make: F) -> Result<()>
where
    F: Fn() -> ActivitySpec + Clone + Send + 'static,
{
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..POPULATE_TASKS.min(count.max(1)) {
        let (ledger, next, make) = (ledger.clone(), Arc::clone(&next), make.clone());
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < count {
                ledger.begin_record(make()).await?;
            }
            Ok::<_, inflight::LedgerError>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(())
}

/// A record executing since `at` with a declared deadline of a year: in
/// flight for the whole run, never due.
fn long_lived(at: i64) -> impl Fn() -> ActivitySpec + Clone + Send + 'static {
    move || spec().deadline(LONG_DEADLINE).started_at(at)
}

// ---------------------------------------------------------------------------
// snapshot_scale
// ---------------------------------------------------------------------------

/// Min, median and max of `samples`.
fn spread(samples: &[f64]) -> (f64, f64, f64) {
    let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let max = samples.iter().copied().fold(0.0, f64::max);
    (min, median(samples.to_vec()), max)
}

/// Writes every dirty page back to disk before a read-only measurement.
fn flush_page_cache() {
    #[cfg(unix)]
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe {
        libc::sync();
    }
}

fn snapshot_scale(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
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
        inflight::store::sqlite::seed_history(&path, scale, t0).context("seed_history")?;
        eprintln!(
            "  snapshot_scale: seeded {scale} history rows in {:.1}s",
            loading.elapsed().as_secs_f64()
        );
        let ledger = sqlite_ledger(&path, Some(FakeClock::at(t0)))?;
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
        target: Target::AtMost(1.5),
        paired_ratio: None,
        note: format!(
            "1,000 in flight; history {per_scale}; ours = {} rows, baseline = {} rows; median of {}; \
             default options (limit 100, since 24h){quick_note}",
            human_count(large_scale),
            human_count(small_scale),
            plan.snapshot_samples
        ),
        extra: serde_json::Map::from_iter([(
            "latency_ms_by_history".to_owned(),
            Value::Object(
                latencies
                    .iter()
                    .map(|(scale, ms)| (scale.to_string(), json!(round(*ms))))
                    .collect(),
            ),
        )]),
    }])
}

fn human_count(n: usize) -> String {
    if n >= 1_000_000 && n % 1_000_000 == 0 {
        format!("{}M", n / 1_000_000)
    } else if n >= 1_000 && n % 1_000 == 0 {
        format!("{}k", n / 1_000)
    } else {
        n.to_string()
    }
}

// ---------------------------------------------------------------------------
// reap_scale
// ---------------------------------------------------------------------------

/// A store with `in_flight` records in flight that never expire (SQLite,
/// fake clock).
fn reap_store(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    in_flight: usize,
) -> Result<(TempDir, Ledger, FakeClock)> {
    let tmp = TempDir::new(dir, &format!("reap-{in_flight}"))?;
    let t0 = now_ms();
    let clock = FakeClock::at(t0);
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

fn reap_scale(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let (small, large) = plan.reap_scales;
    let small_store = reap_store(&runtime, dir, small)?;
    let large_store = reap_store(&runtime, dir, large)?;
    // Alternate small and large passes so both see the same machine.
    let (mut small_times, mut large_times) = (Vec::new(), Vec::new());
    runtime.block_on(async {
        for round in 0..plan.reap_samples + 2 {
            let s = reap_ten(&small_store.1, &small_store.2, small).await?;
            let l = reap_ten(&large_store.1, &large_store.2, large).await?;
            if round >= 2 {
                small_times.push(s);
                large_times.push(l);
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    drop((small_store, large_store));
    let (s_min, small_ms, s_max) = spread(&small_times);
    let (l_min, large_ms, l_max) = spread(&large_times);
    eprintln!("  reap_scale: {small} in flight: median {small_ms:.3} ms (min {s_min:.3}, max {s_max:.3})");
    eprintln!("  reap_scale: {large} in flight: median {large_ms:.3} ms (min {l_min:.3}, max {l_max:.3})");
    Ok(vec![Case {
        name: "reap_scale".into(),
        ours: large_ms,
        baseline: Some(small_ms),
        unit: "ms/pass",
        target: Target::AtMost(2.0),
        paired_ratio: None,
        note: format!(
            "a pass reaping 10 expired among {} in flight (ours) vs among {} (baseline); SQLite, fake clock; \
             median of {}",
            human_count(large),
            human_count(small),
            plan.reap_samples
        ),
        extra: serde_json::Map::new(),
    }])
}

// ---------------------------------------------------------------------------
// admission_scale
// ---------------------------------------------------------------------------

/// The capped lane of `admission_scale` (the lane of `spec()`), its cap, and
/// the records in flight on it: half executing, half waiting.
const ADMISSION_LANE: &str = "knowledge-base::ollama";
const ADMISSION_CAP: u32 = 1_000;
const ADMISSION_IN_FLIGHT: usize = 1_000;
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
    // waits), so the moved share of each sum is `sum / calls * n`.
    tx.execute(
        "INSERT INTO aggregates (service, operation_stage, class, provider, model, priority, admission, \
           calls, succeeded, queue_wait_count, queue_wait_sum_ms, queue_wait_max_ms, \
           execution_count, execution_sum_ms, execution_max_ms, last_seen_at) \
         SELECT 'knowledge-base', operation_stage, class, provider, model, priority, admission, \
           ?1, ?1, ?1, queue_wait_sum_ms / calls * ?1, queue_wait_max_ms, \
           ?1, execution_sum_ms / calls * ?1, execution_max_ms, last_seen_at \
         FROM aggregates WHERE service = 'bench-history'",
        [n],
    )?;
    tx.execute(
        "UPDATE aggregates SET calls = calls - ?1, succeeded = succeeded - ?1, \
           queue_wait_count = queue_wait_count - ?1, \
           queue_wait_sum_ms = queue_wait_sum_ms - queue_wait_sum_ms / calls * ?1, \
           execution_count = execution_count - ?1, \
           execution_sum_ms = execution_sum_ms - execution_sum_ms / calls * ?1 \
         WHERE service = 'bench-history'",
        [n],
    )?;
    tx.commit()?;
    Ok(moved)
}

/// One side of `admission_scale`: `history` settled records (half on the
/// capped lane, half on another), 500 records executing and 500 waiting on
/// the capped lane, and the record whose start is measured, waiting behind
/// them all. The ledger has the lane's cap and a clock stopped at `t0`, so
/// nothing ever becomes due; the id is the measured record's.
fn admission_store(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    history: usize,
    t0: i64,
) -> Result<(TempDir, Ledger, ActivityId)> {
    let tmp = TempDir::new(dir, &format!("admission-{history}"))?;
    let path = tmp.file("ours.db");
    let loading = Instant::now();
    // Settled over the hour before t0.
    inflight::store::sqlite::seed_history(&path, history, t0).context("seed_history")?;
    let on_lane = move_half_history_to_lane(&path)?;
    eprintln!(
        "  admission_scale: seeded {history} history rows ({on_lane} of them on {ADMISSION_LANE}) in {:.1}s",
        loading.elapsed().as_secs_f64()
    );
    // Populated through a ledger without the cap: beginning an executing
    // record on a capped lane is itself an admission decision, and setting
    // up must not cost what is measured.
    {
        let ledger = sqlite_ledger(&path, Some(FakeClock::at(t0)))?;
        runtime.block_on(async {
            populate_in_flight(&ledger, ADMISSION_IN_FLIGHT / 2, long_lived(t0)).await?;
            // Waiting since a second before the measured record.
            let waiting = move || spec().deadline(LONG_DEADLINE).enqueued_at(t0 - 1_000);
            populate_in_flight(&ledger, ADMISSION_IN_FLIGHT / 2, waiting).await
        })?;
    }
    let config = LedgerConfig::default().with_lane_cap(ADMISSION_LANE, ADMISSION_CAP)?;
    let ledger = sqlite_ledger_with(&path, config, Some(FakeClock::at(t0)))?;
    let asker = runtime.block_on(async {
        let record = ledger
            .begin_record(spec().deadline(LONG_DEADLINE).enqueued_at(t0))
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
    Ok((tmp, ledger, asker))
}

/// One admission decision: a start of the waiting record `id`, refused
/// `lane_full` (500 executing plus 500 waiting ahead of it reach the cap),
/// so nothing changes and every sample decides the same lane. Its time in
/// microseconds.
async fn refused_start(ledger: &Ledger, id: ActivityId) -> Result<f64> {
    let started = Instant::now();
    let decided = ledger.start(id, None).await;
    let elapsed = started.elapsed().as_secs_f64() * 1e6;
    match decided {
        Err(err) if err.kind() == ErrorKind::LaneFull => Ok(elapsed),
        Err(err) => Err(err.into()),
        Ok(record) => bail!("the start of {id} was admitted ({:?}), not refused", record.state),
    }
}

fn admission_scale(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let t0 = now_ms();
    let (small, large) = plan.admission_scales;
    let small_store = admission_store(&runtime, dir, small, t0)?;
    let large_store = admission_store(&runtime, dir, large, t0)?;
    // As in snapshot_scale: the seeded files written back before sampling.
    flush_page_cache();
    // Pairs of decisions, small then large, so both sides see the same
    // machine; the ratio is the median of the pairs' ratios.
    let (mut small_us, mut large_us, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let sampling = Instant::now();
    runtime.block_on(async {
        for round in 0..ADMISSION_WARM_UP + plan.admission_samples {
            let s = refused_start(&small_store.1, small_store.2).await?;
            let l = refused_start(&large_store.1, large_store.2).await?;
            if round >= ADMISSION_WARM_UP {
                small_us.push(s);
                large_us.push(l);
                ratios.push(l / s);
                if ratios.len() >= ADMISSION_MIN_PAIRS && sampling.elapsed() >= plan.admission_budget {
                    break;
                }
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let sampled = sampling.elapsed();
    drop((small_store, large_store));
    let pairs = ratios.len();
    let (s_min, small_med, s_max) = spread(&small_us);
    let (l_min, large_med, l_max) = spread(&large_us);
    let (r_min, ratio, r_max) = spread(&ratios);
    eprintln!(
        "  admission_scale: {small} history rows: median {small_med:.1} us (min {s_min:.1}, max {s_max:.1})"
    );
    eprintln!(
        "  admission_scale: {large} history rows: median {large_med:.1} us (min {l_min:.1}, max {l_max:.1})"
    );
    eprintln!(
        "  admission_scale: {pairs} pairs in {:.1}s; per-pair ratio median {ratio:.2}x (min {r_min:.2}, \
         max {r_max:.2}); ratio of medians {:.2}x",
        sampled.as_secs_f64(),
        large_med / small_med
    );
    let cut_short = if pairs < plan.admission_samples {
        format!(
            "; stopped at the {:.0}s budget after {pairs} of {} pairs",
            plan.admission_budget.as_secs_f64(),
            plan.admission_samples
        )
    } else {
        String::new()
    };
    Ok(vec![Case {
        name: "admission_scale".into(),
        ours: large_med,
        baseline: Some(small_med),
        unit: "us/decision",
        target: Target::AtMost(1.5),
        paired_ratio: Some(ratio),
        note: format!(
            "a start refused lane_full on a lane capped at {} with {} executing and {} waiting ahead; \
             history {} (ours) vs {} (baseline) settled records, half on that lane; SQLite, fake clock; \
             ratio = median of {pairs} interleaved pairs' ratios (ratio of medians {:.2}x){cut_short}",
            human_count(ADMISSION_CAP as usize),
            ADMISSION_IN_FLIGHT / 2,
            ADMISSION_IN_FLIGHT / 2,
            human_count(large),
            human_count(small),
            large_med / small_med
        ),
        extra: serde_json::Map::from_iter([
            ("pairs".to_owned(), json!(pairs)),
            ("ratio_of_medians".to_owned(), json!(round(large_med / small_med))),
        ]),
    }])
}

// ---------------------------------------------------------------------------
// http_lifecycle
// ---------------------------------------------------------------------------

const HTTP_CLIENTS: usize = 16;

/// POSTs `body` to `url`; the answer and how long it took, in ms.
async fn post_json(client: &reqwest::Client, url: String, body: Value) -> Result<(Value, f64)> {
    let started = Instant::now();
    let response = client.post(url).json(&body).send().await?;
    let status = response.status();
    let body: Value = response.json().await?;
    if !status.is_success() {
        bail!("HTTP {status}: {body}");
    }
    Ok((body, ms(started.elapsed())))
}

async fn http_lifecycle_once(client: &reqwest::Client, base: &str, latencies: &mut Vec<f64>) -> Result<()> {
    let begin = json!({
        "service": "knowledge-base", "provider": "ollama", "class": "embedding", "model": "nomic-embed-text"
    });
    let (record, t) = post_json(client, format!("{base}/v1/activities"), begin).await?;
    latencies.push(t);
    let id = record["activityId"]
        .as_str()
        .ok_or_else(|| anyhow!("no activityId in {record}"))?
        .to_owned();
    let (_, t) = post_json(client, format!("{base}/v1/activities/{id}/start"), json!({})).await?;
    latencies.push(t);
    let settle = json!({"success": true});
    let (_, t) = post_json(client, format!("{base}/v1/activities/{id}/settle"), settle).await?;
    latencies.push(t);
    Ok(())
}

fn http_lifecycle(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let tmp = TempDir::new(dir, "http")?;
    let ledger = sqlite_ledger(&tmp.file("ours.db"), None)?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        // The real server path: the router, axum::serve, the reaper.
        let server = tokio::spawn(inflight_server::serve_on(listener, ledger, None, async {
            let _ = stopped.await;
        }));
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(HTTP_CLIENTS)
            .timeout(Duration::from_secs(30))
            .build()?;
        let run = |window: Duration| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                let until = Instant::now() + window;
                let started = Instant::now();
                let mut tasks = Vec::new();
                for _ in 0..HTTP_CLIENTS {
                    let (client, base) = (client.clone(), base.clone());
                    tasks.push(tokio::spawn(async move {
                        let (mut latencies, mut lifecycles) = (Vec::new(), 0_u64);
                        while Instant::now() < until {
                            http_lifecycle_once(&client, &base, &mut latencies).await?;
                            lifecycles += 1;
                        }
                        Ok::<_, anyhow::Error>((latencies, lifecycles))
                    }));
                }
                let (mut latencies, mut lifecycles) = (Vec::new(), 0_u64);
                for task in tasks {
                    let (l, n) = task.await??;
                    latencies.extend(l);
                    lifecycles += n;
                }
                Ok::<_, anyhow::Error>((latencies, lifecycles, started.elapsed()))
            }
        };
        run(plan.http_window / 5).await?; // warm-up: connections, caches
        let (mut latencies, lifecycles, elapsed) = run(plan.http_window).await?;
        let _ = stop.send(());
        server.await??;
        latencies.sort_by(f64::total_cmp);
        let (p50, p99) = (percentile(&latencies, 50.0), percentile(&latencies, 99.0));
        let rate = lifecycles as f64 / elapsed.as_secs_f64();
        Ok(vec![Case {
            name: "http_lifecycle".into(),
            ours: rate,
            baseline: None,
            unit: "lifecycles/s",
            target: Target::Report,
            paired_ratio: None,
            note: format!(
                "{HTTP_CLIENTS} concurrent clients over loopback, SQLite store, {:.0}s; per request p50 {p50:.2} ms, \
                 p99 {p99:.2} ms ({} requests); client and server share the machine",
                plan.http_window.as_secs_f64(),
                latencies.len()
            ),
            extra: serde_json::Map::from_iter([
                ("p50_ms".to_owned(), json!(round(p50))),
                ("p99_ms".to_owned(), json!(round(p99))),
                ("clients".to_owned(), json!(HTTP_CLIENTS)),
            ]),
        }])
    })
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
    let pragmas = Pragmas::load();
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
        "sqlite {}: {} (read from {}); files under {}",
        rusqlite::version(),
        pragmas.describe(),
        pragmas.source,
        dir.display()
    );

    let mut cases: Vec<Case> = Vec::new();
    type Runner<'a> = Box<dyn Fn() -> Result<Vec<Case>> + 'a>;
    let runners: Vec<(&str, Runner<'_>)> = vec![
        ("memory_lifecycle", Box::new(|| memory_lifecycle(&plan))),
        (
            "sqlite_lifecycle",
            Box::new(|| sqlite_lifecycle(&plan, &dir, &pragmas)),
        ),
        ("snapshot_scale", Box::new(|| snapshot_scale(&plan, &dir))),
        ("reap_scale", Box::new(|| reap_scale(&plan, &dir))),
        ("admission_scale", Box::new(|| admission_scale(&plan, &dir))),
        ("http_lifecycle", Box::new(|| http_lifecycle(&plan, &dir))),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_baseline_takes_the_store_s_own_pragmas() {
        let pragmas = Pragmas::load();
        assert!(pragmas.set.iter().any(|(name, _)| name == "synchronous"));
        assert_eq!(pragmas.busy_timeout, inflight::store::sqlite::BUSY_TIMEOUT);
    }

    #[test]
    fn targets_read_both_ways() {
        assert!(Target::AtMost(3.0).ok(Some(2.9)));
        assert!(!Target::AtMost(3.0).ok(Some(3.1)));
        assert!(Target::AtLeast(3.0).ok(Some(3.1)));
        assert!(!Target::AtLeast(3.0).ok(None));
        assert!(Target::Report.ok(None));
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.0);
    }

    #[test]
    fn a_paired_ratio_replaces_the_ratio_of_medians() {
        let case = |paired_ratio| Case {
            name: "c".into(),
            ours: 3.0,
            baseline: Some(2.0),
            unit: "us",
            target: Target::AtMost(1.2),
            paired_ratio,
            note: String::new(),
            extra: serde_json::Map::new(),
        };
        assert_eq!(case(None).ratio(), Some(1.5));
        assert!(!case(None).ok());
        assert_eq!(case(Some(1.1)).ratio(), Some(1.1));
        assert!(case(Some(1.1)).ok());
    }
}
