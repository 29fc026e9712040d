-- Owner-lost reaps split by disposition, so that reaps are counted by
-- disposition and reason (`Totals::reaps_ever`). Counted from the records
-- still stored: older ones, already pruned, count as `unsettled`.
ALTER TABLE aggregates ADD COLUMN reaped_owner_lost_abandoned INTEGER NOT NULL DEFAULT 0;
UPDATE aggregates SET reaped_owner_lost_abandoned = MIN(reaped_owner_lost, (
    SELECT COUNT(*) FROM activities AS a
    WHERE a.service = aggregates.service AND a.operation_stage = aggregates.operation_stage
      AND a.class = aggregates.class AND a.provider = aggregates.provider
      AND a.model = aggregates.model AND a.priority = aggregates.priority
      AND a.admission = aggregates.admission
      AND a.state = 'reaped' AND a.disposition = 'abandoned' AND a.reap_reason = 'owner-lost'))
WHERE reaped_owner_lost > 0;
