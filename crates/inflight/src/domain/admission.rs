//! Native admission: a lane's rules, enforced from the ledger's own
//! records.
//!
//! The decision is a pure function of plain counts that the store reads in
//! the same transaction that writes the start, after reaping: a leaked record
//! never holds a slot, and what operators read is what admission decides.
//! `docs/semantics.md` §6 states the rules; this module is their one
//! definition.

use super::budget::Scope;
use super::record::Priority;
use super::timestamp::Timestamp;

/// The longest a provider's `Retry-After` cools a lane down unless the
/// configuration says otherwise (`max_cooldown`): a minute.
pub const DEFAULT_MAX_COOLDOWN_MS: i64 = 60_000;

/// The longest `Retry-After` a settle may carry: an hour.
pub const MAX_RETRY_AFTER_MS: i64 = 3_600_000;

/// How a record's `priority` ranks in its lane's line: `unknown` is
/// batch work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rank {
    /// `interactive`: a user waits on it.
    Interactive,
    /// `batch` or `unknown`.
    Batch,
}

impl Rank {
    /// The rank of `priority`.
    #[inline]
    pub fn of(priority: Priority) -> Self {
        match priority {
            Priority::Interactive => Self::Interactive,
            Priority::Batch | Priority::Unknown => Self::Batch,
        }
    }
}

/// What a governed lane admits by: one with a cap, a token budget, or a
/// provider's token budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneRules {
    /// At most this many records executing; `u32::MAX` on a lane governed
    /// by a token budget alone.
    pub cap: u32,
    /// At most this many of them batch work (below `cap`): the rest is
    /// headroom only interactive work may take. `None`: no such limit.
    pub batch_cap: Option<u32>,
    /// While batch work waits, at most this many interactive records are
    /// admitted in a row before the oldest batch record. 0 keeps one line
    /// first come, first served, whatever the priority.
    pub max_overtakes: u32,
    /// The longest a provider's `Retry-After` cools the lane down, in
    /// milliseconds.
    pub max_cooldown_ms: i64,
    /// Whether a provider's refusal halves the lane's effective cap.
    pub adaptive: bool,
    /// The lane's own tokens per minute (`tokens_per_minute`).
    pub budget: Option<u32>,
    /// Its provider's tokens per minute, shared by every lane of it.
    pub provider_budget: Option<u32>,
}

impl LaneRules {
    /// A lane with `cap` and nothing else: one line, first come, first
    /// served.
    pub fn capped(cap: u32) -> Self {
        Self {
            cap,
            batch_cap: None,
            max_overtakes: 0,
            max_cooldown_ms: DEFAULT_MAX_COOLDOWN_MS,
            adaptive: false,
            budget: None,
            provider_budget: None,
        }
    }

    /// The budget, the lane's own or its provider's, that an `estimate`
    /// alone exceeds: a call that could never start.
    pub fn over_budget(&self, estimate: i64) -> Option<(Scope, u32)> {
        let over = |budget: Option<u32>| budget.filter(|budget| estimate > i64::from(*budget));
        over(self.budget)
            .map(|budget| (Scope::Lane, budget))
            .or_else(|| over(self.provider_budget).map(|budget| (Scope::Provider, budget)))
    }

    /// Whether a token budget governs the lane: its own or its
    /// provider's.
    #[inline]
    pub fn budgeted(&self) -> bool {
        self.budget.is_some() || self.provider_budget.is_some()
    }

    /// The cap in force for a lane in `state`: the configured one, or an
    /// adaptive lane's effective cap.
    #[inline]
    pub fn cap_in(&self, state: &LaneState) -> u32 {
        match state.effective_cap {
            Some(effective) if self.adaptive => effective.clamp(1, self.cap),
            _ => self.cap,
        }
    }

    /// Whether a record's rank matters to its admission, so that its
    /// position is asked by rank ([`LanePosition::ranks`]).
    #[inline]
    pub fn ranked(&self) -> bool {
        self.max_overtakes > 0 || self.batch_cap.is_some()
    }
}

