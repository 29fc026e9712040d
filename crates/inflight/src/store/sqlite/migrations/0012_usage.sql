-- The tokens a call's settle reported (issue 31): kept on its record, and
-- summed per aggregate over the calls that ended there.
ALTER TABLE activities ADD COLUMN input_tokens INTEGER;
ALTER TABLE activities ADD COLUMN output_tokens INTEGER;
ALTER TABLE aggregates ADD COLUMN input_tokens_sum INTEGER NOT NULL DEFAULT 0;
ALTER TABLE aggregates ADD COLUMN output_tokens_sum INTEGER NOT NULL DEFAULT 0;
ALTER TABLE journal ADD COLUMN input_tokens INTEGER;
ALTER TABLE journal ADD COLUMN output_tokens INTEGER;
ALTER TABLE journal ADD COLUMN input_tokens_sum INTEGER NOT NULL DEFAULT 0;
ALTER TABLE journal ADD COLUMN output_tokens_sum INTEGER NOT NULL DEFAULT 0;
