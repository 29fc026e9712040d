//! [`Usage`]: the tokens a provider call spent, as its settle reported
//! them. A leaf shared by the record, the transitions and the counters.

use serde::Serialize;

use super::refusal::Refusal;

/// The most tokens one count of a settle may report (10^9): beyond any
/// call, and small enough that a lifetime of sums stays far from overflow.
pub const MAX_TOKENS: i64 = 1_000_000_000;

/// Whether `count` is one a settle may report: a whole number from 0 to
/// [`MAX_TOKENS`].
pub fn is_token_count(count: i64) -> bool {
    (0..=MAX_TOKENS).contains(&count)
}

/// The tokens a call spent, each `None` when its settle did not say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// Tokens of the prompt (input).
    pub input_tokens: Option<i64>,
    /// Tokens of the answer (output).
    pub output_tokens: Option<i64>,
}

impl Usage {
    /// Neither count was reported.
    pub fn is_empty(&self) -> bool {
        self.input_tokens.is_none() && self.output_tokens.is_none()
    }

    /// `self`, when each count is a whole number from 0 to [`MAX_TOKENS`].
    ///
    /// # Errors
    /// [`Refusal::Invalid`] naming the field, as the HTTP API spells it.
    pub(crate) fn checked(self) -> Result<Self, Refusal> {
        for (field, count) in [
            ("inputTokens", self.input_tokens),
            ("outputTokens", self.output_tokens),
        ] {
            if let Some(count) = count.filter(|count| !is_token_count(*count)) {
                return Err(Refusal::Invalid(format!(
                    "usage.{field} must be a whole number from 0 to {MAX_TOKENS}, got {count}"
                )));
            }
        }
        Ok(self)
    }

    /// Both counts, 0 for one not reported.
    pub fn total(&self) -> i64 {
        self.input_tokens.unwrap_or(0) + self.output_tokens.unwrap_or(0)
    }

    /// What the counters add for it: each count, 0 when not reported. Only
    /// for a checked usage, whose counts fit.
    pub(crate) fn tokens(self) -> Tokens {
        let count = |tokens: Option<i64>| u32::try_from(tokens.unwrap_or(0)).unwrap_or(u32::MAX);
        Tokens {
            input: count(self.input_tokens),
            output: count(self.output_tokens),
        }
    }
}

/// A begin's `maxTokens`, when it is a whole number from 0 to
/// [`MAX_TOKENS`].
///
/// # Errors
/// [`Refusal::Invalid`] naming `maxTokens`.
pub fn estimate(declared: Option<i64>) -> Result<Option<u32>, Refusal> {
    let Some(tokens) = declared else {
        return Ok(None);
    };
    match u32::try_from(tokens) {
        Ok(small) if is_token_count(tokens) => Ok(Some(small)),
        _ => Err(Refusal::Invalid(format!(
            "maxTokens must be a whole number from 0 to {MAX_TOKENS}, got {tokens}"
        ))),
    }
}

/// Tokens an effect adds to the counters: a checked [`Usage`] in eight
/// bytes, so that effects stay small on the hot path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    /// Input tokens.
    pub input: u32,
    /// Output tokens.
    pub output: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_out_of_range_are_refused_naming_the_field() {
        let usage = |input, output| Usage {
            input_tokens: input,
            output_tokens: output,
        };
        assert_eq!(
            usage(Some(0), Some(MAX_TOKENS)).checked(),
            Ok(usage(Some(0), Some(MAX_TOKENS)))
        );
        assert_eq!(usage(None, None).checked(), Ok(Usage::default()));
        let Err(Refusal::Invalid(message)) = usage(Some(-1), None).checked() else {
            panic!("a negative count passed");
        };
        assert!(message.starts_with("usage.inputTokens must be"), "{message}");
        let Err(Refusal::Invalid(message)) = usage(Some(1), Some(MAX_TOKENS + 1)).checked() else {
            panic!("a count past the limit passed");
        };
        assert!(
            message.contains("usage.outputTokens") && message.contains("1000000001"),
            "{message}"
        );
    }

    #[test]
    fn tokens_count_what_was_reported() {
        let usage = Usage {
            input_tokens: Some(12),
            output_tokens: None,
        };
        assert_eq!(usage.tokens(), Tokens { input: 12, output: 0 });
        assert_eq!(Usage::default().tokens(), Tokens::default());
    }
}
