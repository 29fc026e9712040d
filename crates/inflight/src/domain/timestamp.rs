//! Timestamps: epoch milliseconds inside, RFC 3339 UTC with milliseconds
//! outside.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serializer;

/// Milliseconds since the Unix epoch, wall clock.
pub type Millis = i64;

/// Formats epoch milliseconds as `2026-08-12T08:20:48.562Z`.
pub fn format_rfc3339(at: Millis) -> String {
    DateTime::<Utc>::from_timestamp_millis(at)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Parses an RFC 3339 time (any offset) into epoch milliseconds.
pub fn parse_rfc3339(text: &str) -> Option<Millis> {
    DateTime::parse_from_rfc3339(text.trim())
        .ok()
        .map(|at| at.timestamp_millis())
}

pub(crate) fn serialize_opt<S: Serializer>(at: &Option<Millis>, s: S) -> Result<S::Ok, S::Error> {
    match at {
        Some(at) => s.serialize_str(&format_rfc3339(*at)),
        None => s.serialize_none(),
    }
}

pub(crate) fn serialize<S: Serializer>(at: &Millis, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_rfc3339(*at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_with_millisecond_precision() {
        let at = parse_rfc3339("2026-08-12T08:20:48.562Z").unwrap();
        assert_eq!(format_rfc3339(at), "2026-08-12T08:20:48.562Z");
        assert_eq!(parse_rfc3339("2026-08-12T10:20:48.562+02:00"), Some(at));
        assert_eq!(parse_rfc3339("yesterday"), None);
    }
}
