//! What a caller says about a call: [`ActivitySpec`] when it begins it,
//! [`Outcome`] and [`Settlement`] when it ends.

use std::borrow::Cow;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::domain::idempotency::{Fingerprint, Idempotency};
use crate::domain::labels::{ActivityLabels, Label, LabelInterner, RawLabels, Spelling};
use crate::domain::owner::OwnerId;
use crate::domain::record::{ActivityId, Admission, FailureStage, LaneKey, Priority};
use crate::domain::timestamp::Timestamp;
use crate::domain::trace::TraceParent;
use crate::domain::transition::{BeginExtras, NewActivity, Transition};
use crate::domain::usage::{self, Usage};
use crate::error::LedgerError;

/// What a caller says about a call when it begins it.
///
/// Labels are validated by [`Ledger::begin`](crate::ledger::Ledger::begin); a missing optional label is
/// `unknown`. They are `Cow`s so that a spec built from string literals,
/// as most services' are, allocates nothing.
///
/// Built only through its methods, so that it can grow without breaking
/// anyone: `ActivitySpec::new(service, provider)` and the setters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActivitySpec {
    service: Cow<'static, str>,
    provider: Cow<'static, str>,
    class: Option<Cow<'static, str>>,
    operation_stage: Option<Cow<'static, str>>,
    model: Option<Cow<'static, str>>,
    priority: Option<Priority>,
    admission: Option<Admission>,
    enqueued_at: Option<Timestamp>,
    started_at: Option<Timestamp>,
    deadline_ms: Option<i64>,
    max_tokens: Option<i64>,
    owner_id: Option<String>,
    /// What few calls say, boxed: a spec is moved by value through every
    /// begin's future, and inline these cost a memory-store lifecycle
    /// about 5 % of its instructions, in memcpy.
    rare: Option<Box<Rare>>,
}

/// The parts of an [`ActivitySpec`] that few calls give.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Rare {
    idempotency_key: Option<String>,
    trace_parent: Option<TraceParent>,
    /// The fingerprint of the request as its caller made it (`seal`), kept
    /// while a begin adjusts the spec (`begin_started` sets the start).
    fingerprint: Option<i64>,
}

impl ActivitySpec {
    /// A call from `service` to `provider`.
    pub fn new(service: impl Into<Cow<'static, str>>, provider: impl Into<Cow<'static, str>>) -> Self {
        Self {
            service: service.into(),
            provider: provider.into(),
            ..Self::default()
        }
    }

    /// Sets the deadline class.
    pub fn class(mut self, class: impl Into<Cow<'static, str>>) -> Self {
        self.class = Some(class.into());
        self
    }

    /// Sets the caller's stage.
    pub fn operation_stage(mut self, stage: impl Into<Cow<'static, str>>) -> Self {
        self.operation_stage = Some(stage.into());
        self
    }

    /// Sets the model.
    pub fn model(mut self, model: impl Into<Cow<'static, str>>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// Sets the priority.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }

    /// Sets queued, direct or external admission.
    pub fn admission(mut self, admission: Admission) -> Self {
        self.admission = Some(admission);
        self
    }

    /// Declares the call's own execution deadline.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline_ms = Some(i64::try_from(deadline.as_millis()).unwrap_or(i64::MAX));
        self
    }

    /// Sets when it was enqueued (a [`SystemTime`](std::time::SystemTime)
    /// converts with `Timestamp::from`).
    pub fn enqueued_at(mut self, at: Timestamp) -> Self {
        self.enqueued_at = Some(at);
        self
    }

    /// Begins it already started at `at`.
    pub fn started_at(mut self, at: Timestamp) -> Self {
        self.started_at = Some(at);
        self
    }