/// What the configuration declares of a lane: its cap, if any, and the
/// rules that rank its line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LaneSettings {
    /// `cap`: at most this many executing. `None`: declared, uncapped.
    pub cap: Option<u32>,
    /// `batch_cap` (below `cap`).
    pub batch_cap: Option<u32>,
    /// `max_overtakes`; `None` takes `[admission] max_overtakes`.
    pub max_overtakes: Option<u32>,
    /// `max_cooldown` in milliseconds; `None` takes `[admission]
    /// max_cooldown`.
    pub max_cooldown_ms: Option<i64>,
    /// `adaptive`: a provider's refusal halves the lane's cap for a while.
    pub adaptive: bool,
    /// `tokens_per_minute`: the lane's token budget.
    pub tokens_per_minute: Option<u32>,
}

/// `[admission]`: what a capped lane takes when it sets nothing itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionDefaults {
    /// `max_overtakes`: 0, one line first come, first served.
    pub max_overtakes: u32,
    /// `max_cooldown`, in milliseconds: [`DEFAULT_MAX_COOLDOWN_MS`].
    pub max_cooldown_ms: i64,
}

impl Default for AdmissionDefaults {
    fn default() -> Self {
        Self {
            max_overtakes: 0,
            max_cooldown_ms: DEFAULT_MAX_COOLDOWN_MS,
        }
    }
}

impl LaneSettings {
    /// The cap in force for a lane with these settings in `state`
    /// ([`LaneRules::cap_in`]); `None` without a cap.
    pub fn cap_in(&self, state: &LaneState) -> Option<u32> {
        self.cap?;
        self.rules(&AdmissionDefaults::default(), None)
            .map(|rules| rules.cap_in(state))
    }

    /// The rules a lane with these settings admits by, what it does not
    /// set taken from `defaults`, under its provider's token budget
    /// `provider_budget`; `None` for a lane with neither a cap nor a
    /// budget, which admits everything.
    #[inline]
    pub fn rules(&self, defaults: &AdmissionDefaults, provider_budget: Option<u32>) -> Option<LaneRules> {
        if self.cap.is_none() && self.tokens_per_minute.is_none() && provider_budget.is_none() {
            return None;
        }
        Some(LaneRules {
            cap: self.cap.unwrap_or(u32::MAX),
            batch_cap: self.batch_cap,
            max_overtakes: self.max_overtakes.unwrap_or(defaults.max_overtakes),
            max_cooldown_ms: self.max_cooldown_ms.unwrap_or(defaults.max_cooldown_ms),
            adaptive: self.adaptive,
            budget: self.tokens_per_minute,
            provider_budget,
        })
    }
}

/// What a lane looks like to one record asking to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LanePosition {
    /// Records executing on the lane now (leaks already reaped).
    pub executing: i64,
    /// Queued records waiting on the lane that are ahead of this one in
    /// line order.
    pub waiting_ahead: i64,
    /// The same, told apart by rank, when the lane's rules rank
    /// ([`LaneRules::ranked`]).
    pub ranks: Option<RankedPosition>,
    /// On a budgeted lane, the estimates of the records waiting ahead
    /// that the lane serves first ([`LaneQuery::tokens`](super::query::LaneQuery::tokens)).
    pub tokens_ahead: i64,
}

/// [`LanePosition`] told apart by rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankedPosition {
    /// Of those executing, how many are batch work.
    pub executing_batch: i64,
    /// Interactive records waiting ahead in line order.
    pub interactive_ahead: i64,
    /// Batch records waiting ahead in line order.
    pub batch_ahead: i64,
    /// Interactive records waiting, ahead or not.
    pub interactive_waiting: i64,
    /// Batch records waiting, ahead or not.
    pub batch_waiting: i64,
}

/// What a lane remembers between decisions, stored beside its records (a
/// lane that never needed any has none: the default). A grant changes its
/// run of overtakes; a settle its cooldown and adaptive cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LaneState {
    /// Interactive grants in a row while batch work waited.
    pub overtakes: u32,
    /// No new slot is granted before this instant: a provider's
    /// `Retry-After` ([`LaneState::cool`]).
    pub cooling_until: Option<Timestamp>,
    /// Cooldowns the lane ever began, for `/metrics`.
    pub cooldowns: i64,
    /// An adaptive lane's cap in force, when a refusal lowered it below
    /// the configured one.
    pub effective_cap: Option<u32>,
    /// An adaptive lane's successes since its cap last moved.
    pub successes: u32,
}

impl LaneState {
    /// Whether the lane is cooling down at `now`: granting no new slot.
    #[inline]
    pub fn cooling_at(&self, now: Timestamp) -> Option<Timestamp> {
        self.cooling_until.filter(|until| now < *until)
    }

