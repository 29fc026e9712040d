//! Every statement the PostgreSQL store runs, in one place, so that a test
//! can show the plan of each (`STATEMENTS`, and the `EXPLAIN` tests below)
//! and none slips past it.
//!
//! Each query answers one question of [`crate::domain::query`]; its doc
//! names the reference it must agree with. Text columns are
//! `COLLATE "C"`, so that ids and labels order by their bytes, as the
//! domain orders them, whatever the database's collation.
//!
//! Reads that lead to a write lock the rows they read (`FOR UPDATE`): under
//! READ COMMITTED a second transaction that wants the same row waits for
//! the first, then re-reads it, and a record the first reaped or settled no
//! longer matches `state IN ('waiting', 'executing')`. That is what makes
//! every reap happen exactly once however many instances reap at once.
//!
//! The statements both SQL stores run are written once
//! (`store::sql::statements`, re-exported here, each locking one as its
//! `*_LOCKED` twin); this file holds what only PostgreSQL runs.

use crate::store::sql::columns::record_columns;
pub(super) use crate::store::sql::statements::*;

/// Versioned migrations: the row `version = n` of `inflight_schema` says
/// that the first `n` ran. Each runs in one transaction with its row.
pub(super) const MIGRATIONS: &[&str] = &[
    include_str!("migrations/0001_activities_aggregates_owners.sql"),
    include_str!("migrations/0002_owner_lost_abandoned.sql"),
    include_str!("migrations/0003_drop_in_flight_index.sql"),
    include_str!("migrations/0004_counter_shards.sql"),
    include_str!("migrations/0005_write_missed.sql"),
    include_str!("migrations/0006_refined.sql"),
    include_str!("migrations/0007_idempotency_keys.sql"),
    include_str!("migrations/0008_succeeded_unstarted.sql"),
    include_str!("migrations/0009_lane_states.sql"),
    include_str!("migrations/0010_usage.sql"),
    include_str!("migrations/0011_lane_index_covers_rank_and_estimate.sql"),
    include_str!("migrations/0012_trace_parent.sql"),
];

/// The SQLSTATE of `inflight_write_missed()` (a code, not a statement).
pub(super) static WRITE_MISSED: &str = "IF001";

/// The table of applied migrations; created by the migration runner
/// before it reads the version.
pub(super) const SCHEMA_TABLE: &str = "CREATE TABLE IF NOT EXISTS inflight_schema (\
     version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())";
pub(super) const SCHEMA_VERSION: &str = "SELECT COALESCE(MAX(version), 0)::BIGINT FROM inflight_schema";
pub(super) const RECORD_VERSION: &str = "INSERT INTO inflight_schema (version) VALUES ($1)";
/// Held by the instance that migrates, on its own connection: several
/// instances starting at once migrate one after the other. `$1` names the
/// schema.
pub(super) const MIGRATION_LOCK: &str = "SELECT pg_advisory_lock(hashtext($1))";
pub(super) const MIGRATION_UNLOCK: &str = "SELECT pg_advisory_unlock(hashtext($1))";
/// While migrating: an instance waits for another's migration (and the
/// rebound's row locks) for up to a minute rather than [`SESSION`]'s 4 s.
pub(super) const MIGRATION_SESSION: &str = "SET lock_timeout = '60s'";

/// Opens every transaction and reads its "now" from the one clock, in one
/// round trip (a simple query).
pub(super) const BEGIN_NOW: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT inflight_now()";
/// Like [`BEGIN_NOW`], with the clock overridden for this transaction: the
/// `{}` is the time in epoch milliseconds, an integer formatted by the store.
pub(super) const BEGIN_AT: &str =
    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL inflight.now_ms = '{}'; SELECT inflight_now()";
/// Opens a transaction with no "now" (a migration, the bulk loader).
pub(super) const BEGIN: &str = "BEGIN";
/// Set on every connection: a lane lock held by a stuck transaction
/// elsewhere fails a command as `unavailable` within this, never hangs it.
pub(super) const SESSION: &str = "SET lock_timeout = '4s'";

/// The records `$1` (an array of ids, sorted) that a group's commands
/// name, locked one after the other in that order before its first command
/// runs: one round trip instead of one [`GET_RECORD`] per command, and two
/// groups that name the same records lock them in the same order. Each is
/// looked up as `GET_RECORD` looks one up, by its primary key (a lateral
/// subquery per id), so the plan is an index lookup per id whatever the
/// planner knows of the table: the store prepares its statements once per
/// connection, often on a table still empty and never analyzed, on which
/// `activity_id = ANY($1)` is planned as a scan, and the plan is kept.
pub(super) const LOCK_RECORDS: &str = concat!(
    "SELECT r.* FROM unnest($1::text[]) AS k(id) CROSS JOIN LATERAL (SELECT ",
    record_columns!(),
    " FROM activities WHERE activity_id = k.id FOR UPDATE) AS r"
);

