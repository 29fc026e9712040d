//! Token budgets: whether a start fits in its lane's and its provider's
//! tokens per minute, and if not, when it may (`docs/semantics.md` §8,
//! "Budgets").
//!
//! The decision is a pure function of what the store reads under the
//! lane's lock, after the slot decision admitted the record: the charges
//! of the window's seconds ([`window::charge`](super::window::charge)),
//! the reservations of the calls executing, and the estimates of the
//! records the lane serves before this one.

use super::timestamp::Timestamp;
use super::window::{RESERVED, WINDOW_MS};

/// Whose budget: a lane's own, or its provider's, shared by every lane of
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// `[lanes."S::P"] tokens_per_minute`.
    Lane,
    /// `[providers.NAME] tokens_per_minute`.
    Provider,
}

/// One scope's token window as a decision reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WindowUse {
    /// The tokens charged in each second still in the window, seconds
    /// ascending, [`RESERVED`] left out.
    pub seconds: Vec<(i64, i64)>,
    /// The estimates of the calls executing.
    pub reserved: i64,
}

impl WindowUse {
    /// Every token the window holds now.
    pub fn used(&self) -> i64 {
        self.reserved + self.seconds.iter().map(|(_, tokens)| tokens).sum::<i64>()
    }
}

/// A lane's window and its provider's, from the `(second, lane's tokens,
/// provider's tokens)` charges of the provider's seconds from the
/// window's first second on, seconds ascending.
pub fn windows(seconds: impl IntoIterator<Item = (i64, i64, i64)>) -> (WindowUse, WindowUse) {
    let (mut lane, mut provider) = (WindowUse::default(), WindowUse::default());
    for (second, lane_tokens, provider_tokens) in seconds {
        for (window, tokens) in [(&mut lane, lane_tokens), (&mut provider, provider_tokens)] {
            if second == RESERVED {
                window.reserved += tokens;
            } else if tokens != 0 {
                window.seconds.push((second, tokens));
            }
        }
    }
    (lane, provider)
}

/// Why a start does not fit in a budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exhausted {
    /// The budget that holds it.
    pub scope: Scope,
    /// Its tokens per minute.
    pub tokens_per_minute: u32,
    /// What its window holds now, reservations included.
    pub used: i64,
    /// When enough of the window has rolled off for the start to fit;
    /// `None` when roll-off alone never makes room, because the
    /// reservations and the estimates ahead of it are too many: a settle
    /// must come first.
    pub until: Option<Timestamp>,
}

/// Whether a start estimated at `estimate` tokens, behind records whose
/// estimates add up to `ahead` in its lane's line, fits in a budget of
/// `tokens_per_minute` whose window is `window` at `now`.
///
/// It fits while the tokens charged in the last minute, the reservations
/// of the calls executing, `ahead` and `estimate` add up to at most the
/// budget. Else the answer says when enough of the window rolls off: a
/// second leaves it one [`WINDOW_MS`] after it ends.
///
/// ```
/// use inflight::domain::budget::{check, Scope, WindowUse};
/// use inflight::domain::Timestamp;
/// let now = Timestamp::from_millis(100_500);
/// // 400 charged at 50 s, 400 reserved: a third call of 400 waits until
/// // second 50 leaves the window, at 111 s.
/// let window = WindowUse { seconds: vec![(50, 400)], reserved: 400 };
/// let refused = check(Scope::Lane, 1_000, &window, 0, 400, now).unwrap_err();
/// assert_eq!(refused.until, Some(Timestamp::from_millis(111_000)));
/// assert!(check(Scope::Lane, 1_000, &window, 0, 200, now).is_ok());
/// ```
///
/// # Errors
/// [`Exhausted`] when the start does not fit.
pub fn check(
    scope: Scope,
    tokens_per_minute: u32,
    window: &WindowUse,
    ahead: i64,
    estimate: i64,
    now: Timestamp,
) -> Result<(), Exhausted> {
    let used = window.used();
    let mut excess = used + ahead + estimate - i64::from(tokens_per_minute);
    if excess <= 0 {
        return Ok(());
    }
    let mut until = None;
    for (second, tokens) in &window.seconds {
        excess -= tokens;
        if excess <= 0 {
            until = Some(Timestamp::from_millis((second + 1) * 1_000 + WINDOW_MS).max(now));
            break;
        }
    }
    Err(Exhausted {
        scope,
        tokens_per_minute,
        used,
        until,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::window::first_second_at;
    use proptest::prelude::*;

    /// One scope's window from its `(second, tokens)` charges, seconds
    /// ascending.
    fn window_of(charges: impl IntoIterator<Item = (i64, i64)>) -> WindowUse {
        windows(charges.into_iter().map(|(second, tokens)| (second, tokens, 0))).0
    }

    /// What the window holds at `at` of `charges` made in seconds: the
    /// reference of roll-off, from `window::first_second_at`.
    fn held_at(charges: &[(i64, i64)], at: Timestamp) -> i64 {
        let first = first_second_at(at);
        charges
            .iter()
            .filter(|(second, _)| *second >= first)
            .map(|(_, tokens)| tokens)
            .sum()
    }

    proptest! {
        /// The instant a refusal names is the first at which the start
        /// fits, as the window rolls off with nothing new charged: it
        /// fits then, and did not a millisecond before (unless that is
        /// now).
        #[test]
        fn a_refusal_names_the_first_instant_the_start_fits(
            charges in prop::collection::btree_map(0i64..60, 1i64..500, 0..8),
            reserved in 0i64..500,
            ahead in 0i64..500,
            estimate in 0i64..800,
            budget in 1u32..2_000,
            offset in 0i64..1_000,
        ) {
            let now = Timestamp::from_millis(59_000 + offset);
            let charges: Vec<(i64, i64)> = charges.into_iter().collect();
            let window = window_of(
                charges.iter().copied().filter(|(s, _)| *s >= first_second_at(now)).chain([(RESERVED, reserved)]),
            );
            let fits_at = |at: Timestamp| held_at(&charges, at) + reserved + ahead + estimate <= i64::from(budget);
            match check(Scope::Lane, budget, &window, ahead, estimate, now) {
                Ok(()) => prop_assert!(fits_at(now)),
                Err(refused) => {
                    prop_assert!(!fits_at(now));
                    prop_assert_eq!(refused.used, held_at(&charges, now) + reserved);
                    match refused.until {
                        Some(until) => {
                            prop_assert!(until > now);
                            prop_assert!(fits_at(until), "fits at {until}");
                            prop_assert!(!fits_at(until + -1), "not before {until}");
                        }
                        None => prop_assert!(reserved + ahead + estimate > i64::from(budget)),
                    }
                }
            }
        }
    }

    #[test]
    fn a_start_fits_up_to_the_budget_exactly() {
        let now = Timestamp::from_millis(100_000);
        let window = window_of([(90, 300), (RESERVED, 300)]);
        assert_eq!(window.used(), 600);
        assert!(check(Scope::Provider, 1_000, &window, 100, 300, now).is_ok());
        let refused = check(Scope::Provider, 1_000, &window, 100, 301, now).unwrap_err();
        assert_eq!(refused.scope, Scope::Provider);
        assert_eq!(refused.until, Some(Timestamp::from_millis(151_000)));
        // Reservations alone leave no room: no roll-off helps.
        let reserved = window_of([(90, 300), (RESERVED, 900)]);
        assert_eq!(
            check(Scope::Lane, 1_000, &reserved, 0, 200, now)
                .unwrap_err()
                .until,
            None
        );
    }
}