    /// A provider refused a call with `Retry-After: retry_after_ms` at
    /// `completed_at`: the lane grants no new slot until then, at most
    /// `max_cooldown_ms` on (a later cooldown already running is kept).
    #[must_use]
    pub fn cool(mut self, completed_at: Timestamp, retry_after_ms: i64, max_cooldown_ms: i64) -> Self {
        let until = completed_at + retry_after_ms.clamp(0, max_cooldown_ms);
        self.cooling_until = Some(self.cooling_until.map_or(until, |running| running.max(until)));
        self.cooldowns += 1;
        self
    }

    /// A call on a lane with `rules` settled: an adaptive lane halves its
    /// effective cap on a provider's refusal (`refused`, floor 1), and
    /// gives one slot back after each run of `cap` successes, up to the
    /// cap. Other lanes stay as they are.
    #[must_use]
    pub fn settled(mut self, rules: &LaneRules, success: bool, refused: bool) -> Self {
        if !rules.adaptive {
            return self;
        }
        let cap = rules.cap_in(&self);
        if refused {
            self.effective_cap = Some((cap / 2).max(1));
            self.successes = 0;
        } else if success && cap < rules.cap {
            self.successes += 1;
            if self.successes >= rules.cap {
                self.successes = 0;
                self.effective_cap = (cap + 1 < rules.cap).then_some(cap + 1);
            }
        }
        self
    }
}

/// The answer to a start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Start now; the lane's state is then this.
    Admit(LaneState),
    /// The lane is full for this record: its turn has not come.
    LaneFull {
        /// The lane's cap.
        cap: u32,
    },
    /// Batch work holds every slot it may.
    BatchFull {
        /// The lane's `batch_cap`.
        batch_cap: u32,
    },
    /// The lane is cooling down after a provider's refusal.
    Cooling {
        /// When it grants again.
        until: Timestamp,
    },
}

