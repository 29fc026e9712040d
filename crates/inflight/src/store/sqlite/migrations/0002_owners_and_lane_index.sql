-- Owner leases, and what admission decisions read.
CREATE TABLE owners (
    owner_id          TEXT PRIMARY KEY NOT NULL,
    name              TEXT NOT NULL,
    ttl_ms            INTEGER NOT NULL,
    registered_at     INTEGER NOT NULL,
    renewed_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL,
    state             TEXT NOT NULL,
    ended_at          INTEGER,
    reaped_records    INTEGER NOT NULL DEFAULT 0,
    cancelled_records INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX owners_live ON owners (expires_at) WHERE state = 'live';
CREATE INDEX owners_ended ON owners (ended_at) WHERE ended_at IS NOT NULL;
CREATE INDEX activities_owner ON activities (owner_id)
    WHERE owner_id IS NOT NULL AND state IN ('waiting', 'executing');
CREATE INDEX activities_lane ON activities (service, provider, admission, state, enqueued_at, activity_id)
    WHERE state IN ('waiting', 'executing');
