//! How many distinct lanes and aggregates callers can create.
//!
//! Labels are checked for shape, but a caller that sends a new `service` or
//! `model` on every call would otherwise create a new lane, a new aggregate
//! and new metric series each time, and memory, storage and every scrape
//! would grow without limit. As the seed's ledger did with its closed
//! vocabularies, values past a bound are folded into [`OTHER`]: the call is
//! still recorded, admitted and counted, under a label that says it was
//! folded. A setting makes such a begin refused instead.
//!
//! Two steps, both decided here:
//! - [`Cardinality::restrict`]: the configured vocabularies, a pure
//!   function of the labels;
//! - [`Cardinality::bound`]: the limits on distinct lanes and aggregates,
//!   given a [`Census`] of what the store already holds.

use std::collections::BTreeSet;
use std::num::NonZeroU32;

use super::labels::{ActivityLabels, Label, LabelSet};
use super::refusal::Refusal;

/// The label a folded value becomes.
pub const OTHER: &str = "other";

/// The default limit on distinct lanes (`service::provider`).
pub const DEFAULT_MAX_LANES: u32 = 512;
/// The default limit on distinct aggregates (label sets with priority and
/// admission).
pub const DEFAULT_MAX_AGGREGATES: u32 = 10_000;

/// What happens to a begin that would go past a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overflow {
    /// Fold the new values into [`OTHER`]; the call is recorded.
    #[default]
    Fold,
    /// Refuse the begin with an error that names the limit.
    Refuse,
}

/// The values a label may take; anything else is folded.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Vocabularies {
    /// Allowed services, or any.
    pub service: Option<BTreeSet<String>>,
    /// Allowed providers, or any.
    pub provider: Option<BTreeSet<String>>,
    /// Allowed operation stages, or any.
    pub operation_stage: Option<BTreeSet<String>>,
    /// Allowed models, or any.
    pub model: Option<BTreeSet<String>>,
}

/// The bounds on distinct labels. [`Cardinality::default`] allows
/// [`DEFAULT_MAX_LANES`] lanes and [`DEFAULT_MAX_AGGREGATES`] aggregates,
/// folds past them, and has no vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cardinality {
    max_lanes: NonZeroU32,
    max_aggregates: NonZeroU32,
    overflow: Overflow,
    vocabularies: Vocabularies,
}

impl Default for Cardinality {
    fn default() -> Self {
        Self {
            max_lanes: NonZeroU32::new(DEFAULT_MAX_LANES).expect("non-zero"),
            max_aggregates: NonZeroU32::new(DEFAULT_MAX_AGGREGATES).expect("non-zero"),
            overflow: Overflow::Fold,
            vocabularies: Vocabularies::default(),
        }
    }
}

/// What the store holds, as [`Cardinality::bound`] needs it for a begin
/// whose aggregate is not stored yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Census {
    /// Whether the begin's lane is stored (or declared in the
    /// configuration).
    pub lane_known: bool,
    /// Distinct lanes stored.
    pub lanes: i64,
    /// Distinct aggregates stored.
    pub aggregates: i64,
}

impl Cardinality {
    /// At most `max` distinct lanes.
    #[must_use]
    pub fn with_max_lanes(mut self, max: NonZeroU32) -> Self {
        self.max_lanes = max;
        self
    }

    /// At most `max` distinct aggregates.
    #[must_use]
    pub fn with_max_aggregates(mut self, max: NonZeroU32) -> Self {
        self.max_aggregates = max;
        self
    }

    /// What a begin past a limit gets.
    #[must_use]
    pub fn with_overflow(mut self, overflow: Overflow) -> Self {
        self.overflow = overflow;
        self
    }

    /// Only these values, each label for which a set is given.
    #[must_use]
    pub fn with_vocabularies(mut self, vocabularies: Vocabularies) -> Self {
        self.vocabularies = vocabularies;
        self
    }

    /// The limit on distinct lanes.
    pub fn max_lanes(&self) -> u32 {
        self.max_lanes.get()
    }

    /// The limit on distinct aggregates.
    pub fn max_aggregates(&self) -> u32 {
        self.max_aggregates.get()
    }

    /// What a begin past a limit gets.
    pub fn overflow(&self) -> Overflow {
        self.overflow
    }

    /// The vocabularies.
    pub fn vocabularies(&self) -> &Vocabularies {
        &self.vocabularies
    }

    /// `labels` with every value outside its vocabulary folded into
    /// [`OTHER`]; `None` when nothing is outside. The class is never
    /// folded: it chooses the record's bounds.
    pub fn restrict(&self, labels: &ActivityLabels) -> Option<ActivityLabels> {
        let outside = |allowed: &Option<BTreeSet<String>>, value: &str| {
            allowed.as_ref().is_some_and(|allowed| !allowed.contains(value))
        };
        let v = &self.vocabularies;
        let fold_service = outside(&v.service, labels.service.as_str());
        let fold_provider = outside(&v.provider, labels.provider.as_str());
        let fold_stage = outside(&v.operation_stage, labels.operation_stage.as_str());
        let fold_model = outside(&v.model, &labels.model);
        if !(fold_service || fold_provider || fold_stage || fold_model) {
            return None;
        }
        Some(fold(
            labels,
            fold_service,
            fold_provider,
            fold_stage || fold_model,
        ))
    }