    /// Makes the begin idempotent: a repeat with the same key and the same
    /// request (within the record's retention) answers the record the first
    /// made instead of making another; the same key with a different
    /// request is refused (`IdempotencyConflict`). A new attempt after a
    /// refusal or an ended wait takes a new key. 1 to 255 printable ASCII
    /// characters, checked when it begins.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.rare_mut().idempotency_key = Some(key.into());
        self
    }

    /// Makes the span exported when the record ends (`[otel]` on the
    /// server) a child of `parent`, the caller's span. Not part of an
    /// idempotent begin's request: a retry from another span is the same
    /// begin.
    pub fn trace_parent(mut self, parent: TraceParent) -> Self {
        self.rare_mut().trace_parent = Some(parent);
        self
    }

    /// Fixes the fingerprint of the request, with `how` it begins (a plain
    /// begin, or started now with some wait), before a begin adjusts the
    /// spec; a second seal keeps the first.
    pub(super) fn seal(&mut self, how: &str) {
        let keyed = self
            .rare
            .as_ref()
            .is_some_and(|rare| rare.idempotency_key.is_some() && rare.fingerprint.is_none());
        if keyed {
            let fingerprint = self.fingerprint_of(how);
            self.rare_mut().fingerprint = Some(fingerprint);
        }
    }

    fn rare_mut(&mut self) -> &mut Rare {
        self.rare.get_or_insert_with(Box::default)
    }

    /// Every field a caller gives, as given, and `how` it begins.
    fn fingerprint_of(&self, how: &str) -> i64 {
        fn text(value: Option<&str>) -> Option<&[u8]> {
            value.map(str::as_bytes)
        }
        let number = |value: Option<i64>| value.map(i64::to_le_bytes);
        let (enqueued, started, deadline) = (
            number(self.enqueued_at.map(Timestamp::as_millis)),
            number(self.started_at.map(Timestamp::as_millis)),
            number(self.deadline_ms),
        );
        let fingerprint = Fingerprint::default()
            .field(Some(how.as_bytes()))
            .field(Some(self.service.as_bytes()))
            .field(Some(self.provider.as_bytes()))
            .field(text(self.class.as_deref()))
            .field(text(self.operation_stage.as_deref()))
            .field(text(self.model.as_deref()))
            .field(text(self.priority.map(Priority::as_str)))
            .field(text(self.admission.map(Admission::as_str)))
            .field(enqueued.as_ref().map(|b| &b[..]))
            .field(started.as_ref().map(|b| &b[..]))
            .field(deadline.as_ref().map(|b| &b[..]))
            .field(text(self.owner_id.as_deref()));
        // Mixed in only when given, so that a key stored before estimates
        // existed still matches its retry.
        match number(self.max_tokens) {
            Some(tokens) => fingerprint.field(Some(&tokens[..])).finish(),
            None => fingerprint.finish(),
        }
    }

    /// Sets or clears the start: `Ledger::begin_started` begins with it
    /// and, if the lane refuses, again without it.
    pub(super) fn set_started_at(&mut self, at: Option<Timestamp>) {
        self.started_at = at;
    }

    /// When it was enqueued, if the caller said.
    pub(super) fn enqueued_at_set(&self) -> Option<Timestamp> {
        self.enqueued_at
    }

    /// Tags it with the owner (process lease) `owner`, instead of the one
    /// this ledger joined as, if any.
    pub fn owner(mut self, owner: &OwnerId) -> Self {
        self.owner_id = Some(owner.to_string());
        self
    }

    /// The tokens the call is estimated to spend (`maxTokens`), whole, from
    /// 0 to [`MAX_TOKENS`](crate::domain::usage::MAX_TOKENS) (checked when
    /// it begins). Executing, it reserves them in its lane's token window;
    /// a call that ends without reporting usage charges them. Without it,
    /// its class's `tokens` apply, if set.
    pub fn max_tokens(mut self, tokens: i64) -> Self {
        self.max_tokens = Some(tokens);
        self
    }

    /// Declares its own execution deadline in milliseconds as a wire
    /// caller sent it, checked by the ledger (positive) when it begins.
    #[doc(hidden)]
    pub fn deadline_ms(mut self, deadline_ms: i64) -> Self {
        self.deadline_ms = Some(deadline_ms);
        self
    }

    /// Tags it with an owner id as a caller spelled it (any case); the
    /// ledger refuses it unless it names a live owner.
    #[doc(hidden)]
    pub fn owner_spelled(mut self, owner: impl Into<String>) -> Self {
        self.owner_id = Some(owner.into());
        self
    }

    /// The `service::provider` lane it runs on, to declare a cap with
    /// ([`LedgerConfig::with_cap`](crate::config::LedgerConfig::with_cap)) from the
    /// same spelling the calls use.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::error::ErrorKind::InvalidInput) when the
    /// service or provider is not a valid label.
    pub fn lane(&self) -> Result<LaneKey, LedgerError> {
        Ok(LaneKey {
            service: Label::new("service", &self.service)?,
            provider: Label::new("provider", &self.provider)?,
        })
    }

    fn raw_labels(&self) -> RawLabels<'_> {
        RawLabels {
            service: &self.service,
            provider: &self.provider,
            class: self.class.as_deref(),
            operation_stage: self.operation_stage.as_deref(),
            model: self.model.as_deref(),
        }
    }

    /// Where its labels are, when every one of them is a string literal (or
    /// absent): the same addresses hold the same text, so a spec built from
    /// the same literals is recognized without reading its labels
    /// ([`LabelInterner::intern_spelled`], which gives the figure).
    fn literal_spelling(&self) -> Option<Spelling> {
        fn at(label: Option<&Cow<'static, str>>) -> Option<(usize, usize)> {
            match label {
                None => Some((0, 0)),
                Some(Cow::Borrowed(text)) => Some((text.as_ptr() as usize, text.len())),
                Some(Cow::Owned(_)) => None,
            }
        }
        Some([
            at(Some(&self.service))?,
            at(Some(&self.provider))?,
            at(self.class.as_ref())?,
            at(self.operation_stage.as_ref())?,
            at(self.model.as_ref())?,
        ])
    }

    /// The validated call, with `activity_id`. `first_seen` is shown a
    /// label set the first time the interner validates it, so that checks
    /// on a set run once per set, never on every call.
    pub(super) fn validate(
        &self,
        activity_id: ActivityId,
        interner: &Mutex<LabelInterner>,
        first_seen: &dyn Fn(&ActivityLabels),
    ) -> Result<NewActivity, LedgerError> {
        let raw = self.raw_labels();
        let mut interner = interner.lock().unwrap_or_else(PoisonError::into_inner);
        let (labels, new) = match self.literal_spelling() {
            Some(spelling) => interner.intern_spelled(spelling, &raw),
            None => interner.intern(&raw),
        }?;
        drop(interner);
        if new {
            first_seen(&labels);
        }
        Ok(NewActivity {
            activity_id,
            labels,
            priority: self.priority.unwrap_or(Priority::Unknown),
            admission: self.admission.unwrap_or(Admission::Queued),
            enqueued_at: self.enqueued_at,
            started_at: self.started_at,
            deadline_ms: self.deadline_ms,
            max_tokens: usage::estimate(self.max_tokens)?,
            owner_id: self.owner_id.clone(),
            extras: match self.rare.as_deref() {
                None => None,
                Some(rare) => Some(Box::new(BeginExtras {
                    idempotency: match &rare.idempotency_key {
                        None => None,
                        Some(key) => Some(Idempotency::new(
                            key.clone(),
                            rare.fingerprint.unwrap_or_else(|| self.fingerprint_of(BEGIN)),
                        )?),
                    },
                    trace_parent: rare.trace_parent,
                })),
            },
        })
    }
}

