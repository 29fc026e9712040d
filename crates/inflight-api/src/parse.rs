//! The one error of every `FromStr` of the wire's values and the ledger's
//! domain: the text refused, and what was expected instead.

use std::borrow::Cow;
use std::fmt;

/// Text that is not what the type it was parsed as accepts: a wire name, a
/// lane key, an owner id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    input: String,
    expected: Cow<'static, str>,
}

impl ParseError {
    /// `input` is not `expected` (which reads after "is not": "one of a, b",
    /// "an owner id (a UUID)").
    pub fn new(input: &str, expected: impl Into<Cow<'static, str>>) -> Self {
        Self {
            input: input.to_owned(),
            expected: expected.into(),
        }
    }

    /// The text that was refused.
    pub fn input(&self) -> &str {
        &self.input
    }

    /// What was expected instead.
    pub fn expected(&self) -> &str {
        &self.expected
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is not {}", self.input, self.expected)
    }
}

impl std::error::Error for ParseError {}
