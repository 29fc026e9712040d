-- What a lane remembers between admission decisions: how many interactive
-- records it admitted in a row while batch work waited. One row a lane,
-- written at once by the grant that changes it, never ahead; only lanes
-- with `max_overtakes` keep one.
CREATE TABLE lane_states (
    service   TEXT NOT NULL,
    provider  TEXT NOT NULL,
    overtakes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (service, provider)
);
