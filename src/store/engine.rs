//! The one implementation of every command, written against [`Txn`], the
//! primitive operations a store provides inside one transaction.
//!
//! The rules themselves are the domain's; this module only sequences them:
//! load, reap if due, apply, persist the record and the counter changes.

use std::sync::Arc;

use crate::config::LedgerConfig;
use crate::domain::admission::{self, Decision, LanePosition};
use crate::domain::counters::ReapedCounts;
use crate::domain::owner::{self, Owner, OwnerId};
use crate::domain::record::{ActivityId, ActivityRecord, Admission, Disposition, State};
use crate::domain::snapshot::{Snapshot, SnapshotParts};
use crate::domain::timestamp::Millis;
use crate::domain::transition::{self, Effect, Effects, Transition};
use crate::error::{ErrorKind, LedgerError};

use super::{Command, Reply, StoreStats};

/// How many due records a reap pass handles per round trip.
const REAP_BATCH: usize = 512;

/// The primitive operations of a store, inside one transaction.
pub(crate) trait Txn {
    /// The record with `id`, as stored.
    fn get(&mut self, id: ActivityId) -> Result<Option<Arc<ActivityRecord>>, LedgerError>;
    /// Stores a new record.
    fn insert(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError>;
    /// Overwrites a stored record with `record`.
    fn update(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError>;
    /// Shows `look` the record with `id`, as stored, without copying or
    /// sharing it; `false` when there is none.
    fn peek(&mut self, id: ActivityId, look: &mut dyn FnMut(&ActivityRecord)) -> Result<bool, LedgerError>;
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
    /// In-flight records whose `reapable_at` is before `now`, at most `limit`.
    fn due(&mut self, now: Millis, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError>;
    /// Counts `effects` (never empty) in the totals of the aggregate
    /// `record` counts in
    /// ([`AggregateKey::of`](crate::domain::counters::AggregateKey::of)),
    /// by [`Totals::count`](crate::domain::counters::Totals::count).
    fn add_totals(&mut self, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError>;
    /// Counts one completion in the minute of `completed_at`, so that a
    /// snapshot counts its window from per-minute counters, not history.
    fn count_completion(&mut self, completed_at: Millis) -> Result<(), LedgerError>;
    /// Deletes at most `limit` settled or reaped records that ended before
    /// `before`, the owners lost or released before then, and the per-minute
    /// counters of that age; returns how many records it deleted. Counters
    /// are never touched.
    fn prune(&mut self, before: Millis, limit: usize) -> Result<usize, LedgerError>;
    /// How many records are stored.
    fn stored_records(&mut self) -> Result<i64, LedgerError>;
    /// Everything a snapshot reports, for the window from `since`.
    fn snapshot_parts(&mut self, since: Millis, limit: usize) -> Result<SnapshotParts, LedgerError>;
    /// Where `record` stands on its lane: queued records executing, and
    /// queued records waiting that were enqueued before it (by `enqueuedAt`,
    /// then id). A `newcomer` (begun already started, so never in line)
    /// also counts those enqueued in the same millisecond as ahead of it.
    fn lane_position(&mut self, record: &ActivityRecord, newcomer: bool)
        -> Result<LanePosition, LedgerError>;
    /// The owner with `id`.
    fn get_owner(&mut self, id: &OwnerId) -> Result<Option<Owner>, LedgerError>;
    /// Stores a new owner, or overwrites one.
    fn put_owner(&mut self, owner: &Owner) -> Result<(), LedgerError>;
    /// Live owners whose lease ran out before `now`.
    fn expired_owners(&mut self, now: Millis) -> Result<Vec<Owner>, LedgerError>;
    /// In-flight records of the owner `id`.
    fn owner_in_flight(&mut self, id: &OwnerId) -> Result<Vec<Arc<ActivityRecord>>, LedgerError>;
}

/// Runs `command` against `txn`.
pub(crate) fn execute(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    command: Command,
    now: Millis,
) -> Result<Reply, LedgerError> {
    let policy = config.policy();
    match command {
        Command::Begin { mut new } => {
            if let Some(owner_id) = &new.owner_id {
                let id: OwnerId = owner_id.parse().map_err(LedgerError::invalid)?;
                // Stored in one spelling, so loss and release find it.
                new.owner_id = Some(id.to_string());
                let owner = txn
                    .get_owner(&id)?
                    .ok_or_else(|| LedgerError::invalid(format!("no owner {id}: register it first")))?;
                let owner = lose_if_expired(txn, owner, now)?;
                owner.check_live()?;
            }
            let mut applied = transition::begin(new, now, policy)?;
            if applied.record.state == State::Executing {
                admit(txn, config, &applied.record, true, now)?;
            }
            // A record begun with old timestamps may already be past its bound.
            if let Some(reaped) = transition::reap_if_due(&mut applied.record, now) {
                applied.effects.push(reaped);
            }
            let record = Arc::new(applied.record);
            txn.insert(&record)?;
            add_totals(txn, &record, &applied.effects)?;
            Ok(Reply::Record(record))
        }
        Command::Transition { id, transition } => {
            let start = matches!(transition, Transition::Start { .. });
            // Most transitions need neither the owner's lease nor the lane:
            // a glance at the record in place says whether this one does.
            let mut needs = None;
            txn.peek(id, &mut |record| {
                needs = Some(record.owner_id.is_some() || (start && needs_admission(config, record)));
            })?;
            if needs.ok_or_else(|| not_found(id))? {
                let record = load_seen(txn, id, now)?;
                if start && needs_admission(config, &record) {
                    // Reaps what is due first, this record too.
                    admit(txn, config, &record, false, now)?;
                }
            }
            let mut effects = Effects::new();
            let mut transition = Some(transition);
            let mut applied = Ok(());
            // Persisted even when the request is refused: time still passed,
            // and a record past its bound is reaped whatever was asked of it.
            let record = txn
                .modify(id, &mut |record| {
                    if let Some(transition) = transition.take() {
                        applied = transition::apply(record, transition, now, policy, &mut effects);
                    }
                    !effects.is_empty()
                })?
                .ok_or_else(|| not_found(id))?;
            add_totals(txn, &record, &effects)?;
            applied?;
            Ok(Reply::Record(record))
        }
        Command::Get { id } => {
            let record = load_seen(txn, id, now)?;
            Ok(Reply::Record(reap_one(txn, record, now)?))
        }
        Command::Reap => Ok(Reply::Reaped(reap_all(txn, now)?)),
        Command::Snapshot { options } => {
            let reaped_this_read = reap_all(txn, now)?;
            let parts = txn.snapshot_parts(options.since().resolve(now), options.limit())?;
            Ok(Reply::Snapshot(Box::new(Snapshot::assemble(
                parts,
                config.caps(),
                options,
                now,
                reaped_this_read,
            ))))
        }
        Command::Prune { limit } => {
            let keep = i64::try_from(config.retention().as_millis()).unwrap_or(i64::MAX);
            Ok(Reply::Pruned(txn.prune(now.saturating_sub(keep), limit)?))
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
            let mut owner = lose_if_expired(txn, owner, now)?;
            owner.renew(now)?;
            txn.put_owner(&owner)?;
            Ok(Reply::Owner(Box::new(owner)))
        }
        Command::ReleaseOwner { id } => {
            let owner = load_owner(txn, &id)?;
            let mut owner = lose_if_expired(txn, owner, now)?;
            if owner.release(now)? {
                // A clean shutdown: its unfinished work was observed aborted.
                for record in txn.owner_in_flight(&id)? {
                    let cancel = Transition::Cancel {
                        reason: Some("owner released".to_owned()),
                        at: None,
                    };
                    let mut record = record;
                    let mut effects = Effects::new();
                    transition::apply(
                        Arc::make_mut(&mut record),
                        cancel,
                        now,
                        config.policy(),
                        &mut effects,
                    )?;
                    if record.state == State::Cancelled {
                        owner.cancelled_records += 1;
                    }
                    txn.update(&record)?;
                    add_totals(txn, &record, &effects)?;
                }
                txn.put_owner(&owner)?;
            }
            Ok(Reply::Owner(Box::new(owner)))
        }
    }
}

/// The admission decision for `record`, which asks to start now. Leaks are
/// reaped first, in the same transaction, so none of them holds a slot.
fn admit(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    record: &ActivityRecord,
    newcomer: bool,
    now: Millis,
) -> Result<(), LedgerError> {
    if record.admission != Admission::Queued {
        return Ok(());
    }
    let Some(cap) = config.cap_of(&record.labels) else {
        return Ok(());
    };
    let lane = record.lane();
    reap_all(txn, now)?;
    match admission::decide(Some(cap), txn.lane_position(record, newcomer)?) {
        Decision::Admit => Ok(()),
        Decision::LaneFull { cap } => Err(LedgerError::new(
            ErrorKind::LaneFull,
            format!(
                "lane {lane} is full (cap {cap}); activity {} keeps its place in line",
                record.activity_id
            ),
        )),
    }
}

fn load_owner(txn: &mut dyn Txn, id: &OwnerId) -> Result<Owner, LedgerError> {
    txn.get_owner(id)?
        .ok_or_else(|| LedgerError::new(ErrorKind::NotFound, format!("no owner {id}")))
}

/// Loads the record `id` as time has left it: if its owner's lease ran out,
/// the owner is lost first, so the record is seen reaped. Only this record's
/// owner is looked at; reads and reaper passes handle every other owner.
fn load_seen(txn: &mut dyn Txn, id: ActivityId, now: Millis) -> Result<Arc<ActivityRecord>, LedgerError> {
    let record = load(txn, id)?;
    let Some(owner_id) = &record.owner_id else {
        return Ok(record);
    };
    let owner = txn.get_owner(&OwnerId::trusted(owner_id.clone()))?;
    match owner {
        Some(owner) if owner.is_expired(now) => {
            lose(txn, owner, now)?;
            load(txn, id)
        }
        _ => Ok(record),
    }
}

/// `owner` as time has left it: lost (its records reaped) once its lease
/// ran out.
fn lose_if_expired(txn: &mut dyn Txn, owner: Owner, now: Millis) -> Result<Owner, LedgerError> {
    if !owner.is_expired(now) {
        return Ok(owner);
    }
    let owner_id = owner.owner_id.clone();
    lose(txn, owner, now)?;
    load_owner(txn, &owner_id)
}

/// Marks `owner` lost and reaps its in-flight records.
fn lose(txn: &mut dyn Txn, mut owner: Owner, now: Millis) -> Result<ReapedCounts, LedgerError> {
    let mut counts = ReapedCounts::default();
    owner.lose(now);
    for mut record in txn.owner_in_flight(&owner.owner_id)? {
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
            add_totals(txn, &record, &[effect])?;
        }
    }
    txn.put_owner(&owner)?;
    Ok(counts)
}

/// Reaps the in-flight records of every owner whose lease ran out, and marks
/// those owners lost. Idempotent like [`reap_due`].
pub(crate) fn reap_lost_owners(txn: &mut dyn Txn, now: Millis) -> Result<ReapedCounts, LedgerError> {
    let mut counts = ReapedCounts::default();
    for owner in txn.expired_owners(now)? {
        counts.add(lose(txn, owner, now)?);
    }
    Ok(counts)
}

/// Reaps lost owners' records and every record past its bound.
pub(crate) fn reap_all(txn: &mut dyn Txn, now: Millis) -> Result<ReapedCounts, LedgerError> {
    let mut counts = reap_lost_owners(txn, now)?;
    counts.add(reap_due(txn, now)?);
    Ok(counts)
}

fn load(txn: &mut dyn Txn, id: ActivityId) -> Result<Arc<ActivityRecord>, LedgerError> {
    txn.get(id)?.ok_or_else(|| not_found(id))
}

fn not_found(id: ActivityId) -> LedgerError {
    LedgerError::new(ErrorKind::NotFound, format!("no activity {id}"))
}

/// Whether a start of `record` asks for a slot of a capped lane: it would
/// start (it waits, or was abandoned and would be resurrected), it is
/// queued, and its lane has a cap.
fn needs_admission(config: &LedgerConfig, record: &ActivityRecord) -> bool {
    let would_start = record.state == State::Waiting
        || (record.state == State::Reaped && record.disposition == Some(Disposition::Abandoned));
    would_start && record.admission == Admission::Queued && config.cap_of(&record.labels).is_some()
}

fn add_totals(txn: &mut dyn Txn, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError> {
    for effect in effects {
        if let Effect::Settled { at, .. } = effect {
            txn.count_completion(*at)?;
        }
    }
    if effects.is_empty() {
        return Ok(());
    }
    txn.add_totals(record, effects)
}

/// Reaps `record` if it is past its bound, persisting the change.
fn reap_one(
    txn: &mut dyn Txn,
    mut record: Arc<ActivityRecord>,
    now: Millis,
) -> Result<Arc<ActivityRecord>, LedgerError> {
    // Checked first, so that a read copies nothing.
    if !transition::is_due(&record, now) {
        return Ok(record);
    }
    if let Some(effect) = transition::reap_if_due(Arc::make_mut(&mut record), now) {
        txn.update(&record)?;
        add_totals(txn, &record, &[effect])?;
    }
    Ok(record)
}

/// Reaps every record past its bound. Idempotent: a record another process
/// reaped first is no longer in flight, so it is neither found nor counted
/// again.
pub(crate) fn reap_due(txn: &mut dyn Txn, now: Millis) -> Result<ReapedCounts, LedgerError> {
    let mut counts = ReapedCounts::default();
    loop {
        let due = txn.due(now, REAP_BATCH)?;
        let found = due.len();
        for mut record in due {
            if let Some(effect) = transition::reap_if_due(Arc::make_mut(&mut record), now) {
                if let Effect::Reaped { disposition, .. } = effect {
                    counts.count(disposition);
                }
                txn.update(&record)?;
                add_totals(txn, &record, &[effect])?;
            }
        }
        if found < REAP_BATCH {
            return Ok(counts);
        }
    }
}
