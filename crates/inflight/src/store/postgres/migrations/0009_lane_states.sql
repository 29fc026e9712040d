-- What a lane remembers between admission decisions: how many interactive
-- records it admitted in a row while batch work waited, its cooldown after
-- a provider's Retry-After, and an adaptive lane's cap. One row a lane that
-- ever needed one, written at once (not deferred with the records) by the
-- grant or settle that changes it, under the lane's admission lock.
CREATE TABLE lane_states (
    service       TEXT NOT NULL,
    provider      TEXT NOT NULL,
    overtakes     BIGINT NOT NULL DEFAULT 0,
    -- No new slot before this instant (ms since the epoch).
    cooling_until BIGINT,
    cooldowns     BIGINT NOT NULL DEFAULT 0,
    -- An adaptive lane's cap in force, when below its configured one.
    effective_cap BIGINT,
    successes     BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (service, provider)
);
