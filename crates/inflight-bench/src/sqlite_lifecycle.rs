//! `sqlite_lifecycle`: lifecycles per second through the SQLite ledger against
//! plain rusqlite, under both durability settings and several caller counts:
//! one caller against autocommit, more against a hand-written group commit
//! (`group_baseline`).

use std::path::Path;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use inflight::store::Synchronous;
use inflight::Ledger;
use serde_json::json;
use tokio::sync::mpsc;

use crate::group_baseline::{self, answer, next_batch_blocking, Job, Queue, Step};
use crate::report::{Case, Pairs, Target};
use crate::sqlite_env::{
    baseline_lifecycle, ledger_lifecycle, multi_thread, sqlite_ledger_at, Pragmas, TempDir, BASELINE_BEGIN,
    BASELINE_SETTLE, BASELINE_START, BASELINE_TABLE,
};
use crate::Plan;

/// Lifecycles per second through the SQLite ledger with `callers` tasks.
fn ours_sqlite_rate(
    runtime: &tokio::runtime::Runtime,
    ledger: &Ledger,
    callers: usize,
    window: Duration,
) -> Result<f64> {
    let ledger = ledger.clone();
    runtime.block_on(group_baseline::rate(callers, window, move || {
        let ledger = ledger.clone();
        async move { ledger_lifecycle(&ledger).await }
    }))
}

/// Lifecycles per second of plain rusqlite with one caller: one autocommit
/// statement per transition, on the caller's own connection. With one
/// caller nothing is queued to group, so this is the best plain way.
fn autocommit_rate(path: &Path, pragmas: &Pragmas, window: Duration) -> Result<f64> {
    let conn = pragmas.connect(path)?;
    let started = Instant::now();
    let mut done = 0_u64;
    while started.elapsed() < window {
        baseline_lifecycle(&conn).context("baseline lifecycle")?;
        done += 1;
    }
    Ok(done as f64 / started.elapsed().as_secs_f64())
}

/// The group-commit baseline's writer: one connection on its own thread,
/// a transaction for whatever is queued.
struct GroupWriter {
    queue: Queue,
    thread: JoinHandle<()>,
}

impl GroupWriter {
    fn spawn(path: &Path, pragmas: &Pragmas) -> Result<Self> {
        let conn = pragmas.connect(path)?;
        let (queue, mut jobs) = mpsc::unbounded_channel();
        let thread = std::thread::spawn(move || {
            while let Some(batch) = next_batch_blocking(&mut jobs) {
                let outcome = commit(&conn, &batch).map_err(|err| err.to_string());
                answer(batch, &outcome);
            }
        });
        Ok(Self { queue, thread })
    }

    /// Ends the writer once its queue is empty.
    fn stop(self) -> Result<()> {
        drop(self.queue);
        self.thread
            .join()
            .map_err(|_| anyhow!("the baseline's writer panicked"))
    }
}

/// Applies `batch` in one transaction.
fn commit(conn: &rusqlite::Connection, batch: &[Job]) -> rusqlite::Result<()> {
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let applied = batch.iter().try_for_each(|job| {
        let sql = match job.step {
            Step::Begin => BASELINE_BEGIN,
            Step::Start => BASELINE_START,
            Step::Settle => BASELINE_SETTLE,
        };
        conn.prepare_cached(sql)?
            .execute(rusqlite::params![job.id, job.at])
            .map(drop)
    });
    let ended = applied.and_then(|()| conn.execute_batch("COMMIT"));
    if ended.is_err() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    ended
}

/// The baseline of one configuration: autocommit for one caller, group
/// commit for more.
enum Baseline {
    Autocommit,
    Group(GroupWriter),
}

impl Baseline {
    fn rate(
        &self,
        runtime: &tokio::runtime::Runtime,
        path: &Path,
        pragmas: &Pragmas,
        callers: usize,
        window: Duration,
    ) -> Result<f64> {
        match self {
            Self::Autocommit => autocommit_rate(path, pragmas, window),
            Self::Group(writer) => {
                runtime.block_on(group_baseline::baseline_rate(&writer.queue, callers, window))
            }
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Self::Autocommit => "one autocommit statement per transition on its own connection",
            Self::Group(_) => {
                "group commit: callers queue each transition and wait for its commit, one writer thread \
                 commits whatever is queued (up to 256) in one transaction"
            }
        }
    }
}

/// The caller counts of `sqlite_lifecycle`, each under both settings.
const SQLITE_CALLERS: [usize; 3] = [1, 8, 64];

/// The target of `sqlite_lifecycle` with `callers`: one caller against
/// autocommit, more against the group-commit baseline (issue 28: at least
/// half of a hand-written batcher, under either setting).
fn sqlite_target(callers: usize) -> Target {
    if callers == 1 {
        Target::AtLeast(0.8)
    } else {
        Target::AtLeast(0.5)
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
            let baseline = if callers == 1 {
                Baseline::Autocommit
            } else {
                Baseline::Group(GroupWriter::spawn(&base_path, &pragmas)?)
            };
            // Warm-up: page cache, statement caches, the WAL file.
            let warm = plan.sqlite_window / 2;
            baseline.rate(&runtime, &base_path, &pragmas, callers, warm)?;
            ours_sqlite_rate(&runtime, &ledger, callers, warm)?;
            let mut pairs = Pairs::default();
            for _ in 0..plan.sqlite_pairs {
                let b = baseline.rate(&runtime, &base_path, &pragmas, callers, plan.sqlite_window)?;
                let o = ours_sqlite_rate(&runtime, &ledger, callers, plan.sqlite_window)?;
                pairs.push(b, o);
            }
            drop(ledger);
            let described = baseline.describe();
            if let Baseline::Group(writer) = baseline {
                writer.stop()?;
            }
            let name = format!("sqlite_lifecycle_{synchronous}_{callers}");
            let noun = if callers == 1 { "caller" } else { "callers" };
            cases.push(pairs.case(
                name,
                "lifecycles/s",
                sqlite_target(callers),
                plan.sqlite_window,
                &format!(
                    "synchronous={synchronous}, {callers} {noun} (ours: tokio tasks; baseline: {described})"
                ),
                serde_json::Map::from_iter([
                    ("callers".to_owned(), json!(callers)),
                    ("synchronous".to_owned(), json!(synchronous.as_str())),
                ]),
            ));
        }
    }
    Ok(cases)
}
