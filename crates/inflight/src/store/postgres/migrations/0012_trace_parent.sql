-- Trace context (issue 33). A record keeps the W3C `traceparent` its begin
-- carried, as version 00 text, so that the span exported when it ends is a
-- child of the caller's span, whichever instance ends it.
ALTER TABLE activities ADD COLUMN trace_parent TEXT;
