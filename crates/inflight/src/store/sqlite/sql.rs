//! The statements only the SQLite store prepares (its schema, its journal,
//! its aggregates by id), in one place, beside the ones both SQL stores
//! share (`store::sql::statements`, re-exported here), so that a test can
//! show the query plan of each (`STATEMENTS`, in the tests) and none slips
//! past it.

use crate::store::sql::columns::{aggregate_labels, record_columns, totals_columns};
pub(super) use crate::store::sql::statements::*;

/// One versioned migration: its schema change, then what Rust must do
/// after it (a backfill that follows a domain rule, written once there).
pub(super) struct Migration {
    pub(super) sql: &'static str,
    pub(super) backfill: Option<Backfill>,
}

/// A data change that a migration needs after its schema change.
#[derive(Clone, Copy)]
pub(super) enum Backfill {
    /// Counts the completions already stored into `completion_minutes`.
    CompletionMinutes,
}

/// Versioned migrations; `PRAGMA user_version` records how many have run.
pub(super) const MIGRATIONS: &[Migration] = &[
    Migration {
        sql: include_str!("migrations/0001_activities_and_aggregates.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0002_owners_and_lane_index.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0003_completion_minutes.sql"),
        backfill: Some(Backfill::CompletionMinutes),
    },
    Migration {
        sql: include_str!("migrations/0004_owner_lost_abandoned.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0005_drop_in_flight_index.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0006_aggregates_by_id.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0007_journal.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0008_refined.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0009_idempotency_keys.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0010_succeeded_unstarted.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0011_lane_states.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0012_usage.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0013_lane_index_covers_rank_and_estimate.sql"),
        backfill: None,
    },
    Migration {
        sql: include_str!("migrations/0014_trace_parent.sql"),
        backfill: None,
    },
];

pub(super) const BEGIN_IMMEDIATE: &str = "BEGIN IMMEDIATE";
/// Moves when another connection committed to the file: whether the
/// writer's cached records are still the stored rows (`cache.rs`).
pub(super) const DATA_VERSION: &str = "PRAGMA data_version";
/// Copies what it can of the log into the database file without waiting
/// for the write lock (the checkpointer's); answers busy, log pages, pages
/// copied.
pub(super) const CHECKPOINT: &str = "PRAGMA wal_checkpoint(PASSIVE)";

/// Whether a record with id `?1` is stored (a begin's check that its id is
/// free, when it writes ahead).
pub(super) const RECORD_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM activities WHERE activity_id = ?1)";

/// Writes one row ahead: the record, its counter changes, the minute of its
/// completion.
pub(super) const JOURNAL_APPEND: &str = concat!(
    "INSERT INTO journal (",
    record_columns!(),
    ", ",
    totals_columns!(),
    ", completion_minute) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, \
     ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29, ?30, ?31, ?32, ?33, ?34, \
     ?35, ?36, ?37, ?38, ?39, ?40, ?41, ?42, ?43, ?44, ?45, ?46, ?47, ?48, ?49)"
);

/// Every row written ahead, oldest first: columns as `JOURNAL_APPEND`
/// binds them.
pub(super) const JOURNAL_ROWS: &str = concat!(
    "SELECT ",
    record_columns!(),
    ", ",
    totals_columns!(),
    ", completion_minute FROM journal ORDER BY seq"
);

/// Every record the file holds, in the tables or written ahead: for tests
/// that read the file behind the writer's back.
#[cfg(test)]
pub(super) const RECORDS_ANYWHERE: &str =
    "SELECT COUNT(*) FROM (SELECT activity_id FROM activities UNION SELECT activity_id FROM journal)";

/// Rows written ahead, and records in the tables: for tests.
#[cfg(test)]
pub(super) const ROWS_AHEAD_AND_STORED: &str =
    "SELECT (SELECT COUNT(*) FROM journal), (SELECT COUNT(*) FROM activities)";

/// Forgets the rows written ahead, once applied.
pub(super) const JOURNAL_CLEAR: &str = "DELETE FROM journal";

pub(super) const DELETE_RECORD: &str = "DELETE FROM activities WHERE activity_id = ?1";
/// The idempotency key of a record pruned (`idempotency_keys_activity`).
pub(super) const DELETE_KEY: &str = "DELETE FROM idempotency_keys WHERE activity_id = ?1";

