//! The one implementation of every command, written against [`Txn`], the
//! primitive operations a store provides inside one transaction.
//!
//! The rules themselves are the domain's; this module only sequences them:
//! load, reap if due, apply, persist the record and the counter changes.

use std::sync::Arc;

use crate::config::LedgerConfig;
use crate::domain::admission::{self, Decision, LanePosition, LaneRules, LaneState, Rank};
use crate::domain::bounds::ReapPolicy;
use crate::domain::budget::{self, Exhausted, Scope, WindowUse};
use crate::domain::capacity::{self, Capacity};
use crate::domain::cardinality::Census;
use crate::domain::counters::{AggregateKey, ReapedCounts, Totals};
use crate::domain::idempotency::Idempotency;
use crate::domain::labels::{self, ActivityLabels, Label, LabelSet};
use crate::domain::owner::{self, Owner, OwnerId};
use crate::domain::query::{self, Ahead, LaneQuery, Retention, Window};
use crate::domain::record::{ActivityId, ActivityRecord, Admission, LaneKey, Priority, State};
use crate::domain::snapshot::{LaneLoad, Snapshot, SnapshotParts};
use crate::domain::timestamp::Timestamp;
use crate::domain::transition::{self, Effect, Effects, Transition};
use crate::domain::window::{self, LaneTokens};
use crate::error::{ErrorKind, LedgerError};

use super::{Command, Reply, StoreStats};

/// How many due records a reap pass handles per round trip.
const REAP_BATCH: usize = 512;

