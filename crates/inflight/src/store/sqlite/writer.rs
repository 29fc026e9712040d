//! Running a group of commands in one transaction (group commit, on the
//! writer thread or on a lone caller's: `handoff.rs`); each is acknowledged
//! only once that transaction committed. A group runs without savepoints;
//! one that meets a storage failure is rolled back and run again with a
//! savepoint per command ([`run_group`]).

use std::time::Duration;

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::error::{ErrorKind, LedgerError};
use std::sync::{Mutex, PoisonError};

use crate::stats::{CallStats, Landed};
use crate::store::engine;
use crate::store::{Command, Reply};

use crate::store::sql::counts::PendingCounts;

use super::rows::Statements;
use super::sql;
use super::tables::{self, write_counts};
use super::txn::SqliteTxn;

/// The most commands grouped into one transaction.
pub(super) const MAX_GROUP: usize = 256;

/// Whether the first transaction of a group is already open.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Begun {
    /// `run_group` begins it, waiting up to the busy timeout for another
    /// process's transaction.
    No,
    /// [`begin_without_waiting`] began it.
    Yes,
}

/// Begins a transaction if no other connection holds the write lock;
/// `false` when one does, without waiting for it.
///
/// # Errors
/// `Storage` when the transaction cannot be begun for another reason.
pub(super) fn begin_without_waiting(conn: &mut Statements<'_>) -> Result<bool, LedgerError> {
    let set = |conn: &Statements<'_>, timeout| {
        conn.conn()
            .busy_timeout(timeout)
            .map_err(|err| LedgerError::storage("cannot set busy_timeout", err))
    };
    set(conn, Duration::ZERO)?;
    let begun = control(conn, sql::BEGIN_IMMEDIATE);
    set(conn, super::BUSY_TIMEOUT)?;
    match begun {
        Ok(()) => Ok(true),
        Err(rusqlite::Error::SqliteFailure(failure, _))
            if failure.code == rusqlite::ErrorCode::DatabaseBusy =>
        {
            Ok(false)
        }
        Err(err) => Err(LedgerError::storage("cannot begin a transaction", err)),
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
    begun: Begun,
) -> Vec<Result<Reply, LedgerError>> {
    let count = commands.len();
    let run = |conn: &mut Statements<'_>, commands, isolation, begun| {
        let (results, landed) = run_transaction(conn, config, clock, commands, isolation, begun)?;
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
        return match run(conn, commands, Isolation::Whole, begun) {
            Ok(results) => results,
            Err(Failed::Command(err)) => vec![Err(err)],
            Err(Failed::Transaction(err)) => failed_all(count, &err),
        };
    }
    let again = commands.clone();
    match run(conn, commands, Isolation::Whole, begun) {
        Ok(results) => results,
        Err(Failed::Command(_)) => match run(conn, again, Isolation::PerCommand, Begun::No) {
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

/// Runs `commands` in one `BEGIN IMMEDIATE` transaction (begun here unless
/// `begun`) and commits it; rolled back when it fails.
fn run_transaction(
    conn: &mut Statements<'_>,
    config: &LedgerConfig,
    clock: &dyn Clock,
    commands: Vec<Command>,
    isolation: Isolation,
    begun: Begun,
) -> Result<Committed, Failed> {
    if begun == Begun::No {
        control(conn, sql::BEGIN_IMMEDIATE)
            .map_err(|err| Failed::Transaction(LedgerError::storage("cannot begin a transaction", err)))?;
    }
    // Read once the write lock is held: no one else commits until ours.
    let run = match conn.check_data_version() {
        Ok(()) => run_commands(conn, config, clock, commands, isolation),
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
            write_counts(conn, &mut counts).map_err(Failed::Transaction)?;
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
        let mut result = engine::execute(&mut txn, config, command, now);
        if let Err(err) = txn.finish() {
            result = Err(err);
        }
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
    if conn.journal.is_full() {
        tables::apply(conn).map_err(Failed::Transaction)?;
    }
    write_counts(conn, &mut counts).map_err(Failed::Transaction)?;
    control(conn, sql::COMMIT)
        .map_err(|err| Failed::Transaction(LedgerError::storage("cannot commit", err)))?;
    Ok((results, landed))
}

/// Applies the rows written ahead to the tables, in a transaction of its
/// own (`journal.rs`): at close, so that a file closed cleanly holds every
/// record in its tables for anyone who opens it.
///
/// # Errors
/// `Storage` when the transaction fails; the rows stay, for the next
/// writer to apply.
pub(super) fn apply_journal(conn: &mut Statements<'_>) -> Result<(), LedgerError> {
    control(conn, sql::BEGIN_IMMEDIATE)
        .map_err(|err| LedgerError::storage("cannot begin a transaction", err))?;
    let applied = conn
        .check_data_version()
        .map_err(|err| LedgerError::storage("cannot read data_version", err))
        .and_then(|()| tables::apply(conn))
        .and_then(|()| control(conn, sql::COMMIT).map_err(|err| LedgerError::storage("cannot commit", err)));
    if applied.is_err() {
        rollback(conn);
    }
    applied
}

/// Rolls back the open transaction, if any (a failed `COMMIT` may have
/// ended it already).
pub(super) fn rollback(conn: &mut Statements<'_>) {
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
