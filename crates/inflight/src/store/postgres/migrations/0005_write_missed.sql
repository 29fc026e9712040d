-- Raised by `WRITE_GROUP` when a write did not land as its command
-- expected: the statement fails, so the `COMMIT` sent right behind it in
-- the same round trip rolls the group back instead.
CREATE FUNCTION inflight_write_missed() RETURNS BIGINT LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'a deferred record write did not land as expected' USING ERRCODE = 'IF001';
END
$$;