/// What a store provides inside one transaction: storage primitives,
/// which each store keeps its own way, and ([`Questions`]) the questions
/// of [`crate::domain::query`]. The engine holds every rule; a store holds
/// none.
pub(crate) trait Txn: Questions {
    /// The record with `id`, as stored.
    fn get(&mut self, id: ActivityId) -> Result<Option<Arc<ActivityRecord>>, LedgerError>;
    /// Stores a new record.
    fn insert(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError>;
    /// Overwrites a stored record with `record`.
    fn update(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError>;
    /// Shows `look` the record with `id`, as stored; `false` when there is
    /// none. A store that keeps records in memory shows its own version,
    /// without copying or sharing it.
    fn peek(&mut self, id: ActivityId, look: &mut dyn FnMut(&ActivityRecord)) -> Result<bool, LedgerError> {
        let Some(record) = self.get(id)? else {
            return Ok(false);
        };
        look(&record);
        Ok(true)
    }
    /// Changes the record with `id` with `change`, and stores the result
    /// when `change` says it changed something; returns the version stored,
    /// `None` when there is no such record. A store that keeps records in
    /// memory changes its own version in place when no reply still holds
    /// it.
    fn modify(
        &mut self,
        id: ActivityId,
        change: &mut dyn FnMut(&mut ActivityRecord) -> bool,
    ) -> Result<Option<Arc<ActivityRecord>>, LedgerError>;
    /// Deletes the records `ids`; returns how many there were.
    fn delete(&mut self, ids: &[ActivityId]) -> Result<usize, LedgerError>;
    /// Counts `effects` (never empty) in the totals of the aggregate
    /// `record` counts in
    /// ([`AggregateKey::of`](crate::domain::counters::AggregateKey::of)),
    /// by [`Totals::count`](crate::domain::counters::Totals::count).
    fn add_totals(&mut self, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError>;
    /// Adds one to the completion counter of `minute`
    /// ([`query::completion_minute`]), for `record`'s completion.
    fn count_completion(&mut self, record: &ActivityRecord, minute: i64) -> Result<(), LedgerError>;
    /// Charges `tokens` to `lane` in `second` ([`window::moves`]), at once:
    /// a later command of the transaction reads it.
    fn spend(&mut self, lane: &LaneKey, second: i64, tokens: i64) -> Result<(), LedgerError>;
    /// `effect` landed for `record` (after [`Txn::add_totals`]), changing
    /// its lane's capacity by `capacity`: the store shows it to this
    /// process's statistics, reap log and capacity watchers
    /// ([`CallStats::land`](crate::stats::CallStats::land),
    /// [`Watchers::changed`](super::Watchers::changed)) once the command is
    /// committed, and never if the command is undone.
    fn landed(&mut self, record: &Arc<ActivityRecord>, effect: &Effect, capacity: Option<Capacity>);
    /// Whether the aggregate of `labels`, `priority` and `admission` has
    /// totals stored, or counted by an earlier command
    /// of this transaction.
    fn aggregate_known(
        &mut self,
        labels: &ActivityLabels,
        priority: Priority,
        admission: Admission,
    ) -> Result<bool, LedgerError>;

    /// Claims the idempotency key of `record`, just inserted, which
    /// [`Questions::find_key`] did not find in this transaction. A store
    /// shared by several writers (PostgreSQL) may find it claimed by
    /// another meanwhile: it then fails the transaction so that it runs
    /// again, and the repeat finds the key.
    fn claim_key(&mut self, key: &Idempotency, record: &ActivityRecord) -> Result<(), LedgerError>;

    /// Takes the lane's admission lock until the transaction ends, before
    /// an admission decision reads the lane: a store shared by several
    /// writers at once (PostgreSQL) serializes every decision on one lane
    /// with it. A store with one writer has nothing to do.
    fn lock_lane(&mut self, _lane: &LaneKey) -> Result<(), LedgerError> {
        Ok(())
    }

    /// Takes `provider`'s admission lock, before its lane's
    /// ([`Txn::lock_lane`]), when the provider has a token budget:
    /// decisions on its lanes then take turns, and take the two locks in
    /// one order, so that no two groups of them deadlock.
    fn lock_provider(&mut self, _provider: &Label) -> Result<(), LedgerError> {
        Ok(())
    }
}

/// The questions a store answers inside a transaction, each exactly as the
/// reference predicate and order named in its documentation say
/// (`tests/differential.rs` checks it), and the owner table. The SQL stores
/// share one implementation (`store::sql::questions`).
pub(crate) trait Questions {
    /// Every aggregate's totals, in any order.
    fn aggregates(&mut self) -> Result<Vec<(AggregateKey, Totals)>, LedgerError>;
    /// The sum of the completion counters of `minute` and every later one.
    fn completion_minutes_from(&mut self, minute: i64) -> Result<i64, LedgerError>;
    /// Deletes the completion counters of minutes before `minute`.
    fn delete_minutes_before(&mut self, minute: i64) -> Result<(), LedgerError>;
    /// [`window::lane_tokens`] of the seconds from `second` on: what each
    /// lane's calls charged, and what they reserve.
    fn tokens_since(&mut self, second: i64) -> Result<Vec<LaneTokens>, LedgerError>;
    /// [`budget::windows`] of the seconds from `first` on: the token
    /// window of `lane`, and of its provider.
    fn window_use(&mut self, lane: &LaneKey, first: i64) -> Result<(WindowUse, WindowUse), LedgerError>;
    /// Deletes the tokens charged in seconds before `second`.
    fn delete_token_seconds_before(&mut self, second: i64) -> Result<(), LedgerError>;
    /// How many records are stored.
    fn stored_records(&mut self) -> Result<i64, LedgerError>;
    /// The owner with `id`.
    fn get_owner(&mut self, id: &OwnerId) -> Result<Option<Owner>, LedgerError>;
    /// The record the idempotency key `key` was first used for, and that
    /// begin's fingerprint.
    fn find_key(&mut self, key: &str) -> Result<Option<(ActivityId, i64)>, LedgerError>;
    /// Stores a new owner, or overwrites one.
    fn put_owner(&mut self, owner: &Owner) -> Result<(), LedgerError>;
    /// Whether any aggregate of the lane of `labels` has totals stored.
    fn lane_known(&mut self, labels: &LabelSet) -> Result<bool, LedgerError>;
    /// How many distinct lanes, and how many aggregates, have totals
    /// stored.
    fn label_census(&mut self) -> Result<(i64, i64), LedgerError>;
    /// Records that [`query::is_due`] at `now`, in [`query::due_order`], at
    /// most `limit`.
    fn due(&mut self, now: Timestamp, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError>;
    /// [`LaneQuery::answer`]: how many records [`LaneQuery::counts`] as
    /// executing, and how many as waiting ahead (by rank, when asked).
    fn lane_position(&mut self, query: &LaneQuery) -> Result<LanePosition, LedgerError>;
    /// What `lane` remembers between admission decisions; the default for
    /// a lane with none stored.
    fn lane_state(&mut self, lane: &LaneKey) -> Result<LaneState, LedgerError>;
    /// Stores what `lane` remembers, written at once.
    fn put_lane_state(&mut self, lane: &LaneKey, state: LaneState) -> Result<(), LedgerError>;
    /// Every lane's stored state, in any order.
    fn lane_states(&mut self) -> Result<Vec<(LaneKey, LaneState)>, LedgerError>;
    /// Records in flight in [`query::line_order`], at most `limit`.
    fn in_flight(&mut self, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError>;
    /// How many records are in flight.
    fn in_flight_count(&mut self) -> Result<i64, LedgerError>;
    /// [`query::lane_loads`] of every record in flight.
    fn lane_loads(&mut self) -> Result<Vec<LaneLoad>, LedgerError>;
    /// Records [`Window::completed`] in `window`, in
    /// [`Window::completed_order`], at most `limit`.
    fn completed(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError>;
    /// How many records [`Window::completed`] has from `from`, with a
    /// `completedAt` before `to`.
    fn completed_between(&mut self, from: Timestamp, to: Timestamp) -> Result<i64, LedgerError>;
    /// Records [`Window::reaped`] in `window`, in [`Window::reaped_order`],
    /// at most `limit`.
    fn reaped(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError>;
    /// Owners [`Window::lists_owner`] in `window`, in
    /// [`Window::owner_order`].
    fn listed_owners(&mut self, window: Window) -> Result<Vec<Owner>, LedgerError>;
    /// Owners that [`Owner::is_expired`] at `now`, in any order.
    fn expired_owners(&mut self, now: Timestamp) -> Result<Vec<Owner>, LedgerError>;
    /// Records in flight whose owner is `id`, in [`query::line_order`].
    fn owner_in_flight(&mut self, id: &OwnerId) -> Result<Vec<Arc<ActivityRecord>>, LedgerError>;
    /// Records [`Retention::prunes`], in [`Retention::record_order`], at
    /// most `limit`.
    fn prunable(&mut self, retention: Retention, limit: usize) -> Result<Vec<ActivityId>, LedgerError>;
    /// Deletes the owners [`Retention::prunes_owner`].
    fn prune_owners(&mut self, retention: Retention) -> Result<(), LedgerError>;
}

/// Runs `command` against `txn`.
pub(crate) fn execute(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    command: Command,
    now: Timestamp,
) -> Result<Reply, LedgerError> {
    let policy = config.policy();
    match command {
        Command::Begin { mut new } => {
            // A repeat answers what the first begin made, whatever has
            // happened to its owner or its lane since.
            let idempotency = new.extras.as_mut().and_then(|extras| extras.idempotency.take());
            if let Some(key) = &idempotency {
                if let Some(first) = txn.find_key(&key.key)? {
                    return replay(txn, config, key, first, now).map(Reply::Record);
                }
            }
            if let Some(owner_id) = &new.owner_id {
                let id: OwnerId = owner_id.parse()?;
                // Stored in one spelling, so loss and release find it.
                new.owner_id = Some(id.to_string());
                let owner = txn
                    .get_owner(&id)?
                    .ok_or_else(|| LedgerError::invalid(format!("no owner {id}: register it first")))?;
                let owner = lose_if_expired(txn, config, owner, now)?;
                owner.check_live()?;
            }
            bound_labels(txn, config, &mut new.labels, new.priority, new.admission)?;
            let declared = new.max_tokens.is_some();
            let mut applied = transition::begin(new, now, policy)?;
            fits_a_budget(config, &applied.record, declared)?;
            let granted = if applied.record.state == State::Executing {
                admit(txn, config, &applied.record, true, now)?
            } else {
                None
            };
            // A record begun with old timestamps may already be past its bound.
            if let Some(reaped) = transition::reap_if_due(&mut applied.record, now) {
                applied.effects.push(reaped);
            }
            let record = Arc::new(applied.record);
            txn.insert(&record)?;
            if let Some(key) = &idempotency {
                txn.claim_key(key, &record)?;
            }
            add_totals(txn, config, now, None, &record, &applied.effects)?;
            if let Some((lane, state)) = granted {
                txn.put_lane_state(&lane, state)?;
            }
            Ok(Reply::Record(record))
        }
        Command::Transition { id, transition } => {
            let start = matches!(transition, Transition::Start { .. });
            let settle = match transition {
                Transition::Settle {
                    success,
                    retry_after_ms,
                    ..
                } => Some((success, retry_after_ms)),
                _ => None,
            };
            // Most transitions need neither the owner's lease nor the lane:
            // a glance at the record in place says whether this one does.
            let mut needs = None;
            let mut granted = None;
            txn.peek(id, &mut |record| {
                needs = Some(record.owner_id.is_some() || (start && needs_admission(config, record)));
            })?;
            if needs.ok_or_else(|| not_found(id))? {
                let record = load_seen(txn, config, id, now)?;
                if start && needs_admission(config, &record) {
                    // Reaps what is due first, this record too.
                    granted = admit(txn, config, &record, false, now)?;
                }
            }
            let mut effects = Effects::new();
            let mut transition = Some(transition);
            let mut applied = Ok(());
            let mut charged = None;
            // Persisted even when the request is refused: time still passed,
            // and a record past its bound is reaped whatever was asked of it.
            let record = txn
                .modify(id, &mut |record| {
                    if let Some(transition) = transition.take() {
                        charged = window::charge(record);
                        applied = transition::apply(record, transition, now, policy, &mut effects);
                    }
                    !effects.is_empty()
                })?
                .ok_or_else(|| not_found(id))?;
            add_totals(txn, config, now, charged, &record, &effects)?;
            applied?;
            // Stored only once the start landed (even if the record was
            // then reaped at once): a start refused after its admission
            // leaves the lane as it was.
            if let Some((lane, state)) = granted.filter(|_| started(&effects)) {
                txn.put_lane_state(&lane, state)?;
            }
            // Most settles carry no Retry-After, and most ledgers have no
            // adaptive lane: those look no lane up.
            if let Some((success, retry)) = settle {
                if retry.is_some() || config.any_adaptive() {
                    lane_settled(txn, config, &record, &effects, (success, retry))?;
                }
            }
            Ok(Reply::Record(record))
        }
        Command::Refine { id, model } => refine(txn, config, id, &model, now).map(Reply::Record),
        Command::Get { id } => {
            let record = load_seen(txn, config, id, now)?;
            Ok(Reply::Record(reap_one(txn, config, record, now)?))
        }
        Command::Reap => Ok(Reply::Reaped(reap_all(txn, config, now)?)),
        Command::Snapshot { options } => {
            let reaped_this_read = reap_all(txn, config, now)?;
            let window = Window {
                since: options.since().resolve(now),
            };
            let parts = snapshot_parts(txn, window, options.limit(), now)?;
            Ok(Reply::Snapshot(Box::new(Snapshot::assemble(
                parts,
                config.lanes(),
                config.provider_budgets(),
                options,
                now,
                reaped_this_read,
            ))))
        }
        Command::Prune { limit } => {
            let keep = i64::try_from(config.retention().as_millis()).unwrap_or(i64::MAX);
            Ok(Reply::Pruned(prune(txn, Retention::at(now, keep), limit, now)?))
        }
        Command::Stats => Ok(Reply::Stats(StoreStats {
            stored_records: txn.stored_records()?,
        })),
        Command::RegisterOwner { name, ttl_ms } => {
            let owner = Owner::register(name, owner::check_ttl(ttl_ms)?, now);
            txn.put_owner(&owner)?;
            Ok(Reply::Owner(Box::new(owner)))
        }
        Command::RenewOwner { id } => {
            let owner = load_owner(txn, &id)?;
            let mut owner = lose_if_expired(txn, config, owner, now)?;
            owner.renew(now)?;
            txn.put_owner(&owner)?;
            Ok(Reply::Owner(Box::new(owner)))
        }
        Command::ReleaseOwner { id } => {
            let owner = load_owner(txn, &id)?;
            let mut owner = lose_if_expired(txn, config, owner, now)?;
            if owner.release(now)? {
                // A clean shutdown: its unfinished work was observed aborted.
                // Every cancel is decided before any is written, so that a
                // refusal leaves them all as they were.
                let mut cancelled = Vec::new();
                for mut record in txn.owner_in_flight(&id)? {
                    let cancel = Transition::Cancel {
                        reason: Some("owner released".to_owned()),
                        at: None,
                    };
                    let mut effects = Effects::new();
                    let charged = window::charge(&record);
                    let changed = Arc::make_mut(&mut record);
                    transition::apply(changed, cancel, now, config.policy(), &mut effects)?;
                    if changed.state == State::Cancelled {
                        owner.cancelled_records += 1;
                    }
                    cancelled.push((record, charged, effects));
                }
                for (record, charged, effects) in cancelled {
                    txn.update(&record)?;
                    add_totals(txn, config, now, charged, &record, &effects)?;
                }
                txn.put_owner(&owner)?;
            }
            Ok(Reply::Owner(Box::new(owner)))
        }
    }
}

/// Keeps the labels a begin or a refinement gives a record within the
/// configured [`Cardinality`](crate::domain::Cardinality): folds them (or
/// refuses the command) when they are outside a vocabulary, or would make
/// a new lane or aggregate past its limit. The store is asked only about
/// an aggregate it does not hold yet, which a steady service never sends.
fn bound_labels(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    labels: &mut ActivityLabels,
    priority: Priority,
    admission: Admission,
) -> Result<(), LedgerError> {
    let bounds = config.cardinality();
    if let Some(restricted) = bounds.restrict(labels) {
        *labels = restricted;
    }
    if txn.aggregate_known(labels, priority, admission)? {
        return Ok(());
    }
    let lane_known = config.declares(labels) || txn.lane_known(labels)?;
    let (lanes, aggregates) = txn.label_census()?;
    let census = Census {
        lane_known,
        lanes,
        aggregates,
    };
    if let Some(folded) = bounds.bound(labels, census)? {
        *labels = folded;
    }
    Ok(())
}

/// Refines the model of the record `id` to `model`: the domain's rule
/// ([`transition::refined_model`]) on the model as a begin would record it
/// (sanitized, restricted to its vocabulary), then the label limits. The
/// record's count in flight moves to its new aggregate.
fn refine(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    id: ActivityId,
    model: &str,
    now: Timestamp,
) -> Result<Arc<ActivityRecord>, LedgerError> {
    let asked = labels::refinement_model(model)?;
    let before = load_seen(txn, config, id, now)?;
    let restrict = |labels: ActivityLabels| config.cardinality().restrict(&labels).unwrap_or(labels);
    let asked = restrict(before.labels.with_model(asked));
    let mut labels = before
        .labels
        .with_model(transition::refined_model(&before, &asked.model));
    if labels != before.labels {
        bound_labels(txn, config, &mut labels, before.priority, before.admission)?;
    }
    let mut effects = Effects::new();
    let mut refined = Ok(false);
    let mut labels = Some(labels);
    let mut charged = None;
    let record = txn
        .modify(id, &mut |record| {
            if let Some(labels) = labels.take() {
                charged = window::charge(record);
                refined = transition::refine(record, labels, now, &mut effects);
            }
            matches!(refined, Ok(true)) || !effects.is_empty()
        })?
        .ok_or_else(|| not_found(id))?;
    if effects
        .iter()
        .any(|effect| matches!(effect, Effect::JoinedAggregate { .. }))
    {
        // The lane is the same: nothing moves in its token window.
        add_totals(
            txn,
            config,
            now,
            window::charge(&before),
            &before,
            &[Effect::LeftAggregate],
        )?;
    }
    add_totals(txn, config, now, charged, &record, &effects)?;
    refined?;
    Ok(record)
}

/// The answer to a repeated begin with the key `key`, whose first begin
/// made the record `id` with the request fingerprinted `fingerprint`: that
/// record as it stands now.
fn replay(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    key: &Idempotency,
    (id, fingerprint): (ActivityId, i64),
    now: Timestamp,
) -> Result<Arc<ActivityRecord>, LedgerError> {
    if fingerprint != key.fingerprint {
        return Err(LedgerError::new(
            ErrorKind::IdempotencyConflict,
            format!(
                "Idempotency-Key {:?} was first sent with a different request (activity {id}); \
                 a new request takes a new key",
                key.key
            ),
        ));
    }
    let record = load_seen(txn, config, id, now)?;
    reap_one(txn, config, record, now)
}

/// Everything a snapshot reports, for `window`, each list at most
/// `limit + 1` long so that the snapshot can say it was truncated.
fn snapshot_parts(
    txn: &mut dyn Txn,
    window: Window,
    limit: usize,
    now: Timestamp,
) -> Result<SnapshotParts, LedgerError> {
    let fetch = limit.saturating_add(1);
    let plan = window.completion_count_plan();
    let mut aggregates = txn.aggregates()?;
    aggregates.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    Ok(SnapshotParts {
        lane_loads: txn.lane_loads()?,
        aggregates,
        in_flight: txn
            .in_flight(fetch)?
            .into_iter()
            .map(Arc::unwrap_or_clone)
            .collect(),
        in_flight_total: txn.in_flight_count()?,
        recent_completions: txn.completed(window, fetch)?,
        recent_completions_total: txn.completed_between(plan.partial.0, plan.partial.1)?
            + txn.completion_minutes_from(plan.first_whole_minute)?,
        reaped: txn.reaped(window, fetch)?,
        owners: txn.listed_owners(window)?,
        lane_states: txn.lane_states()?,
        lane_tokens: txn.tokens_since(window::first_second_at(now))?,
    })
}

/// Deletes at most `limit` records that `retention` prunes, oldest first,
/// then the owners and the per-minute counters it prunes, and the token
/// seconds out of the window at `now`; returns how many records it
/// deleted. The aggregate counters are never touched.
fn prune(
    txn: &mut dyn Txn,
    retention: Retention,
    limit: usize,
    now: Timestamp,
) -> Result<usize, LedgerError> {
    let doomed = txn.prunable(retention, limit)?;
    let deleted = txn.delete(&doomed)?;
    txn.prune_owners(retention)?;
    txn.delete_minutes_before(retention.first_kept_minute())?;
    txn.delete_token_seconds_before(window::first_second_at(now))?;
    Ok(deleted)
}

/// Recomputes the bounds of every record in flight under `policy`
/// ([`ReapPolicy::rebound`]), when a persistent store opens; returns how
/// many changed. (A memory store opens empty: it has nothing to rebound.)
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) fn rebound(txn: &mut dyn Txn, policy: &ReapPolicy) -> Result<usize, LedgerError> {
    let mut changed = 0;
    for mut record in txn.in_flight(usize::MAX)? {
        if policy.rebound(Arc::make_mut(&mut record)) {
            txn.update(&record)?;
            changed += 1;
        }
    }
    Ok(changed)
}

/// The admission decision for `record`, which asks to start now. Leaks are
/// reaped first, in the same transaction, so none of them holds a slot.
/// Returns the lane's state to store once the start has landed, when the
/// decision changed it.
fn admit(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    record: &ActivityRecord,
    newcomer: bool,
    now: Timestamp,
) -> Result<Option<(LaneKey, LaneState)>, LedgerError> {
    if record.admission != Admission::Queued {
        return Ok(None);
    }
    let Some(rules) = config.rules_of(&record.labels) else {
        return Ok(None);
    };
    let lane = record.lane();
    // Locked before anything is read, so that the reap and the counts below
    // see every decision on this lane that committed before. A provider's
    // budget lock comes first: every decision takes the two in one order,
    // so two groups of decisions on its lanes never wait on each other.
    if rules.provider_budget.is_some() {
        txn.lock_provider(&lane.provider)?;
    }
    txn.lock_lane(&lane)?;
    reap_all(txn, config, now)?;
    let mut query = LaneQuery::of(record, newcomer, rules.ranked());
    if rules.budgeted() {
        query = query.with_tokens(
            if rules.max_overtakes > 0 && Rank::of(record.priority) == Rank::Interactive {
                Ahead::Interactive
            } else {
                Ahead::All
            },
        );
    }
    let position = txn.lane_position(&query)?;
    let state = txn.lane_state(&lane)?;
    let place = Some((
        rules.ranked().then(|| Rank::of(record.priority)),
        query::line_order(record),
    ));
    // A newcomer (a begin already started) is refused before it is
    // stored: it has no place in line to keep.
    let keeps = |refused: String| {
        if newcomer {
            format!("{refused}; nothing was recorded")
        } else {
            format!(
                "{refused}; activity {} keeps its place in line",
                record.activity_id
            )
        }
    };
    let refused = match admission::decide(&rules, record.priority, &position, state, now) {
        Decision::Admit(next) => {
            if rules.budgeted() {
                if let Err(exhausted) = within_budget(txn, &rules, record, &position, now)? {
                    let left = exhausted
                        .until
                        .map_or(WINDOW, |until| millis(until.millis_since(now)));
                    let message = keeps(budget_refusal(&lane, record, position.tokens_ahead, &exhausted));
                    return Err(LedgerError::refused(
                        ErrorKind::BudgetExhausted,
                        lane,
                        place,
                        Some(left),
                        message,
                    ));
                }
            }
            return Ok((next != state).then_some((lane, next)));
        }
        Decision::LaneFull { cap } => format!("lane {lane} is full (cap {cap})"),
        Decision::BatchFull { batch_cap } => {
            format!("lane {lane} runs all the batch work it may (batch_cap {batch_cap})")
        }
        Decision::Cooling { until } => {
            let left = millis(until.millis_since(now));
            let message = keeps(format!(
                "lane {lane} is cooling down after a provider's Retry-After until {until}"
            ));
            return Err(LedgerError::refused(
                ErrorKind::LaneCooling,
                lane,
                place,
                Some(left),
                message,
            ));
        }
    };
    Err(LedgerError::refused(
        ErrorKind::LaneFull,
        lane,
        place,
        None,
        keeps(refused),
    ))
}

/// How long a refusal says to wait when no roll-off of the window makes
/// room: the window's length, by which a settle that comes now will have
/// rolled off too. A settle wakes the line before then.
const WINDOW: std::time::Duration = std::time::Duration::from_millis(window::WINDOW_MS as u64);

fn millis(ms: i64) -> std::time::Duration {
    std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// Whether `record`, which the lane's slots admit at `position`, fits in
/// its lane's token budget and its provider's ([`budget::check`]), read
/// under the provider's lock when it has a budget ([`admit`]).
fn within_budget(
    txn: &mut dyn Txn,
    rules: &LaneRules,
    record: &ActivityRecord,
    position: &LanePosition,
    now: Timestamp,
) -> Result<Result<(), Exhausted>, LedgerError> {
    let lane = record.lane();
    let estimate = record.max_tokens.unwrap_or(0);
    let (own, provider) = txn.window_use(&lane, window::first_second_at(now))?;
    let check = |scope, budget: Option<u32>, window: &WindowUse| {
        budget.map_or(Ok(()), |budget| {
            budget::check(scope, budget, window, position.tokens_ahead, estimate, now)
        })
    };
    Ok(check(Scope::Lane, rules.budget, &own)
        .and_then(|()| check(Scope::Provider, rules.provider_budget, &provider)))
}

/// Refuses a queued call whose estimate alone exceeds its lane's whole
/// token budget or its provider's ([`LaneRules::over_budget`]): it could
/// never start. `declared`: the estimate is the begin's `maxTokens`, not
/// its class's `tokens`.
fn fits_a_budget(config: &LedgerConfig, record: &ActivityRecord, declared: bool) -> Result<(), LedgerError> {
    let (Some(estimate), Admission::Queued) = (record.max_tokens, record.admission) else {
        return Ok(());
    };
    let Some((scope, budget)) = config
        .rules_of(&record.labels)
        .and_then(|rules| rules.over_budget(estimate))
    else {
        return Ok(());
    };
    let lane = record.lane();
    let whose = match scope {
        Scope::Lane => format!("lanes.\"{lane}\".tokens_per_minute = {budget}"),
        Scope::Provider => format!("providers.{}.tokens_per_minute = {budget}", lane.provider),
    };
    let what = if declared {
        "maxTokens".to_owned()
    } else {
        format!("class {}'s tokens", record.labels.class)
    };
    Err(LedgerError::invalid(format!(
        "{what} {estimate} exceeds the whole token budget ({whose}): the call could never start"
    )))
}

/// What a refusal for budget says: whose budget, what its window holds,
/// what waits ahead, the estimate that does not fit, and when room comes.
fn budget_refusal(lane: &LaneKey, record: &ActivityRecord, ahead: i64, exhausted: &Exhausted) -> String {
    let whose = match exhausted.scope {
        Scope::Lane => format!(
            "lane {lane} has no room in its token budget (tokens_per_minute {})",
            exhausted.tokens_per_minute
        ),
        Scope::Provider => format!(
            "provider {} has no room in its token budget (tokens_per_minute {}, shared by its lanes)",
            lane.provider, exhausted.tokens_per_minute
        ),
    };
    let ahead = if ahead > 0 {
        format!(", {ahead} are estimated by calls ahead in line")
    } else {
        String::new()
    };
    let when = match exhausted.until {
        Some(until) => format!("room comes back at {until}, as the window rolls off"),
        None => "only a settle of a call executing or ahead in line makes room".to_owned(),
    };
    format!(
        "{whose}: {} tokens were spent in the last minute or are reserved by calls executing{ahead}, \
         and the estimate of {} does not fit; {when}",
        exhausted.used,
        record.max_tokens.unwrap_or(0),
    )
}

fn load_owner(txn: &mut dyn Txn, id: &OwnerId) -> Result<Owner, LedgerError> {
    txn.get_owner(id)?
        .ok_or_else(|| LedgerError::new(ErrorKind::NotFound, format!("no owner {id}")))
}

/// Loads the record `id` as time has left it: if its owner's lease ran out,
/// the owner is lost first, so the record is seen reaped. Only this record's
/// owner is looked at; reads and reaper passes handle every other owner.
fn load_seen(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    id: ActivityId,
    now: Timestamp,
) -> Result<Arc<ActivityRecord>, LedgerError> {
    let record = load(txn, id)?;
    let Some(owner_id) = &record.owner_id else {
        return Ok(record);
    };
    let owner = txn.get_owner(&OwnerId::trusted(owner_id.clone()))?;
    match owner {
        Some(owner) if owner.is_expired(now) => {
            lose(txn, config, owner, now)?;
            load(txn, id)
        }
        _ => Ok(record),
    }
}

/// `owner` as time has left it: lost (its records reaped) once its lease
/// ran out.
fn lose_if_expired(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    owner: Owner,
    now: Timestamp,
) -> Result<Owner, LedgerError> {
    if !owner.is_expired(now) {
        return Ok(owner);
    }
    let owner_id = owner.owner_id.clone();
    lose(txn, config, owner, now)?;
    load_owner(txn, &owner_id)
}

/// Marks `owner` lost and reaps its in-flight records.
fn lose(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    mut owner: Owner,
    now: Timestamp,
) -> Result<ReapedCounts, LedgerError> {
    let mut counts = ReapedCounts::default();
    owner.lose(now);
    for mut record in txn.owner_in_flight(&owner.owner_id)? {
        let charged = window::charge(&record);
        // A record already past its deadline bound is reaped for that.
        let changed = Arc::make_mut(&mut record);
        let effect =
            transition::reap_if_due(changed, now).or_else(|| transition::reap_for_owner_loss(changed, now));
        if let Some(effect) = effect {
            if let Effect::Reaped { disposition, .. } = effect {
                counts.count(disposition);
            }
            owner.reaped_records += 1;
            txn.update(&record)?;
            add_totals(txn, config, now, charged, &record, &[effect])?;
        }
    }
    txn.put_owner(&owner)?;
    Ok(counts)
}

/// Reaps the in-flight records of every owner whose lease ran out, and marks
/// those owners lost. Idempotent like [`reap_due`].
pub(crate) fn reap_lost_owners(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    now: Timestamp,
) -> Result<ReapedCounts, LedgerError> {
    let mut counts = ReapedCounts::default();
    for owner in txn.expired_owners(now)? {
        counts.add(lose(txn, config, owner, now)?);
    }
    Ok(counts)
}

/// Reaps lost owners' records and every record past its bound.
pub(crate) fn reap_all(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    now: Timestamp,
) -> Result<ReapedCounts, LedgerError> {
    let mut counts = reap_lost_owners(txn, config, now)?;
    counts.add(reap_due(txn, config, now)?);
    Ok(counts)
}

fn load(txn: &mut dyn Txn, id: ActivityId) -> Result<Arc<ActivityRecord>, LedgerError> {
    txn.get(id)?.ok_or_else(|| not_found(id))
}

fn not_found(id: ActivityId) -> LedgerError {
    LedgerError::new(ErrorKind::NotFound, format!("no activity {id}"))
}

/// What a settle that landed (`effects` hold its `Settled`) does to its
/// capped lane: a provider's `Retry-After` (`settle.1`) cools it down, and
/// every lane that shares the provider's cooldown with it
/// ([`LedgerConfig::cooled_with`]); an adaptive lane's cap follows
/// ([`LaneState::settled`]). Each lane is locked first, as for a
/// decision, so that no decision's state overwrites it.
fn lane_settled(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    record: &ActivityRecord,
    effects: &[Effect],
    (success, retry_after_ms): (bool, Option<i64>),
) -> Result<(), LedgerError> {
    let Some(completed_at) = effects.iter().find_map(|effect| match effect {
        Effect::Settled { at, .. } => Some(*at),
        _ => None,
    }) else {
        return Ok(());
    };
    let Some(rules) = config.rules_of(&record.labels) else {
        return Ok(());
    };
    if retry_after_ms.is_none() && !rules.adaptive {
        return Ok(());
    }
    let lane = record.lane();
    let cooled = match retry_after_ms {
        Some(_) => config.cooled_with(&lane),
        None => vec![lane.clone()],
    };
    for other in cooled {
        let Some(other_rules) = config.lane_rules(&other) else {
            continue;
        };
        txn.lock_lane(&other)?;
        let before = txn.lane_state(&other)?;
        let mut after = before;
        if let Some(retry_after_ms) = retry_after_ms {
            after = after.cool(completed_at, retry_after_ms, other_rules.max_cooldown_ms);
        }
        if other == lane {
            after = after.settled(&rules, success, retry_after_ms.is_some());
        }
        if after != before {
            txn.put_lane_state(&other, after)?;
        }
    }
    Ok(())
}

/// Whether `effects` hold a start: the slot the admission granted was
/// taken.
fn started(effects: &[Effect]) -> bool {
    effects
        .iter()
        .any(|effect| matches!(effect, Effect::Started { .. }))
}

/// Whether a start of `record` asks for admission: it would start
/// ([`transition::would_start`]), it is queued, and its lane is governed
/// (a cap or a token budget).
fn needs_admission(config: &LedgerConfig, record: &ActivityRecord) -> bool {
    transition::would_start(record)
        && record.admission == Admission::Queued
        && config.is_governed(&record.labels)
}

/// Counts `effects` of `record` and hands each to the store to publish,
/// with the capacity it changed ([`capacity::change`]); moves its token
/// charge from `charged`, what it charged before the command.
fn add_totals(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    now: Timestamp,
    charged: Option<(i64, i64)>,
    record: &Arc<ActivityRecord>,
    effects: &[Effect],
) -> Result<(), LedgerError> {
    let charge = window::charge(record);
    if charge != charged {
        spend(txn, now, record, charged, charge)?;
    }
    let mut capped = None;
    for effect in effects {
        if let Effect::Settled { at, .. } = effect {
            txn.count_completion(record, query::completion_minute(*at))?;
        }
        let capped = || *capped.get_or_insert_with(|| config.is_governed(&record.labels));
        txn.landed(record, effect, capacity::change(record, effect, capped));
    }
    if effects.is_empty() {
        return Ok(());
    }
    txn.add_totals(record, effects)
}

/// Moves `record`'s charge in its lane's token window from `charged`, what
/// it charged before the command, to `charge`. A second already out of the
/// window changes nothing anyone reads: not written. Out of line: most
/// commands charge nothing.
#[inline(never)]
fn spend(
    txn: &mut dyn Txn,
    now: Timestamp,
    record: &ActivityRecord,
    charged: Option<(i64, i64)>,
    charge: Option<(i64, i64)>,
) -> Result<(), LedgerError> {
    for (second, tokens) in window::moves(charged, charge).into_iter().flatten() {
        if second >= window::first_second_at(now) {
            txn.spend(&record.lane(), second, tokens)?;
        }
    }
    Ok(())
}

/// Reaps `record` if it is past its bound, persisting the change.
fn reap_one(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    mut record: Arc<ActivityRecord>,
    now: Timestamp,
) -> Result<Arc<ActivityRecord>, LedgerError> {
    // Checked first, so that a read copies nothing.
    if !transition::is_due(&record, now) {
        return Ok(record);
    }
    let charged = window::charge(&record);
    if let Some(effect) = transition::reap_if_due(Arc::make_mut(&mut record), now) {
        txn.update(&record)?;
        add_totals(txn, config, now, charged, &record, &[effect])?;
    }
    Ok(record)
}

/// Reaps every record past its bound. Idempotent: a record another process
/// reaped first is no longer in flight, so it is neither found nor counted
/// again.
pub(crate) fn reap_due(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    now: Timestamp,
) -> Result<ReapedCounts, LedgerError> {
    let mut counts = ReapedCounts::default();
    loop {
        let due = txn.due(now, REAP_BATCH)?;
        let found = due.len();
        for mut record in due {
            let charged = window::charge(&record);
            if let Some(effect) = transition::reap_if_due(Arc::make_mut(&mut record), now) {
                if let Effect::Reaped { disposition, .. } = effect {
                    counts.count(disposition);
                }
                txn.update(&record)?;
                add_totals(txn, config, now, charged, &record, &[effect])?;
            }
        }
        if found < REAP_BATCH {
            return Ok(counts);
        }
    }
}
