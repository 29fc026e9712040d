//! Statements the PostgreSQL store's own tests run beside it: faults,
//! held commits and other instances' doings. The test databases come from
//! the `inflight-pg-testing` crate.

pub(super) use inflight_pg_testing::TestDatabase;

/// Makes every write of a record of class `broken` fail, as a storage
/// failure of the command that writes it (the store's own tests).
pub(super) const BREAK_CLASS: &str =
    "CREATE FUNCTION refuse_broken() RETURNS trigger LANGUAGE plpgsql AS $$ \
     BEGIN IF NEW.class = 'broken' THEN RAISE EXCEPTION 'broken by the test'; END IF; RETURN NEW; END $$; \
     CREATE TRIGGER refuse_broken BEFORE INSERT OR UPDATE ON activities \
     FOR EACH ROW EXECUTE FUNCTION refuse_broken()";

/// Holds every commit that adds to the counters (a deferred trigger) until
/// the session that ran [`TAKE_COMMIT_LOCK`] lets go of that advisory lock:
/// a group then stays committing for as long as the test needs. Advisory
/// locks are the database's, and each run has a database of its own.
pub(super) const HELD_COMMIT: &str = "CREATE FUNCTION held_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
     BEGIN PERFORM set_config('lock_timeout', '0', true); PERFORM pg_advisory_xact_lock(1, 1187); \
     RETURN NULL; END $$; \
     CREATE CONSTRAINT TRIGGER held_commit AFTER INSERT OR UPDATE ON aggregates \
     DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION held_commit()";
pub(super) const TAKE_COMMIT_LOCK: &str = "SELECT pg_advisory_lock(1, 1187)";
pub(super) const RELEASE_COMMIT_LOCK: &str = "SELECT pg_advisory_unlock(1, 1187)";
/// How many commits wait for the test's lock.
pub(super) const HELD_COMMITS: &str = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
     AND NOT granted AND classid = 1 AND objid = 1187 AND objsubid = 2 \
     AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
/// How many of the backends `$1` wait for a lock.
pub(super) const LOCK_WAITS: &str =
    "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1) AND wait_event_type = 'Lock'";

/// Locks the record `$1` until the transaction ends, as another instance's
/// stuck transaction would.
pub(super) const HOLD_RECORD: &str = "SELECT 1 FROM activities WHERE activity_id = $1 FOR UPDATE";

/// Inserts a bare record of id `$1`, as another instance's begin would.
pub(super) const INSERT_RECORD: &str = "INSERT INTO activities (activity_id, service, provider, class, \
     operation_stage, model, priority, admission, state, enqueued_at, deadline_ms) \
     VALUES ($1, 'a', 'b', 'c', 'd', 'e', 'f', 'queued', 'waiting', 0, 1000)";

/// Another instance's begin of the record `$1` with the idempotency key
/// `$2` (fingerprint `$3`): its record and its claim of the key.
pub(super) const BEGIN_WITH_KEY_ELSEWHERE: &str = "WITH begun AS (INSERT INTO activities (activity_id, \
     service, provider, class, operation_stage, model, priority, admission, state, enqueued_at, \
     deadline_ms) VALUES ($1, 'kb', 'ollama', 'chat', 'unknown', 'unknown', 'unknown', 'queued', \
     'waiting', 0, 1000) RETURNING activity_id) \
     INSERT INTO idempotency_keys (idempotency_key, activity_id, fingerprint) SELECT $2, activity_id, $3 FROM begun";

/// The connection's backend, and the server's end of one: what a restart
/// of the server does to every connection.
pub(super) const BACKEND_PID: &str = "SELECT pg_backend_pid()";
pub(super) const TERMINATE_BACKEND: &str = "SELECT pg_terminate_backend($1)";
