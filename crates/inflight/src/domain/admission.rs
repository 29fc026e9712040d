//! Native admission: the cap of a lane, enforced from the ledger's own
//! records.
//!
//! The decision is a pure function of plain counts that the store reads in
//! the same transaction that writes the start, after reaping: a leaked record
//! never holds a slot, and what operators read is what admission decides.

/// What a lane looks like to one record asking to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LanePosition {
    /// Queued records executing on the lane now (leaks already reaped).
    pub executing: i64,
    /// Queued records waiting on the lane that were enqueued before this one.
    pub waiting_ahead: i64,
}

/// The answer to a start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Start now.
    Admit,
    /// The lane is full for this record: its turn has not come.
    LaneFull {
        /// The lane's cap.
        cap: u32,
    },
}

/// Decides whether a record may start on a lane with `cap`.
///
/// Capacity goes to waiting records first come, first served: a record is
/// admitted when the lane's executing count plus the records waiting ahead
/// of it is below the cap, so a newcomer never overtakes a record that waits.
/// A lane with no cap admits everything.
///
/// ```
/// use inflight::domain::admission::{decide, Decision, LanePosition};
/// let third_in_line = LanePosition { executing: 0, waiting_ahead: 2 };
/// assert_eq!(decide(Some(2), third_in_line), Decision::LaneFull { cap: 2 });
/// assert_eq!(decide(Some(3), third_in_line), Decision::Admit);
/// assert_eq!(decide(None, third_in_line), Decision::Admit);
/// ```
pub fn decide(cap: Option<u32>, position: LanePosition) -> Decision {
    match cap {
        Some(cap) if position.executing + position.waiting_ahead >= i64::from(cap) => {
            Decision::LaneFull { cap }
        }
        _ => Decision::Admit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn admits_exactly_while_below_the_cap(cap in 1u32..64, executing in 0i64..80, ahead in 0i64..80) {
            let decision = decide(Some(cap), LanePosition { executing, waiting_ahead: ahead });
            prop_assert_eq!(decision == Decision::Admit, executing + ahead < i64::from(cap));
        }

        #[test]
        fn a_lane_without_cap_admits_everything(executing in 0i64..1000, ahead in 0i64..1000) {
            prop_assert_eq!(decide(None, LanePosition { executing, waiting_ahead: ahead }), Decision::Admit);
        }
    }
}
