//! The questions the engine asks a store, each defined once, here.
//!
//! A store answers each question from its own indexes; this module says
//! what the answer *is*: a predicate that selects records and a key that
//! orders them, over plain records and owners. The memory store answers
//! with these functions directly; a SQL store answers with one indexed
//! statement per question, and `tests/differential.rs` runs every store
//! against a reference model to prove that they agree. A new store
//! implements the questions, never the rules behind them.

use std::cmp::Reverse;

use super::admission::{LanePosition, Rank, RankedPosition};
use super::owner::{Owner, OwnerState};
use super::record::{ActivityId, ActivityRecord, Admission, LaneKey, State};
use super::snapshot::LaneLoad;
use super::timestamp::Timestamp;
use inflight_api::ByPriority;

// Defined beside `Timestamp`, so that owners ask it without depending on
// this module; still public here, where the stores ask it.
pub use super::timestamp::is_past;

/// The grain of the per-minute completion counters.
pub const MINUTE_MS: i64 = 60_000;

/// Whether `record` is past its bound at `now`: in flight, and
/// [`is_past`] its `reapableAt`. The question "which records are due"
/// selects these, earliest `reapableAt` first ([`due_order`]).
#[inline]
pub fn is_due(record: &ActivityRecord, now: Timestamp) -> bool {
    record.state.is_in_flight() && record.reapable_at.is_some_and(|at| is_past(at, now))
}

/// The order of a reap pass: earliest bound first, then id.
pub fn due_order(record: &ActivityRecord) -> (Option<Timestamp>, ActivityId) {
    (record.reapable_at, record.activity_id)
}

/// A record's place in [`line_order`]: its `enqueuedAt`, then its id.
pub type LinePlace = (Timestamp, ActivityId);

/// Where a record waits in its lane's line: its [`Rank`] when the lane
/// ranks ([`LaneRules::ranked`](super::admission::LaneRules::ranked)),
/// each rank waiting apart, and its [`line_order`].
pub type LineSpot = (Option<Rank>, LinePlace);

/// The order of records in flight, in a snapshot and in an owner's work:
/// by `enqueuedAt`, then id. It is also the order of a lane's line.
#[inline]
pub fn line_order(record: &ActivityRecord) -> LinePlace {
    (record.enqueued_at, record.activity_id)
}

/// What a record counts as, seen from another one asking to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InLine {
    /// It holds one of the lane's slots.
    Executing,
    /// It waits in the lane's line: ahead of the record asking, or not.
    Waiting {
        /// Ahead of it by [`line_order`].
        ahead: bool,
    },
}

/// The question behind an admission decision: where a record stands in its
/// lane's line. Only `queued` records of the same lane count, and not the
/// record itself. Executing ones hold slots; waiting ones count when they
/// are ahead of it by [`line_order`]. A `newcomer` (a record begun already
/// started, so never in line) also yields to those enqueued in the same
/// millisecond, whatever their id. A `ranked` question
/// ([`LaneRules::ranked`](super::admission::LaneRules::ranked)) also tells
/// the counts apart by [`Rank`], and counts every waiting record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneQuery {
    /// The lane.
    pub lane: LaneKey,
    /// The record asking.
    pub activity_id: ActivityId,
    /// Its `enqueuedAt`.
    pub enqueued_at: Timestamp,
    /// Whether it was begun already started.
    pub newcomer: bool,
    /// Whether the answer tells ranks apart.
    pub ranked: bool,
    /// On a budgeted lane, whose estimates ahead of it the answer sums
    /// ([`LanePosition::tokens_ahead`]).
    pub tokens: Option<Ahead>,
}

/// Whose estimates a record waits for in a budgeted lane's line: those of
/// the records waiting ahead of it that the lane serves first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ahead {
    /// Every record ahead of it in line order.
    All,
    /// Only the interactive ones: an interactive record on a lane that
    /// lets interactive work overtake (`max_overtakes > 0`).
    Interactive,
}

impl LaneQuery {
    /// The question `record` asks.
    pub fn of(record: &ActivityRecord, newcomer: bool, ranked: bool) -> Self {
        Self {
            lane: record.lane(),
            activity_id: record.activity_id,
            enqueued_at: record.enqueued_at,
            newcomer,
            ranked,
            tokens: None,
        }
    }

    /// The same question, also summing the estimates `ahead` of it.
    #[must_use]
    pub fn with_tokens(mut self, ahead: Ahead) -> Self {
        self.tokens = Some(ahead);
        self
    }

