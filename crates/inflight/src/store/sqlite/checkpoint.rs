//! The checkpointer: a thread with its own connection that copies the log
//! (the `-wal` file) back into the database file, so that a commit does not
//! pay for it.
//!
//! SQLite checkpoints on the committing connection by default, once the log
//! holds 1,000 pages: that commit, and every caller grouped into it, waits
//! for the log's sync, the copy and the database file's sync. With one
//! caller under `normal` that was half of a lifecycle's time, since a
//! lifecycle writes about 15 pages (docs/performance.md, "Checkpoints off
//! the commit path").
//!
//! A passive checkpoint never takes the write lock, so the writer commits
//! while it runs. It cannot restart the log alone, though: SQLite rewinds the
//! log only at a `BEGIN` that finds every page of it copied, and writes that
//! never pause always leave a few pages behind. The writer's connection
//! therefore still checkpoints itself, past [`WRITER_PAGES`]; by then the
//! checkpointer has copied and synced nearly all of it, and what is left
//! takes little.

use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rusqlite::Connection;

use crate::error::LedgerError;
use crate::store::sql::group::Published;

use super::schema::connect;
use super::sql;
use super::Synchronous;

/// How long the checkpointer waits after the first commit it hears of, so
/// that one checkpoint (two syncs) covers the commits of that spell.
const EVERY: Duration = Duration::from_millis(10);

/// Log pages past which the writer's connection checkpoints itself (its
/// `wal_autocheckpoint`), restarting the log: about 16 MB of log at most
/// while writes never pause.
pub(super) const WRITER_PAGES: u32 = 4_000;

/// The checkpointer thread; stopped by [`Checkpointer::stop`] (or dropped
/// with it, without waiting).
pub(super) struct Checkpointer {
    nudge: mpsc::SyncSender<()>,
    thread: thread::JoinHandle<()>,
}

impl Checkpointer {
    /// Opens the checkpointer's connection to `path` and starts its thread.
    ///
    /// # Errors
    /// [`ErrorKind::Storage`](crate::ErrorKind::Storage) when the
    /// connection cannot be opened or the thread started.
    pub(super) fn start(
        path: &Path,
        synchronous: Synchronous,
        published: Arc<Published>,
    ) -> Result<Self, LedgerError> {
        let conn = connect(path, synchronous)?;
        // One nudge pending is enough: it stands for every commit since.
        let (nudge, nudged) = mpsc::sync_channel(1);
        let thread = thread::Builder::new()
            .name("inflight-checkpoint".into())
            .spawn(move || checkpoint_loop(&conn, &nudged, &published))
            .map_err(|err| LedgerError::storage("cannot start the SQLite checkpointer thread", err))?;
        Ok(Self { nudge, thread })
    }

    /// Tells the checkpointer that a transaction committed: one system call
    /// at most, when it was idle.
    pub(super) fn nudge(&self) {
        let _ = self.nudge.try_send(());
    }

    /// Stops the thread once it has finished the checkpoint it is in, if
    /// any, and closed its connection. Called before the writer closes its
    /// own, so that the last connection to close (which copies the rest of
    /// the log and deletes it) is the writer's.
    pub(super) fn stop(self) {
        drop(self.nudge);
        if self.thread.join().is_err() {
            tracing::error!("the SQLite checkpointer thread panicked");
        }
    }
}

fn checkpoint_loop(conn: &Connection, nudged: &mpsc::Receiver<()>, published: &Published) {
    // Whether the last checkpoint failed, so that a failing disk logs once
    // per spell of failures rather than every few milliseconds.
    let mut failing = false;
    while nudged.recv().is_ok() {
        thread::sleep(EVERY);
        // Commits heard of while waiting are covered by this checkpoint.
        while nudged.try_recv().is_ok() {}
        // A checkpoint that finds another one running (the writer's) counts
        // as done: its row says busy, and the next nudge tries again.
        let began = Instant::now();
        let checkpointed = conn.query_row(sql::CHECKPOINT, [], |_| Ok(()));
        // It takes no lock the writer waits on, but it shares the disk.
        published
            .slow
            .keep(began, began.elapsed(), || "a checkpoint of the log".to_owned());
        match checkpointed {
            Ok(()) if failing => {
                failing = false;
                tracing::info!("SQLite checkpoints succeed again");
            }
            Ok(()) => {}
            Err(err) if !failing => {
                failing = true;
                tracing::warn!(error = %err, "SQLite checkpoint failed; the writer checkpoints the log itself past {WRITER_PAGES} pages");
            }
            Err(_) => {}
        }
    }
}
