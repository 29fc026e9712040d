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

    /// What happens on a lane: a record joins the line, one of those in
    /// line (by its place, wrapped) asks to start, or one executing ends.
    #[derive(Debug, Clone)]
    enum Step {
        Join,
        Ask(usize),
        End,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            2 => Just(Step::Join),
            3 => (0..16usize).prop_map(Step::Ask),
            1 => Just(Step::End),
        ]
    }

    /// The reference: FIFO with a cap, stated as a line. Whoever is asked
    /// lets each record waiting ahead of it take a free slot first, in
    /// line order; its own turn comes if a slot is still free after them.
    fn turn_comes(cap: u32, executing: usize, ahead: usize) -> bool {
        let mut free = (cap as usize).saturating_sub(executing);
        for _ in 0..ahead {
            if free == 0 {
                return false;
            }
            free -= 1;
        }
        free > 0
    }

    proptest! {
        /// On any history of joins, starts and ends, `decide` admits
        /// exactly whom the reference admits, and so: never more than
        /// `cap` executing; the first in line admitted whenever a slot is
        /// free; and a record admitted never takes a slot that one ahead
        /// of it still waiting would need (those can all start after it).
        #[test]
        fn admits_first_come_first_served_up_to_the_cap(
            cap in 1u32..5,
            steps in proptest::collection::vec(step(), 0..80),
        ) {
            // The line: records waiting, oldest first.
            let mut line: Vec<u32> = Vec::new();
            let mut executing = 0usize;
            let mut next = 0u32;
            for step in steps {
                match step {
                    Step::Join => {
                        line.push(next);
                        next += 1;
                    }
                    Step::Ask(at) if !line.is_empty() => {
                        let at = at % line.len();
                        let position = LanePosition { executing: executing as i64, waiting_ahead: at as i64 };
                        let decision = decide(Some(cap), position);
                        prop_assert_eq!(
                            decision == Decision::Admit,
                            turn_comes(cap, executing, at),
                            "record {} of {:?} with {} executing, cap {}", at, line, executing, cap
                        );
                        if at == 0 {
                            prop_assert_eq!(decision == Decision::Admit, executing < cap as usize);
                        }
                        match decision {
                            Decision::Admit => {
                                line.remove(at);
                                executing += 1;
                                prop_assert!(executing <= cap as usize, "{} over cap {}", executing, cap);
                                // Every record it passed still gets its slot.
                                for started in executing..executing + at {
                                    let first = LanePosition { executing: started as i64, waiting_ahead: 0 };
                                    prop_assert_eq!(decide(Some(cap), first), Decision::Admit, "overtaken");
                                }
                            }
                            Decision::LaneFull { cap: told } => prop_assert_eq!(told, cap),
                        }
                    }
                    Step::Ask(_) => {}
                    Step::End => executing = executing.saturating_sub(1),
                }
            }
        }

        #[test]
        fn a_lane_without_cap_admits_everything(executing in 0i64..1000, ahead in 0i64..1000) {
            prop_assert_eq!(decide(None, LanePosition { executing, waiting_ahead: ahead }), Decision::Admit);
        }
    }
}
