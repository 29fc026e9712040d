-- Aggregates by an integer id, their labels in a unique index: the writer
-- knows each aggregate's id and adds to its totals by it, instead of
-- binding and comparing seven texts at every command.
CREATE TABLE aggregates_by_id (
    id                 INTEGER PRIMARY KEY,
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
    reaped_owner_lost_abandoned INTEGER NOT NULL DEFAULT 0
);
INSERT INTO aggregates_by_id (service, operation_stage, class, provider, model, priority, admission,
    calls, succeeded, failed, cancelled, reaped_abandoned, reaped_unsettled, reaped_owner_lost,
    late_settles, resurrections, in_flight, queue_wait_count, queue_wait_sum_ms, queue_wait_max_ms,
    execution_count, execution_sum_ms, execution_max_ms, last_seen_at, reaped_owner_lost_abandoned)
SELECT service, operation_stage, class, provider, model, priority, admission,
    calls, succeeded, failed, cancelled, reaped_abandoned, reaped_unsettled, reaped_owner_lost,
    late_settles, resurrections, in_flight, queue_wait_count, queue_wait_sum_ms, queue_wait_max_ms,
    execution_count, execution_sum_ms, execution_max_ms, last_seen_at, reaped_owner_lost_abandoned
FROM aggregates;
DROP TABLE aggregates;
ALTER TABLE aggregates_by_id RENAME TO aggregates;
CREATE UNIQUE INDEX aggregates_labels
    ON aggregates (service, operation_stage, class, provider, model, priority, admission);
