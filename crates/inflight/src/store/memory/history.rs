//! The memory store's history: records out of flight, packed.
//!
//! History is most of what a memory store holds (every record settled or
//! reaped within the retention period) and grows with every call. A record
//! behind an `Arc` costs about 240 bytes of heap; packed inline in the
//! history's sorted run it costs 80, so a busy store faults in well under
//! half the fresh pages, and the `Arc` that carried the record in flight is
//! freed and reused by the next call instead of being kept.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::domain::labels::ActivityLabels;
use crate::domain::record::{
    ActivityId, ActivityRecord, Admission, Disposition, FailureStage, Priority, ReapReason, State,
};
use crate::domain::timestamp::Timestamp;
use crate::domain::trace::TraceParent;
use crate::domain::usage::Usage;

use super::append_map::AppendMap;

/// Records out of flight, by id.
#[derive(Default)]
pub(super) struct History {
    packed: AppendMap<ActivityId, Packed>,
    /// The rare record with a value a packed record cannot hold (an
    /// instant before its enqueue or 49 days after it, a deadline past
    /// `u32`), kept as it is.
    wide: BTreeMap<ActivityId, Arc<ActivityRecord>>,
}

impl History {
    /// The record `id`, unpacked.
    pub(super) fn get(&self, id: &ActivityId) -> Option<Arc<ActivityRecord>> {
        match self.packed.get(id) {
            Some(packed) => Some(Arc::new(packed.unpack(*id))),
            None => self.wide.get(id).cloned(),
        }
    }

    pub(super) fn contains(&self, id: &ActivityId) -> bool {
        self.packed.contains_key(id) || self.wide.contains_key(id)
    }

    /// Whether `id` is newer than every record here: a fresh UUIDv7 is, so
    /// a begin need not search for it.
    pub(super) fn is_newer(&self, id: &ActivityId) -> bool {
        let newest = self
            .packed
            .last_key()
            .max(self.wide.last_key_value().map(|(id, _)| id));
        newest.is_none_or(|newest| newest < id)
    }

    pub(super) fn remove(&mut self, id: &ActivityId) -> Option<Arc<ActivityRecord>> {
        match self.packed.remove(id) {
            Some(packed) => Some(Arc::new(packed.unpack(*id))),
            None => self.wide.remove(id),
        }
    }

    /// Drops the record `id`, without unpacking it.
    pub(super) fn forget(&mut self, id: &ActivityId) {
        if self.packed.remove(id).is_none() {
            self.wide.remove(id);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.packed.len() + self.wide.len()
    }

    /// Keeps `record`, replacing any version with its id.
    pub(super) fn insert(&mut self, record: &ActivityRecord) {
        let id = record.activity_id;
        match Packed::pack(record) {
            Some(packed) => {
                self.packed.insert(id, packed);
                self.wide.remove(&id);
            }
            None => {
                self.wide.insert(id, Arc::new(record.clone()));
                self.packed.remove(&id);
            }
        }
    }
}

/// An optional instant in four bytes: milliseconds after the record's
/// `enqueuedAt`, `u32::MAX` for none. Every instant of a record out of
/// flight is at or after its enqueue, and within 49 days of it unless a
/// caller said otherwise; such a record is kept whole instead.
#[derive(Debug, Clone, Copy)]
struct After(u32);

impl After {
    const NONE: u32 = u32::MAX;

    fn pack(value: Option<Timestamp>, enqueued_at: Timestamp) -> Option<Self> {
        match value {
            None => Some(Self(Self::NONE)),
            Some(at) => {
                let offset = at.as_millis().checked_sub(enqueued_at.as_millis())?;
                u32::try_from(offset)
                    .ok()
                    .filter(|&offset| offset != Self::NONE)
                    .map(Self)
            }
        }
    }

    fn unpack(self, enqueued_at: Timestamp) -> Option<Timestamp> {
        (self.0 != Self::NONE).then(|| Timestamp::from_millis(enqueued_at.as_millis() + i64::from(self.0)))
    }
}

/// Every field of an [`ActivityRecord`] but its id (the history's key), with
/// the instants after the enqueue and the deadline in four bytes each
/// instead of sixteen and eight, the owner boxed, and what few records have
/// boxed apart. Every page of history is a page the kernel must fault in
/// and zero as the store grows, so its bytes cost time as well as memory.
/// What history always implies is not kept: a record out of flight has no
/// `reapable_at`, and its queue wait and execution time follow from its
/// instants; a record for which that does not hold is not packed.
#[derive(Debug)]
struct Packed {
    labels: ActivityLabels,
    owner_id: Option<Box<str>>,
    /// What few records have: a cancel reason, a deadline of their own,
    /// reported usage.
    rare: Option<Box<Rare>>,
    enqueued_at: Timestamp,
    deadline_ms: u32,
    started_at: After,
    completed_at: After,
    reaped_at: After,
    priority: Priority,
    admission: Admission,
    state: State,
    disposition: Option<Disposition>,
    reap_reason: Option<ReapReason>,
    success: Option<bool>,
    failure_stage: Option<FailureStage>,
    /// `late_settle` and `refined` in one byte ([`Packed::LATE_SETTLE`],
    /// [`Packed::REFINED`]): a second `bool` would take the packed record
    /// from 64 bytes to 72.
    marks: u8,
}

impl Packed {
    const LATE_SETTLE: u8 = 1;
    const REFINED: u8 = 2;

