-- Tokens (issue 31). A record keeps what its settle reported
-- (`input_tokens`, `output_tokens`) and the estimate it began with
-- (`max_tokens`: its `maxTokens`, else its class's `tokens`); an aggregate
-- sums the reported counts over the calls that ended there.
ALTER TABLE activities ADD COLUMN input_tokens BIGINT, ADD COLUMN output_tokens BIGINT,
    ADD COLUMN max_tokens BIGINT;
ALTER TABLE aggregates ADD COLUMN input_tokens_sum BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN output_tokens_sum BIGINT NOT NULL DEFAULT 0;

-- What each lane's calls charge to its token window (`domain::window::charge`),
-- per second of the charge; a running call's estimate in the second
-- `window::RESERVED`. A row per writer (`shard`), as the counters have, so
-- that two writers never wait on one row; written at once by the command
-- that charges them; seconds that left the window are pruned.
CREATE TABLE token_seconds (
    second   BIGINT NOT NULL,
    service  TEXT NOT NULL,
    provider TEXT NOT NULL,
    shard    SMALLINT NOT NULL,
    tokens   BIGINT NOT NULL,
    PRIMARY KEY (second, service, provider, shard)
);