/// A group's deferred writes in one statement, one round trip: its
/// records and its counters.
///
/// Records: `$1`..`$28` are the columns of every written record, in
/// `record_columns!` order, as arrays one element per record; `$29` says
/// which are new. The new ones are
/// inserted (none when the id is taken); the others, whose rows the
/// transaction holds locked, overwritten. Both go through the primary key
/// (`ON CONFLICT`), never through a join the planner could turn into a
/// scan (see [`LOCK_RECORDS`]). `$60` to `$63` are the rows expected:
/// overwritten, inserted, aggregates and minutes added to. When any count
/// differs, or an overwrite found no row, the statement fails with
/// [`WRITE_MISSED`], so that a `COMMIT` already sent behind it rolls back.
///
/// Counters: `$30`..`$56` are the aggregates' keys and totals to add, as
/// arrays one element per aggregate (`aggregate_labels!` then
/// `totals_columns!` order), `$57` and `$58` the minutes and their
/// completions; each key at most once per array, as `ON CONFLICT DO
/// UPDATE` requires; `$59` the writer's shard of the counter rows. Either part may be empty arrays: a flush of records
/// before a read sends no counters, a write of counters before a snapshot
/// no records.
pub(super) const WRITE_GROUP: &str = concat!(
    "WITH w AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
     $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[], \
     $13::bigint[], $14::bigint[], $15::bigint[], $16::bigint[], $17::bigint[], $18::bigint[], \
     $19::bigint[], $20::boolean[], $21::text[], $22::boolean[], $23::text[], $24::boolean[], \
     $25::bigint[], $26::bigint[], $27::bigint[], $28::text[], $29::boolean[]) \
     AS w(",
    record_columns!(),
    ", fresh)), \
     updated AS (INSERT INTO activities AS a (",
    record_columns!(),
    ") SELECT ",
    record_columns!(),
    " FROM w WHERE NOT w.fresh ON CONFLICT (activity_id) DO UPDATE SET service = excluded.service, \
     provider = excluded.provider, class = excluded.class, operation_stage = excluded.operation_stage, \
     model = excluded.model, priority = excluded.priority, admission = excluded.admission, \
     state = excluded.state, disposition = excluded.disposition, reap_reason = excluded.reap_reason, \
     owner_id = excluded.owner_id, enqueued_at = excluded.enqueued_at, \
     started_at = excluded.started_at, completed_at = excluded.completed_at, \
     reaped_at = excluded.reaped_at, declared_deadline_ms = excluded.declared_deadline_ms, \
     deadline_ms = excluded.deadline_ms, reapable_at = excluded.reapable_at, \
     success = excluded.success, failure_stage = excluded.failure_stage, \
     late_settle = excluded.late_settle, cancel_reason = excluded.cancel_reason, \
     refined = excluded.refined, input_tokens = excluded.input_tokens, \
     output_tokens = excluded.output_tokens, max_tokens = excluded.max_tokens \
     RETURNING (a.xmax = 0) AS new), \
     inserted AS (INSERT INTO activities (",
    record_columns!(),
    ") SELECT ",
    record_columns!(),
    " FROM w WHERE w.fresh ON CONFLICT (activity_id) DO NOTHING RETURNING 1), \
     g AS (INSERT INTO aggregates AS a (service, operation_stage, class, provider, model, \
     priority, admission, succeeded, failed, cancelled, reaped_abandoned, reaped_unsettled, \
     reaped_owner_lost, late_settles, resurrections, in_flight, queue_wait_count, queue_wait_sum_ms, \
     queue_wait_max_ms, execution_count, execution_sum_ms, execution_max_ms, last_seen_at, \
     reaped_owner_lost_abandoned, succeeded_unstarted, input_tokens_sum, output_tokens_sum, shard) \
     SELECT *, $59::smallint FROM unnest($30::text[], $31::text[], $32::text[], $33::text[], $34::text[], $35::text[], \
     $36::text[], $37::bigint[], $38::bigint[], $39::bigint[], $40::bigint[], \
     $41::bigint[], $42::bigint[], $43::bigint[], $44::bigint[], $45::bigint[], $46::bigint[], \
     $47::bigint[], $48::bigint[], $49::bigint[], $50::bigint[], $51::bigint[], $52::bigint[], \
     $53::bigint[], $54::bigint[], $55::bigint[], $56::bigint[]) \
     ON CONFLICT (service, operation_stage, class, provider, model, priority, admission, shard) \
     DO UPDATE SET succeeded = a.succeeded + excluded.succeeded, \
     failed = a.failed + excluded.failed, cancelled = a.cancelled + excluded.cancelled, \
     reaped_abandoned = a.reaped_abandoned + excluded.reaped_abandoned, \
     reaped_unsettled = a.reaped_unsettled + excluded.reaped_unsettled, \
     reaped_owner_lost = a.reaped_owner_lost + excluded.reaped_owner_lost, \
     reaped_owner_lost_abandoned = a.reaped_owner_lost_abandoned + excluded.reaped_owner_lost_abandoned, \
     succeeded_unstarted = a.succeeded_unstarted + excluded.succeeded_unstarted, \
     late_settles = a.late_settles + excluded.late_settles, \
     resurrections = a.resurrections + excluded.resurrections, \
     in_flight = a.in_flight + excluded.in_flight, \
     queue_wait_count = a.queue_wait_count + excluded.queue_wait_count, \
     queue_wait_sum_ms = a.queue_wait_sum_ms + excluded.queue_wait_sum_ms, \
     queue_wait_max_ms = GREATEST(a.queue_wait_max_ms, excluded.queue_wait_max_ms), \
     execution_count = a.execution_count + excluded.execution_count, \
     execution_sum_ms = a.execution_sum_ms + excluded.execution_sum_ms, \
     execution_max_ms = GREATEST(a.execution_max_ms, excluded.execution_max_ms), \
     input_tokens_sum = a.input_tokens_sum + excluded.input_tokens_sum, \
     output_tokens_sum = a.output_tokens_sum + excluded.output_tokens_sum, \
     last_seen_at = GREATEST(a.last_seen_at, excluded.last_seen_at) RETURNING 1), \
     m AS (INSERT INTO completion_minutes AS m (minute, completions, shard) \
     SELECT *, $59::smallint FROM unnest($57::bigint[], $58::bigint[]) \
     ON CONFLICT (minute, shard) DO UPDATE SET completions = m.completions + excluded.completions RETURNING 1) \
     SELECT CASE WHEN (SELECT COUNT(*) FILTER (WHERE NOT new) FROM updated) = $60 \
     AND (SELECT COUNT(*) FILTER (WHERE new) FROM updated) = 0 \
     AND (SELECT COUNT(*) FROM inserted) = $61 AND (SELECT COUNT(*) FROM g) = $62 \
     AND (SELECT COUNT(*) FROM m) = $63 THEN 0 ELSE inflight_write_missed() END"
);

