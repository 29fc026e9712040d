//! The writer thread: one per process, owning the connection. Commands that
//! arrive while a transaction is being written are grouped into the next
//! one (group commit), each in its own savepoint, and each is acknowledged
//! only once that transaction committed.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::error::{ErrorKind, LedgerError};
use crate::store::engine;
use crate::store::{Command, Reply};

use super::sql;
use super::txn::{PendingCounts, SqliteTxn};

/// The most commands grouped into one transaction.
const MAX_GROUP: usize = 256;
/// The longest a group waits for the callers of the previous one.
const GROUP_WAIT: Duration = Duration::from_micros(300);

/// What the writer thread is asked to do.
pub(super) enum Job {
    /// Run a command and answer it.
    Run(Command, oneshot::Sender<Result<Reply, LedgerError>>),
    /// Stop, once every job queued before this one has been answered;
    /// answered once the connection is closed.
    Close(oneshot::Sender<()>),
}

pub(super) fn write_loop(
    mut conn: Connection,
    config: &LedgerConfig,
    clock: &dyn Clock,
    queue: &mpsc::Receiver<Job>,
) {
    let mut last_group = 1;
    let mut closing = None;
    while let Ok(first) = queue.recv() {
        let mut group = Group::default();
        group.push(first, &mut closing);
        drain(queue, &mut group, &mut closing);
        // Callers answered by the last commit resubmit within microseconds,
        // while a commit costs a sync: when the last group was larger, wait
        // briefly for them so that one sync serves them all. A lone caller
        // (last group of one) never waits.
        if group.commands.len() < last_group && closing.is_none() {
            let until = Instant::now() + GROUP_WAIT;
            while group.commands.len() < last_group && closing.is_none() {
                let Some(left) = until.checked_duration_since(Instant::now()) else {
                    break;
                };
                match queue.recv_timeout(left) {
                    Ok(job) => {
                        group.push(job, &mut closing);
                        drain(queue, &mut group, &mut closing);
                    }
                    Err(_) => break,
                }
            }
        }
        last_group = group.commands.len().max(1);
        if !group.commands.is_empty() {
            let results = run_group(&mut conn, config, clock, group.commands);
            for (reply, result) in group.replies.into_iter().zip(results) {
                // A caller that went away still had its command committed.
                let _ = reply.send(result);
            }
        }
        if closing.is_some() {
            break;
        }
    }
    // Closed before the caller of `close` hears of it; commands queued
    // after the close are dropped, and their callers told the store closed.
    drop(conn);
    if let Some(done) = closing {
        let _ = done.send(());
    }
}

/// The commands of one transaction and their callers.
#[derive(Default)]
pub(super) struct Group {
    commands: Vec<Command>,
    replies: Vec<oneshot::Sender<Result<Reply, LedgerError>>>,
}

impl Group {
    /// Adds `job`; a close ends the group and is kept in `closing`.
    fn push(&mut self, job: Job, closing: &mut Option<oneshot::Sender<()>>) {
        match job {
            Job::Run(command, reply) => {
                self.commands.push(command);
                self.replies.push(reply);
            }
            Job::Close(done) => *closing = Some(done),
        }
    }
}

/// Moves jobs already queued into `group`, up to [`MAX_GROUP`] commands,
/// stopping at a close.
pub(super) fn drain(
    queue: &mpsc::Receiver<Job>,
    group: &mut Group,
    closing: &mut Option<oneshot::Sender<()>>,
) {
    while group.commands.len() < MAX_GROUP && closing.is_none() {
        match queue.try_recv() {
            Ok(job) => group.push(job, closing),
            Err(_) => return,
        }
    }
}

/// Runs `commands` in one transaction, each inside its own savepoint so that
/// a storage failure in one leaves the others intact.
pub(super) fn run_group(
    conn: &mut Connection,
    config: &LedgerConfig,
    clock: &dyn Clock,
    commands: Vec<Command>,
) -> Vec<Result<Reply, LedgerError>> {
    let count = commands.len();
    let failed_all = |err: LedgerError| -> Vec<Result<Reply, LedgerError>> {
        tracing::error!(error = %err, "SQLite transaction failed");
        (0..count)
            .map(|_| Err(LedgerError::new(ErrorKind::Storage, err.message().to_owned())))
            .collect()
    };
    let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(err) => return failed_all(LedgerError::storage("cannot begin a transaction", err)),
    };
    let mut results = Vec::with_capacity(count);
    // Counter changes of the commands kept so far, written once per counter
    // row: before a command that reads the counters, and before the commit.
    let mut counts = PendingCounts::default();
    for command in commands {
        if matches!(command, Command::Snapshot { .. }) {
            if let Err(err) = counts.write(&tx) {
                drop(tx);
                return failed_all(err);
            }
        }
        // A savepoint per command, by prepared statements: rusqlite's
        // `Savepoint` formats and parses its statements every time.
        if let Err(err) = savepoint(&tx, sql::SAVEPOINT) {
            results.push(Err(LedgerError::storage("cannot open a savepoint", err)));
            continue;
        }
        // Read once the write lock is held: timestamps follow commit order.
        let now = clock.now();
        let mut txn = SqliteTxn::new(&tx);
        let result = engine::execute(&mut txn, config, command, now);
        let pending = std::mem::take(&mut txn.counts);
        // A refusal keeps what time forced (a reap); a storage failure keeps
        // nothing, its counts included.
        let keep = !matches!(&result, Err(err) if err.kind() == ErrorKind::Storage);
        let released = if keep {
            savepoint(&tx, sql::RELEASE)
        } else {
            savepoint(&tx, sql::ROLLBACK_TO).and_then(|()| savepoint(&tx, sql::RELEASE))
        };
        results.push(match released {
            Ok(()) => {
                if keep {
                    counts.merge(pending);
                }
                result
            }
            Err(err) => Err(LedgerError::storage("cannot release a savepoint", err)),
        });
    }
    if let Err(err) = counts.write(&tx) {
        drop(tx);
        return failed_all(err);
    }
    match tx.commit() {
        Ok(()) => results,
        Err(err) => failed_all(LedgerError::storage("cannot commit", err)),
    }
}

/// Runs one of the statements that open, release or roll back a command's
/// savepoint, prepared once per connection.
pub(super) fn savepoint(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}
