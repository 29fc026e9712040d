//! The writer thread: one per process, owning the connection. Commands that
//! arrive while a transaction is being written are grouped into the next
//! one (group commit), and each is acknowledged only once that transaction
//! committed. A group runs without savepoints; one that meets a storage
//! failure is rolled back and run again with a savepoint per command
//! ([`run_group`]).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::error::{ErrorKind, LedgerError};
use std::sync::{Mutex, PoisonError};

use crate::stats::{CallStats, Landed};
use crate::store::engine;
use crate::store::{Command, Reply};

use super::checkpoint::Checkpointer;
use super::rows::Statements;
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
    conn: Connection,
    checkpointer: Checkpointer,
    config: &LedgerConfig,
    clock: &dyn Clock,
    calls: &Mutex<CallStats>,
    queue: &mpsc::Receiver<Job>,
) {
    let mut statements = Statements::new(&conn);
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
            let results = run_group(&mut statements, config, clock, calls, group.commands);
            for (reply, result) in group.replies.into_iter().zip(results) {
                // A caller that went away still had its command committed.
                let _ = reply.send(result);
            }
            checkpointer.nudge();
        }
        if closing.is_some() {
            break;
        }
    }
    // Closed before the caller of `close` hears of it; commands queued
    // after the close are dropped, and their callers told the store closed.
    checkpointer.stop();
    drop(statements);
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

/// Runs `commands` in one transaction and answers each.
///
/// A storage failure must undo only the command it hit. A group of one
/// needs no savepoint for that: the failure rolls the whole transaction
/// back. A larger group first runs without savepoints too, which is what
/// nearly every group does; only if a command hits a storage failure is the
/// whole transaction rolled back (nothing was answered yet) and the group
/// run again with a savepoint per command, so that the failure undoes that
/// command alone.
pub(super) fn run_group(
    conn: &mut Statements<'_>,
    config: &LedgerConfig,
    clock: &dyn Clock,
    calls: &Mutex<CallStats>,
    commands: Vec<Command>,
) -> Vec<Result<Reply, LedgerError>> {
    let count = commands.len();
    let run = |conn: &mut Statements<'_>, commands, isolation| {
        let (results, landed) = run_transaction(conn, config, clock, commands, isolation)?;
        // Committed: what landed is published, each command's apart.
        let mut calls = calls.lock().unwrap_or_else(PoisonError::into_inner);
        for landed in landed.iter().filter(|landed| !landed.is_empty()) {
            for event in landed {
                event.publish(&mut calls);
            }
            calls.finish();
        }
        Ok(results)
    };
    if count == 1 {
        return match run(conn, commands, Isolation::Whole) {
            Ok(results) => results,
            Err(Failed::Command(err)) => vec![Err(err)],
            Err(Failed::Transaction(err)) => failed_all(count, &err),
        };
    }
    let again = commands.clone();
    match run(conn, commands, Isolation::Whole) {
        Ok(results) => results,
        Err(Failed::Command(_)) => match run(conn, again, Isolation::PerCommand) {
            Ok(results) => results,
            Err(Failed::Command(err) | Failed::Transaction(err)) => failed_all(count, &err),
        },
        Err(Failed::Transaction(err)) => failed_all(count, &err),
    }
}

/// How a transaction undoes a command's storage failure.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Isolation {
    /// The whole transaction rolls back.
    Whole,
    /// The command's savepoint rolls back.
    PerCommand,
}

/// Why a transaction was rolled back.
enum Failed {
    /// A command hit a storage failure under [`Isolation::Whole`]: its
    /// error.
    Command(LedgerError),
    /// The transaction itself failed (begin, counters, commit).
    Transaction(LedgerError),
}

fn failed_all(count: usize, err: &LedgerError) -> Vec<Result<Reply, LedgerError>> {
    tracing::error!(error = %err, "SQLite transaction failed");
    (0..count)
        .map(|_| Err(LedgerError::new(ErrorKind::Storage, err.message().to_owned())))
        .collect()
}

/// What a committed transaction answers, and what each of its commands
/// did that landed.
type Committed = (Vec<Result<Reply, LedgerError>>, Vec<Vec<Landed>>);

