-- What a lane remembers between admission decisions: how many interactive
-- records it admitted in a row while batch work waited, its cooldown after
-- a provider's Retry-After, and an adaptive lane's cap. One row a lane that
-- ever needed one, written at once by the grant or settle that changes it,
-- never ahead.
CREATE TABLE lane_states (
    service       TEXT NOT NULL,
    provider      TEXT NOT NULL,
    overtakes     INTEGER NOT NULL DEFAULT 0,
    -- No new slot before this instant (ms since the epoch).
    cooling_until INTEGER,
    cooldowns     INTEGER NOT NULL DEFAULT 0,
    -- An adaptive lane's cap in force, when below its configured one.
    effective_cap INTEGER,
    successes     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (service, provider)
);
