-- What a lane remembers between admission decisions: how many interactive
-- records it admitted in a row while batch work waited. One row a lane,
-- written at once (not deferred with the records) by the grant that
-- changes it, under the lane's admission lock; only lanes with
-- `max_overtakes` keep one.
CREATE TABLE lane_states (
    service   TEXT NOT NULL,
    provider  TEXT NOT NULL,
    overtakes BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (service, provider)
);