/// Runs `commands` in one `BEGIN IMMEDIATE` transaction and commits it;
/// rolled back when it fails.
fn run_transaction(
    conn: &mut Statements<'_>,
    config: &LedgerConfig,
    clock: &dyn Clock,
    commands: Vec<Command>,
    isolation: Isolation,
) -> Result<Committed, Failed> {
    control(conn, sql::BEGIN_IMMEDIATE)
        .map_err(|err| Failed::Transaction(LedgerError::storage("cannot begin a transaction", err)))?;
    // Read once the write lock is held: no one else commits until ours.
    let version = conn
        .prepare(sql::DATA_VERSION)
        .and_then(|statement| statement.query_row([], |row| row.get::<_, i64>(0)));
    let run = match version {
        Ok(version) => {
            conn.records.check(version);
            run_commands(conn, config, clock, commands, isolation)
        }
        Err(err) => Err(Failed::Transaction(LedgerError::storage(
            "cannot read data_version",
            err,
        ))),
    };
    if run.is_err() {
        rollback(conn);
    }
    run
}

/// The body of [`run_transaction`], from its first command to its commit.
fn run_commands(
    conn: &mut Statements<'_>,
    config: &LedgerConfig,
    clock: &dyn Clock,
    commands: Vec<Command>,
    isolation: Isolation,
) -> Result<Committed, Failed> {
    let mut results = Vec::with_capacity(commands.len());
    let mut landed = Vec::with_capacity(commands.len());
    // Counter changes of the commands kept so far, written once per counter
    // row: before a command that reads the counters, and before the commit.
    let mut counts = PendingCounts::default();
    for command in commands {
        if matches!(command, Command::Snapshot { .. }) {
            counts.write(conn).map_err(Failed::Transaction)?;
        }
        if isolation == Isolation::PerCommand {
            // By prepared statements: rusqlite's `Savepoint` formats and
            // parses its statements every time.
            if let Err(err) = control(conn, sql::SAVEPOINT) {
                results.push(Err(LedgerError::storage("cannot open a savepoint", err)));
                continue;
            }
        }
        // Read once the write lock is held: timestamps follow commit order.
        let now = clock.now();
        let mut txn = SqliteTxn::new(conn);
        let result = engine::execute(&mut txn, config, command, now);
        let pending = std::mem::take(&mut txn.counts);
        let did = std::mem::take(&mut txn.landed);
        // A refusal keeps what time forced (a reap); a storage failure keeps
        // nothing, its counts included.
        let keep = !matches!(&result, Err(err) if err.kind() == ErrorKind::Storage);
        let ended = match isolation {
            Isolation::Whole if keep => Ok(()),
            Isolation::Whole => {
                let err = result.expect_err("a storage failure");
                return Err(Failed::Command(err));
            }
            Isolation::PerCommand if keep => control(conn, sql::RELEASE),
            Isolation::PerCommand => {
                // What the command wrote is undone.
                conn.forget_uncommitted();
                control(conn, sql::ROLLBACK_TO).and_then(|()| control(conn, sql::RELEASE))
            }
        };
        results.push(match ended {
            Ok(()) => {
                if keep {
                    counts.merge(pending);
                    landed.push(did);
                }
                result
            }
            Err(err) => Err(LedgerError::storage("cannot release a savepoint", err)),
        });
    }
    counts.write(conn).map_err(Failed::Transaction)?;
    control(conn, sql::COMMIT)
        .map_err(|err| Failed::Transaction(LedgerError::storage("cannot commit", err)))?;
    Ok((results, landed))
}

/// Rolls back the open transaction, if any (a failed `COMMIT` may have
/// ended it already).
fn rollback(conn: &mut Statements<'_>) {
    conn.forget_uncommitted();
    if !conn.conn().is_autocommit() {
        if let Err(err) = control(conn, sql::ROLLBACK) {
            tracing::error!(error = %err, "SQLite rollback failed");
        }
    }
}

/// Runs one of the statements that begin, commit or roll back a
/// transaction, or open, release or roll back a command's savepoint,
/// prepared once per connection.
pub(super) fn control(conn: &mut Statements<'_>, sql: &'static str) -> rusqlite::Result<()> {
    conn.prepare(sql)?.execute([]).map(|_| ())
}
