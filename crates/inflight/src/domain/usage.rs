//! [`Usage`]: the tokens a provider call spent, as its settle reported
//! them. A leaf shared by the record, the transitions and the counters.

use serde::Serialize;

use super::record::{ActivityRecord, State};
use super::refusal::Refusal;
use super::timestamp::Timestamp;

/// The most tokens one count of a settle may report (10^9): beyond any
/// call, and small enough that a lifetime of sums stays far from overflow.
pub const MAX_TOKENS: i64 = 1_000_000_000;

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
            if let Some(count) = count.filter(|count| !(0..=MAX_TOKENS).contains(count)) {
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
        Ok(small) if tokens <= MAX_TOKENS => Ok(Some(small)),
        _ => Err(Refusal::Invalid(format!(
            "maxTokens must be a whole number from 0 to {MAX_TOKENS}, got {tokens}"
        ))),
    }
}

/// The span of a lane's token window: the last minute.
pub const WINDOW_MS: i64 = 60_000;

/// The second that a reservation counts in: every window, until the call
/// ends.
pub const RESERVED: i64 = i64::MAX;

/// What `record` charges to its lane's token window, and in which second
/// ([`second_of`]); `None` for nothing:
/// - executing, its estimate (`maxTokens`), reserved ([`RESERVED`]);
/// - ended after it ran (it started, or settled with an outcome): the
///   tokens its settle reported, else its estimate, at its `completedAt`,
///   or at its `reapedAt` when it was reaped (a late settle's usage
///   replaces the estimate there);
/// - waiting, or ended without running: what a late settle reported, else
///   nothing.
#[inline]
pub fn charge(record: &ActivityRecord) -> Option<(i64, i64)> {
    // Most calls carry neither an estimate nor usage: nothing to look at.
    if record.max_tokens.is_none() && record.usage.is_empty() {
        return None;
    }
    charge_of(record)
}

fn charge_of(record: &ActivityRecord) -> Option<(i64, i64)> {
    let estimate = record.max_tokens.unwrap_or(0);
    let (second, tokens) = match record.state {
        State::Waiting => return None,
        State::Executing => (RESERVED, estimate),
        _ => {
            let ran = record.started_at.is_some() || record.success.is_some();
            let tokens = if !record.usage.is_empty() {
                record.usage.total()
            } else if ran {
                estimate
            } else {
                0
            };
            (second_of(record.completed_at.or(record.reaped_at)?), tokens)
        }
    };
    (tokens > 0).then_some((second, tokens))
}

/// What a change of a record from charging `before` to charging `after`
/// ([`charge`]) moves in its lane's window: at most two `(second, tokens)`
/// changes. The stores add these up per second, so that what they hold is
/// always the sum of their records' charges.
pub fn moves(before: Option<(i64, i64)>, after: Option<(i64, i64)>) -> [Option<(i64, i64)>; 2] {
    match (before, after) {
        (before, after) if before == after => [None, None],
        (Some((was, old)), Some((is, new))) if was == is => [Some((is, new - old)), None],
        (before, after) => [before.map(|(second, tokens)| (second, -tokens)), after],
    }
}

/// The second of the window that tokens charged at `at` count in.
pub fn second_of(at: Timestamp) -> i64 {
    at.as_millis().div_euclid(1_000)
}

/// The first second whose tokens still count at `now`: a second counts
/// while any of it is within the last [`WINDOW_MS`], so a charge leaves the
/// window at most a second late, never early.
pub fn first_second_at(now: Timestamp) -> i64 {
    (now.as_millis() - WINDOW_MS).div_euclid(1_000)
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
    fn moves_take_the_old_charge_out_and_put_the_new_one_in() {
        assert_eq!(moves(None, None), [None, None]);
        assert_eq!(moves(Some((RESERVED, 5)), Some((RESERVED, 5))), [None, None]);
        assert_eq!(moves(None, Some((RESERVED, 5))), [None, Some((RESERVED, 5))]);
        assert_eq!(
            moves(Some((RESERVED, 5)), Some((7, 3))),
            [Some((RESERVED, -5)), Some((7, 3))]
        );
        assert_eq!(moves(Some((7, 5)), Some((7, 3))), [Some((7, -2)), None]);
        assert_eq!(moves(Some((7, 5)), None), [Some((7, -5)), None]);
    }

    #[test]
    fn a_second_counts_while_any_of_it_is_in_the_window() {
        let at = |ms| Timestamp::from_millis(ms);
        assert_eq!(second_of(at(1_786_000_000_999)), 1_786_000_000);
        // At 61.5 s, seconds 1..=61 hold charges from 1.0 s on: the second
        // starting at 1.0 s still has 1.5..2.0 s within the last minute.
        assert_eq!(first_second_at(at(61_500)), 1);
        assert_eq!(first_second_at(at(61_000)), 1);
        assert_eq!(first_second_at(at(60_999)), 0);
    }

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