/// The cancel reason of a call dropped before it ended, unless its caller
/// says another ([`Ledger::admit_within`](super::Ledger::admit_within)).
pub(super) const HANDLE_DROPPED: &str = "handle dropped";

/// How a plain begin (a handle, or a record by id) is fingerprinted.
pub(super) const BEGIN: &str = "begin";

/// How a call ended, as its caller reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The provider answered.
    Success,
    /// It failed, at this stage.
    Failure(FailureStage),
}

/// A settle as the HTTP API and other by-id callers express it: an
/// [`Outcome`] (so a success with a failure stage cannot be built), when
/// it completed, a refusing provider's `Retry-After`, and the tokens the
/// call spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    outcome: Outcome,
    completed_at: Option<Timestamp>,
    retry_after_ms: Option<i64>,
    usage: Usage,
}

impl Settlement {
    /// A settle with `outcome`, completed *now*.
    pub fn new(outcome: Outcome) -> Self {
        Self {
            outcome,
            completed_at: None,
            retry_after_ms: None,
            usage: Usage::default(),
        }
    }

    /// The tokens the call spent, as the provider reported them: kept on
    /// the record and summed per aggregate (`docs/semantics.md` §8). Each
    /// count is a whole number from 0 to [`MAX_TOKENS`](crate::domain::usage::MAX_TOKENS);
    /// past that the settle is refused (`InvalidInput`, naming the field).
    /// A late settle's usage is counted too: the call ran.
    pub fn usage(mut self, usage: Usage) -> Self {
        self.usage = usage;
        self
    }

