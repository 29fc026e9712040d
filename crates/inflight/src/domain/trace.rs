//! A call's W3C trace context: the `traceparent` its begin carried, kept
//! with its record so that whoever exports the record's span when it ends
//! (this process or another sharing the store) makes it a child of the
//! caller's span.

use std::fmt;

/// A W3C `traceparent` (Trace Context, level 1): the trace, the caller's
/// span and its flags. Only what version `00` defines is kept; a later
/// version's extra fields are dropped, as the specification allows.
///
/// Kept as its version `00` text, checked, which is how the SQL stores
/// keep it: binding it copies nothing.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    text: [u8; LENGTH],
}

/// The length of a version `00` `traceparent`.
const LENGTH: usize = 55;

impl TraceParent {
    /// The trace id, sixteen bytes, never all zero.
    pub fn trace_id(&self) -> [u8; 16] {
        hex(&self.text[3..35]).unwrap_or_default()
    }

    /// The caller's span (the parent of the record's span), never all zero.
    pub fn span_id(&self) -> [u8; 8] {
        hex(&self.text[36..52]).unwrap_or_default()
    }

    /// The trace flags; bit 0 is `sampled`.
    pub fn flags(&self) -> u8 {
        hex::<1>(&self.text[53..55]).unwrap_or_default()[0]
    }

    /// Whether the caller sampled its span (flag bit 0).
    pub fn sampled(&self) -> bool {
        self.flags() & 1 == 1
    }

    /// Its version `00` form, as a `traceparent` header carries it.
    pub fn as_str(&self) -> &str {
        // Checked ASCII when read.
        std::str::from_utf8(&self.text).unwrap_or_default()
    }

    /// Reads `text`, a `traceparent` header's value.
    ///
    /// # Errors
    /// A [`TraceParentError`], naming `traceparent`, when it is not
    /// `VERSION-TRACEID-SPANID-FLAGS` in lowercase hex, its version is
    /// `ff`, version `00` has more, or the trace or span id is all zero.
    pub fn parse(text: &str) -> Result<Self, TraceParentError> {
        let bad = |why: &str| {
            TraceParentError(format!(
                "traceparent: {why}; expected 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>, got {:?}",
                text.chars().take(80).collect::<String>()
            ))
        };
        let bytes = text.as_bytes();
        if bytes.len() < LENGTH {
            return Err(bad("too short"));
        }
        let version = hex::<1>(&bytes[0..2]).ok_or_else(|| bad("the version is not lowercase hex"))?[0];
        if version == 0xff {
            return Err(bad("version ff is invalid"));
        }
        // A later version may append fields after a dash; version 00 may not.
        if (version == 0 && bytes.len() != LENGTH) || (bytes.len() > LENGTH && bytes[LENGTH] != b'-') {
            return Err(bad("unexpected text after the flags"));
        }
        if bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
            return Err(bad("the fields are not separated by dashes"));
        }
        let trace_id = hex::<16>(&bytes[3..35]).ok_or_else(|| bad("the trace id is not lowercase hex"))?;
        let span_id = hex::<8>(&bytes[36..52]).ok_or_else(|| bad("the span id is not lowercase hex"))?;
        hex::<1>(&bytes[53..55]).ok_or_else(|| bad("the flags are not lowercase hex"))?;
        if trace_id == [0; 16] {
            return Err(bad("the trace id is all zero"));
        }
        if span_id == [0; 8] {
            return Err(bad("the span id is all zero"));
        }
        let mut parent = Self { text: [0; LENGTH] };
        parent.text.copy_from_slice(&bytes[..LENGTH]);
        parent.text[..2].copy_from_slice(b"00");
        Ok(parent)
    }
}

/// Why a `traceparent` was refused: its message names the header. An
/// invalid input wherever it is converted to a ledger error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParentError(String);

impl fmt::Display for TraceParentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TraceParentError {}

/// `N` bytes from `2N` lowercase hex digits.
fn hex<const N: usize>(digits: &[u8]) -> Option<[u8; N]> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    let mut out = [0; N];
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceParent({})", self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_reads_and_writes_back_the_same() {
        let parent = TraceParent::parse(SAMPLE).unwrap();
        assert_eq!(parent.to_string(), SAMPLE);
        assert_eq!(parent.trace_id()[0], 0x4b);
        assert_eq!(parent.span_id()[7], 0xb7);
        assert!(parent.sampled());
        assert!(!TraceParent::parse(&SAMPLE.replace("-01", "-00"))
            .unwrap()
            .sampled());
    }

    #[test]
    fn a_later_version_keeps_what_version_00_defines() {
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-what-comes-next";
        let parent = TraceParent::parse(later).unwrap();
        assert_eq!(parent.to_string(), SAMPLE.replace("-01", "-09"));
    }

    #[test]
    fn a_bad_traceparent_is_refused_naming_the_header() {
        for (text, why) in [
            ("", "too short"),
            (&SAMPLE[..54], "too short"),
            (&format!("{SAMPLE}-x"), "after the flags"),
            (&SAMPLE.replacen("00", "ff", 1), "version ff"),
            (&SAMPLE.to_uppercase(), "not lowercase hex"),
            (&SAMPLE.replace('-', "_"), "dashes"),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "trace id is all zero",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "span id is all zero",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
                "trace id is not",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
                "flags are not",
            ),
        ] {
            let error = crate::LedgerError::from(TraceParent::parse(text).unwrap_err());
            assert_eq!(error.kind(), crate::ErrorKind::InvalidInput);
            let message = error.message().to_owned();
            assert!(message.starts_with("traceparent: "), "{message}");
            assert!(message.contains(why), "{text:?}: {message}");
        }
    }
}
