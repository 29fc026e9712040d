-- Completions per minute: a snapshot counts its window from these, never
-- by scanning history.
CREATE TABLE completion_minutes (
    minute      INTEGER PRIMARY KEY NOT NULL,
    completions INTEGER NOT NULL
);