/// The id of an aggregate, by its labels (`aggregates_labels`).
pub(super) const AGGREGATE_ID: &str = "SELECT id FROM aggregates WHERE service = ?1 \
     AND operation_stage = ?2 AND class = ?3 AND provider = ?4 AND model = ?5 AND priority = ?6 \
     AND admission = ?7";

/// Adds to the totals of the aggregate with id `?1` (migration 6).
pub(super) const ADD_TO_AGGREGATE: &str =
    "UPDATE aggregates SET succeeded = succeeded + ?2, failed = failed + ?3, \
     cancelled = cancelled + ?4, reaped_abandoned = reaped_abandoned + ?5, \
     reaped_unsettled = reaped_unsettled + ?6, reaped_owner_lost = reaped_owner_lost + ?7, \
     late_settles = late_settles + ?8, resurrections = resurrections + ?9, \
     in_flight = in_flight + ?10, queue_wait_count = queue_wait_count + ?11, \
     queue_wait_sum_ms = queue_wait_sum_ms + ?12, queue_wait_max_ms = MAX(queue_wait_max_ms, ?13), \
     execution_count = execution_count + ?14, execution_sum_ms = execution_sum_ms + ?15, \
     execution_max_ms = MAX(execution_max_ms, ?16), \
     last_seen_at = MAX(COALESCE(last_seen_at, ?17), COALESCE(?17, last_seen_at)), \
     reaped_owner_lost_abandoned = reaped_owner_lost_abandoned + ?18, \
     succeeded_unstarted = succeeded_unstarted + ?19, input_tokens_sum = input_tokens_sum + ?20, \
     output_tokens_sum = output_tokens_sum + ?21 \
     WHERE id = ?1";

/// Stores a new aggregate with its first totals.
pub(super) const INSERT_AGGREGATE: &str = concat!(
    "INSERT INTO aggregates (",
    aggregate_labels!(),
    ", ",
    totals_columns!(),
    ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, \
     ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27)"
);

/// Charges `?4` tokens to the lane `?2::?3` in the second `?1`.
pub(super) const SPEND: &str = "INSERT INTO token_seconds (second, service, provider, tokens) \
     VALUES (?1, ?2, ?3, ?4) \
     ON CONFLICT (second, service, provider) DO UPDATE SET tokens = tokens + excluded.tokens";

pub(super) const COUNT_COMPLETIONS: &str =
    "INSERT INTO completion_minutes (minute, completions) VALUES (?1, ?2) \
     ON CONFLICT (minute) DO UPDATE SET completions = completions + excluded.completions";

/// Walks history once, when migration 3 runs.
pub(super) const COMPLETED_AT_ALL: &str =
    "SELECT completed_at FROM activities WHERE completed_at IS NOT NULL";

/// The bulk loader's insert (`seed_history`).
pub(super) const SEED_RECORD: &str = concat!(
    "INSERT INTO activities (",
    record_columns!(),
    ") VALUES (?1, 'bench-history', 'ollama', 'embedding', \
     'history', 'nomic-embed-text', 'batch', 'queued', 'succeeded', NULL, NULL, NULL, ?2, ?3, ?4, NULL, \
     NULL, 300000, NULL, 1, NULL, 0, NULL, 0, NULL, NULL, NULL, NULL)"
);

#[cfg(test)]
pub(super) use crate::store::sql::Reach;

