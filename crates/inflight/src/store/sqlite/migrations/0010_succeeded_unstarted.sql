-- Successes of records that never started, counted apart: a caller that
-- reports its starts as facts (`external` admission) and forgot one must
-- not pass for a normal completion.
ALTER TABLE aggregates ADD COLUMN succeeded_unstarted INTEGER NOT NULL DEFAULT 0;
ALTER TABLE journal ADD COLUMN succeeded_unstarted INTEGER NOT NULL DEFAULT 0;
