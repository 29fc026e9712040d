//! The snapshot: the operators' instrument.
//!
//! Stores gather [`SnapshotParts`] inside the same transaction that reaped
//! on read; [`Snapshot::assemble`] turns them into what operators read.

use std::collections::BTreeMap;
use std::time::Duration;

use inflight_api::ByPriority;
use serde::Serialize;

use super::admission::{LaneSettings, LaneState};
use super::bounds::ReapPolicy;
use super::counters::{AggregateKey, AggregateView, ReapedCounts, Totals};
use super::owner::Owner;
use super::record::{ActivityRecord, Admission, LaneKey};
use super::timestamp::Timestamp;
use super::warnings::{Seen, Warning};
use super::window;

/// The most records a snapshot lists per section.
pub const MAX_LIMIT: usize = 10_000;
/// The default number of records per section.
pub const DEFAULT_LIMIT: usize = 100;
/// The default history window.
pub const DEFAULT_SINCE: Duration = Duration::from_secs(24 * 60 * 60);

/// The start of the history window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Since {
    /// This long before the snapshot.
    Ago(Duration),
    /// From this instant.
    At(Timestamp),
}

impl Since {
    /// The window's start, given the snapshot's `now`.
    pub fn resolve(self, now: Timestamp) -> Timestamp {
        match self {
            Self::Ago(ago) => now.sub_millis(i64::try_from(ago.as_millis()).unwrap_or(i64::MAX)),
            Self::At(at) => at,
        }
    }
}

/// What a snapshot covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotOptions {
    limit: usize,
    since: Since,
}

impl Default for SnapshotOptions {
    fn default() -> Self {
        Self {
            limit: DEFAULT_LIMIT,
            since: Since::Ago(DEFAULT_SINCE),
        }
    }
}

impl SnapshotOptions {
    /// Lists at most `limit` records per section (1 to 10,000).
    ///
    /// # Errors
    /// A limit outside 1 to 10,000, with a message saying so.
    pub fn with_limit(mut self, limit: usize) -> Result<Self, String> {
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(format!("limit must be between 1 and {MAX_LIMIT}, got {limit}"));
        }
        self.limit = limit;
        Ok(self)
    }

    /// Lists completions and reaps from `since` on. In-flight work older than
    /// the window is still live demand and is always listed.
    pub fn with_since(mut self, since: Since) -> Self {
        self.since = since;
        self
    }

    /// The per-section limit.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The window's start.
    pub fn since(&self) -> Since {
        self.since
    }
}

/// Executing and waiting `queued` records of one lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneLoad {
    /// The lane.
    pub lane: LaneKey,
    /// Queued records executing.
    pub executing: i64,
    /// Queued records waiting.
    pub waiting: i64,
    /// The `enqueuedAt` of its oldest waiting record.
    pub oldest_waiting_since: Option<Timestamp>,
    /// The soonest `reapableAt` of its waiting records: when the first of
    /// them is reaped `abandoned` unless it starts.
    pub next_waiting_reapable_at: Option<Timestamp>,
    /// The same counts by priority.
    pub by_priority: ByPriority,
}

/// What a store gathers for a snapshot, after reaping.
#[derive(Debug, Clone, Default)]
pub struct SnapshotParts {
    /// Load per lane (queued records only).
    pub lane_loads: Vec<LaneLoad>,
    /// Every aggregate's totals.
    pub aggregates: Vec<(AggregateKey, Totals)>,
    /// The oldest in-flight records, oldest first, at most limit + 1.
    pub in_flight: Vec<ActivityRecord>,
    /// All in-flight records.
    pub in_flight_total: i64,
    /// Completions in the window, newest first, at most limit + 1.
    pub recent_completions: Vec<ActivityRecord>,
    /// All completions in the window.
    pub recent_completions_total: i64,
    /// Reaped records in the window, newest first, at most limit + 1.
    pub reaped: Vec<ActivityRecord>,
    /// Live owners, and owners lost or released within the window.
    pub owners: Vec<Owner>,
    /// What each lane that ever needed one remembers: its cooldown and
    /// adaptive cap.
    pub lane_states: Vec<(LaneKey, LaneState)>,
    /// What each lane's calls charged to its token window in the last
    /// minute, and what its executing calls reserve.
    pub lane_tokens: Vec<window::LaneTokens>,
}