/// Every statement above, by name, with how it may read the tables; with
/// the shared ones (`BOTH`), what the plan check reads.
#[cfg(test)]
pub(super) const STATEMENTS: &[(&str, &str, Reach)] = &[
    ("BEGIN_IMMEDIATE", BEGIN_IMMEDIATE, Reach::Control),
    ("DATA_VERSION", DATA_VERSION, Reach::Control),
    ("CHECKPOINT", CHECKPOINT, Reach::Control),
    ("DELETE_RECORD", DELETE_RECORD, Reach::Indexed),
    ("DELETE_KEY", DELETE_KEY, Reach::Indexed),
    ("RECORD_EXISTS", RECORD_EXISTS, Reach::Indexed),
    ("JOURNAL_APPEND", JOURNAL_APPEND, Reach::Indexed),
    ("JOURNAL_ROWS", JOURNAL_ROWS, Reach::Indexed),
    ("JOURNAL_CLEAR", JOURNAL_CLEAR, Reach::Indexed),
    ("RECORDS_ANYWHERE", RECORDS_ANYWHERE, Reach::WalksHistory),
    (
        "ROWS_AHEAD_AND_STORED",
        ROWS_AHEAD_AND_STORED,
        Reach::WalksHistory,
    ),
    ("AGGREGATE_ID", AGGREGATE_ID, Reach::Indexed),
    ("ADD_TO_AGGREGATE", ADD_TO_AGGREGATE, Reach::Indexed),
    ("INSERT_AGGREGATE", INSERT_AGGREGATE, Reach::Indexed),
    ("COUNT_COMPLETIONS", COUNT_COMPLETIONS, Reach::Indexed),
    ("SPEND", SPEND, Reach::Indexed),
    ("COMPLETED_AT_ALL", COMPLETED_AT_ALL, Reach::WalksHistory),
    ("SEED_RECORD", SEED_RECORD, Reach::WalksHistory),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Partial indexes of what is in flight or live: scanning one costs
    /// what is live, never history.
    const LIVE_INDEXES: &[&str] = &["activities_lane", "activities_owner", "owners_live"];

    /// The lines of `EXPLAIN QUERY PLAN` that read `activities` or `owners`
    /// by a scan of history.
    fn history_scans(conn: &rusqlite::Connection, sql: &str) -> Vec<String> {
        let mut statement = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        // The plan is made before parameters are bound: any values do.
        let unbound = std::iter::repeat_n(rusqlite::types::Null, statement.parameter_count());
        let details: Vec<String> = statement
            .query_map(rusqlite::params_from_iter(unbound), |row| row.get::<_, String>(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        details
            .into_iter()
            .filter(|detail| {
                let scans = detail.starts_with("SCAN activities") || detail.starts_with("SCAN owners");
                scans
                    && !LIVE_INDEXES
                        .iter()
                        .any(|index| detail.ends_with(&format!("INDEX {index}")))
            })
            .collect()
    }

    #[test]
    fn no_statement_on_a_hot_path_scans_history() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn =
            super::super::connect(&dir.path().join("plans.db"), super::super::Synchronous::Full).unwrap();
        super::super::migrate(&mut conn).unwrap();
        let mut failures = Vec::new();
        for (name, sql, reach) in STATEMENTS.iter().chain(BOTH) {
            if *reach != Reach::Indexed {
                continue;
            }
            let scans = history_scans(&conn, sql);
            if !scans.is_empty() {
                failures.push(format!("{name}: {scans:?}"));
            }
        }
        assert!(
            failures.is_empty(),
            "statements that scan history:\n{}",
            failures.join("\n")
        );
    }

    #[test]
    fn the_check_catches_a_lane_count_the_partial_index_cannot_serve() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn =
            super::super::connect(&dir.path().join("plans.db"), super::super::Synchronous::Full).unwrap();
        super::super::migrate(&mut conn).unwrap();
        // The statement before the fix: `state = 'executing'` alone does
        // not imply the partial index's condition.
        let unfixed = "SELECT COUNT(*) FROM activities WHERE service = ?1 AND provider = ?2 \
                       AND admission = 'queued' AND state = 'executing'";
        assert!(!history_scans(&conn, unfixed).is_empty());
    }

    #[test]
    fn every_statement_the_store_prepares_is_listed() {
        // The store's own code holds no SQL: every statement is here, and
        // so in the plan check above.
        crate::store::assert_sql_only_in_sql_rs(
            "sqlite",
            &[
                ("mod.rs", include_str!("mod.rs")),
                ("schema.rs", include_str!("schema.rs")),
                ("writer.rs", include_str!("writer.rs")),
                ("rows.rs", include_str!("rows.rs")),
                ("txn.rs", include_str!("txn.rs")),
                ("cache.rs", include_str!("cache.rs")),
                ("checkpoint.rs", include_str!("checkpoint.rs")),
                ("handoff.rs", include_str!("handoff.rs")),
                ("journal.rs", include_str!("journal.rs")),
                ("tables.rs", include_str!("tables.rs")),
            ],
            &["SELECT", "INSERT", "UPDATE", "DELETE", "SAVEPOINT", "RELEASE"],
            include_str!("sql.rs"),
            STATEMENTS.len(),
        );
    }
}
