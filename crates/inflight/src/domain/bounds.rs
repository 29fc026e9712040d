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
    /// The tokens a call of the class is estimated to spend, when its begin
    /// declares none (`maxTokens`).
    tokens: Option<i64>,
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
            tokens: None,
        })
    }

    /// The class with `tokens` as the estimate of a call that declares
    /// none (`[classes.NAME] tokens`).
    ///
    /// # Errors
    /// A count outside 0 to [`MAX_TOKENS`](super::usage::MAX_TOKENS), naming
    /// `tokens`.
    pub fn with_tokens(self, tokens: i64) -> Result<Self, BoundsError> {
        if !(0..=super::usage::MAX_TOKENS).contains(&tokens) {
            return Err(BoundsError {
                field: "tokens",
                problem: format!(
                    "must be a whole number from 0 to {}, got {tokens}",
                    super::usage::MAX_TOKENS
                ),
            });
        }
        Ok(Self {
            tokens: Some(tokens),
            ..self
        })
    }

    /// The estimate of a call of the class that declares none.
    pub fn tokens(&self) -> Option<i64> {
        self.tokens
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
    /// The classes again, in the same order, with their queue wait already
    /// scaled: every begin looks its class up, and a short list compared by
    /// length first finds it without the tree's string comparisons or the
    /// float arithmetic of [`Self::scale`].
    resolved: Vec<ResolvedClass>,
    factor: f64,
    /// The factor when it is a whole number (the default 4 is), for the
    /// integer fast path of [`Self::scale`].
    whole_factor: Option<i64>,
    /// The widest deadline or queue wait of any class, before the factor:
    /// the deadline of a record of an unconfigured class.
    widest_raw_ms: i64,
    widest_ms: i64,
    /// Whether any class sets `tokens`: without one, a begin that declares
    /// no estimate looks no class up for it.
    class_tokens: bool,
}

/// A class as the hot path reads it.
#[derive(Debug, Clone, PartialEq)]
struct ResolvedClass {
    name: Box<str>,
    deadline_ms: i64,
    /// `max_queue_wait_ms`, factor applied.
    scaled_queue_wait_ms: i64,
    tokens: Option<i64>,
}

/// Past this many classes, the resolved list is searched by bisection.
/// Below, a scan compared by length first: with the default two classes it
/// ran 168 instructions a lifecycle fewer than bisection (4,996 against
/// 5,164 at `a1c37ea`, callgrind, `memory_lifecycle`).
const LINEAR_CLASSES: usize = 8;

