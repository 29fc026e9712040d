//! The transaction: [`SqliteTxn`] keeps the engine's records its own way
//! (written ahead, `journal.rs`, or to the tables), and answers the
//! questions through the shared SQL core as its [`Driver`].

use std::sync::Arc;

use crate::domain::capacity::Capacity;
use crate::domain::counters::Totals;
use crate::domain::idempotency::Idempotency;
use crate::domain::labels::ActivityLabels;
use crate::domain::record::{ActivityId, ActivityRecord, Admission, LaneKey, Priority};
use crate::domain::transition::Effect;
use crate::error::LedgerError;
use crate::store::engine::Txn;
use crate::store::sql::codec::{self, Columns, Value};
use crate::store::sql::counts::PendingCounts;
use crate::store::sql::group::Landed;
use crate::store::sql::questions::{Driver, Reads};

use super::journal::Ahead;
use super::rows::{query_rows, Statements};
use super::sql;
use super::tables::{self, count_ahead, overwrite, store_record, write_counts, write_new};

pub(super) struct SqliteTxn<'t, 'c> {
    st: &'t mut Statements<'c>,
    /// The counter changes of this command, for its group to write, once it
    /// writes to the tables directly.
    pub(super) counts: PendingCounts,
    /// What this command did, to publish once its group is committed.
    pub(super) landed: Vec<Landed>,
    /// The records this command changed, while it writes ahead
    /// (`journal.rs`); appended by [`SqliteTxn::finish`].
    ahead: Vec<Ahead>,
    /// Whether this command writes to the tables: once it asked something
    /// the rows written ahead must be applied for.
    direct: bool,
}

impl<'t, 'c> SqliteTxn<'t, 'c> {
    pub(super) fn new(st: &'t mut Statements<'c>) -> Self {
        Self {
            st,
            counts: PendingCounts::default(),
            landed: Vec::new(),
            ahead: Vec::new(),
            direct: false,
        }
    }

    /// Ends the command: what it changed is written ahead, unless it went
    /// to the tables.
    pub(super) fn finish(&mut self) -> Result<(), LedgerError> {
        for entry in std::mem::take(&mut self.ahead) {
            tables::append(self.st, &entry)?;
        }
        Ok(())
    }

    /// Applies the rows written ahead and writes this command's changes to
    /// the tables, before a question the tables answer; the rest of the
    /// command writes to them too.
    fn go_direct(&mut self) -> Result<(), LedgerError> {
        if self.direct {
            return Ok(());
        }
        self.direct = true;
        // Older rows first: this command's changes are the later ones.
        tables::apply(self.st)?;
        for entry in std::mem::take(&mut self.ahead) {
            // Stored now, no longer ahead. With no row in the table, the
            // apply above clears nothing: a copy left here would be read
            // in place of the table's, stale once changed directly (a
            // record reaped again, counted twice: differential `0b9969b6`).
            self.st.journal.take(entry.record.activity_id);
            store_record(self.st, &entry.record)?;
            self.st.records.stored(&entry.record);
            count_ahead(&mut self.counts, &entry);
        }
        Ok(())
    }

    /// Makes sure what memory holds of the journal is the table's: after a
    /// rollback or another connection's commit, the rows are applied first.
    fn journal_known(&mut self) -> Result<(), LedgerError> {
        if self.direct || self.st.journal.is_known() {
            return Ok(());
        }
        self.go_direct()
    }

    /// `record`, changed by this command, written ahead.
    fn write_ahead(&mut self, record: &Arc<ActivityRecord>) {
        self.st.journal.put(Arc::clone(record));
        match self.position(record.activity_id) {
            Some(index) => self.ahead[index].record = Arc::clone(record),
            None => self.ahead.push(Ahead {
                record: Arc::clone(record),
                totals: Totals::default(),
                completion_minute: None,
            }),
        }
    }

    /// This command's entry for `record`; written ahead as it is if the
    /// command has not changed it, so that what it counts travels with it.
    fn entry(&mut self, record: &ActivityRecord) -> &mut Ahead {
        let index = match self.position(record.activity_id) {
            Some(index) => index,
            None => {
                self.write_ahead(&Arc::new(record.clone()));
                self.ahead.len() - 1
            }
        };
        &mut self.ahead[index]
    }

    fn position(&self, id: ActivityId) -> Option<usize> {
        self.ahead.iter().position(|entry| entry.record.activity_id == id)
    }

    /// Stores `record`, changed by this command: to the tables, or ahead.
    fn changed(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        if self.direct {
            overwrite(self.st, record)?;
            self.st.records.stored(record);
        } else {
            self.write_ahead(record);
        }
        Ok(())
    }
}

impl Driver for SqliteTxn<'_, '_> {
    const LOCKS: bool = false;

    fn query(
        &mut self,
        reads: Reads,
        sql: &'static str,
        params: &[Value<'_>],
        row: &mut dyn FnMut(&dyn Columns) -> Result<(), LedgerError>,
    ) -> Result<(), LedgerError> {
        self.before(reads)?;
        query_rows(self.st, sql, params, |columns| row(columns)).map(drop)
    }

    fn execute(&mut self, reads: Reads, sql: &'static str, params: &[Value<'_>]) -> Result<u64, LedgerError> {
        self.before(reads)?;
        tables::run(self.st, sql, params).map(|changed| changed as u64)
    }
}

impl SqliteTxn<'_, '_> {
    /// Makes what a statement reads current: the rows written ahead
    /// applied, and for the counters this command's counts written.
    fn before(&mut self, reads: Reads) -> Result<(), LedgerError> {
        match reads {
            Reads::Records | Reads::Aggregates => self.go_direct(),
            Reads::Counters => {
                self.go_direct()?;
                write_counts(self.st, &mut self.counts)
            }
            Reads::Owners => Ok(()),
        }
    }
}

