-- Owner-lost reaps split by disposition, so that reaps are counted by
-- disposition and reason (`Totals::reaps_ever`); counted from the records
-- still stored.
ALTER TABLE aggregates ADD COLUMN reaped_owner_lost_abandoned BIGINT NOT NULL DEFAULT 0;
UPDATE aggregates AS g SET reaped_owner_lost_abandoned = LEAST(g.reaped_owner_lost, (
    SELECT COUNT(*) FROM activities AS a
    WHERE a.service = g.service AND a.operation_stage = g.operation_stage
      AND a.class = g.class AND a.provider = g.provider AND a.model = g.model
      AND a.priority = g.priority AND a.admission = g.admission
      AND a.state = 'reaped' AND a.disposition = 'abandoned' AND a.reap_reason = 'owner-lost'))
WHERE g.reaped_owner_lost > 0;
