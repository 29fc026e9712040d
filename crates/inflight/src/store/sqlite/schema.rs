//! The schema: opening a connection with the store's pragmas, versioned
//! migrations (and the backfills they need), and the rebound of records in
//! flight when the store opens.

use std::path::Path;

use rusqlite::{Connection, TransactionBehavior};

use crate::config::LedgerConfig;
use crate::domain::query;
use crate::domain::timestamp::Timestamp;
use crate::error::{ErrorKind, LedgerError};
use crate::store::engine;

use super::rows::{query_rows, Statements};
use super::sql::{self, Backfill, MIGRATIONS};
use super::tables::write_counts;
use super::txn::SqliteTxn;
use super::{pragmas, sql_error, Synchronous, BUSY_TIMEOUT};
use crate::store::sql::codec;
use crate::store::sql::counts::PendingCounts;

pub(super) fn connect(path: &Path, synchronous: Synchronous) -> Result<Connection, LedgerError> {
    let conn = Connection::open(path).map_err(sql_error("cannot open the SQLite store"))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(sql_error("cannot set busy_timeout"))?;
    for (name, value) in pragmas(synchronous) {
        conn.pragma_update(None, name, value)
            .map_err(|err| LedgerError::storage(&format!("cannot set PRAGMA {name} = {value}"), err))?;
    }
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

pub(super) fn migrate(conn: &mut Connection) -> Result<(), LedgerError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(sql_error("cannot begin the migration"))?;
    let version: usize = tx
        .query_row("PRAGMA user_version", [], |row| row.get::<_, i64>(0))
        .map_err(sql_error("cannot read the schema version"))? as usize;
    if version > MIGRATIONS.len() {
        return Err(LedgerError::new(
            ErrorKind::Storage,
            format!(
                "the store's schema version {version} is newer than this build knows ({}); upgrade inflight",
                MIGRATIONS.len()
            ),
        ));
    }
    for (index, migration) in MIGRATIONS.iter().enumerate().skip(version) {
        tx.execute_batch(migration.sql)
            .map_err(sql_error("cannot apply a migration"))?;
        if let Some(backfill) = migration.backfill {
            run_backfill(&tx, backfill)?;
        }
        tx.pragma_update(None, "user_version", (index + 1) as i64)
            .map_err(sql_error("cannot record the schema version"))?;
    }
    tx.commit().map_err(sql_error("cannot commit the migration"))
}

/// Runs what a migration needs done in Rust after its schema change.
pub(super) fn run_backfill(conn: &Connection, backfill: Backfill) -> Result<(), LedgerError> {
    match backfill {
        Backfill::CompletionMinutes => {
            // Counted by the domain's minute, not restated in SQL.
            let mut counts = PendingCounts::default();
            let mut st = Statements::new(conn);
            let completed = query_rows(&mut st, sql::COMPLETED_AT_ALL, &[], |row| codec::int(row, 0))?;
            for at in completed {
                counts.complete(query::completion_minute(Timestamp::from_millis(at)));
            }
            write_counts(&mut st, &mut counts)
        }
    }
}

/// Recomputes the bounds of in-flight records under `config`
/// ([`engine::rebound`]), so that a configuration change (a longer deadline,
/// a new factor) applies to work already in flight.
pub(super) fn rebound_in_flight(conn: &mut Connection, config: &LedgerConfig) -> Result<(), LedgerError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(sql_error("cannot begin"))?;
    {
        let mut st = Statements::new(&tx);
        let mut txn = SqliteTxn::new(&mut st);
        engine::rebound(&mut txn, config.policy())?;
        txn.finish()?;
    }
    tx.commit().map_err(sql_error("cannot commit"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_takes_the_durability_it_is_given() {
        let dir = tempfile::tempdir().unwrap();
        for (synchronous, pragma) in [(Synchronous::Full, 2), (Synchronous::Normal, 1)] {
            let conn = connect(&dir.path().join("durability.db"), synchronous).unwrap();
            let set: i64 = conn
                .query_row("PRAGMA synchronous", [], |row| row.get(0))
                .unwrap();
            assert_eq!(set, pragma, "{synchronous}");
        }
    }

    #[test]
    fn a_migrated_store_writes_two_indexes_of_records_in_flight_not_three() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = connect(&dir.path().join("indexes.db"), Synchronous::Full).unwrap();
        migrate(&mut conn).unwrap();
        let mut names = Vec::new();
        conn.pragma(None, "index_list", "activities", |row| {
            names.push(row.get::<_, String>("name")?);
            Ok(())
        })
        .unwrap();
        // The primary key's own index (WITHOUT ROWID) is not one of ours.
        names.retain(|name| !name.starts_with("sqlite_autoindex"));
        names.sort();
        // `activities_in_flight` went in migration 5: its condition is
        // `activities_lane`'s, which serves the line order too.
        assert_eq!(
            names,
            [
                "activities_completed",
                "activities_due",
                "activities_lane",
                "activities_owner",
                "activities_reaped"
            ]
        );
    }
}