/// Charges `$5` tokens to the lane `$2::$3` in the second `$1`, in this
/// writer's row (`$4`, its shard).
pub(super) const SPEND: &str = "INSERT INTO token_seconds AS t (second, service, provider, shard, tokens) \
     VALUES ($1, $2, $3, $4, $5) \
     ON CONFLICT (second, service, provider, shard) DO UPDATE SET tokens = t.tokens + excluded.tokens";

pub(super) const DELETE_RECORDS: &str = "DELETE FROM activities WHERE activity_id = ANY($1)";
/// The idempotency keys of records pruned (`idempotency_keys_activity`).
pub(super) const DELETE_KEYS: &str = "DELETE FROM idempotency_keys WHERE activity_id = ANY($1)";

/// The admission lock of the lane `$1::$2`: every decision on a lane holds
/// it until its transaction ends. No `SKIP LOCKED` (it would break first
/// come, first served), no count-then-claim.
pub(super) const LOCK_LANE: &str = "SELECT 1 FROM lanes WHERE service = $1 AND provider = $2 FOR UPDATE";
/// The lane's row, the first time it is asked for.
pub(super) const ADD_LANE: &str =
    "INSERT INTO lanes (service, provider) VALUES ($1, $2) ON CONFLICT (service, provider) DO NOTHING";

/// Whether an aggregate has totals stored: its primary key.
pub(super) const AGGREGATE_KNOWN: &str = "SELECT EXISTS (SELECT 1 FROM aggregates WHERE service = $1 \
     AND operation_stage = $2 AND class = $3 AND provider = $4 AND model = $5 AND priority = $6 \
     AND admission = $7)";

