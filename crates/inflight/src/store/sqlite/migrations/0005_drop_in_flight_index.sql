-- Records in flight in line order are read through `activities_lane`,
-- which has the same condition: one index fewer for every begin, start
-- and settle to write. (`IF EXISTS`: a store rewound to an older version
-- by hand runs this again.)
DROP INDEX IF EXISTS activities_in_flight;