    /// How `other` counts in the answer, if at all.
    #[inline]
    pub fn counts(&self, other: &ActivityRecord) -> Option<InLine> {
        if other.admission == Admission::Direct
            || other.activity_id == self.activity_id
            || other.labels.service != self.lane.service
            || other.labels.provider != self.lane.provider
        {
            return None;
        }
        match other.state {
            // An `external` record executing holds a slot; waiting, it
            // holds no place in line.
            State::Executing => Some(InLine::Executing),
            State::Waiting if other.admission == Admission::Queued => {
                let ahead = (other.enqueued_at, other.activity_id) < (self.enqueued_at, self.activity_id)
                    || (self.newcomer && other.enqueued_at == self.enqueued_at);
                Some(InLine::Waiting { ahead })
            }
            _ => None,
        }
    }

    /// The answer, from every record in flight (any order).
    pub fn answer<'a>(&self, in_flight: impl IntoIterator<Item = &'a ActivityRecord>) -> LanePosition {
        let mut position = LanePosition::default();
        let mut ranks = RankedPosition::default();
        for other in in_flight {
            let Some(in_line) = self.counts(other) else {
                continue;
            };
            let batch = Rank::of(other.priority) == Rank::Batch;
            match in_line {
                InLine::Executing => {
                    position.executing += 1;
                    ranks.executing_batch += i64::from(batch);
                }
                InLine::Waiting { ahead } => {
                    position.waiting_ahead += i64::from(ahead);
                    if ahead && self.tokens.is_some_and(|rule| rule == Ahead::All || !batch) {
                        position.tokens_ahead += other.max_tokens.unwrap_or(0);
                    }
                    let (waiting, counted_ahead) = if batch {
                        (&mut ranks.batch_waiting, &mut ranks.batch_ahead)
                    } else {
                        (&mut ranks.interactive_waiting, &mut ranks.interactive_ahead)
                    };
                    *waiting += 1;
                    *counted_ahead += i64::from(ahead);
                }
            }
        }
        position.ranks = self.ranked.then_some(ranks);
        position
    }
}

/// Tallies the load of every lane from the records in flight, given in
/// [`line_order`]: only `queued` records count; the oldest waiting one
/// gives the lane's wait. Lanes come out ordered by lane.
pub fn lane_loads<'a>(in_flight: impl IntoIterator<Item = &'a ActivityRecord>) -> Vec<LaneLoad> {
    let mut loads: std::collections::BTreeMap<LaneKey, LaneLoad> = std::collections::BTreeMap::new();
    for record in in_flight {
        let in_line = record.admission == Admission::Queued && record.state == State::Waiting;
        if !(in_line || (record.admission != Admission::Direct && record.state == State::Executing)) {
            continue;
        }
        let lane = record.lane();
        let load = loads.entry(lane.clone()).or_insert(LaneLoad {
            lane,
            executing: 0,
            waiting: 0,
            oldest_waiting_since: None,
            next_waiting_reapable_at: None,
            by_priority: ByPriority::default(),
        });
        let by_priority = load.by_priority.of_mut(record.priority);
        if record.state == State::Executing {
            load.executing += 1;
            by_priority.executing += 1;
        } else {
            load.waiting += 1;
            by_priority.waiting += 1;
            let oldest = load.oldest_waiting_since.get_or_insert(record.enqueued_at);
            *oldest = (*oldest).min(record.enqueued_at);
            if let Some(at) = record.reapable_at {
                let next = load.next_waiting_reapable_at.get_or_insert(at);
                *next = (*next).min(at);
            }
        }
    }
    loads.into_values().collect()
}

/// A snapshot's history window: from `since` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// The window's start (inclusive).
    pub since: Timestamp,
}

impl Window {
    /// Whether `record` is a completion in the window: settled at or after
    /// `since`. Listed newest first ([`Window::completed_order`]).
    pub fn completed(&self, record: &ActivityRecord) -> bool {
        record.state.is_settled() && record.completed_at.is_some_and(|at| at >= self.since)
    }

    /// Completions newest first: by `completedAt`, then id, descending.
    pub fn completed_order(record: &ActivityRecord) -> Reverse<(Option<Timestamp>, ActivityId)> {
        Reverse((record.completed_at, record.activity_id))
    }

    /// Whether `record` was reaped in the window: reaped at or after `since`.
    pub fn reaped(&self, record: &ActivityRecord) -> bool {
        record.state == State::Reaped && record.reaped_at.is_some_and(|at| at >= self.since)
    }

    /// Reaped records newest first: by `reapedAt`, then id, descending.
    pub fn reaped_order(record: &ActivityRecord) -> Reverse<(Option<Timestamp>, ActivityId)> {
        Reverse((record.reaped_at, record.activity_id))
    }

    /// Whether a snapshot lists `owner`: live, or ended in the window.
    /// Listed by [`Window::owner_order`].
    pub fn lists_owner(&self, owner: &Owner) -> bool {
        owner.state == OwnerState::Live || owner.ended_at.is_some_and(|at| at >= self.since)
    }