/// A hint to every instance's listener that a slot was granted or freed;
/// sent inside the committing transaction, so it is delivered only if it
/// commits. `$1` is the channel, `$2` the lanes (`txn::notice`).
pub(super) const NOTIFY: &str = "SELECT pg_notify($1, $2)";

/// The bulk loader's insert (`seed_history`): `$1` ids, `$2` enqueued,
/// `$3` started and `$4` completed instants, all arrays.
pub(super) const SEED_RECORDS: &str = concat!(
    "INSERT INTO activities (",
    record_columns!(),
    ") SELECT id, 'bench-history', 'ollama', 'embedding', \
     'history', 'nomic-embed-text', 'batch', 'queued', 'succeeded', NULL, NULL, NULL, e, s, c, NULL, \
     NULL, 300000, NULL, true, NULL, false, NULL, false, NULL, NULL, NULL, NULL \
     FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[]) AS t(id, e, s, c)"
);

/// Refreshes the planner's statistics after the bulk loader.
pub(super) const ANALYZE: &str = "ANALYZE activities, aggregates, completion_minutes";

#[cfg(test)]
pub(super) use crate::store::sql::Reach;

/// Every statement above, by name, with how it may read the tables.
#[cfg(test)]
pub(super) const STATEMENTS: &[(&str, &str, Reach)] = &[
    ("SCHEMA_TABLE", SCHEMA_TABLE, Reach::Control),
    ("SCHEMA_VERSION", SCHEMA_VERSION, Reach::Control),
    ("RECORD_VERSION", RECORD_VERSION, Reach::Control),
    ("MIGRATION_LOCK", MIGRATION_LOCK, Reach::Control),
    ("MIGRATION_UNLOCK", MIGRATION_UNLOCK, Reach::Control),
    ("MIGRATION_SESSION", MIGRATION_SESSION, Reach::Control),
    ("BEGIN_NOW", BEGIN_NOW, Reach::Control),
    ("BEGIN_AT", BEGIN_AT, Reach::Control),
    ("BEGIN", BEGIN, Reach::Control),
    ("SESSION", SESSION, Reach::Control),
    ("DELETE_RECORDS", DELETE_RECORDS, Reach::Indexed),
    ("DELETE_KEYS", DELETE_KEYS, Reach::Indexed),
    ("LOCK_RECORDS", LOCK_RECORDS, Reach::Indexed),
    ("WRITE_GROUP", WRITE_GROUP, Reach::Indexed),
    ("LOCK_LANE", LOCK_LANE, Reach::Indexed),
    ("ADD_LANE", ADD_LANE, Reach::Indexed),
    ("AGGREGATE_KNOWN", AGGREGATE_KNOWN, Reach::Indexed),
    ("SPEND", SPEND, Reach::Indexed),
    ("NOTIFY", NOTIFY, Reach::Control),
    ("SEED_RECORDS", SEED_RECORDS, Reach::WalksHistory),
    ("ANALYZE", ANALYZE, Reach::Control),
];

/// `LISTEN` for `channel`, quoted as an identifier (LISTEN takes no
/// parameter).
pub(super) fn listen(channel: &str) -> String {
    format!("LISTEN {}", quote_ident(channel))
}

/// Makes `schema` the connection's schema.
pub(super) fn use_schema(schema: &str) -> String {
    format!("SET search_path TO {}", quote_ident(schema))
}

/// Creates `schema` if it is missing.
pub(super) fn create_schema(schema: &str) -> String {
    format!("CREATE SCHEMA IF NOT EXISTS {}", quote_ident(schema))
}