/// The definition of a scaled bound: `ms` times `factor` in f64, rounded
/// up, saturating. [`ReapPolicy::scale`] gives the same answer faster for
/// whole factors.
fn scaled_by_float(ms: i64, factor: f64) -> i64 {
    let scaled = (ms as f64 * factor).ceil();
    if scaled >= i64::MAX as f64 {
        i64::MAX
    } else {
        scaled as i64
    }
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
        // Exact in f64 and in i64 alike up to 2^20; larger whole factors
        // take the float path, which is the definition.
        let whole_factor = (factor.fract() == 0.0 && factor <= f64::from(1 << 20)).then_some(factor as i64);
        let mut policy = Self {
            classes,
            resolved: Vec::new(),
            factor,
            whole_factor,
            widest_raw_ms: widest_raw,
            widest_ms: 0,
            class_tokens: false,
        };
        policy.class_tokens = policy.classes.values().any(|bounds| bounds.tokens.is_some());
        policy.widest_ms = policy.scale(widest_raw);
        policy.resolved = policy
            .classes
            .iter()
            .map(|(name, bounds)| ResolvedClass {
                name: name.as_str().into(),
                deadline_ms: bounds.deadline_ms,
                scaled_queue_wait_ms: policy.scale(bounds.max_queue_wait_ms),
                tokens: bounds.tokens,
            })
            .collect();
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

    /// `ms` times the factor, rounded up, saturating.
    fn scale(&self, ms: i64) -> i64 {
        // A whole factor gives the float path's answer exactly while the
        // product stays within f64's 53 bits of integer precision.
        if let Some(product) = self.whole_factor.and_then(|k| ms.checked_mul(k)) {
            if product.unsigned_abs() < 1 << 53 {
                return product;
            }
        }
        scaled_by_float(ms, self.factor)
    }

    /// The execution deadline a record runs under: its own when it declared
    /// one, else its class's; for an unconfigured class, the widest raw
    /// deadline or queue wait of any class.
    pub fn effective_deadline_ms(&self, class: &str, declared: Option<i64>) -> i64 {
        if let Some(own) = declared {
            return own;
        }
        match self.class(class) {
            Some(resolved) => resolved.deadline_ms,
            None => self.widest_raw_ms,
        }
    }

    /// The tokens a call is estimated to spend: its begin's `maxTokens`,
    /// else its class's `tokens`, else none (it reserves nothing, and its
    /// reported usage is what counts).
    pub fn estimate(&self, class: &str, declared: Option<i64>) -> Option<i64> {
        match declared {
            Some(tokens) => Some(tokens),
            None if self.class_tokens => self.class(class).and_then(|resolved| resolved.tokens),
            None => None,
        }
    }

    /// Whether the class `name` is configured: a call of any other gets
    /// the widest bound.
    pub fn knows(&self, name: &str) -> bool {
        self.class(name).is_some()
    }

    /// The configured class `name`.
    fn class(&self, name: &str) -> Option<&ResolvedClass> {
        if self.resolved.len() <= LINEAR_CLASSES {
            // `==` on strings compares lengths before bytes.
            self.resolved.iter().find(|class| *class.name == *name)
        } else {
            let at = self
                .resolved
                .binary_search_by(|class| (*class.name).cmp(name))
                .ok()?;
            Some(&self.resolved[at])
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
                let bound = match self.class(record.labels.class.as_str()) {
                    Some(class) => class.scaled_queue_wait_ms,
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

    #[test]
    fn a_whole_factor_scales_exactly_as_the_float_definition() {
        let classes = BTreeMap::from([("chat".to_owned(), ClassBounds::new(secs(1), None).unwrap())]);
        for factor in [1.0, 4.0, 7.0, 2.5, 1_048_576.0, 2_097_152.0] {
            let policy = ReapPolicy::new(classes.clone(), factor).unwrap();
            assert_eq!(
                policy.whole_factor.is_some(),
                factor.fract() == 0.0 && factor <= 1_048_576.0
            );
            for ms in [
                1,
                999,
                300_000,
                (1 << 50) + 1,
                (1 << 51) - 1,
                1 << 53,
                (1 << 53) + 1,
                i64::MAX / 4 + 3,
                i64::MAX,
            ] {
                assert_eq!(
                    policy.scale(ms),
                    scaled_by_float(ms, factor),
                    "{ms} ms x {factor}"
                );
            }
        }
    }

    #[test]
    fn classes_are_found_in_a_short_list_and_in_a_long_one() {
        for count in [1, LINEAR_CLASSES, LINEAR_CLASSES + 1, 40] {
            let classes: BTreeMap<_, _> = (0..count)
                .map(|i| {
                    let wait = secs(1_000 + i as u64);
                    (
                        format!("class-{i}"),
                        ClassBounds::new(secs(1 + i as u64), Some(wait)).unwrap(),
                    )
                })
                .collect();
            let policy = ReapPolicy::new(classes.clone(), 2.5).unwrap();
            for (name, bounds) in &classes {
                assert_eq!(policy.effective_deadline_ms(name, None), bounds.deadline_ms());
                let found = policy.class(name).expect("a configured class");
                assert_eq!(
                    found.scaled_queue_wait_ms,
                    scaled_by_float(bounds.max_queue_wait_ms(), 2.5)
                );
            }
            assert!(policy.class("class-").is_none());
            assert!(policy.class("zzz").is_none());
            assert_eq!(policy.effective_deadline_ms("nope", None), policy.widest_raw_ms);
        }
    }
}
