//! Running a group of commands in one transaction (group commit, on the
//! writer thread or on a lone caller's: `handoff.rs`), as the shared
//! `store::sql::group` runs it: how SQLite begins (`BEGIN IMMEDIATE`),
//! runs a command (its journal) and commits.

use std::time::Duration;

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::error::LedgerError;
use crate::store::engine;
use crate::store::sql::counts::PendingCounts;
use crate::store::sql::group::{self, Committed, Failed, GroupTxn, Isolation, Published, Ran, Savepoint};
use crate::store::{Command, Reply};

use super::rows::Statements;
use super::sql;
use super::tables::{self, write_counts};
use super::txn::SqliteTxn;

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
    if let Err(err) = set(conn, super::BUSY_TIMEOUT) {
        // Reported as not begun: nothing may be left open.
        rollback(conn);
        return Err(err);
    }
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

/// Runs `commands` in one transaction and answers each
/// (`store::sql::group`: a storage failure undoes only its command).
pub(super) fn run_group(
    conn: &mut Statements<'_>,
    config: &LedgerConfig,
    clock: &dyn Clock,
    published: &Published,
    commands: Vec<Command>,
    begun: Begun,
) -> Vec<Result<Reply, LedgerError>> {
    group::run_group("SQLite", commands, false, published, |commands, attempt| {
        let begun = if attempt.first { begun } else { Begun::No };
        run_transaction(conn, config, clock, commands, attempt.isolation, begun)
    })
}

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
    let failed = |context: &'static str| move |err| Failed::Transaction(LedgerError::storage(context, err));
    if begun == Begun::No {
        control(conn, sql::BEGIN_IMMEDIATE).map_err(failed("cannot begin a transaction"))?;
    }
    // Read once the write lock is held: no one else commits until ours.
    let run = conn
        .check_data_version()
        .map_err(failed("cannot read data_version"))
        .and_then(|()| {
            let mut group = SqliteGroup { conn, config, clock };
            group::run_commands(&mut group, commands, isolation)
        })
        .and_then(|mut outcome| {
            if conn.journal.is_full() {
                tables::apply(conn).map_err(Failed::Transaction)?;
            }
            write_counts(conn, &mut outcome.counts).map_err(Failed::Transaction)?;
            control(conn, sql::COMMIT).map_err(failed("cannot commit"))?;
            Ok((outcome.results, outcome.landed))
        });
    if run.is_err() {
        rollback(conn);
    }
    run
}

/// A group's transaction on the writer's connection.
struct SqliteGroup<'g, 'c> {
    conn: &'g mut Statements<'c>,
    config: &'g LedgerConfig,
    clock: &'g dyn Clock,
}

impl GroupTxn for SqliteGroup<'_, '_> {
    fn command(&mut self, command: Command) -> Ran {
        // Read once the write lock is held: timestamps follow commit order.
        let now = self.clock.now();
        let mut txn = SqliteTxn::new(self.conn);
        let mut result = engine::execute(&mut txn, self.config, command, now);
        if let Err(err) = txn.finish() {
            result = Err(err);
        }
        Ran {
            counts: std::mem::take(&mut txn.counts),
            landed: std::mem::take(&mut txn.landed),
            ..Ran::of(result)
        }
    }

    fn savepoint(&mut self, step: Savepoint) -> Result<(), Failed> {
        // By prepared statements: rusqlite's `Savepoint` formats and parses
        // its statements every time.
        let sql = match step {
            Savepoint::Open => sql::SAVEPOINT,
            Savepoint::Release => sql::RELEASE,
            Savepoint::RollBack => sql::ROLLBACK_TO,
        };
        control(self.conn, sql).map_err(|err| Failed::Transaction(LedgerError::storage(sql, err)))
    }

    fn forget(&mut self) {
        self.conn.forget_uncommitted();
    }

    fn write_counts(&mut self, counts: &mut PendingCounts) -> Result<(), Failed> {
        write_counts(self.conn, counts).map_err(Failed::Transaction)
    }
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
