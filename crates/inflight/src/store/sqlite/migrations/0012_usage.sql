-- Tokens (issue 31). A record keeps what its settle reported
-- (`input_tokens`, `output_tokens`) and the estimate it began with
-- (`max_tokens`: its `maxTokens`, else its class's `tokens`); an aggregate
-- sums the reported counts over the calls that ended there.
ALTER TABLE activities ADD COLUMN input_tokens INTEGER;
ALTER TABLE activities ADD COLUMN output_tokens INTEGER;
ALTER TABLE activities ADD COLUMN max_tokens INTEGER;
ALTER TABLE aggregates ADD COLUMN input_tokens_sum INTEGER NOT NULL DEFAULT 0;
ALTER TABLE aggregates ADD COLUMN output_tokens_sum INTEGER NOT NULL DEFAULT 0;
ALTER TABLE journal ADD COLUMN input_tokens INTEGER;
ALTER TABLE journal ADD COLUMN output_tokens INTEGER;
ALTER TABLE journal ADD COLUMN max_tokens INTEGER;
ALTER TABLE journal ADD COLUMN input_tokens_sum INTEGER NOT NULL DEFAULT 0;
ALTER TABLE journal ADD COLUMN output_tokens_sum INTEGER NOT NULL DEFAULT 0;

-- What each lane's calls charge to its token window (`domain::window::charge`),
-- per second of the charge; a running call's estimate in the second
-- `window::RESERVED`. Written at once by the command that charges them,
-- never ahead; seconds that left the window are pruned.
CREATE TABLE token_seconds (
    second   INTEGER NOT NULL,
    service  TEXT NOT NULL,
    provider TEXT NOT NULL,
    tokens   INTEGER NOT NULL,
    PRIMARY KEY (second, service, provider)
);
