//! The one implementation of every command, written against [`Txn`], the
//! primitive operations a store provides inside one transaction.
//!
//! The rules themselves are the domain's; this module only sequences them:
//! load, reap if due, apply, persist the record and the counter changes.

use crate::config::LedgerConfig;
use crate::domain::counters::{AggregateKey, ReapedCounts, Totals};
use crate::domain::record::{ActivityId, ActivityRecord};
use crate::domain::snapshot::{Snapshot, SnapshotParts};
use crate::domain::timestamp::Millis;
use crate::domain::transition::{self, Effect};
use crate::error::{ErrorKind, LedgerError};

use super::{Command, Reply};

/// How many due records a reap pass handles per round trip.
const REAP_BATCH: usize = 512;

/// The primitive operations of a store, inside one transaction.
pub(crate) trait Txn {
    /// The record with `id`, as stored.
    fn get(&mut self, id: ActivityId) -> Result<Option<ActivityRecord>, LedgerError>;
    /// Stores a new record.
    fn insert(&mut self, record: &ActivityRecord) -> Result<(), LedgerError>;
    /// Overwrites a stored record.
    fn update(&mut self, record: &ActivityRecord) -> Result<(), LedgerError>;
    /// In-flight records whose `reapable_at` is before `now`, at most `limit`.
    fn due(&mut self, now: Millis, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError>;
    /// Adds `delta` to the totals of `key`.
    fn add_totals(&mut self, key: &AggregateKey, delta: &Totals) -> Result<(), LedgerError>;
    /// Everything a snapshot reports, for the window from `since`.
    fn snapshot_parts(&mut self, since: Millis, limit: usize) -> Result<SnapshotParts, LedgerError>;
}

/// Runs `command` against `txn`.
pub(crate) fn execute(
    txn: &mut dyn Txn,
    config: &LedgerConfig,
    command: Command,
) -> Result<Reply, LedgerError> {
    let policy = config.policy();
    match command {
        Command::Begin { new, now } => {
            if txn.get(new.activity_id)?.is_some() {
                return Err(LedgerError::new(
                    ErrorKind::Conflict,
                    format!("activity {} already exists", new.activity_id),
                ));
            }
            let mut applied = transition::begin(new, now, policy)?;
            // A record begun with old timestamps may already be past its bound.
            applied
                .effects
                .extend(transition::reap_if_due(&mut applied.record, now));
            txn.insert(&applied.record)?;
            add_totals(txn, &applied.record, &applied.effects)?;
            Ok(Reply::Record(Box::new(applied.record)))
        }
        Command::Transition { id, transition, now } => {
            let record = load(txn, id)?;
            let reaped_before = transition::is_due(&record, now);
            match transition::apply(record.clone(), transition, now, policy) {
                Ok(applied) => {
                    if applied.changed() {
                        txn.update(&applied.record)?;
                        add_totals(txn, &applied.record, &applied.effects)?;
                    }
                    Ok(Reply::Record(Box::new(applied.record)))
                }
                Err(refusal) => {
                    // The request is refused, but time still passed: a record
                    // past its bound is reaped whatever was asked of it.
                    if reaped_before {
                        reap_one(txn, record, now)?;
                    }
                    Err(refusal.into())
                }
            }
        }
        Command::Get { id, now } => {
            let record = load(txn, id)?;
            Ok(Reply::Record(Box::new(reap_one(txn, record, now)?)))
        }
        Command::Reap { now } => Ok(Reply::Reaped(reap_due(txn, now)?)),
        Command::Snapshot { options, now } => {
            let reaped_this_read = reap_due(txn, now)?;
            let parts = txn.snapshot_parts(options.since().resolve(now), options.limit())?;
            Ok(Reply::Snapshot(Box::new(Snapshot::assemble(
                parts,
                config.caps(),
                options,
                now,
                reaped_this_read,
            ))))
        }
    }
}

fn load(txn: &mut dyn Txn, id: ActivityId) -> Result<ActivityRecord, LedgerError> {
    txn.get(id)?
        .ok_or_else(|| LedgerError::new(ErrorKind::NotFound, format!("no activity {id}")))
}

fn add_totals(txn: &mut dyn Txn, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError> {
    let delta = Totals::from_effects(effects);
    if delta.is_zero() {
        return Ok(());
    }
    txn.add_totals(&AggregateKey::of(record), &delta)
}

/// Reaps `record` if it is past its bound, persisting the change.
fn reap_one(
    txn: &mut dyn Txn,
    mut record: ActivityRecord,
    now: Millis,
) -> Result<ActivityRecord, LedgerError> {
    if let Some(effect) = transition::reap_if_due(&mut record, now) {
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
            if let Some(effect) = transition::reap_if_due(&mut record, now) {
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