    /// `record`, packed; `None` when an instant is before its enqueue or 49
    /// days after it, when its deadline passes `u32`, or when it holds what
    /// [`Packed::unpack`] would not give back.
    fn pack(record: &ActivityRecord) -> Option<Self> {
        // Destructured, so that a field added to records cannot be missed.
        let ActivityRecord {
            activity_id: _,
            labels,
            priority,
            admission,
            state,
            disposition,
            reap_reason,
            owner_id,
            enqueued_at,
            started_at,
            completed_at,
            reaped_at,
            declared_deadline_ms,
            deadline_ms,
            reapable_at,
            queue_wait_ms,
            execution_ms,
            success,
            failure_stage,
            late_settle,
            cancel_reason,
            refined,
            usage,
            max_tokens,
            trace_parent,
        } = record;
        let (queue_wait, execution) = record.implied_durations()?;
        if (*reapable_at, *queue_wait_ms, *execution_ms) != (None, queue_wait, execution) {
            return None;
        }
        Some(Self {
            labels: labels.clone(),
            owner_id: owner_id.as_deref().map(Box::from),
            rare: (cancel_reason.is_some()
                || declared_deadline_ms.is_some()
                || !usage.is_empty()
                || max_tokens.is_some()
                || trace_parent.is_some())
            .then(|| {
                Box::new(Rare {
                    cancel_reason: cancel_reason.clone(),
                    declared_deadline_ms: *declared_deadline_ms,
                    usage: *usage,
                    max_tokens: *max_tokens,
                    trace_parent: trace_parent.as_deref().copied(),
                })
            }),
            enqueued_at: *enqueued_at,
            deadline_ms: u32::try_from(*deadline_ms).ok()?,
            started_at: After::pack(*started_at, *enqueued_at)?,
            completed_at: After::pack(*completed_at, *enqueued_at)?,
            reaped_at: After::pack(*reaped_at, *enqueued_at)?,
            priority: *priority,
            admission: *admission,
            state: *state,
            disposition: *disposition,
            reap_reason: *reap_reason,
            success: *success,
            failure_stage: *failure_stage,
            marks: u8::from(*late_settle) * Self::LATE_SETTLE + u8::from(*refined) * Self::REFINED,
        })
    }

    fn unpack(&self, activity_id: ActivityId) -> ActivityRecord {
        let mut record = ActivityRecord {
            activity_id,
            labels: self.labels.clone(),
            priority: self.priority,
            admission: self.admission,
            state: self.state,
            disposition: self.disposition,
            reap_reason: self.reap_reason,
            owner_id: self.owner_id.as_deref().map(String::from),
            enqueued_at: self.enqueued_at,
            started_at: self.started_at.unpack(self.enqueued_at),
            completed_at: self.completed_at.unpack(self.enqueued_at),
            reaped_at: self.reaped_at.unpack(self.enqueued_at),
            declared_deadline_ms: self.rare.as_ref().and_then(|rare| rare.declared_deadline_ms),
            deadline_ms: i64::from(self.deadline_ms),
            reapable_at: None,
            queue_wait_ms: None,
            execution_ms: None,
            success: self.success,
            failure_stage: self.failure_stage,
            late_settle: self.marks & Self::LATE_SETTLE != 0,
            cancel_reason: self.rare.as_ref().and_then(|rare| rare.cancel_reason.clone()),
            refined: self.marks & Self::REFINED != 0,
            usage: self.rare.as_ref().map(|rare| rare.usage).unwrap_or_default(),
            max_tokens: self.rare.as_ref().and_then(|rare| rare.max_tokens),
            trace_parent: self
                .rare
                .as_ref()
                .and_then(|rare| rare.trace_parent)
                .map(Box::new),
        };
        // Packing checked that these exist.
        record.derive_durations();
        record
    }
}

/// The fields of a packed record that few records have. Usage and the
/// trace context are here too: boxed, they cost nothing to the calls that
/// report none.
#[derive(Debug)]
struct Rare {
    cancel_reason: Option<String>,
    declared_deadline_ms: Option<i64>,
    usage: Usage,
    max_tokens: Option<i64>,
    trace_parent: Option<TraceParent>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::labels::RawLabels;

