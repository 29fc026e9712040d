-- Idempotent begins: the key a begin came with, the record it made and the
-- fingerprint of its request. Written at once, never ahead: a repeat reads
-- only this table, then the record as `get` finds it. Deleted with the
-- record when it is pruned, by `activity_id`.
CREATE TABLE idempotency_keys (
    idempotency_key TEXT PRIMARY KEY,
    activity_id     TEXT NOT NULL,
    fingerprint     INTEGER NOT NULL
);
CREATE INDEX idempotency_keys_activity ON idempotency_keys (activity_id);