    /// What a begin whose aggregate the store does not hold yet may be
    /// recorded as, given the `census`: `None` to keep `labels`, or the
    /// folded labels. A lane past the limit folds to `other::other`; an
    /// aggregate past it keeps its lane and folds its stage and model.
    /// The folded aggregates themselves are not limited: there are at most
    /// a few per lane and class, and they are what keeps the rest bounded.
    ///
    /// # Errors
    /// With [`Overflow::Refuse`], a refusal that names the limit.
    pub fn bound(&self, labels: &ActivityLabels, census: Census) -> Result<Option<ActivityLabels>, Refusal> {
        let lane_full = !census.lane_known && census.lanes >= i64::from(self.max_lanes.get());
        let aggregates_full = census.aggregates >= i64::from(self.max_aggregates.get());
        if !lane_full && !aggregates_full {
            return Ok(None);
        }
        if is_folded(labels, lane_full) {
            // Already an overflow aggregate: recorded as it is.
            return Ok(None);
        }
        if self.overflow == Overflow::Refuse {
            return Err(Refusal::Invalid(if lane_full {
                format!(
                    "the ledger already holds its limit of {} lanes; {}::{} would be a new one \
                     (set [labels] max_lanes, or declare the lane)",
                    self.max_lanes, labels.service, labels.provider
                )
            } else {
                format!(
                    "the ledger already holds its limit of {} label sets; this call's would be a new one \
                     (set [labels] max_aggregates)",
                    self.max_aggregates
                )
            }));
        }
        Ok(Some(fold(labels, lane_full, lane_full, true)))
    }
}

/// Whether `labels` are an overflow aggregate already: stage and model
/// folded, and the lane too when `lane` says it must be.
fn is_folded(labels: &LabelSet, lane: bool) -> bool {
    let other = |value: &str| value == OTHER;
    other(labels.operation_stage.as_str())
        && other(&labels.model)
        && (!lane || (other(labels.service.as_str()) && other(labels.provider.as_str())))
}

fn fold(labels: &LabelSet, service: bool, provider: bool, detail: bool) -> ActivityLabels {
    let other = || Label::new("other", OTHER).expect("a valid label");
    let keep = |fold: bool, label: &Label| if fold { other() } else { label.clone() };
    ActivityLabels::new(LabelSet {
        service: keep(service, &labels.service),
        provider: keep(provider, &labels.provider),
        class: labels.class.clone(),
        operation_stage: keep(detail, &labels.operation_stage),
        model: if detail {
            OTHER.into()
        } else {
            labels.model.clone()
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::labels::RawLabels;

    fn labels(service: &str, model: &str) -> ActivityLabels {
        ActivityLabels::validate(&RawLabels {
            service,
            provider: "ollama",
            class: Some("embedding"),
            operation_stage: Some("ingest"),
            model: Some(model),
        })
        .unwrap()
    }

    fn census(lane_known: bool, lanes: i64, aggregates: i64) -> Census {
        Census {
            lane_known,
            lanes,
            aggregates,
        }
    }

    #[test]
    fn under_the_limits_nothing_is_folded() {
        let bounds = Cardinality::default();
        assert_eq!(
            bounds.bound(&labels("kb", "m1"), census(false, 511, 9_999)),
            Ok(None)
        );
        assert_eq!(
            bounds.bound(&labels("kb", "m1"), census(true, 10_000, 0)),
            Ok(None)
        );
    }

    #[test]
    fn a_new_lane_past_the_limit_folds_to_other_other_and_keeps_its_class() {
        let bounds = Cardinality::default().with_max_lanes(NonZeroU32::new(2).unwrap());
        let folded = bounds
            .bound(&labels("svc-9", "m1"), census(false, 2, 5))
            .unwrap()
            .unwrap();
        assert_eq!(
            (
                folded.service.as_str(),
                folded.provider.as_str(),
                folded.class.as_str()
            ),
            ("other", "other", "embedding")
        );
        assert_eq!(
            (folded.operation_stage.as_str(), &*folded.model),
            ("other", "other")
        );
        // The overflow aggregate itself is never folded again.
        assert_eq!(bounds.bound(&folded, census(false, 2, 5)), Ok(None));
    }

    #[test]
    fn a_new_aggregate_past_the_limit_keeps_its_lane_and_folds_stage_and_model() {
        let bounds = Cardinality::default().with_max_aggregates(NonZeroU32::new(3).unwrap());
        let folded = bounds
            .bound(&labels("kb", "m7"), census(true, 1, 3))
            .unwrap()
            .unwrap();
        assert_eq!(
            (folded.service.as_str(), folded.provider.as_str()),
            ("kb", "ollama")
        );
        assert_eq!(
            (folded.operation_stage.as_str(), &*folded.model),
            ("other", "other")
        );
        assert_eq!(bounds.bound(&folded, census(true, 1, 3)), Ok(None));
    }

    #[test]
    fn refuse_names_the_limit_instead_of_folding() {
        let bounds = Cardinality::default()
            .with_max_lanes(NonZeroU32::new(1).unwrap())
            .with_overflow(Overflow::Refuse);
        let Err(Refusal::Invalid(message)) = bounds.bound(&labels("svc-2", "m"), census(false, 1, 1)) else {
            panic!("not refused");
        };
        assert!(
            message.contains("limit of 1 lanes") && message.contains("svc-2::ollama"),
            "{message}"
        );
    }

    #[test]
    fn vocabularies_fold_what_they_do_not_list() {
        let bounds = Cardinality::default().with_vocabularies(Vocabularies {
            service: Some(["kb".to_owned()].into()),
            model: Some(["nomic-embed-text".to_owned()].into()),
            ..Vocabularies::default()
        });
        assert_eq!(bounds.restrict(&labels("kb", "nomic-embed-text")), None);
        let folded = bounds.restrict(&labels("kb", "llama3")).unwrap();
        assert_eq!((folded.service.as_str(), &*folded.model), ("kb", "other"));
        let folded = bounds
            .restrict(&labels("memory-core", "nomic-embed-text"))
            .unwrap();
        assert_eq!(
            (folded.service.as_str(), folded.provider.as_str()),
            ("other", "ollama")
        );
    }
}
