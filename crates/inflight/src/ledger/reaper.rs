//! The background reaper: expiry with no reader at all.

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Ledger;

impl Ledger {
    /// Runs a reaper pass (then a prune of records past their retention)
    /// every configured interval until the returned guard is dropped, so
    /// records expire with no reader at all. Must be called
    /// within a Tokio runtime.
    pub fn spawn_reaper(&self) -> ReaperGuard {
        let ledger = self.clone();
        let interval = self.inner.config.reap_interval();
        let (passes_tx, passes) = watch::channel(0_u64);
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                // Each reap is logged by the store as it lands, with a
                // summary when a pass reaps several; a pass that failed is
                // not counted as a run, so a reaper stuck on a failing
                // store looks like one that does not run.
                let began = std::time::Instant::now();
                match ledger.reap().await {
                    Ok(_) => ledger.inner.stats.reaper_ran(began.elapsed()),
                    Err(err) => tracing::warn!(error = %err, "reaper pass failed; will retry next interval"),
                }
                match ledger.prune().await {
                    Ok(0) => {}
                    Ok(pruned) => tracing::debug!(pruned, "pruned records past their retention"),
                    Err(err) => tracing::warn!(error = %err, "pruning failed; will retry next interval"),
                }
                passes_tx.send_modify(|passes| *passes += 1);
            }
        });
        ReaperGuard { task, passes }
    }
}

/// Stops the background reaper when dropped.
#[must_use = "the reaper stops when this guard is dropped"]
#[derive(Debug)]
pub struct ReaperGuard {
    task: JoinHandle<()>,
    passes: watch::Receiver<u64>,
}

impl ReaperGuard {
    /// How many passes the reaper has completed.
    pub fn passes(&self) -> u64 {
        *self.passes.borrow()
    }

    /// Waits until the reaper has completed at least `count` passes.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn wait_for_passes(&mut self, count: u64) {
        // The sender lives as long as the task; if it ended, stop waiting.
        let _ = self.passes.wait_for(|passes| *passes >= count).await;
    }
}

impl Drop for ReaperGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}
