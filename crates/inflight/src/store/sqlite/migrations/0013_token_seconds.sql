-- The tokens each lane's calls charged to its window, per second of their
-- charge (`domain::usage::charge`): what a snapshot's `tokensLastMinute`
-- sums. Written at once by the command that charges them, never ahead;
-- seconds that left the window are pruned.
CREATE TABLE token_seconds (
    second   INTEGER NOT NULL,
    service  TEXT NOT NULL,
    provider TEXT NOT NULL,
    tokens   INTEGER NOT NULL,
    PRIMARY KEY (second, service, provider)
);