// Whether the ledger has seen leaks lately: the wire's own enum.
pub use inflight_api::SnapshotStatus as Status;

/// One lane of native admission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LaneView {
    /// The calling service.
    pub service: String,
    /// The provider.
    pub provider: String,
    /// Its declared cap, or `null`.
    pub cap: Option<u32>,
    /// Queued records executing.
    pub executing: i64,
    /// Queued records waiting.
    pub waiting: i64,
    /// Records that ended reaped, ever, by disposition.
    pub reaped: ReapedCounts,
    /// Of those, records reaped because their owner's lease expired.
    pub reaped_owner_lost: i64,
    /// Settles absorbed after a reap.
    pub late_settles: i64,
    /// Abandoned records started after all.
    pub resurrections: i64,
    /// How long its oldest waiting record has waited.
    pub longest_wait_ms: i64,
    /// The cap in force: `cap`, or an adaptive lane's lowered one.
    pub effective_cap: Option<u32>,
    /// While it cools down after a provider's `Retry-After`: until when.
    pub cooling_until: Option<Timestamp>,
    /// Cooldowns it ever began.
    pub cooldowns: i64,
    /// Executing and waiting records by priority.
    pub by_priority: ByPriority,
    /// The tokens its calls charged within the last minute: reported, or
    /// estimated for a call that ran and reported none (by the second of
    /// their end, so at most a second longer).
    pub tokens_last_minute: i64,
    /// The estimates of its calls executing.
    pub tokens_reserved: i64,
    /// Its own token budget (`tokens_per_minute`), if it has one.
    pub tokens_per_minute: Option<u32>,
    /// Its provider's token budget, shared by every lane of it, if it has
    /// one.
    pub provider_tokens_per_minute: Option<u32>,
    /// How long until the first of its waiting records is reaped
    /// `abandoned` unless it starts; `None` when none waits. Not on the
    /// wire: `/metrics` reads it.
    #[serde(skip)]
    pub next_waiting_reap_in_ms: Option<i64>,
}

/// An in-flight record, with how long ago it was enqueued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InFlightEntry {
    /// The record.
    #[serde(flatten)]
    pub record: ActivityRecord,
    /// `now - enqueuedAt`.
    pub elapsed_ms: i64,
}

/// A reaped record, with how long ago it was enqueued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReapedEntry {
    /// The record.
    #[serde(flatten)]
    pub record: ActivityRecord,
    /// `now - enqueuedAt`.
    pub age_ms: i64,
}

/// The ledger as operators read it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// `ok`, or `degraded` when records were reaped within the window.
    pub status: Status,
    /// When it was taken.
    pub at: Timestamp,
    /// The start of the history window.
    pub since: Timestamp,
    /// Lanes keyed `service::provider`, over `queued` records.
    pub native_admission: BTreeMap<String, LaneView>,
    /// Records ever begun.
    pub total_activities: i64,
    /// Records ever settled as succeeded.
    pub total_succeeded: i64,
    /// Of those, records that never started.
    pub total_succeeded_unstarted: i64,
    /// Records ever settled as failed.
    pub total_failed: i64,
    /// Records ever cancelled by their caller.
    pub total_cancelled: i64,
    /// Records in flight now (queued and direct).
    pub total_in_flight: i64,
    /// Completions within the window.
    pub total_recent_completions: i64,
    /// Records that ended reaped, ever.
    pub total_reaped: i64,
    /// Of those, records reaped because their owner's lease expired.
    pub total_reaped_owner_lost: i64,
    /// Settles absorbed after a reap, ever.
    pub total_late_settles: i64,
    /// Abandoned records started after all, ever.
    pub total_resurrections: i64,
    /// What the reap on this read found.
    pub reaped_this_read: ReapedCounts,
    /// In-flight records, oldest first.
    pub in_flight: Vec<InFlightEntry>,
    /// Settled records within the window, newest first.
    pub recent_completions: Vec<ActivityRecord>,
    /// Reaped records within the window, newest first.
    pub reaped: Vec<ReapedEntry>,
    /// More in-flight records exist than listed.
    pub in_flight_truncated: bool,
    /// More completions exist than listed.
    pub recent_completions_truncated: bool,
    /// More reaped records exist than listed.
    pub reaped_truncated: bool,
    /// Counters per service, stage, class, provider, model, priority and
    /// admission, for those in flight or seen within the window.
    pub aggregates: Vec<AggregateView>,
    /// Live owners, and owners lost or released within the window: a lost
    /// owner is evidence, with how many records its loss reaped.
    pub owners: Vec<Owner>,
    /// What the configuration and the calls in the window do not match
    /// ([`Snapshot::note_mismatches`]); empty until noted.
    pub warnings: Vec<Warning>,
    /// Calls in the window per class the configuration does not know (not
    /// on the wire: `/metrics` reads it).
    #[serde(skip)]
    pub unknown_classes: BTreeMap<String, i64>,
}