impl Txn for SqliteTxn<'_, '_> {
    fn get(&mut self, id: ActivityId) -> Result<Option<Arc<ActivityRecord>>, LedgerError> {
        self.journal_known()?;
        if let Some(record) = self.st.journal.get(id) {
            return Ok(Some(Arc::clone(record)));
        }
        if let Some(record) = self.st.records.get(id) {
            return Ok(Some(Arc::clone(record)));
        }
        let text = id.to_string();
        let record = query_rows(
            self.st,
            sql::GET_RECORD,
            &[text.as_str().into()],
            codec::record_from,
        )?
        .pop()
        .map(Arc::new);
        if let Some(record) = &record {
            self.st.records.stored(record);
        }
        Ok(record)
    }

    fn insert(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        self.journal_known()?;
        if self.direct {
            write_new(self.st, record)?;
            self.st.records.stored(record);
            return Ok(());
        }
        let id = record.activity_id.to_string();
        let taken = self.st.journal.get(record.activity_id).is_some()
            || query_rows(self.st, sql::RECORD_EXISTS, &[id.as_str().into()], |row| {
                Ok(row.boolean(0)?.unwrap_or(false))
            })?
            .pop()
            .unwrap_or(false);
        if taken {
            // As the primary key would say.
            return Err(tables::taken(record));
        }
        self.write_ahead(record);
        Ok(())
    }

    fn update(&mut self, record: &Arc<ActivityRecord>) -> Result<(), LedgerError> {
        self.journal_known()?;
        self.changed(record)
    }

    fn modify(
        &mut self,
        id: ActivityId,
        change: &mut dyn FnMut(&mut ActivityRecord) -> bool,
    ) -> Result<Option<Arc<ActivityRecord>>, LedgerError> {
        self.journal_known()?;
        // Taken out, so that it is changed in place unless a reply still
        // holds it, and kept again only once written.
        let ahead = self.st.journal.take(id);
        let was_ahead = ahead.is_some();
        let taken = ahead.or_else(|| self.st.records.take(id));
        let Some(mut record) = taken.map_or_else(|| self.get(id), |record| Ok(Some(record)))? else {
            return Ok(None);
        };
        if change(Arc::make_mut(&mut record)) {
            self.changed(&record)?;
        } else if was_ahead {
            // Unchanged, but `change` may have touched it without saying
            // so: the journal's rows, not memory, say what was written.
            self.st.journal.forget();
        } else {
            // Unchanged, it is stored as it was; forgotten all the same, in
            // case `change` touched it without saying so.
            self.st.records.deleted(id);
        }
        Ok(Some(record))
    }

    fn delete(&mut self, ids: &[ActivityId]) -> Result<usize, LedgerError> {
        self.go_direct()?;
        let mut deleted = 0;
        for id in ids {
            self.st.records.deleted(*id);
            let text = id.to_string();
            deleted += tables::run(self.st, sql::DELETE_RECORD, &[text.as_str().into()])?;
            tables::run(self.st, sql::DELETE_KEY, &[text.as_str().into()])?;
        }
        Ok(deleted)
    }

    fn claim_key(&mut self, key: &Idempotency, record: &ActivityRecord) -> Result<(), LedgerError> {
        // One writer: a key `find_key` did not find is free.
        let id = record.activity_id.to_string();
        let params = [
            key.key.as_str().into(),
            id.as_str().into(),
            key.fingerprint.into(),
        ];
        tables::run(self.st, sql::CLAIM_KEY, &params).map(drop)
    }

    fn add_totals(&mut self, record: &ActivityRecord, effects: &[Effect]) -> Result<(), LedgerError> {
        // A row written ahead counts into its record's aggregate only; a
        // refinement counts one record into two. Rare: it goes direct, and
        // only its effects are looked at, so no other command scans the
        // rows ahead a second time.
        let refines =
            |effect: &Effect| matches!(effect, Effect::LeftAggregate | Effect::JoinedAggregate { .. });
        if !self.direct && effects.iter().any(refines) {
            self.go_direct()?;
        }
        if self.direct {
            self.counts.count(record, effects);
        } else {
            let totals = &mut self.entry(record).totals;
            for effect in effects {
                totals.count(effect);
            }
        }
        Ok(())
    }

    fn spend(&mut self, lane: &LaneKey, second: i64, tokens: i64) -> Result<(), LedgerError> {
        let params = [
            second.into(),
            lane.service.as_str().into(),
            lane.provider.as_str().into(),
            tokens.into(),
        ];
        self.execute(Reads::Owners, sql::SPEND, &params).map(drop)
    }

    fn count_completion(&mut self, record: &ActivityRecord, minute: i64) -> Result<(), LedgerError> {
        if self.direct {
            self.counts.complete(minute);
        } else {
            // A record completes once: its row holds the minute.
            self.entry(record).completion_minute = Some(minute);
        }
        Ok(())
    }

    fn landed(&mut self, record: &Arc<ActivityRecord>, effect: &Effect, capacity: Option<Capacity>) {
        self.landed.extend(Landed::of(record, effect, capacity));
    }

    fn aggregate_known(
        &mut self,
        labels: &ActivityLabels,
        priority: Priority,
        admission: Admission,
    ) -> Result<bool, LedgerError> {
        let slot = (labels.clone(), priority, admission);
        if self.st.aggregate_ids.contains(&slot) || self.counts.counts_into(&slot) {
            return Ok(true);
        }
        // An aggregate counted only ahead is stored once the rows are
        // applied: a new one is rare, so they are.
        self.go_direct()?;
        Ok(tables::aggregate_id(self.st, &slot)?.is_some())
    }
}
