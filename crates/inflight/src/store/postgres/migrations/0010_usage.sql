-- The tokens a call's settle reported (issue 31): kept on its record, and
-- summed per aggregate over the calls that ended there.
ALTER TABLE activities ADD COLUMN input_tokens BIGINT, ADD COLUMN output_tokens BIGINT;
ALTER TABLE aggregates ADD COLUMN input_tokens_sum BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN output_tokens_sum BIGINT NOT NULL DEFAULT 0;