fn truncate<T>(mut items: Vec<T>, limit: usize) -> (Vec<T>, bool) {
    let truncated = items.len() > limit;
    items.truncate(limit);
    (items, truncated)
}

impl Snapshot {
    /// Builds the snapshot from what a store gathered at `now`.
    pub fn assemble(
        parts: SnapshotParts,
        lanes_declared: &BTreeMap<LaneKey, LaneSettings>,
        provider_budgets: &BTreeMap<String, u32>,
        options: SnapshotOptions,
        now: Timestamp,
        reaped_this_read: ReapedCounts,
    ) -> Self {
        let since = options.since.resolve(now);
        let limit = options.limit;
        let mut lanes: BTreeMap<LaneKey, LaneView> = BTreeMap::new();
        let lane = |key: &LaneKey| -> LaneView {
            LaneView {
                service: key.service.to_string(),
                provider: key.provider.to_string(),
                cap: lanes_declared.get(key).and_then(|settings| settings.cap),
                executing: 0,
                waiting: 0,
                reaped: ReapedCounts::default(),
                reaped_owner_lost: 0,
                late_settles: 0,
                resurrections: 0,
                longest_wait_ms: 0,
                effective_cap: lanes_declared.get(key).and_then(|settings| settings.cap),
                cooling_until: None,
                cooldowns: 0,
                by_priority: ByPriority::default(),
                tokens_last_minute: 0,
                tokens_reserved: 0,
                tokens_per_minute: lanes_declared
                    .get(key)
                    .and_then(|settings| settings.tokens_per_minute),
                provider_tokens_per_minute: provider_budgets.get(key.provider.as_str()).copied(),
                next_waiting_reap_in_ms: None,
            }
        };
        for key in lanes_declared.keys() {
            lanes.insert(key.clone(), lane(key));
        }
        let mut everything = Totals::default();
        for (key, totals) in &parts.aggregates {
            everything.add(totals);
            if key.admission == Admission::Direct {
                continue;
            }
            let Ok(lane_key) = LaneKey::parse(&format!("{}::{}", key.service, key.provider)) else {
                continue;
            };
            let view = lanes.entry(lane_key.clone()).or_insert_with(|| lane(&lane_key));
            view.reaped.abandoned += totals.reaped_abandoned;
            view.reaped.unsettled += totals.reaped_unsettled;
            view.reaped_owner_lost += totals.reaped_owner_lost;
            view.late_settles += totals.late_settles;
            view.resurrections += totals.resurrections;
        }
        for load in &parts.lane_loads {
            let view = lanes.entry(load.lane.clone()).or_insert_with(|| lane(&load.lane));
            view.executing = load.executing;
            view.waiting = load.waiting;
            view.longest_wait_ms = load
                .oldest_waiting_since
                .map_or(0, |enqueued| now.millis_since(enqueued).max(0));
            view.next_waiting_reap_in_ms = load
                .next_waiting_reapable_at
                .map(|at| at.millis_since(now).max(0));
            view.by_priority = load.by_priority;
        }
        for (key, state) in &parts.lane_states {
            let view = lanes.entry(key.clone()).or_insert_with(|| lane(key));
            view.cooling_until = state.cooling_at(now);
            view.cooldowns = state.cooldowns;
            if let Some(settings) = lanes_declared.get(key) {
                view.effective_cap = settings.cap_in(state);
            }
        }

        // A lane that spent tokens is shown, whatever its admission.
        for tokens in &parts.lane_tokens {
            let view = lanes
                .entry(tokens.lane.clone())
                .or_insert_with(|| lane(&tokens.lane));
            view.tokens_last_minute = tokens.charged;
            view.tokens_reserved = tokens.reserved;
        }

        let (in_flight, in_flight_truncated) = truncate(parts.in_flight, limit);
        let (recent_completions, recent_completions_truncated) = truncate(parts.recent_completions, limit);
        let (reaped, reaped_truncated) = truncate(parts.reaped, limit);
        let status = if reaped.is_empty() && reaped_this_read.total() == 0 {
            Status::Ok
        } else {
            Status::Degraded
        };
        let aggregates = parts
            .aggregates
            .into_iter()
            .filter(|(_, totals)| {
                totals.in_flight > 0 || totals.last_seen_at.is_some_and(|seen| seen >= since)
            })
            .map(|(key, totals)| AggregateView::new(key, &totals))
            .collect();

        Self {
            status,
            at: now,
            since,
            native_admission: lanes
                .into_iter()
                .map(|(key, view)| (key.to_string(), view))
                .collect(),
            total_activities: everything.calls(),
            total_succeeded: everything.succeeded,
            total_succeeded_unstarted: everything.succeeded_unstarted,
            total_failed: everything.failed,
            total_cancelled: everything.cancelled,
            total_in_flight: parts.in_flight_total,
            total_recent_completions: parts.recent_completions_total,
            total_reaped: everything.reaped(),
            total_reaped_owner_lost: everything.reaped_owner_lost,
            total_late_settles: everything.late_settles,
            total_resurrections: everything.resurrections,
            reaped_this_read,
            in_flight: in_flight
                .into_iter()
                .map(|record| InFlightEntry {
                    elapsed_ms: now.millis_since(record.enqueued_at).max(0),
                    record,
                })
                .collect(),
            recent_completions,
            reaped: reaped
                .into_iter()
                .map(|record| ReapedEntry {
                    age_ms: now.millis_since(record.enqueued_at).max(0),
                    record,
                })
                .collect(),
            in_flight_truncated,
            recent_completions_truncated,
            reaped_truncated,
            aggregates,
            owners: parts.owners,
            warnings: Vec::new(),
            unknown_classes: BTreeMap::new(),
        }
    }

    /// Notes what the configuration (`caps`, `policy`) and the calls in the
    /// window (its aggregates) do not match, as [`warnings`](super::warnings)
    /// says. Bounded: one pass over the aggregates; lanes are compared only
    /// for configured lanes without calls.
    pub fn note_mismatches(&mut self, caps: &BTreeMap<LaneKey, LaneSettings>, policy: &ReapPolicy) {
        let mut seen = Seen::default();
        let track_lanes = !caps.is_empty();
        for aggregate in &self.aggregates {
            let key = &aggregate.key;
            seen.add(
                policy,
                track_lanes,
                (&key.service, &key.provider),
                &key.class,
                aggregate.calls,
            );
        }
        self.warnings = seen.warnings(caps, policy, &format!("since {}", self.since));
        self.unknown_classes = seen
            .unknown_classes()
            .iter()
            .map(|(class, calls)| ((*class).to_owned(), *calls))
            .collect();
    }

    /// The lane keyed `service::provider`, if the snapshot shows it.
    pub fn lane(&self, key: &str) -> Option<&LaneView> {
        self.native_admission.get(key)
    }
}
