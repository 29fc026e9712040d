//! The statements both SQL stores run, written once.
//!
//! Placeholders are `$1`, `$2`, ... in both dialects. PostgreSQL reads
//! them by number; SQLite reads `$NAME` as a named parameter and numbers
//! each name by its first appearance, so every statement here names its
//! parameters in ascending order of first appearance, and a test checks
//! that SQLite numbers them as PostgreSQL does.
//!
//! Each query answers one question of [`crate::domain::query`]; its doc
//! names the reference it must agree with. A statement marked `/ NAME`
//! also exists as `NAME`, which locks the rows it reads (`FOR UPDATE`):
//! PostgreSQL runs that one, because under READ COMMITTED a second
//! transaction that wants the same rows then waits for the first and reads
//! them again, so that a record another instance reaped or settled no
//! longer matches. SQLite has one writer and no such clause.

use super::columns::{aggregate_labels, in_flight, lane_state_columns, owner_columns, record_columns};

/// Defines each statement, its locking twin when it has one, and the
/// lists the plan checks walk, so that none slips past them.
macro_rules! statements {
    ($(
        $(#[doc = $doc:expr])*
        $name:ident $(/ $locked:ident)? : $reach:ident = $($part:expr),+ ;
    )*) => {
        $(
            statement!([$(#[doc = $doc])*] $name [$($locked)?] $($part),+);
        )*

        /// Every statement both dialects run, with how it may read the
        /// tables.
        #[cfg(test)]
        pub(crate) const BOTH: &[(&str, &str, super::Reach)] = &[
            $((stringify!($name), $name, super::Reach::$reach)),*
        ];

        /// The locking twins, which only PostgreSQL runs; each reads what
        /// its statement reads.
        #[cfg(test)]
        #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
        pub(crate) const LOCKING: &[(&str, &str)] = &[
            $($((stringify!($locked), $locked),)?)*
        ];
    };
}

/// One statement of [`statements!`], and its locking twin when named.
macro_rules! statement {
    ([$(#[$meta:meta])*] $name:ident [] $($part:expr),+) => {
        $(#[$meta])*
        // A build with one SQL store leaves what only the other runs unused.
        #[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
        pub(crate) const $name: &str = concat!($($part),+);
    };
    ([$(#[$meta:meta])*] $name:ident [$locked:ident] $($part:expr),+) => {
        statement!([$(#[$meta])*] $name [] $($part),+);
        #[doc = concat!("[`", stringify!($name), "`], locking the rows it reads.")]
        #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
        pub(crate) const $locked: &str = concat!($($part),+, " FOR UPDATE");
    };
}

/// A record waiting in a lane's line (an `external` record holds no place
/// in it).
macro_rules! in_line {
    () => {
        "state = 'waiting' AND admission = 'queued'"
    };
}

/// Ahead of the record asking ($1 its `enqueuedAt`, $2 whether it is a
/// newcomer, $3 its id), as `LaneQuery::counts` says.
macro_rules! ahead {
    () => {
        "(enqueued_at < $1 OR (enqueued_at = $1 AND ($2 OR activity_id < $3)))"
    };
}

statements! {
    COMMIT: Control = "COMMIT";
    ROLLBACK: Control = "ROLLBACK";
    SAVEPOINT: Control = "SAVEPOINT command";
    RELEASE: Control = "RELEASE SAVEPOINT command";
    ROLLBACK_TO: Control = "ROLLBACK TO SAVEPOINT command";

    /// The record `$1`.
    GET_RECORD / GET_RECORD_LOCKED: Indexed =
        "SELECT ", record_columns!(), " FROM activities WHERE activity_id = $1";

    /// A new record; no row when the id is taken, which the store reports
    /// as a conflict (an error would abort a transaction a group shares).
    INSERT_RECORD: Indexed =
        "INSERT INTO activities (", record_columns!(), ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, \
         $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28) \
         ON CONFLICT (activity_id) DO NOTHING";

    /// Writes what a transition, a reap or a rebound can change
    /// ([`super::codec::record_changes`]). A record's labels, priority,
    /// admission, owner, `enqueuedAt` and declared deadline are set by its
    /// begin and never change: left out, they cost neither a bound value
    /// nor a comparison for every index that holds them.
    UPDATE_RECORD: Indexed =
        "UPDATE activities SET state = $1, disposition = $2, reap_reason = $3, started_at = $4, \
         completed_at = $5, reaped_at = $6, deadline_ms = $7, reapable_at = $8, success = $9, \
         failure_stage = $10, late_settle = $11, cancel_reason = $12, operation_stage = $13, model = $14, \
         refined = $15, input_tokens = $16, output_tokens = $17 WHERE activity_id = $18";

    /// Every aggregate's totals: the sum of its rows (PostgreSQL keeps one
    /// per writer that counted into it, SQLite one).
    AGGREGATES: Indexed =
        "SELECT ", aggregate_labels!(), ", \
         CAST(SUM(succeeded) AS BIGINT), CAST(SUM(failed) AS BIGINT), CAST(SUM(cancelled) AS BIGINT), \
         CAST(SUM(reaped_abandoned) AS BIGINT), \
         CAST(SUM(reaped_unsettled) AS BIGINT), CAST(SUM(reaped_owner_lost) AS BIGINT), \
         CAST(SUM(late_settles) AS BIGINT), CAST(SUM(resurrections) AS BIGINT), \
         CAST(SUM(in_flight) AS BIGINT), CAST(SUM(queue_wait_count) AS BIGINT), \
         CAST(SUM(queue_wait_sum_ms) AS BIGINT), MAX(queue_wait_max_ms), \
         CAST(SUM(execution_count) AS BIGINT), CAST(SUM(execution_sum_ms) AS BIGINT), \
         MAX(execution_max_ms), MAX(last_seen_at), CAST(SUM(reaped_owner_lost_abandoned) AS BIGINT), \
         CAST(SUM(succeeded_unstarted) AS BIGINT), CAST(SUM(input_tokens_sum) AS BIGINT), \
         CAST(SUM(output_tokens_sum) AS BIGINT) \
         FROM aggregates GROUP BY ", aggregate_labels!();

    /// Whether a lane has an aggregate.
    LANE_KNOWN: Indexed =
        "SELECT EXISTS (SELECT 1 FROM aggregates WHERE service = $1 AND provider = $2)";

    /// Distinct lanes and aggregates. Reads every aggregate, which the
    /// label bounds themselves keep few (`domain::cardinality`); asked only
    /// for a begin whose aggregate is new.
    LABEL_CENSUS: Indexed =
        "SELECT (SELECT COUNT(*) FROM (SELECT DISTINCT service, provider FROM aggregates) AS lanes), \
         (SELECT COUNT(*) FROM (SELECT DISTINCT ", aggregate_labels!(), " FROM aggregates) AS aggregates)";

    COMPLETION_MINUTES_FROM: Indexed =
        "SELECT CAST(COALESCE(SUM(completions), 0) AS BIGINT) FROM completion_minutes WHERE minute >= $1";

    DELETE_MINUTES_BEFORE: Indexed = "DELETE FROM completion_minutes WHERE minute < $1";

    /// The tokens charged per lane from the second `$2` on
    /// (`domain::window::first_second_at`), and those reserved (the second
    /// `$1`, `window::RESERVED`): the window's rows only.
    TOKENS_SINCE: Indexed =
        "SELECT service, provider, CAST(COALESCE(SUM(tokens) FILTER (WHERE second < $1), 0) AS BIGINT), \
         CAST(COALESCE(SUM(tokens) FILTER (WHERE second = $1), 0) AS BIGINT) \
         FROM token_seconds WHERE second >= $2 GROUP BY service, provider \
         HAVING SUM(tokens) FILTER (WHERE second < $1) <> 0 OR SUM(tokens) FILTER (WHERE second = $1) <> 0 \
         ORDER BY service, provider";

    DELETE_TOKEN_SECONDS_BEFORE: Indexed = "DELETE FROM token_seconds WHERE second < $1";

    /// Walks every record: `Command::Stats`, never on a hot path.
    STORED_RECORDS: WalksHistory = "SELECT COUNT(*) FROM activities";

    /// The owner `$1`.
    GET_OWNER / GET_OWNER_LOCKED: Indexed =
        "SELECT ", owner_columns!(), " FROM owners WHERE owner_id = $1";

    PUT_OWNER: Indexed =
        "INSERT INTO owners (", owner_columns!(), ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
         ON CONFLICT (owner_id) DO UPDATE SET name = excluded.name, ttl_ms = excluded.ttl_ms, \
         registered_at = excluded.registered_at, renewed_at = excluded.renewed_at, \
         expires_at = excluded.expires_at, state = excluded.state, ended_at = excluded.ended_at, \
         reaped_records = excluded.reaped_records, cancelled_records = excluded.cancelled_records";

    /// `query::is_due`, in `query::due_order`. `reapableAt` is set only
    /// while a record is in flight.
    DUE / DUE_LOCKED: Indexed =
        "SELECT ", record_columns!(), " FROM activities WHERE reapable_at IS NOT NULL \
         AND reapable_at < $1 ORDER BY reapable_at, activity_id LIMIT $2";

    /// `LaneQuery::counts`: $1 service, $2 provider, $3 the asking record's
    /// id, $4 its `enqueuedAt`, $5 whether it is a newcomer. PostgreSQL
    /// reads it after its lane lock, in a statement of its own, so it sees
    /// every decision on the lane that committed before the lock was
    /// granted.
    LANE_POSITION: Indexed =
        "SELECT \
           (SELECT COUNT(*) FROM activities WHERE service = $1 AND provider = $2 \
              AND admission IN ('queued', 'external') AND ", in_flight!(), " AND state = 'executing' \
              AND activity_id <> $3), \
           (SELECT COUNT(*) FROM activities WHERE service = $1 AND provider = $2 \
              AND admission = 'queued' AND ", in_flight!(), " AND state = 'waiting' \
              AND activity_id <> $3 \
              AND (enqueued_at < $4 OR (enqueued_at = $4 AND ($5 OR activity_id < $3))))";

    /// `LaneQuery::answer` told apart by rank (`Rank::of`: all but
    /// `interactive` is batch): $1 the asking record's `enqueuedAt`, $2
    /// whether it is a newcomer, $3 its id, $4 service, $5 provider. It
    /// reads every record of the lane in flight through `activities_lane`,
    /// which carries each one's priority (migrations 13 and 11).
    LANE_POSITION_RANKED: Indexed =
        "SELECT COUNT(*) FILTER (WHERE state = 'executing'), \
         COUNT(*) FILTER (WHERE ", in_line!(), " AND ", ahead!(), "), \
         COUNT(*) FILTER (WHERE state = 'executing' AND priority <> 'interactive'), \
         COUNT(*) FILTER (WHERE ", in_line!(), " AND priority = 'interactive' AND ", ahead!(), "), \
         COUNT(*) FILTER (WHERE ", in_line!(), " AND priority <> 'interactive' AND ", ahead!(), "), \
         COUNT(*) FILTER (WHERE ", in_line!(), " AND priority = 'interactive'), \
         COUNT(*) FILTER (WHERE ", in_line!(), " AND priority <> 'interactive') \
         FROM activities WHERE service = $4 AND provider = $5 AND admission IN ('queued', 'external') \
         AND ", in_flight!(), " AND activity_id <> $3";

    /// `LaneQuery::answer`'s `tokens_ahead`: the estimates of the records
    /// waiting ahead of the one asking ($1 its `enqueuedAt`, $2 whether it
    /// is a newcomer, $3 its id) in the lane $4::$5; of batch records too
    /// when $6. Run only on a budgeted lane; read from `activities_lane`,
    /// which carries each record's estimate.
    TOKENS_AHEAD: Indexed =
        "SELECT CAST(COALESCE(SUM(max_tokens), 0) AS BIGINT) FROM activities WHERE ", ahead!(), " \
         AND service = $4 AND provider = $5 AND ", in_line!(), " AND ", in_flight!(), " AND activity_id <> $3 \
         AND ($6 OR priority = 'interactive')";

    /// The token windows a budgeted decision reads (`budget::windows`):
    /// each second's charge to the lane `$1::$3` and to its whole provider
    /// $3, from the window's first second $2 on, seconds ascending (the
    /// reserved second, `window::RESERVED`, last).
    WINDOW_USE: Indexed =
        "SELECT second, CAST(COALESCE(SUM(tokens) FILTER (WHERE service = $1), 0) AS BIGINT), \
         CAST(SUM(tokens) AS BIGINT) FROM token_seconds WHERE second >= $2 AND provider = $3 \
         GROUP BY second ORDER BY second";

    /// What the lane `$1::$2` remembers between admission decisions.
    LANE_STATE: Indexed =
        "SELECT ", lane_state_columns!(), " FROM lane_states WHERE service = $1 AND provider = $2";

    PUT_LANE_STATE: Indexed =
        "INSERT INTO lane_states (service, provider, ", lane_state_columns!(), ") \
         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (service, provider) DO UPDATE SET \
         overtakes = excluded.overtakes, cooling_until = excluded.cooling_until, \
         cooldowns = excluded.cooldowns, effective_cap = excluded.effective_cap, \
         successes = excluded.successes";

    /// Every lane's state, for a snapshot: one row a lane that ever needed
    /// one.
    LANE_STATES: Indexed =
        "SELECT service, provider, ", lane_state_columns!(), " FROM lane_states ORDER BY service, provider";

    /// Records in flight in `query::line_order`: the line is sorted from
    /// `activities_lane`, which covers the order's columns, and only the
    /// first `$1` rows are then read whole.
    IN_FLIGHT / IN_FLIGHT_LOCKED: Indexed =
        "SELECT ", record_columns!(), " FROM activities WHERE activity_id IN \
         (SELECT activity_id FROM activities WHERE ", in_flight!(), " \
         ORDER BY enqueued_at, activity_id LIMIT $1) ORDER BY enqueued_at, activity_id";

    IN_FLIGHT_COUNT: Indexed = "SELECT COUNT(*) FROM activities WHERE ", in_flight!();

    /// `query::lane_loads`.
    LANE_LOADS: Indexed =
        "SELECT service, provider, COUNT(*) FILTER (WHERE state = 'executing'), \
         COUNT(*) FILTER (WHERE state = 'waiting' AND admission = 'queued'), \
         MIN(enqueued_at) FILTER (WHERE state = 'waiting' AND admission = 'queued'), \
         MIN(reapable_at) FILTER (WHERE state = 'waiting' AND admission = 'queued'), \
         COUNT(*) FILTER (WHERE state = 'executing' AND priority = 'interactive'), \
         COUNT(*) FILTER (WHERE state = 'waiting' AND admission = 'queued' AND priority = 'interactive'), \
         COUNT(*) FILTER (WHERE state = 'executing' AND priority = 'batch'), \
         COUNT(*) FILTER (WHERE state = 'waiting' AND admission = 'queued' AND priority = 'batch'), \
         COUNT(*) FILTER (WHERE state = 'executing' AND priority = 'unknown'), \
         COUNT(*) FILTER (WHERE state = 'waiting' AND admission = 'queued' AND priority = 'unknown') \
         FROM activities WHERE ", in_flight!(), " AND admission IN ('queued', 'external') \
         GROUP BY service, provider ORDER BY service, provider";

    /// `Window::completed`, in `Window::completed_order`. `completedAt` is
    /// set only by a settle.
    COMPLETED: Indexed =
        "SELECT ", record_columns!(), " FROM activities WHERE completed_at >= $1 \
         ORDER BY completed_at DESC, activity_id DESC LIMIT $2";

    COMPLETED_BETWEEN: Indexed =
        "SELECT COUNT(*) FROM activities WHERE completed_at >= $1 AND completed_at < $2";

    /// `Window::reaped`, in `Window::reaped_order`. `reapedAt` is set only
    /// while a record is reaped.
    REAPED: Indexed =
        "SELECT ", record_columns!(), " FROM activities WHERE reaped_at >= $1 \
         ORDER BY reaped_at DESC, activity_id DESC LIMIT $2";

    /// `Window::lists_owner`, in `Window::owner_order`.
    LISTED_OWNERS: Indexed =
        "SELECT ", owner_columns!(), " FROM owners WHERE state = 'live' \
         UNION ALL SELECT ", owner_columns!(), " FROM owners WHERE ended_at >= $1 AND state <> 'live' \
         ORDER BY registered_at, owner_id";

    /// `Owner::is_expired`; each is then lost. In the order of
    /// `owners_live`, so that instances lock them in one order.
    EXPIRED_OWNERS / EXPIRED_OWNERS_LOCKED: Indexed =
        "SELECT ", owner_columns!(), " FROM owners WHERE state = 'live' AND expires_at < $1 \
         ORDER BY expires_at, owner_id";

    /// An owner's records in flight, in `query::line_order`: a release
    /// cancels them, a loss reaps them.
    OWNER_IN_FLIGHT / OWNER_IN_FLIGHT_LOCKED: Indexed =
        "SELECT ", record_columns!(), " FROM activities WHERE owner_id = $1 AND ", in_flight!(),
        " ORDER BY enqueued_at, activity_id";

    /// `Retention::prunes`, in `Retention::record_order`: the oldest `$2`
    /// of each end index, merged.
    PRUNABLE: Indexed =
        "SELECT activity_id, ended_at FROM ( \
           SELECT activity_id, completed_at AS ended_at FROM activities WHERE completed_at < $1 \
           ORDER BY completed_at, activity_id LIMIT $2) AS completed \
         UNION ALL SELECT activity_id, ended_at FROM ( \
           SELECT activity_id, reaped_at AS ended_at FROM activities WHERE reaped_at < $1 \
           ORDER BY reaped_at, activity_id LIMIT $2) AS reaped \
         ORDER BY ended_at, activity_id LIMIT $2";

    /// `Retention::prunes_owner`.
    PRUNE_OWNERS: Indexed = "DELETE FROM owners WHERE ended_at < $1";

    /// The record the idempotency key `$1` was first used for, and the
    /// fingerprint of that begin.
    FIND_KEY: Indexed = "SELECT activity_id, fingerprint FROM idempotency_keys WHERE idempotency_key = $1";

    /// Claims the key `$1` for the new record `$2`: no row when another
    /// transaction holds it (PostgreSQL waits for it to end first).
    CLAIM_KEY: Indexed =
        "INSERT INTO idempotency_keys (idempotency_key, activity_id, fingerprint) VALUES ($1, $2, $3) \
         ON CONFLICT (idempotency_key) DO NOTHING";
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    #[test]
    fn sqlite_numbers_every_parameter_as_postgres_does() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = crate::store::sqlite::test_connection(&dir.path().join("numbers.db"));
        let conn = &mut conn;
        for (name, sql, _) in BOTH {
            let statement = conn.prepare(sql).unwrap_or_else(|err| panic!("{name}: {err}"));
            for index in 1..=statement.parameter_count() {
                assert_eq!(
                    statement.parameter_name(index),
                    Some(format!("${index}").as_str()),
                    "{name}: SQLite numbers its parameters by first appearance"
                );
            }
        }
    }
}
