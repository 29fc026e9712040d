//! The schema: versioned migrations under an advisory lock, and the
//! rebound of records in flight when the store opens.

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::error::{ErrorKind, LedgerError};
use crate::store::engine;
use crate::store_url::PostgresUrl;

use super::sql::{self, MIGRATIONS};
use super::txn::{Conn, Fault, PgTxn, Records};
use super::writer;

/// Migrates the database and rebounds what is in flight, holding the
/// migration lock on the connection it returns, which then serves as a
/// writer's.
pub(super) fn migrate(
    settings: &PostgresUrl,
    config: &LedgerConfig,
    clock: &dyn Clock,
) -> Result<Conn, LedgerError> {
    let mut conn = settings.connect()?;
    let key = settings.lock_key();
    let failed = |context: &'static str| move |err: postgres::Error| Fault::of(&err).error(context, err);
    conn.client
        .batch_execute(sql::MIGRATION_SESSION)
        .map_err(failed("cannot set up the migration"))?;
    conn.client
        .execute(sql::MIGRATION_LOCK, &[&key])
        .map_err(failed("cannot take the migration lock"))?;
    let migrated = migrate_locked(&mut conn, settings, config, clock);
    let unlocked = conn
        .client
        .execute(sql::MIGRATION_UNLOCK, &[&key])
        .map_err(failed("cannot release the migration lock"));
    migrated?;
    unlocked?;
    // Back to a writer's settings: it serves as one from here on.
    conn.client
        .batch_execute(sql::SESSION)
        .map_err(failed("cannot set up a PostgreSQL connection"))?;
    Ok(conn)
}

fn migrate_locked(
    conn: &mut Conn,
    settings: &PostgresUrl,
    config: &LedgerConfig,
    clock: &dyn Clock,
) -> Result<(), LedgerError> {
    let failed = |context: &'static str| move |err: postgres::Error| Fault::of(&err).error(context, err);
    if let Some(schema) = &settings.schema {
        conn.client
            .batch_execute(&sql::create_schema(schema))
            .map_err(failed("cannot create the schema"))?;
    }
    conn.client
        .batch_execute(sql::SCHEMA_TABLE)
        .map_err(failed("cannot create the schema version table"))?;
    let version: i64 = conn
        .client
        .query_one(sql::SCHEMA_VERSION, &[])
        .and_then(|row| row.try_get(0))
        .map_err(failed("cannot read the schema version"))?;
    let known = MIGRATIONS.len() as i64;
    if version > known {
        return Err(LedgerError::new(
            ErrorKind::Storage,
            format!(
                "the database's schema version {version} is newer than this build of inflight knows \
                 ({known}); upgrade inflight, or point it at another database"
            ),
        ));
    }
    for (index, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let next = index as i32 + 1;
        conn.client
            .batch_execute(sql::BEGIN)
            .map_err(failed("cannot begin the migration"))?;
        let applied = conn
            .client
            .batch_execute(migration)
            .map_err(failed("cannot apply a migration"))
            .and_then(|()| {
                conn.client
                    .execute(sql::RECORD_VERSION, &[&next])
                    .map_err(failed("cannot record the schema version"))
            });
        if let Err(err) = applied {
            // Nothing of it stays; the connection is left as it was found.
            let _ = conn.client.batch_execute(sql::ROLLBACK);
            return Err(err);
        }
        conn.client
            .batch_execute(sql::COMMIT)
            .map_err(failed("cannot commit the migration"))?;
    }
    rebound_in_flight(conn, config, clock)
}

/// Recomputes the bounds of in-flight records under `config`
/// ([`engine::rebound`]), so that a configuration change applies to work
/// already in flight. The records are locked as they are read.
fn rebound_in_flight(conn: &mut Conn, config: &LedgerConfig, clock: &dyn Clock) -> Result<(), LedgerError> {
    let at = (!clock.is_system()).then(|| clock.now());
    writer::begin(conn, at, &[]).map_err(|(_, err)| err)?;
    let mut records = Records::new(false);
    let mut txn = PgTxn::new(conn, &mut records);
    txn.lock_in_flight = true;
    let rebound = engine::rebound(&mut txn, config.policy());
    let control = if rebound.is_ok() {
        sql::COMMIT
    } else {
        sql::ROLLBACK
    };
    let ended = conn
        .client
        .batch_execute(control)
        .map_err(|err| Fault::of(&err).error("cannot end the rebound", err));
    rebound?;
    ended
}