/// Decides whether a record of `priority` may start on a lane with
/// `rules`, standing at `position`, with the lane in `state`.
///
/// The lane's free slots go to the records waiting in the order the lane
/// grants them, and a record is admitted when its turn falls within them:
/// so a newcomer never takes a slot that a record served before it needs.
/// The order:
/// - by default, first come, first served (line order);
/// - with `max_overtakes = N`, interactive records first, each rank first
///   come, first served; while batch work waits, after N interactive grants
///   in a row the oldest batch record is next;
/// - with `batch_cap`, a batch record is passed over while batch work
///   holds `batch_cap` slots.
///
/// ```
/// use inflight::domain::admission::{decide, Decision, LanePosition, LaneRules, LaneState};
/// use inflight::domain::{Priority, Timestamp};
/// let now = Timestamp::from_millis(1_786_000_000_000);
/// let third_in_line = LanePosition { executing: 0, waiting_ahead: 2, ranks: None, tokens_ahead: 0 };
/// let state = LaneState::default();
/// assert_eq!(
///     decide(&LaneRules::capped(2), Priority::Unknown, &third_in_line, state, now),
///     Decision::LaneFull { cap: 2 }
/// );
/// assert_eq!(decide(&LaneRules::capped(3), Priority::Unknown, &third_in_line, state, now), Decision::Admit(state));
/// ```
pub fn decide(
    rules: &LaneRules,
    priority: Priority,
    position: &LanePosition,
    state: LaneState,
    now: Timestamp,
) -> Decision {
    if let Some(until) = state.cooling_at(now) {
        return Decision::Cooling { until };
    }
    let cap = rules.cap_in(&state);
    let free = i64::from(cap) - position.executing;
    let Some(ranks) = position.ranks.filter(|_| rules.ranked()) else {
        return if position.waiting_ahead < free {
            Decision::Admit(state)
        } else {
            Decision::LaneFull { cap }
        };
    };
    // Batch grants the lane can still make before batch work is full.
    let batch_room = rules.batch_cap.map_or(i64::MAX, |batch_cap| {
        (i64::from(batch_cap) - ranks.executing_batch).max(0)
    });
    let n = i64::from(rules.max_overtakes);
    // Interactive grants before the first batch one.
    let first = (n - i64::from(state.overtakes)).max(0);
    let rank = Rank::of(priority);
    let served_before = match rank {
        Rank::Interactive if n == 0 => ranks.interactive_ahead + ranks.batch_ahead.min(batch_room),
        Rank::Interactive => {
            let i = ranks.interactive_ahead;
            let batches = ranks.batch_waiting.min(batch_room);
            let batches_before = if i < first {
                0
            } else {
                batches.min((i - first) / n + 1)
            };
            i + batches_before
        }
        Rank::Batch => {
            if ranks.batch_ahead >= batch_room {
                return Decision::BatchFull {
                    batch_cap: rules.batch_cap.unwrap_or(cap),
                };
            }
            let j = ranks.batch_ahead;
            let interactive_before = if n == 0 {
                ranks.interactive_ahead
            } else {
                ranks
                    .interactive_waiting
                    .min(first.saturating_add(j.saturating_mul(n)))
            };
            j + interactive_before
        }
    };
    if served_before >= free {
        return Decision::LaneFull { cap };
    }
    let overtakes = match rank {
        Rank::Interactive if n > 0 && ranks.batch_waiting > 0 => state.overtakes.saturating_add(1),
        _ => 0,
    };
    Decision::Admit(LaneState { overtakes, ..state })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    const NOW: Timestamp = Timestamp::from_millis(1_786_000_000_000);

    /// One record waiting in line, in line order: its rank.
    type Line = Vec<Rank>;

    fn priority(rank: Rank) -> Priority {
        match rank {
            Rank::Interactive => Priority::Interactive,
            Rank::Batch => Priority::Batch,
        }
    }

    /// The reference: the lane hands its free slots out one at a time, as
    /// `docs/semantics.md` §6 states the order, to the records in `line`;
    /// returns the places in line served, in the order served.
    fn serve(
        rules: &LaneRules,
        executing: i64,
        executing_batch: i64,
        line: &Line,
        state: LaneState,
    ) -> Vec<usize> {
        let mut interactive: VecDeque<usize> = (0..line.len())
            .filter(|&at| line[at] == Rank::Interactive)
            .collect();
        let mut batch: VecDeque<usize> = (0..line.len()).filter(|&at| line[at] == Rank::Batch).collect();
        let (mut free, mut batch_executing, mut run) =
            (i64::from(rules.cap) - executing, executing_batch, state.overtakes);
        let mut served = Vec::new();
        while free > 0 {
            let batch_may =
                !batch.is_empty() && rules.batch_cap.is_none_or(|cap| batch_executing < i64::from(cap));
            let batch_next = batch_may
                && match interactive.front() {
                    None => true,
                    Some(first) if rules.max_overtakes == 0 => batch[0] < *first,
                    Some(_) => run >= rules.max_overtakes,
                };
            let next = if batch_next {
                batch_executing += 1;
                run = 0;
                batch.pop_front()
            } else {
                run = if batch.is_empty() { 0 } else { run + 1 };
                interactive.pop_front()
            };
            let Some(next) = next else { break };
            served.push(next);
            free -= 1;
        }
        served
    }

    /// Where the record at `at` of `line` stands, as a store counts it.
    fn position(
        rules: &LaneRules,
        executing: i64,
        executing_batch: i64,
        line: &Line,
        at: usize,
    ) -> LanePosition {
        let count = |rank: Rank, range: std::ops::Range<usize>| {
            line[range].iter().filter(|r| **r == rank).count() as i64
        };
        let others = |rank: Rank| count(rank, 0..line.len()) - i64::from(line[at] == rank);
        LanePosition {
            executing,
            waiting_ahead: at as i64,
            ranks: rules.ranked().then(|| RankedPosition {
                executing_batch,
                interactive_ahead: count(Rank::Interactive, 0..at),
                batch_ahead: count(Rank::Batch, 0..at),
                interactive_waiting: others(Rank::Interactive),
                batch_waiting: others(Rank::Batch),
            }),
            tokens_ahead: 0,
        }
    }

    fn rules() -> impl Strategy<Value = LaneRules> {
        (1u32..6, 0u32..4, prop::option::of(1u32..5)).prop_map(|(cap, max_overtakes, batch_cap)| LaneRules {
            batch_cap: batch_cap.filter(|b| *b < cap),
            max_overtakes,
            ..LaneRules::capped(cap)
        })
    }

    fn rank() -> impl Strategy<Value = Rank> {
        prop_oneof![Just(Rank::Interactive), Just(Rank::Batch)]
    }

    /// Asks on behalf of the record at `at`; admits it into the lane when
    /// the decision says so.
    fn ask(rules: &LaneRules, lane: &mut (i64, i64, Line, LaneState), at: usize) -> Decision {
        let (executing, executing_batch, line, state) = lane;
        let rank = line[at];
        let decision = decide(
            rules,
            priority(rank),
            &position(rules, *executing, *executing_batch, line, at),
            *state,
            NOW,
        );
        if let Decision::Admit(next) = decision {
            line.remove(at);
            *executing += 1;
            *executing_batch += i64::from(rank == Rank::Batch);
            *state = next;
        }
        decision
    }

    proptest! {
        /// Whoever asks is admitted exactly when the reference serves it
        /// within the free slots; so never more than `cap` executing nor
        /// more than `batch_cap` of batch work, and the records served
        /// before it can all still start after it.
        #[test]
        fn admits_exactly_whom_the_lane_would_serve(
            rules in rules(),
            executing in 0i64..6,
            batch_share in 0i64..6,
            line in prop::collection::vec(rank(), 1..10),
            at in 0usize..10,
            overtakes in 0u32..4,
        ) {
            let at = at % line.len();
            let executing_batch = batch_share.min(executing);
            let state = LaneState {
                overtakes: overtakes.min(rules.max_overtakes),
                ..LaneState::default()
            };
            let served = serve(&rules, executing, executing_batch, &line, state);
            let decision = decide(&rules, priority(line[at]), &position(&rules, executing, executing_batch, &line, at), state, NOW);
            prop_assert_eq!(
                matches!(decision, Decision::Admit(_)),
                served.contains(&at),
                "{:?} at {} of {:?}, {} executing ({} batch), {:?}: served {:?}",
                rules, at, line, executing, executing_batch, state, served
            );
        }

        /// Asked in the reference's order, one at a time as slots come
        /// back, the lane admits each in turn, and its state follows.
        #[test]
        fn a_lane_asked_in_turn_serves_in_the_references_order(
            rules in rules(),
            line in prop::collection::vec(rank(), 1..12),
        ) {
            let expected = {
                // One slot at a time: the order the reference serves in.
                let mut order = Vec::new();
                let mut lane = (i64::from(rules.cap) - 1, 0, line.clone(), LaneState::default());
                let mut places: Vec<usize> = (0..line.len()).collect();
                while !lane.2.is_empty() {
                    let served = serve(&rules, lane.0, lane.1.min(lane.0), &lane.2, lane.3);
                    let Some(&next) = served.first() else { break };
                    order.push(places.remove(next));
                    prop_assert!(matches!(ask(&rules, &mut lane, next), Decision::Admit(_)));
                    // Its slot ends at once; batch work it held frees too.
                    lane.0 -= 1;
                    lane.1 = 0;
                }
                order
            };
            prop_assert_eq!(expected.len(), line.len());
        }
    }

    /// neomjs/neo#17093's fixture: one slot, a blocker executing, then one
    /// batch and two interactive records waiting; with `max_overtakes = 1`
    /// the lane serves interactive-1, the batch, interactive-2. With two
    /// batch records: I1, B1, I2, B2.
    #[test]
    fn one_overtake_interleaves_interactive_and_batch_work() {
        use Rank::{Batch as B, Interactive as I};
        let rules = LaneRules {
            batch_cap: None,
            max_overtakes: 1,
            ..LaneRules::capped(1)
        };
        for (line, expected) in [
            (vec![B, I, I], vec![1, 0, 2]),
            (vec![B, B, I, I], vec![2, 0, 3, 1]),
            (vec![I, B, I, B], vec![0, 1, 2, 3]),
        ] {
            let mut lane = (1, 0, line.clone(), LaneState::default());
            let mut ids: Vec<usize> = (0..line.len()).collect();
            let mut order = Vec::new();
            // The blocker ends.
            lane.0 = 0;
            while !lane.2.is_empty() {
                // Every waiter asks; exactly one is admitted.
                let admitted: Vec<usize> = (0..lane.2.len())
                    .filter(|&at| {
                        let (executing, batch, line, state) = &lane;
                        let position = position(&rules, *executing, *batch, line, at);
                        matches!(
                            decide(&rules, priority(line[at]), &position, *state, NOW),
                            Decision::Admit(_)
                        )
                    })
                    .collect();
                assert_eq!(admitted.len(), 1, "{lane:?}");
                assert!(matches!(ask(&rules, &mut lane, admitted[0]), Decision::Admit(_)));
                order.push(ids.remove(admitted[0]));
                lane = (0, 0, lane.2, lane.3);
            }
            assert_eq!(order, expected, "{line:?}");
        }
    }

    /// With `batch_cap`, batch work is refused while it holds its share,
    /// and an interactive record behind it still takes the headroom.
    #[test]
    fn batch_work_leaves_its_headroom_to_interactive_work() {
        use Rank::{Batch as B, Interactive as I};
        let rules = LaneRules {
            batch_cap: Some(3),
            max_overtakes: 0,
            ..LaneRules::capped(4)
        };
        let mut lane = (3, 3, vec![B, B, I, I], LaneState::default());
        assert_eq!(ask(&rules, &mut lane, 0), Decision::BatchFull { batch_cap: 3 });
        assert_eq!(ask(&rules, &mut lane, 1), Decision::BatchFull { batch_cap: 3 });
        assert!(matches!(ask(&rules, &mut lane, 2), Decision::Admit(_)));
        // The headroom is taken: the next interactive record waits.
        assert_eq!(ask(&rules, &mut lane, 2), Decision::LaneFull { cap: 4 });
    }

    #[test]
    fn a_cooling_lane_grants_nothing_until_its_cooldown_ends() {
        let rules = LaneRules::capped(2);
        let first = LanePosition::default();
        let state = LaneState::default().cool(NOW, 2_500, rules.max_cooldown_ms);
        let until = NOW + 2_500;
        assert_eq!(state.cooldowns, 1);
        for priority in [Priority::Interactive, Priority::Batch] {
            assert_eq!(
                decide(&rules, priority, &first, state, NOW),
                Decision::Cooling { until }
            );
            assert_eq!(
                decide(&rules, priority, &first, state, until + -1),
                Decision::Cooling { until }
            );
            assert!(matches!(
                decide(&rules, priority, &first, state, until),
                Decision::Admit(_)
            ));
        }
        // Capped by max_cooldown; a shorter one later keeps the longer.
        let capped = LaneState::default().cool(NOW, 3_600_000, 60_000);
        assert_eq!(capped.cooling_until, Some(NOW + 60_000));
        let kept = capped.cool(NOW + 1_000, 1_000, 60_000);
        assert_eq!((kept.cooling_until, kept.cooldowns), (Some(NOW + 60_000), 2));
    }

    #[test]
    fn an_adaptive_lane_halves_on_a_refusal_and_recovers_a_slot_per_run_of_cap_successes() {
        let rules = LaneRules {
            adaptive: true,
            ..LaneRules::capped(8)
        };
        let mut state = LaneState::default();
        assert_eq!(rules.cap_in(&state), 8);
        for expected in [4, 2, 1, 1] {
            state = state.settled(&rules, false, true);
            assert_eq!(rules.cap_in(&state), expected);
        }
        // A failure without Retry-After changes nothing.
        assert_eq!(state.settled(&rules, false, false), state);
        for expected in 2..=8 {
            for _ in 0..7 {
                state = state.settled(&rules, true, false);
            }
            assert_eq!(rules.cap_in(&state), expected - 1, "not before a run of 8");
            state = state.settled(&rules, true, false);
            assert_eq!(rules.cap_in(&state), expected);
        }
        assert_eq!(state, LaneState::default(), "back at its cap, nothing kept");
        // The decision reads the effective cap.
        let halved = LaneState::default().settled(&rules, false, true);
        let position = LanePosition {
            executing: 4,
            ..LanePosition::default()
        };
        assert_eq!(
            decide(&rules, Priority::Unknown, &position, halved, NOW),
            Decision::LaneFull { cap: 4 }
        );
        // A lane that is not adaptive keeps its cap.
        let plain = LaneRules::capped(8);
        assert_eq!(
            LaneState::default().settled(&plain, false, true),
            LaneState::default()
        );
    }

    #[test]
    fn a_plain_lane_serves_first_come_first_served_whatever_the_priority() {
        let rules = LaneRules::capped(2);
        let third = LanePosition {
            executing: 0,
            waiting_ahead: 2,
            ranks: None,
            tokens_ahead: 0,
        };
        let state = LaneState::default();
        assert_eq!(
            decide(&rules, Priority::Interactive, &third, state, NOW),
            Decision::LaneFull { cap: 2 }
        );
        let second = LanePosition {
            waiting_ahead: 1,
            ..third
        };
        assert_eq!(
            decide(&rules, Priority::Batch, &second, state, NOW),
            Decision::Admit(state)
        );
    }
}
