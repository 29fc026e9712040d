//! How an effect changes its lane's capacity: the one rule that wakes the
//! records waiting in line in this process and, on PostgreSQL, tells the
//! other instances.

use super::record::{ActivityRecord, Admission};
use super::transition::Effect;

/// A change of a lane's capacity, for those waiting on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Capacity {
    /// A slot was taken: the record started.
    Granted,
    /// A slot or a place in line came free: the record, executing or
    /// waiting, left the line (settled, cancelled or reaped). A waiter
    /// behind a record that left may be admitted now, as after a freed
    /// slot.
    Freed,
}

/// The change `effect` made to the capacity of `record`'s lane, if any.
/// Only records admitted by the lane's line count ([`Admission::Queued`]),
/// as [`LaneQuery::counts`](super::query::LaneQuery::counts) counts them,
/// and only on a lane with a cap: no one waits on another. `capped` says
/// whether the lane has one; it is asked last, only about an effect that
/// would change capacity. A late settle or a begin frees nothing: a
/// reaped record left the line when it was reaped, and a newcomer joins
/// behind every waiter.
pub fn change(record: &ActivityRecord, effect: &Effect, capped: impl FnOnce() -> bool) -> Option<Capacity> {
    if record.admission == Admission::Direct {
        return None;
    }
    let change = match effect {
        Effect::Started { .. } => Capacity::Granted,
        Effect::Settled { .. } | Effect::Reaped { .. } => Capacity::Freed,
        Effect::Begun { .. }
        | Effect::Resurrected
        | Effect::LateSettle { .. }
        | Effect::LeftAggregate
        | Effect::JoinedAggregate { .. } => return None,
    };
    capped().then_some(change)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::record::{Disposition, ReapReason, State};
    use crate::domain::timestamp::Timestamp;
    use crate::domain::transition::{self, NewActivity};
    use crate::domain::usage::Tokens;

    fn record(admission: Admission) -> ActivityRecord {
        let new = NewActivity {
            admission,
            ..NewActivity::fixture("chat")
        };
        let policy = crate::config::LedgerConfig::default();
        transition::begin(new, Timestamp::from_millis(1_000), policy.policy())
            .unwrap()
            .record
    }

    fn effects() -> [Effect; 6] {
        let at = Timestamp::from_millis(2_000);
        [
            Effect::Begun { at },
            Effect::Started { at, queue_wait_ms: 0 },
            Effect::Settled {
                at,
                state: State::Succeeded,
                execution_ms: Some(1),
                queue_wait_ms: Some(0),
                tokens: Tokens::default(),
            },
            Effect::Reaped {
                disposition: Disposition::Abandoned,
                reason: ReapReason::Deadline,
                age_ms: 1,
                bound_ms: 1,
                queue_wait_ms: None,
            },
            Effect::Resurrected,
            Effect::LateSettle {
                at,
                tokens: Tokens::default(),
            },
        ]
    }

    #[test]
    fn a_start_grants_and_a_settle_or_a_reap_frees() {
        let queued = record(Admission::Queued);
        let changes: Vec<_> = effects()
            .iter()
            .map(|effect| change(&queued, effect, || true))
            .collect();
        assert_eq!(
            changes,
            [
                None,
                Some(Capacity::Granted),
                Some(Capacity::Freed),
                Some(Capacity::Freed),
                None,
                None
            ]
        );
    }

    #[test]
    fn nothing_changes_off_the_line_or_on_a_lane_without_a_cap() {
        let direct = record(Admission::Direct);
        let queued = record(Admission::Queued);
        for effect in effects() {
            assert_eq!(change(&direct, &effect, || true), None);
            assert_eq!(change(&queued, &effect, || false), None);
        }
    }
}
