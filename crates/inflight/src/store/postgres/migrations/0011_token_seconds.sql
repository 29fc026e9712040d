-- The tokens each lane's calls charged to its window, per second of their
-- charge (`domain::usage::charge`): what a snapshot's `tokensLastMinute`
-- sums. A row per writer (`shard`), as the counters have, so that two
-- writers never wait on one row; written at once by the command that
-- charges them; seconds that left the window are pruned.
CREATE TABLE token_seconds (
    second   BIGINT NOT NULL,
    service  TEXT NOT NULL,
    provider TEXT NOT NULL,
    shard    SMALLINT NOT NULL,
    tokens   BIGINT NOT NULL,
    PRIMARY KEY (second, service, provider, shard)
);