/// `name` as a quoted SQL identifier.
pub(super) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::super::testing::TestDatabase;
    use super::super::{off_runtime, seed_history};
    use super::*;

    /// The plan of `sql` as PostgreSQL would run it for any parameters (a
    /// generic plan), one line per node.
    fn plan(client: &mut postgres::Client, sql: &str) -> Vec<String> {
        let params = client.prepare(sql).unwrap().params().len();
        client
            .batch_execute(&format!("PREPARE checked AS {sql}"))
            .unwrap();
        let args = if params == 0 {
            String::new()
        } else {
            format!("({})", vec!["NULL"; params].join(", "))
        };
        let lines = client
            .simple_query(&format!("EXPLAIN EXECUTE checked{args}"))
            .unwrap()
            .into_iter()
            .filter_map(|message| match message {
                postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                _ => None,
            })
            .collect();
        client.batch_execute("DEALLOCATE checked").unwrap();
        lines
    }

    /// The nodes of a plan that read `activities` or `owners` whole.
    fn history_scans(plan: &[String]) -> Vec<String> {
        plan.iter()
            .filter(|line| line.contains("Seq Scan on activities") || line.contains("Seq Scan on owners"))
            .cloned()
            .collect()
    }

    #[test]
    fn no_statement_on_a_hot_path_scans_history() {
        // A history of settled records, analyzed, as a ledger in
        // production has: the plans are those PostgreSQL picks for it.
        let database = TestDatabase::new();
        seed_history(
            &database.store_url("listen=false"),
            20_000,
            crate::domain::Timestamp::from_millis(1_786_000_000_000),
        )
        .unwrap();
        let failures = off_runtime(|| {
            let mut client = database.client();
            // And owners that ended long ago, with one live.
            client
                .batch_execute(
                    "INSERT INTO owners (owner_id, name, ttl_ms, registered_at, renewed_at, expires_at, \
                     state, ended_at) SELECT 'o' || n, 'worker', 2000, n, n, n + 2000, \
                     CASE WHEN n = 1 THEN 'live' ELSE 'released' END, CASE WHEN n = 1 THEN NULL ELSE n + 1 END \
                     FROM generate_series(1, 20000) AS n; ANALYZE owners",
                )
                .unwrap();
            client
                .batch_execute("SET plan_cache_mode = force_generic_plan")
                .unwrap();
            let mut failures = Vec::new();
            let locking = LOCKING.iter().map(|(name, sql)| (*name, *sql, Reach::Indexed));
            for (name, sql, reach) in STATEMENTS
                .iter()
                .copied()
                .chain(BOTH.iter().copied())
                .chain(locking)
            {
                if reach != Reach::Indexed {
                    continue;
                }
                let plan = plan(&mut client, sql);
                let scans = history_scans(&plan);
                if !scans.is_empty() {
                    failures.push(format!("{name}: {}", plan.join("\n")));
                }
            }
            failures
        });
        assert!(
            failures.is_empty(),
            "statements that scan history:\n{}",
            failures.join("\n\n")
        );
    }

    #[test]
    fn a_group_reads_and_writes_records_by_key_even_on_a_table_never_analyzed() {
        // The writers prepare these on their first group, often on an empty
        // table, and keep the plan while the table grows: it must look each
        // record up by its key, not scan what was small when planned.
        let database = TestDatabase::new();
        drop(
            super::super::PostgresStore::open(
                &database.store_url("listen=false"),
                std::sync::Arc::new(crate::config::LedgerConfig::default()),
                std::sync::Arc::new(crate::clock::SystemClock),
            )
            .unwrap(),
        );
        let plans = off_runtime(|| {
            let mut client = database.client();
            client
                .batch_execute("SET plan_cache_mode = force_generic_plan")
                .unwrap();
            [LOCK_RECORDS, WRITE_GROUP].map(|sql| plan(&mut client, sql))
        });
        for plan in plans {
            assert!(history_scans(&plan).is_empty(), "{}", plan.join("\n"));
            assert!(
                !plan.iter().any(|line| line.contains("Join")),
                "{}",
                plan.join("\n")
            );
        }
    }

    #[test]
    fn the_check_catches_a_query_no_index_serves() {
        let database = TestDatabase::new();
        seed_history(
            &database.store_url("listen=false"),
            20_000,
            crate::domain::Timestamp::from_millis(1_786_000_000_000),
        )
        .unwrap();
        let plan = off_runtime(|| {
            let mut client = database.client();
            client
                .batch_execute("SET plan_cache_mode = force_generic_plan")
                .unwrap();
            // By model: no index covers it, so history is scanned.
            plan(&mut client, "SELECT COUNT(*) FROM activities WHERE model = $1")
        });
        assert!(!history_scans(&plan).is_empty(), "{plan:?}");
    }

    #[test]
    fn every_statement_the_store_runs_is_listed() {
        // The store's own code holds no SQL: every statement is here, and
        // so in the plan check below.
        crate::store::assert_sql_only_in_sql_rs(
            "postgres",
            &[
                ("mod.rs", include_str!("mod.rs")),
                ("schema.rs", include_str!("schema.rs")),
                ("writer.rs", include_str!("writer.rs")),
                ("txn.rs", include_str!("txn.rs")),
                ("listen.rs", include_str!("listen.rs")),
            ],
            &["SELECT", "INSERT", "UPDATE", "DELETE", "SAVEPOINT", "LISTEN"],
            include_str!("sql.rs"),
            STATEMENTS.len(),
        );
    }
}
