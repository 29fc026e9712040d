-- A lane's line index also carries each record's priority and estimate,
-- which never change after its begin: a ranked lane's counts
-- (`LANE_POSITION_RANKED`) and a budgeted lane's estimates waiting ahead
-- (`TOKENS_AHEAD`) are then read from the index alone, not from each
-- record's row.
DROP INDEX activities_lane;
CREATE INDEX activities_lane ON activities (service, provider, admission, state, enqueued_at, activity_id)
    INCLUDE (priority, max_tokens)
    WHERE state IN ('waiting', 'executing');