    fn settled() -> ActivityRecord {
        let raw = RawLabels {
            service: "svc",
            provider: "prov",
            class: Some("chat"),
            operation_stage: Some("answer"),
            model: Some("llama3"),
        };
        ActivityRecord {
            activity_id: ActivityId::new(),
            labels: ActivityLabels::validate(&raw).unwrap(),
            priority: Priority::Interactive,
            admission: Admission::Direct,
            state: State::Cancelled,
            disposition: Some(Disposition::Unsettled),
            reap_reason: Some(ReapReason::OwnerLost),
            owner_id: Some("owner-1".to_owned()),
            enqueued_at: Timestamp::from_millis(1_000),
            started_at: Some(Timestamp::from_millis(1_500)),
            completed_at: Some(Timestamp::from_millis(2_000)),
            reaped_at: None,
            declared_deadline_ms: Some(30_000),
            deadline_ms: 30_000,
            reapable_at: None,
            queue_wait_ms: Some(500),
            execution_ms: Some(500),
            success: None,
            failure_stage: Some(FailureStage::Queue),
            late_settle: true,
            cancel_reason: Some("client went away".to_owned()),
            refined: true,
            usage: Usage {
                input_tokens: Some(12),
                output_tokens: None,
            },
            max_tokens: Some(400),
            trace_parent: Some(Box::new(
                TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap(),
            )),
        }
    }

    #[test]
    fn a_packed_record_unpacks_to_what_it_was() {
        let record = settled();
        let mut history = History::default();
        history.insert(&record);
        assert_eq!(*history.get(&record.activity_id).unwrap(), record);
        let bare = ActivityRecord {
            owner_id: None,
            cancel_reason: None,
            refined: false,
            usage: Usage::default(),
            max_tokens: None,
            trace_parent: None,
            started_at: None,
            queue_wait_ms: None,
            execution_ms: None,
            declared_deadline_ms: None,
            ..settled()
        };
        history.insert(&bare);
        assert_eq!(*history.get(&bare.activity_id).unwrap(), bare);
        assert!(history.wide.is_empty());
    }

    #[test]
    fn a_record_that_cannot_be_packed_is_kept_whole_until_a_version_that_can() {
        let record = ActivityRecord {
            reaped_at: Some(Timestamp::from_millis(i64::MIN)),
            ..settled()
        };
        let mut history = History::default();
        history.insert(&record);
        assert_eq!(history.wide.len(), 1);
        assert_eq!(*history.get(&record.activity_id).unwrap(), record);
        // Replaced by a version that packs: kept once, packed.
        let packable = ActivityRecord {
            reaped_at: Some(Timestamp::from_millis(5_000)),
            ..record.clone()
        };
        history.insert(&packable);
        assert_eq!(history.len(), 1);
        assert!(history.wide.is_empty());
        assert_eq!(*history.remove(&record.activity_id).unwrap(), packable);
        assert_eq!(history.len(), 0);
    }

    #[test]
    fn instants_and_deadlines_out_of_four_bytes_keep_a_record_whole() {
        let enqueued = settled().enqueued_at;
        let after = |ms: i64| Some(Timestamp::from_millis(enqueued.as_millis() + ms));
        let last = i64::from(u32::MAX) - 1;
        let mut history = History::default();
        let fits = [
            ActivityRecord {
                completed_at: after(last),
                ..settled()
            },
            ActivityRecord {
                deadline_ms: i64::from(u32::MAX),
                ..settled()
            },
        ];
        let too_wide = [
            ActivityRecord {
                completed_at: after(last + 1),
                ..settled()
            },
            ActivityRecord {
                reaped_at: after(-1),
                ..settled()
            },
            ActivityRecord {
                deadline_ms: i64::from(u32::MAX) + 1,
                ..settled()
            },
        ];
        for mut record in fits.into_iter().chain(too_wide) {
            record.derive_durations();
            history.insert(&record);
            assert_eq!(*history.get(&record.activity_id).unwrap(), record);
        }
        assert_eq!(history.wide.len(), 3);
        assert_eq!(history.len(), 5);
    }

    #[test]
    fn a_record_that_history_does_not_imply_is_kept_whole() {
        let mut history = History::default();
        for record in [
            ActivityRecord {
                execution_ms: Some(7),
                ..settled()
            },
            ActivityRecord {
                queue_wait_ms: None,
                ..settled()
            },
            ActivityRecord {
                reapable_at: Some(Timestamp::from_millis(9_000)),
                ..settled()
            },
        ] {
            history.insert(&record);
            assert_eq!(*history.get(&record.activity_id).unwrap(), record);
        }
        assert_eq!(history.wide.len(), 3);
    }

    #[test]
    fn a_packed_record_takes_under_half_of_a_shared_one() {
        // A shared record is its size plus the Arc's two counts (then
        // rounded up by the allocator, and an entry in the run on top); a
        // packed one sits inline in the run, id and all.
        let packed = std::mem::size_of::<(ActivityId, Option<Packed>)>();
        let shared = std::mem::size_of::<ActivityRecord>() + 2 * std::mem::size_of::<usize>();
        assert!(packed * 2 <= shared, "{packed} bytes packed vs {shared} shared");
        // What a settled record adds to the history's run: its id and 64
        // bytes (docs/performance.md).
        assert_eq!(packed, 80);
    }
}
