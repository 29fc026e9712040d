//! The writer's connection: its statements, prepared once, and what it
//! keeps of what it wrote; and the helper that runs a query for rows.

use rusqlite::{Connection, Statement};

use crate::error::LedgerError;
use crate::store::sql::codec::{Columns, Value};

use super::cache::RecordCache;
use super::journal::Journal;
use super::{sql, sql_error};

/// The statements of `sql.rs` prepared on one connection, each once, found
/// again by the address of its text. rusqlite's own `prepare_cached` hashes
/// the whole text of a statement to find it, and again to put it back: for
/// the long record and counter statements that was about a tenth of a
/// lifecycle's instructions.
pub(super) struct Statements<'c> {
    conn: &'c Connection,
    prepared: Vec<(usize, usize, Statement<'c>)>,
    /// Records in flight as this connection last wrote or read them.
    pub(super) records: RecordCache,
    /// The id of each aggregate this connection saw stored (ids are never
    /// reused while the row lives, and aggregates are never deleted): it
    /// lives as long as the statements, and says which aggregates are known.
    pub(super) aggregate_ids: crate::store::sql::counts::SeenAggregates<i64>,
    /// What this connection wrote ahead and has not applied.
    pub(super) journal: Journal,
}

impl<'c> Statements<'c> {
    pub(super) fn new(conn: &'c Connection) -> Self {
        Self {
            conn,
            prepared: Vec::with_capacity(48),
            records: RecordCache::default(),
            aggregate_ids: crate::store::sql::counts::SeenAggregates::default(),
            journal: Journal::default(),
        }
    }

    /// Forgets what this connection kept of what it wrote, once a
    /// transaction or a savepoint is rolled back.
    pub(super) fn forget_uncommitted(&mut self) {
        self.records.forget_all();
        self.aggregate_ids.clear();
        self.journal.forget();
    }

    /// Reads SQLite's `data_version`, once a transaction holds the write
    /// lock: if another connection committed since this one's last
    /// transaction, forgets the records kept and what was known of the rows
    /// written ahead, which it may have applied.
    pub(super) fn check_data_version(&mut self) -> rusqlite::Result<()> {
        let version = self
            .prepare(sql::DATA_VERSION)?
            .query_row([], |row| row.get::<_, i64>(0))?;
        if self.records.check(version) {
            self.journal.forget();
        }
        Ok(())
    }

    /// The connection.
    pub(super) fn conn(&self) -> &'c Connection {
        self.conn
    }

    /// `sql`, prepared the first time it is asked for. A statement is
    /// reset after each use by rusqlite (`execute`, `query_row`, a dropped
    /// `Rows`), so it is ready for the next.
    pub(super) fn prepare(&mut self, sql: &'static str) -> rusqlite::Result<&mut Statement<'c>> {
        let key = (sql.as_ptr() as usize, sql.len());
        let found = self
            .prepared
            .iter()
            .position(|(address, len, _)| (*address, *len) == key);
        let index = match found {
            Some(index) => index,
            None => {
                let statement = self.conn.prepare(sql)?;
                self.prepared.push((key.0, key.1, statement));
                self.prepared.len() - 1
            }
        };
        Ok(&mut self.prepared[index].2)
    }
}

/// Runs a query and reads every row with `from_row`.
pub(super) fn query_rows<T>(
    statements: &mut Statements<'_>,
    sql: &'static str,
    params: &[Value<'_>],
    mut from_row: impl FnMut(&dyn Columns) -> Result<T, LedgerError>,
) -> Result<Vec<T>, LedgerError> {
    let statement = statements.prepare(sql).map_err(sql_error("cannot prepare"))?;
    let mut rows = statement
        .query(rusqlite::params_from_iter(params))
        .map_err(sql_error("cannot read rows"))?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(sql_error("cannot read rows"))? {
        out.push(from_row(row)?);
    }
    Ok(out)
}
