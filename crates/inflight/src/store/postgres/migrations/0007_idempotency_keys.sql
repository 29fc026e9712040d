-- Idempotent begins: the key a begin came with, the record it made and the
-- fingerprint of its request. Claimed at once (not deferred with the
-- record), so that a second instance's claim waits for the first to end.
-- Deleted with the record when it is pruned, by `activity_id`.
CREATE TABLE idempotency_keys (
    idempotency_key TEXT PRIMARY KEY,
    activity_id     TEXT NOT NULL,
    fingerprint     BIGINT NOT NULL
);
CREATE INDEX idempotency_keys_activity ON idempotency_keys (activity_id);