    /// A failure the provider refused with `Retry-After: retry_after`
    /// (HTTP 429 or 503): the lane grants no new slot until then, at most
    /// its `max_cooldown` (`docs/semantics.md` §6, "Cooldowns"). Whole
    /// milliseconds, from 1 ms to an hour; with a success the settle is
    /// refused (`InvalidInput`).
    pub fn retry_after(self, retry_after: std::time::Duration) -> Self {
        self.retry_after_ms(i64::try_from(retry_after.as_millis()).unwrap_or(i64::MAX))
    }

    /// [`Settlement::retry_after`] in milliseconds, as the HTTP API's
    /// `retryAfterMs` carries it.
    pub fn retry_after_ms(mut self, retry_after_ms: i64) -> Self {
        self.retry_after_ms = Some(retry_after_ms);
        self
    }

    /// Completed at `at` instead of *now*.
    pub fn completed_at(mut self, at: Timestamp) -> Self {
        self.completed_at = Some(at);
        self
    }

    /// How it ended.
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }
}

impl From<Settlement> for Transition {
    fn from(settlement: Settlement) -> Self {
        let (success, failure_stage) = match settlement.outcome {
            Outcome::Success => (true, None),
            Outcome::Failure(stage) => (false, Some(stage)),
        };
        Self::Settle {
            success,
            failure_stage,
            at: settlement.completed_at,
            retry_after_ms: settlement.retry_after_ms,
            usage: settlement.usage,
        }
    }
}

impl From<Outcome> for Settlement {
    fn from(outcome: Outcome) -> Self {
        Self::new(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels_of(
        spec: &ActivitySpec,
        interner: &Mutex<LabelInterner>,
    ) -> Result<ActivityLabels, LedgerError> {
        spec.validate(ActivityId::new(), interner, &|_| {})
            .map(|new| new.labels)
    }

    #[test]
    fn a_spec_of_literals_seen_last_shares_its_labels() {
        let interner = Mutex::new(LabelInterner::default());
        let spec = || {
            ActivitySpec::new("kb", "ollama")
                .class("embedding")
                .model("nomic-embed-text")
        };
        let first = labels_of(&spec(), &interner).unwrap();
        let again = labels_of(&spec(), &interner).unwrap();
        assert!(again.is_shared_with(&first));
        // Another literal in one place is another set.
        let chat = labels_of(&spec().class("chat"), &interner).unwrap();
        assert_eq!(chat.class.as_str(), "chat");
        assert!(!chat.is_shared_with(&first));
        // An owned spelling skips the literal cache and is validated.
        let owned = labels_of(&ActivitySpec::new("kb".to_owned(), "ollama"), &interner).unwrap();
        assert_eq!(owned.service.as_str(), "kb");
        assert_eq!(owned.class.as_str(), "unknown");
    }

    #[test]
    fn a_refused_spec_of_literals_is_not_remembered() {
        let interner = Mutex::new(LabelInterner::default());
        let bad = || ActivitySpec::new("bad service!", "ollama");
        assert_eq!(
            labels_of(&bad(), &interner).unwrap_err().kind(),
            crate::error::ErrorKind::InvalidInput
        );
        assert_eq!(
            labels_of(&bad(), &interner).unwrap_err().kind(),
            crate::error::ErrorKind::InvalidInput
        );
        let good = labels_of(&ActivitySpec::new("kb", "ollama"), &interner).unwrap();
        assert_eq!(good.provider.as_str(), "ollama");
    }
}
