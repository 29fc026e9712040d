//! [`Effect`]: what a transition did, which the counters follow. A leaf
//! between the state machine that produces effects and the counters that
//! count them, so that neither depends on the other.

use smallvec::SmallVec;

use super::record::{Disposition, ReapReason, State};
use super::timestamp::Timestamp;
use super::usage::Tokens;

/// Something a transition did, which the aggregate counters follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// A record was created (at its `enqueuedAt`).
    Begun {
        /// Its `enqueuedAt`.
        at: Timestamp,
    },
    /// A record started executing after waiting `queue_wait_ms`.
    Started {
        /// Its `startedAt`.
        at: Timestamp,
        /// `startedAt - enqueuedAt`.
        queue_wait_ms: i64,
    },
    /// A record settled (`Succeeded`, `Failed` or `Cancelled`).
    Settled {
        /// Its `completedAt`.
        at: Timestamp,
        /// The state it settled in.
        state: State,
        /// `completedAt - startedAt`, if it had started.
        execution_ms: Option<i64>,
        /// `startedAt - enqueuedAt`, if it had started: the queue wait is
        /// counted when the call ends, under its final model.
        queue_wait_ms: Option<i64>,
        /// The tokens its settle reported.
        tokens: Tokens,
    },
    /// A record was reaped.
    Reaped {
        /// How it had leaked.
        disposition: Disposition,
        /// Why it was reaped.
        reason: ReapReason,
        /// How long it had been in its state when reaped: since its start
        /// when `unsettled`, since its enqueue when `abandoned`.
        age_ms: i64,
        /// Its bound, from the same instant: past this age it is due.
        bound_ms: i64,
        /// `startedAt - enqueuedAt` when it had started (`unsettled`).
        queue_wait_ms: Option<i64>,
    },
    /// An abandoned record was started after all: it is live again.
    Resurrected,
    /// A refinement moved a record in flight out of this aggregate (to the
    /// one its new model counts in).
    LeftAggregate,
    /// A refinement moved a record in flight into this aggregate at `at`.
    JoinedAggregate {
        /// When the refinement landed.
        at: Timestamp,
    },
    /// The first settle or cancel to arrive for a reaped record.
    LateSettle {
        /// When the late settle counts as seen (clamped into the record's life).
        at: Timestamp,
        /// The tokens it reported: the call ran, and spent them.
        tokens: Tokens,
    },
}

impl Effect {
    /// Whether it ends a record (settled, cancelled or reaped) or takes an
    /// end back (a resurrection): what a store shows those watching its
    /// records' ends.
    pub fn marks_end(&self) -> bool {
        matches!(
            self,
            Self::Settled { .. } | Self::Reaped { .. } | Self::Resurrected
        )
    }
}

/// What one transition did: at most a reap, a resurrection, a start and a
/// second reap, so they fit inline and a transition allocates nothing.
pub type Effects = SmallVec<[Effect; 4]>;
