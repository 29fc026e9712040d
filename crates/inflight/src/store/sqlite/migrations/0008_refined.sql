-- A refinement sets a record's model at dispatch (`refined`). A call now
-- counts into its aggregate when it ends, under its final model, so
-- `calls` is no longer stored: it is the calls in flight plus the ones
-- that ended (`Totals::calls`), which it always equalled.
ALTER TABLE activities ADD COLUMN refined INTEGER NOT NULL DEFAULT 0;
ALTER TABLE journal ADD COLUMN refined INTEGER NOT NULL DEFAULT 0;
ALTER TABLE aggregates DROP COLUMN calls;
ALTER TABLE journal DROP COLUMN calls;
