-- Successes of records that never started, counted apart: a caller that
-- reports its starts as facts (`external` admission) and forgot one must
-- not pass for a normal completion.
ALTER TABLE aggregates ADD COLUMN succeeded_unstarted BIGINT NOT NULL DEFAULT 0;
