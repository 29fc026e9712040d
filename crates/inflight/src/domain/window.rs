//! A lane's token window: what each record charges to it, and when a
//! second of it still counts (`docs/semantics.md` §8, "Tokens").

use std::collections::BTreeMap;

use super::record::{ActivityRecord, LaneKey, State};
use super::timestamp::Timestamp;

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

/// A lane's token window, as a snapshot shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneTokens {
    /// The lane.
    pub lane: LaneKey,
    /// Charged by calls that ended within the window.
    pub charged: i64,
    /// Reserved by the estimates of its calls executing ([`RESERVED`]).
    pub reserved: i64,
}

/// The reference of `Questions::tokens_since`: the `(second, lane,
/// tokens)` charges of the seconds from `first` on, summed per lane into
/// what was charged and what is reserved, in lane order; a lane with
/// neither left out.
pub fn lane_tokens<'a>(
    seconds: impl IntoIterator<Item = (i64, &'a LaneKey, i64)>,
    first: i64,
) -> Vec<LaneTokens> {
    let mut by_lane: BTreeMap<&LaneKey, (i64, i64)> = BTreeMap::new();
    for (second, lane, tokens) in seconds.into_iter().filter(|(second, _, _)| *second >= first) {
        let sums = by_lane.entry(lane).or_default();
        if second == RESERVED {
            sums.1 += tokens;
        } else {
            sums.0 += tokens;
        }
    }
    by_lane
        .into_iter()
        .filter(|(_, sums)| *sums != (0, 0))
        .map(|(lane, (charged, reserved))| LaneTokens {
            lane: lane.clone(),
            charged,
            reserved,
        })
        .collect()
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
}
