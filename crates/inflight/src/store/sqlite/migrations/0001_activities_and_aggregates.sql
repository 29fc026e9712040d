CREATE TABLE activities (
    activity_id          TEXT PRIMARY KEY NOT NULL,
    service              TEXT NOT NULL,
    provider             TEXT NOT NULL,
    class                TEXT NOT NULL,
    operation_stage      TEXT NOT NULL,
    model                TEXT NOT NULL,
    priority             TEXT NOT NULL,
    admission            TEXT NOT NULL,
    state                TEXT NOT NULL,
    disposition          TEXT,
    reap_reason          TEXT,
    owner_id             TEXT,
    enqueued_at          INTEGER NOT NULL,
    started_at           INTEGER,
    completed_at         INTEGER,
    reaped_at            INTEGER,
    declared_deadline_ms INTEGER,
    deadline_ms          INTEGER NOT NULL,
    reapable_at          INTEGER,
    success              INTEGER,
    failure_stage        TEXT,
    late_settle          INTEGER NOT NULL DEFAULT 0,
    cancel_reason        TEXT
) WITHOUT ROWID;
-- The expiry index: a reap pass reads only what is due.
CREATE INDEX activities_due ON activities (reapable_at) WHERE reapable_at IS NOT NULL;
CREATE INDEX activities_in_flight ON activities (enqueued_at) WHERE state IN ('waiting', 'executing');
CREATE INDEX activities_completed ON activities (completed_at) WHERE completed_at IS NOT NULL;
CREATE INDEX activities_reaped ON activities (reaped_at) WHERE reaped_at IS NOT NULL;

-- Counters maintained as records change; pruning records never lowers them.
CREATE TABLE aggregates (
    service            TEXT NOT NULL,
    operation_stage    TEXT NOT NULL,
    class              TEXT NOT NULL,
    provider           TEXT NOT NULL,
    model              TEXT NOT NULL,
    priority           TEXT NOT NULL,
    admission          TEXT NOT NULL,
    calls              INTEGER NOT NULL DEFAULT 0,
    succeeded          INTEGER NOT NULL DEFAULT 0,
    failed             INTEGER NOT NULL DEFAULT 0,
    cancelled          INTEGER NOT NULL DEFAULT 0,
    reaped_abandoned   INTEGER NOT NULL DEFAULT 0,
    reaped_unsettled   INTEGER NOT NULL DEFAULT 0,
    reaped_owner_lost  INTEGER NOT NULL DEFAULT 0,
    late_settles       INTEGER NOT NULL DEFAULT 0,
    resurrections      INTEGER NOT NULL DEFAULT 0,
    in_flight          INTEGER NOT NULL DEFAULT 0,
    queue_wait_count   INTEGER NOT NULL DEFAULT 0,
    queue_wait_sum_ms  INTEGER NOT NULL DEFAULT 0,
    queue_wait_max_ms  INTEGER NOT NULL DEFAULT 0,
    execution_count    INTEGER NOT NULL DEFAULT 0,
    execution_sum_ms   INTEGER NOT NULL DEFAULT 0,
    execution_max_ms   INTEGER NOT NULL DEFAULT 0,
    last_seen_at       INTEGER,
    PRIMARY KEY (service, operation_stage, class, provider, model, priority, admission)
) WITHOUT ROWID;
