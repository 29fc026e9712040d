//! Re-reading files while serving: the one place that says "reload now".
//!
//! `inflight serve` makes one [`Reload`] and feeds it from SIGHUP
//! ([`Reload::on_sighup`]); whatever the server re-reads on a reload
//! subscribes to it, and a test triggers it directly ([`Reload::trigger`]).
//! Each subscriber re-reads on its own and keeps what it had when the
//! re-reading fails, logging why.
//!
//! To re-read something on every reload, in `serve` (or wherever the
//! [`Reload`] is), either run a closure on each signal:
//!
//! ```no_run
//! # async fn example() {
//! let reload = inflight_server::Reload::new();
//! reload.each(|| {
//!     // Re-read the file; on failure keep the old contents and log why.
//! });
//! # }
//! ```
//!
//! or take a [`Reloads`] and wait on it in a task of your own:
//!
//! ```no_run
//! # async fn example() {
//! let reload = inflight_server::Reload::new();
//! let mut reloads = reload.subscribe();
//! tokio::spawn(async move {
//!     while reloads.next().await {
//!         // Re-read.
//!     }
//! });
//! # }
//! ```

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Where reloads come from: cloned freely, every clone triggers the same
/// subscribers.
#[derive(Debug, Clone)]
pub struct Reload {
    /// The count of reloads so far; subscribers wait for it to change.
    sender: Arc<watch::Sender<u64>>,
}

/// One subscriber's view of the reloads: [`Reloads::next`] waits for the
/// next one. Reloads that come while a subscriber is still re-reading count
/// as one.
#[derive(Debug)]
pub struct Reloads {
    receiver: watch::Receiver<u64>,
}

impl Default for Reload {
    fn default() -> Self {
        Self::new()
    }
}

impl Reload {
    /// A reload source with no subscribers yet.
    pub fn new() -> Self {
        Self {
            sender: Arc::new(watch::channel(0).0),
        }
    }

    /// Tells every subscriber to re-read now.
    pub fn trigger(&self) {
        self.sender.send_modify(|count| *count = count.wrapping_add(1));
    }

    /// A subscriber that sees the reloads triggered from now on.
    pub fn subscribe(&self) -> Reloads {
        Reloads {
            receiver: self.sender.subscribe(),
        }
    }

    /// Runs `reread` on every reload from now on, in a task of its own
    /// (spawned on the current runtime), until every [`Reload`] is dropped.
    pub fn each(&self, mut reread: impl FnMut() + Send + 'static) -> JoinHandle<()> {
        let mut reloads = self.subscribe();
        tokio::spawn(async move {
            while reloads.next().await {
                reread();
            }
        })
    }

    /// Triggers a reload on each SIGHUP, for as long as the returned task
    /// runs (abort it, or drop the runtime, to stop). The handler is
    /// installed before this returns, so a SIGHUP sent after it no longer
    /// ends the process. Elsewhere than on Unix, and when the handler
    /// cannot be installed (logged), nothing triggers.
    pub fn on_sighup(&self) -> JoinHandle<()> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            match signal(SignalKind::hangup()) {
                Ok(mut hangups) => {
                    let reload = self.clone();
                    tokio::spawn(async move {
                        while hangups.recv().await.is_some() {
                            tracing::info!("SIGHUP received; re-reading files");
                            reload.trigger();
                        }
                    })
                }
                Err(err) => {
                    tracing::warn!(error = %err, "cannot listen for SIGHUP; files will not be re-read");
                    tokio::spawn(async {})
                }
            }
        }
        #[cfg(not(unix))]
        tokio::spawn(async {})
    }
}

impl Reloads {
    /// Waits for the next reload: `true` when one came, `false` once every
    /// [`Reload`] is dropped (there will be none).
    ///
    /// # Cancel safety
    /// Cancel safe: a reload triggered while no call waits is kept, and the
    /// next call returns at once (`tokio::sync::watch::Receiver::changed`).
    pub async fn next(&mut self) -> bool {
        self.receiver.changed().await.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_subscriber_sees_a_trigger_and_the_end() {
        let reload = Reload::new();
        let (mut first, mut second) = (reload.subscribe(), reload.subscribe());
        reload.trigger();
        assert!(first.next().await);
        assert!(second.next().await);
        // Two reloads before a subscriber looks count as one.
        reload.trigger();
        reload.trigger();
        assert!(first.next().await);
        drop(reload);
        assert!(!first.next().await);
    }

    #[tokio::test]
    async fn each_runs_its_closure_on_every_reload() {
        let reload = Reload::new();
        let (sender, mut received) = tokio::sync::mpsc::unbounded_channel();
        let task = reload.each(move || {
            let _ = sender.send(());
        });
        for _ in 0..3 {
            reload.trigger();
            received.recv().await.expect("a re-read");
        }
        drop(reload);
        task.await.unwrap();
    }
}
