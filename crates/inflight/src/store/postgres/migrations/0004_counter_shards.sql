-- Counter rows per writer: each writer of an instance adds to the rows of
-- its own `shard` (its index in the pool), so that a group never waits for
-- another writer's commit to count; every read sums the shards.
ALTER TABLE aggregates ADD COLUMN shard SMALLINT NOT NULL DEFAULT 0;
ALTER TABLE aggregates DROP CONSTRAINT aggregates_pkey,
    ADD PRIMARY KEY (service, operation_stage, class, provider, model, priority, admission, shard);
ALTER TABLE completion_minutes ADD COLUMN shard SMALLINT NOT NULL DEFAULT 0;
ALTER TABLE completion_minutes DROP CONSTRAINT completion_minutes_pkey,
    ADD PRIMARY KEY (minute, shard);
