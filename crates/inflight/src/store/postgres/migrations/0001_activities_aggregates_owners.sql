CREATE TABLE activities (
    activity_id          TEXT COLLATE "C" PRIMARY KEY,
    service              TEXT COLLATE "C" NOT NULL,
    provider             TEXT COLLATE "C" NOT NULL,
    class                TEXT COLLATE "C" NOT NULL,
    operation_stage      TEXT COLLATE "C" NOT NULL,
    model                TEXT COLLATE "C" NOT NULL,
    priority             TEXT COLLATE "C" NOT NULL,
    admission            TEXT COLLATE "C" NOT NULL,
    state                TEXT COLLATE "C" NOT NULL,
    disposition          TEXT COLLATE "C",
    reap_reason          TEXT COLLATE "C",
    owner_id             TEXT COLLATE "C",
    enqueued_at          BIGINT NOT NULL,
    started_at           BIGINT,
    completed_at         BIGINT,
    reaped_at            BIGINT,
    declared_deadline_ms BIGINT,
    deadline_ms          BIGINT NOT NULL,
    reapable_at          BIGINT,
    success              BOOLEAN,
    failure_stage        TEXT COLLATE "C",
    late_settle          BOOLEAN NOT NULL DEFAULT false,
    cancel_reason        TEXT
);
-- The expiry index: a reap pass reads only what is due.
CREATE INDEX activities_due ON activities (reapable_at, activity_id) WHERE reapable_at IS NOT NULL;
CREATE INDEX activities_in_flight ON activities (enqueued_at, activity_id)
    WHERE state IN ('waiting', 'executing');
CREATE INDEX activities_completed ON activities (completed_at, activity_id) WHERE completed_at IS NOT NULL;
CREATE INDEX activities_reaped ON activities (reaped_at, activity_id) WHERE reaped_at IS NOT NULL;
CREATE INDEX activities_owner ON activities (owner_id, enqueued_at, activity_id)
    WHERE owner_id IS NOT NULL AND state IN ('waiting', 'executing');
CREATE INDEX activities_lane ON activities (service, provider, admission, state, enqueued_at, activity_id)
    WHERE state IN ('waiting', 'executing');

-- One row per lane: the admission lock (`LOCK_LANE`).
CREATE TABLE lanes (
    service  TEXT COLLATE "C" NOT NULL,
    provider TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (service, provider)
);

-- Counters maintained as records change; pruning records never lowers them.
CREATE TABLE aggregates (
    service            TEXT COLLATE "C" NOT NULL,
    operation_stage    TEXT COLLATE "C" NOT NULL,
    class              TEXT COLLATE "C" NOT NULL,
    provider           TEXT COLLATE "C" NOT NULL,
    model              TEXT COLLATE "C" NOT NULL,
    priority           TEXT COLLATE "C" NOT NULL,
    admission          TEXT COLLATE "C" NOT NULL,
    calls              BIGINT NOT NULL DEFAULT 0,
    succeeded          BIGINT NOT NULL DEFAULT 0,
    failed             BIGINT NOT NULL DEFAULT 0,
    cancelled          BIGINT NOT NULL DEFAULT 0,
    reaped_abandoned   BIGINT NOT NULL DEFAULT 0,
    reaped_unsettled   BIGINT NOT NULL DEFAULT 0,
    reaped_owner_lost  BIGINT NOT NULL DEFAULT 0,
    late_settles       BIGINT NOT NULL DEFAULT 0,
    resurrections      BIGINT NOT NULL DEFAULT 0,
    in_flight          BIGINT NOT NULL DEFAULT 0,
    queue_wait_count   BIGINT NOT NULL DEFAULT 0,
    queue_wait_sum_ms  BIGINT NOT NULL DEFAULT 0,
    queue_wait_max_ms  BIGINT NOT NULL DEFAULT 0,
    execution_count    BIGINT NOT NULL DEFAULT 0,
    execution_sum_ms   BIGINT NOT NULL DEFAULT 0,
    execution_max_ms   BIGINT NOT NULL DEFAULT 0,
    last_seen_at       BIGINT,
    PRIMARY KEY (service, operation_stage, class, provider, model, priority, admission)
);

-- Owner leases.
CREATE TABLE owners (
    owner_id          TEXT COLLATE "C" PRIMARY KEY,
    name              TEXT COLLATE "C" NOT NULL,
    ttl_ms            BIGINT NOT NULL,
    registered_at     BIGINT NOT NULL,
    renewed_at        BIGINT NOT NULL,
    expires_at        BIGINT NOT NULL,
    state             TEXT COLLATE "C" NOT NULL,
    ended_at          BIGINT,
    reaped_records    BIGINT NOT NULL DEFAULT 0,
    cancelled_records BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX owners_live ON owners (expires_at) WHERE state = 'live';
CREATE INDEX owners_ended ON owners (ended_at) WHERE ended_at IS NOT NULL;

-- Completions per minute: a snapshot counts its window from these, never
-- by scanning history.
CREATE TABLE completion_minutes (
    minute      BIGINT PRIMARY KEY,
    completions BIGINT NOT NULL
);

-- The one clock: every "now" of this store is read from this function,
-- inside the transaction that uses it. A test overrides it for one
-- transaction with `SET LOCAL inflight.now_ms = '...'`.
CREATE FUNCTION inflight_now() RETURNS BIGINT LANGUAGE sql VOLATILE AS $$
    SELECT COALESCE(NULLIF(current_setting('inflight.now_ms', true), '')::BIGINT,
                    floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT)
$$;