    /// Owners by registration, then id.
    pub fn owner_order(owner: &Owner) -> (Timestamp, &str) {
        (owner.registered_at, owner.owner_id.as_str())
    }

    /// How completions in the window are counted without reading history:
    /// the records completed in `partial` (the window's first, partial
    /// minute) one by one, and every whole minute from `first_whole_minute`
    /// on from its counter.
    pub fn completion_count_plan(&self) -> CompletionCountPlan {
        let first_whole_minute = completion_minute(self.since) + 1;
        CompletionCountPlan {
            partial: (self.since, Timestamp::from_millis(first_whole_minute * MINUTE_MS)),
            first_whole_minute,
        }
    }
}

/// See [`Window::completion_count_plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompletionCountPlan {
    /// `[from, to)`: count settled records whose `completedAt` is in it.
    pub partial: (Timestamp, Timestamp),
    /// Sum the per-minute counters of this minute and every later one.
    pub first_whole_minute: i64,
}

/// The minute a completion at `at` is counted in.
#[inline]
pub fn completion_minute(at: Timestamp) -> i64 {
    at.as_millis().div_euclid(MINUTE_MS)
}

/// When a record left flight: settled or reaped. `None` while in flight.
pub fn ended_at(record: &ActivityRecord) -> Option<Timestamp> {
    match record.state {
        State::Waiting | State::Executing => None,
        State::Reaped => record.reaped_at,
        _ => record.completed_at,
    }
}

/// What a prune deletes: everything that ended before `before`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Records, owners and minute counters older than this go.
    pub before: Timestamp,
}

impl Retention {
    /// The retention window ending at `now`, `keep_ms` long.
    pub fn at(now: Timestamp, keep_ms: i64) -> Self {
        Self {
            before: now.sub_millis(keep_ms),
        }
    }

    /// Whether a prune deletes `record`: it settled or was reaped before
    /// `before`. Deleted oldest first ([`Retention::record_order`]), a batch
    /// at a time.
    pub fn prunes(&self, record: &ActivityRecord) -> bool {
        ended_at(record).is_some_and(|at| at < self.before)
    }

    /// Oldest end first, then id.
    pub fn record_order(record: &ActivityRecord) -> (Option<Timestamp>, ActivityId) {
        (ended_at(record), record.activity_id)
    }

    /// Whether a prune deletes `owner`: it was lost or released before
    /// `before`.
    pub fn prunes_owner(&self, owner: &Owner) -> bool {
        owner.ended_at.is_some_and(|at| at < self.before)
    }

    /// Minute counters before this minute are deleted.
    pub fn first_kept_minute(&self) -> i64 {
        completion_minute(self.before)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LedgerConfig;
    use crate::domain::transition::{self, NewActivity};

    /// `ms` after a realistic instant: the ledger refuses a caller's time
    /// before 2001.
    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(1_786_000_000_000 + ms)
    }

    fn waiting(enqueued_at: Timestamp) -> ActivityRecord {
        let new = NewActivity {
            enqueued_at: Some(enqueued_at),
            ..NewActivity::fixture("embedding")
        };
        transition::begin(new, enqueued_at, LedgerConfig::default().policy())
            .unwrap()
            .record
    }

    #[test]
    fn a_newcomer_yields_to_records_enqueued_in_the_same_millisecond() {
        let me = waiting(at(10));
        let same_ms = waiting(at(10)); // a later id
        let query = LaneQuery::of(&me, false, false);
        assert_eq!(
            query.counts(&same_ms),
            Some(InLine::Waiting { ahead: false }),
            "a later id waits behind"
        );
        let query = LaneQuery::of(&me, true, false);
        assert_eq!(query.counts(&same_ms), Some(InLine::Waiting { ahead: true }));
        assert_eq!(query.counts(&me), None, "never counts itself");
    }

    #[test]
    fn the_first_whole_minute_follows_the_partial_one() {
        let plan = Window {
            since: Timestamp::from_millis(90_000),
        }
        .completion_count_plan();
        assert_eq!(
            plan.partial,
            (Timestamp::from_millis(90_000), Timestamp::from_millis(120_000))
        );
        assert_eq!(plan.first_whole_minute, 2);
        let plan = Window {
            since: Timestamp::from_millis(120_000),
        }
        .completion_count_plan();
        assert_eq!(
            plan.partial,
            (Timestamp::from_millis(120_000), Timestamp::from_millis(180_000))
        );
    }

    #[test]
    fn lane_loads_take_the_oldest_wait() {
        let (a, b) = (waiting(at(20)), waiting(at(10)));
        let loads = lane_loads([&a, &b]);
        assert_eq!(loads.len(), 1);
        assert_eq!(
            (loads[0].waiting, loads[0].oldest_waiting_since),
            (2, Some(at(10)))
        );
    }
}
