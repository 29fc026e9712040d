//! The fair baseline of the multi-caller lifecycle cases: the best ledger one
//! would write by hand with the same promise as ours. Each caller submits
//! each transition (begin, start, settle) and waits until the commit that
//! holds it; writers take whatever is queued, up to [`MAX_BATCH`], into one
//! transaction (group commit). `sqlite_lifecycle` drives one writer thread,
//! `postgres_lifecycle` a pool as large as ours; both tables have the
//! columns a lifecycle writes, keyed by id, with no other index.
//!
//! [`rate`] also drives our side of those cases, so that both sides are
//! called by the same loop.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use tokio::sync::{mpsc, oneshot};

use crate::sqlite_env::now_ms;

/// The most transitions a writer puts in one transaction (ours: `MAX_GROUP`).
pub(crate) const MAX_BATCH: usize = 256;

/// A transition of a lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    Begin,
    Start,
    Settle,
}

/// One transition a caller waits on: its record's id, its time, and where
/// the writer answers once the transaction that holds it committed.
pub(crate) struct Job {
    pub(crate) step: Step,
    pub(crate) id: String,
    pub(crate) at: i64,
    reply: oneshot::Sender<Result<(), String>>,
}

/// Where callers queue their transitions.
pub(crate) type Queue = mpsc::UnboundedSender<Job>;

/// What a writer takes its batches from.
pub(crate) type Jobs = mpsc::UnboundedReceiver<Job>;

/// Answers every job of a batch with the outcome of its transaction.
pub(crate) fn answer(batch: Vec<Job>, outcome: &Result<(), String>) {
    for job in batch {
        // A caller that stopped waiting is gone; nothing to tell it.
        let _ = job.reply.send(outcome.clone());
    }
}

/// `first`, and whatever else is queued behind it, up to [`MAX_BATCH`].
fn fill(first: Job, jobs: &mut Jobs) -> Vec<Job> {
    let mut batch = Vec::with_capacity(MAX_BATCH.min(jobs.len() + 1));
    batch.push(first);
    while batch.len() < MAX_BATCH {
        match jobs.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
    batch
}

/// The next batch, for a writer on its own thread; `None` once every
/// caller's queue is dropped.
pub(crate) fn next_batch_blocking(jobs: &mut Jobs) -> Option<Vec<Job>> {
    let first = jobs.blocking_recv()?;
    Some(fill(first, jobs))
}

/// The next batch, for a writer task.
pub(crate) async fn next_batch(jobs: &mut Jobs) -> Option<Vec<Job>> {
    let first = jobs.recv().await?;
    Some(fill(first, jobs))
}

/// One lifecycle through `queue`: each transition submitted, and waited
/// for until committed.
async fn queued_lifecycle(queue: &Queue) -> Result<()> {
    let id = uuid::Uuid::new_v4().to_string();
    for step in [Step::Begin, Step::Start, Step::Settle] {
        let (reply, answered) = oneshot::channel();
        let job = Job {
            step,
            id: id.clone(),
            at: now_ms(),
            reply,
        };
        queue
            .send(job)
            .map_err(|_| anyhow!("the baseline's writers stopped"))?;
        answered
            .await
            .map_err(|_| anyhow!("a baseline writer dropped a transition"))?
            .map_err(|err| anyhow!("baseline transaction: {err}"))?;
    }
    Ok(())
}

/// Lifecycles per second of the group-commit baseline with `callers` tasks.
pub(crate) async fn baseline_rate(queue: &Queue, callers: usize, window: Duration) -> Result<f64> {
    let queue = queue.clone();
    rate(callers, window, move || {
        let queue = queue.clone();
        async move { queued_lifecycle(&queue).await }
    })
    .await
}

/// Lifecycles per second of `callers` tasks, each running `lifecycle`
/// again and again for `window`.
pub(crate) async fn rate<F, Fut>(callers: usize, window: Duration, lifecycle: F) -> Result<f64>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<()>> + Send,
{
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let until = started + window;
    let mut tasks = Vec::with_capacity(callers);
    for _ in 0..callers {
        let (lifecycle, done) = (lifecycle.clone(), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                lifecycle().await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}
