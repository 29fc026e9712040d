//! Bounds: when an in-flight record is definitionally leaked.
//!
//! Every bound derives from the record's own deadline class (or its own
//! declared deadline), never from one global TTL: a global TTL either reaps
//! legitimate long batches or lets short calls leak for hours.

use std::collections::BTreeMap;
use std::time::Duration;

use super::record::{ActivityRecord, State};
use super::timestamp::Timestamp;

/// The deadlines of one class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassBounds {
    deadline_ms: i64,
    max_queue_wait_ms: i64,
}

impl ClassBounds {
    /// A class with execution `deadline` and `max_queue_wait` (which defaults
    /// to the deadline when `None`).
    ///
    /// # Errors
    /// A zero duration, or one too large to count in milliseconds, names the
    /// offending field.
    pub fn new(deadline: Duration, max_queue_wait: Option<Duration>) -> Result<Self, BoundsError> {
        let deadline_ms = positive_millis("deadline", deadline)?;
        let max_queue_wait_ms = match max_queue_wait {
            Some(wait) => positive_millis("max_queue_wait", wait)?,
            None => deadline_ms,
        };
        Ok(Self {
            deadline_ms,
            max_queue_wait_ms,
        })
    }

    /// The execution deadline, in milliseconds.
    pub fn deadline_ms(&self) -> i64 {
        self.deadline_ms
    }

    /// The longest legitimate wait in the queue, in milliseconds.
    pub fn max_queue_wait_ms(&self) -> i64 {
        self.max_queue_wait_ms
    }
}

/// A bound that cannot be constructed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct BoundsError {
    /// The setting at fault (`deadline`, `factor`, `classes`, ...).
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

fn positive_millis(field: &'static str, d: Duration) -> Result<i64, BoundsError> {
    let ms = i64::try_from(d.as_millis()).map_err(|_| BoundsError {
        field,
        problem: "is too large".into(),
    })?;
    if ms <= 0 {
        return Err(BoundsError {
            field,
            problem: "must be at least 1ms".into(),
        });
    }
    Ok(ms)
}

/// The reaping rules of one ledger: its classes and its factor.
///
/// Only valid policies can be constructed: at least one class, a factor of
/// at least 1.
#[derive(Debug, Clone, PartialEq)]
pub struct ReapPolicy {
    classes: BTreeMap<String, ClassBounds>,
    factor: f64,
    /// The widest deadline or queue wait of any class, before the factor:
    /// the deadline of a record of an unconfigured class.
    widest_raw_ms: i64,
    widest_ms: i64,
}

/// The default reap factor.
pub const DEFAULT_FACTOR: f64 = 4.0;

impl ReapPolicy {
    /// A policy over `classes` with reap `factor`.
    ///
    /// # Errors
    /// No class at all, or a factor below 1 (or not finite).
    pub fn new(classes: BTreeMap<String, ClassBounds>, factor: f64) -> Result<Self, BoundsError> {
        if classes.is_empty() {
            return Err(BoundsError {
                field: "classes",
                problem: "at least one deadline class must be configured".into(),
            });
        }
        if !factor.is_finite() || factor < 1.0 {
            return Err(BoundsError {
                field: "factor",
                problem: format!("must be a number of at least 1, got {factor}"),
            });
        }
        let widest_raw = classes
            .values()
            .map(|c| c.deadline_ms.max(c.max_queue_wait_ms))
            .max()
            .unwrap_or(1);
        let mut policy = Self {
            classes,
            factor,
            widest_raw_ms: widest_raw,
            widest_ms: 0,
        };
        policy.widest_ms = policy.scale(widest_raw);
        Ok(policy)
    }

    /// The configured classes.
    pub fn classes(&self) -> &BTreeMap<String, ClassBounds> {
        &self.classes
    }

    /// The reap factor.
    pub fn factor(&self) -> f64 {
        self.factor
    }

    /// The widest bound of any configured class, execution or queue, factor
    /// applied: what a record of an unconfigured class is given.
    pub fn widest_bound_ms(&self) -> i64 {
        self.widest_ms
    }

