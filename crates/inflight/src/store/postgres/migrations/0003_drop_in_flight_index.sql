-- The records in flight in line order are read through `activities_lane`
-- (the same predicate): one index fewer to write per record written.
DROP INDEX activities_in_flight;