    fn scale(&self, ms: i64) -> i64 {
        let scaled = (ms as f64 * self.factor).ceil();
        if scaled >= i64::MAX as f64 {
            i64::MAX
        } else {
            scaled as i64
        }
    }

    /// The execution deadline a record runs under: its own when it declared
    /// one, else its class's; for an unconfigured class, the widest raw
    /// deadline or queue wait of any class.
    pub fn effective_deadline_ms(&self, class: &str, declared: Option<i64>) -> i64 {
        if let Some(own) = declared {
            return own;
        }
        match self.classes.get(class) {
            Some(bounds) => bounds.deadline_ms,
            None => self.widest_raw_ms,
        }
    }

    /// Recomputes the deadline and bound of an in-flight `record` under
    /// this policy, so that a changed configuration (a longer deadline, a
    /// new factor) applies to work already in flight when a store opens;
    /// `true` when either changed.
    pub fn rebound(&self, record: &mut ActivityRecord) -> bool {
        if !record.state.is_in_flight() {
            return false;
        }
        let stored = (record.deadline_ms, record.reapable_at);
        // The deadline first: the bound is computed from it.
        record.deadline_ms =
            self.effective_deadline_ms(record.labels.class.as_str(), record.declared_deadline_ms);
        record.reapable_at = self.reapable_at(record);
        (record.deadline_ms, record.reapable_at) != stored
    }

    /// The instant past which `record` is reaped, or `None` when it is not in
    /// flight. A record is reapable once `now` is past it ([`crate::domain::query::is_past`]).
    ///
    /// An executing record's bound is its effective deadline
    /// (`deadline_ms`, as [`Self::effective_deadline_ms`] set it) times the
    /// factor; a waiting record's is its class's queue wait times the
    /// factor, or the widest bound for an unconfigured class.
    pub fn reapable_at(&self, record: &ActivityRecord) -> Option<Timestamp> {
        match record.state {
            State::Executing => {
                let started = record.started_at.unwrap_or(record.enqueued_at);
                Some(started.add_millis(self.scale(record.deadline_ms)))
            }
            State::Waiting => {
                let bound = match self.classes.get(record.labels.class.as_str()) {
                    Some(class) => self.scale(class.max_queue_wait_ms),
                    None => self.widest_ms,
                };
                Some(record.enqueued_at.add_millis(bound))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_policy_needs_a_class_and_a_factor_of_at_least_one() {
        assert_eq!(
            ReapPolicy::new(BTreeMap::new(), 4.0).unwrap_err().field,
            "classes"
        );
        let classes = BTreeMap::from([("chat".to_owned(), ClassBounds::new(secs(1), None).unwrap())]);
        assert_eq!(ReapPolicy::new(classes.clone(), 0.5).unwrap_err().field, "factor");
        assert_eq!(ReapPolicy::new(classes, f64::NAN).unwrap_err().field, "factor");
    }

    #[test]
    fn zero_deadlines_cannot_be_constructed() {
        assert_eq!(
            ClassBounds::new(Duration::ZERO, None).unwrap_err().field,
            "deadline"
        );
        assert_eq!(
            ClassBounds::new(secs(1), Some(Duration::ZERO)).unwrap_err().field,
            "max_queue_wait"
        );
    }

    #[test]
    fn widest_bound_covers_execution_and_queue() {
        let classes = BTreeMap::from([
            ("embedding".to_owned(), ClassBounds::new(secs(300), None).unwrap()),
            (
                "chat".to_owned(),
                ClassBounds::new(secs(600), Some(secs(900))).unwrap(),
            ),
        ]);
        let policy = ReapPolicy::new(classes, 4.0).unwrap();
        assert_eq!(policy.widest_bound_ms(), 3_600_000);
        assert_eq!(policy.effective_deadline_ms("embedding", None), 300_000);
        assert_eq!(policy.effective_deadline_ms("embedding", Some(7)), 7);
        assert_eq!(policy.effective_deadline_ms("unknown", None), 900_000);
    }
}
