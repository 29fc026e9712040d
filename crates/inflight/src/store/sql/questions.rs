//! The questions of [`crate::domain::query`] and the owner table, answered
//! once for both SQL stores over a [`Driver`]: a statement of
//! [`super::statements`] per question, its rows read by [`super::codec`].

use std::sync::Arc;

use crate::domain::admission::{LanePosition, LaneState, RankedPosition};
use crate::domain::budget::{self, WindowUse};
use crate::domain::counters::{AggregateKey, Totals};
use crate::domain::labels::LabelSet;
use crate::domain::owner::{Owner, OwnerId};
use crate::domain::query::{Ahead, LaneQuery, Retention, Window};
use crate::domain::record::{ActivityId, ActivityRecord, LaneKey};
use crate::domain::snapshot::LaneLoad;
use crate::domain::timestamp::Timestamp;
use crate::domain::window;
use crate::domain::window::LaneTokens;
use crate::error::{ErrorKind, LedgerError};
use crate::store::engine::Questions;

use super::codec::{self, Columns, Value};
use super::statements as sql;

/// What a statement reads, so that a store first makes visible to it what
/// the transaction holds back (SQLite's rows written ahead, PostgreSQL's
/// deferred writes), and no more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reads {
    /// Records: every record write of the transaction must be visible.
    Records,
    /// The counters: every counter change of the transaction must be
    /// written.
    Counters,
    /// Which aggregates exist: what earlier commands stored.
    Aggregates,
    /// Owners, idempotency keys, lane states and token seconds, which are
    /// written at once.
    Owners,
}

/// A SQL store's transaction as the shared questions use it: one statement
/// at a time, after the store made what it holds back visible to what the
/// statement reads.
pub(crate) trait Driver {
    /// Whether reads that lead to a write lock the rows they read (the
    /// `*_LOCKED` statements): PostgreSQL, whose writers run at once.
    const LOCKS: bool;

    /// Runs `sql` with `params`, showing each row to `row`.
    fn query(
        &mut self,
        reads: Reads,
        sql: &'static str,
        params: &[Value<'_>],
        row: &mut dyn FnMut(&dyn Columns) -> Result<(), LedgerError>,
    ) -> Result<(), LedgerError>;

    /// Runs `sql` with `params` for its changes; returns how many rows it
    /// changed.
    fn execute(&mut self, reads: Reads, sql: &'static str, params: &[Value<'_>]) -> Result<u64, LedgerError>;

    /// Whether reads of records in flight lock them too (PostgreSQL's
    /// rebound at open, which rewrites what it reads).
    fn lock_in_flight(&self) -> bool {
        false
    }
}

/// Every row of `sql`, read by `from`.
fn rows<D: Driver + ?Sized, T>(
    driver: &mut D,
    reads: Reads,
    sql: &'static str,
    params: &[Value<'_>],
    from: fn(&dyn Columns) -> Result<T, LedgerError>,
) -> Result<Vec<T>, LedgerError> {
    let mut out = Vec::new();
    driver.query(reads, sql, params, &mut |row| {
        out.push(from(row)?);
        Ok(())
    })?;
    Ok(out)
}

/// The records `sql` answers, those in a row with the same labels sharing
/// them ([`codec::LastLabels`]).
fn records<D: Driver + ?Sized>(
    driver: &mut D,
    sql: &'static str,
    params: &[Value<'_>],
) -> Result<Vec<ActivityRecord>, LedgerError> {
    let mut out = Vec::new();
    let mut last = codec::LastLabels::default();
    driver.query(Reads::Records, sql, params, &mut |row| {
        out.push(codec::record_with(row, &mut last)?);
        Ok(())
    })?;
    Ok(out)
}

/// The one row of `sql`, read by `from`.
fn one<D: Driver + ?Sized, T>(
    driver: &mut D,
    reads: Reads,
    sql: &'static str,
    params: &[Value<'_>],
    from: fn(&dyn Columns) -> Result<T, LedgerError>,
) -> Result<T, LedgerError> {
    rows(driver, reads, sql, params, from)?
        .pop()
        .ok_or_else(|| LedgerError::new(ErrorKind::Storage, format!("no row answered {sql:?}")))
}

fn count(row: &dyn Columns) -> Result<i64, LedgerError> {
    codec::int(row, 0)
}

fn flag(row: &dyn Columns) -> Result<bool, LedgerError> {
    Ok(row.boolean(0)?.unwrap_or(false))
}

fn shared(records: Vec<ActivityRecord>) -> Vec<Arc<ActivityRecord>> {
    records.into_iter().map(Arc::new).collect()
}

fn limit_of(limit: usize) -> Value<'static> {
    Value::Int(i64::try_from(limit).unwrap_or(i64::MAX))
}

/// Where a record stands among the lane's slots and line ([`LanePosition`]
/// less its `tokens_ahead`).
fn slot_position<D: Driver + ?Sized>(driver: &mut D, query: &LaneQuery) -> Result<LanePosition, LedgerError> {
    let id = query.activity_id.to_string();
    let (service, provider) = (query.lane.service.as_str(), query.lane.provider.as_str());
    if query.ranked {
        let params = [
            query.enqueued_at.into(),
            query.newcomer.into(),
            id.as_str().into(),
            service.into(),
            provider.into(),
        ];
        return one(
            driver,
            Reads::Records,
            sql::LANE_POSITION_RANKED,
            &params,
            |row| {
                Ok(LanePosition {
                    executing: codec::int(row, 0)?,
                    waiting_ahead: codec::int(row, 1)?,
                    ranks: Some(RankedPosition {
                        executing_batch: codec::int(row, 2)?,
                        interactive_ahead: codec::int(row, 3)?,
                        batch_ahead: codec::int(row, 4)?,
                        interactive_waiting: codec::int(row, 5)?,
                        batch_waiting: codec::int(row, 6)?,
                    }),
                    tokens_ahead: 0,
                })
            },
        );
    }
    let params = [
        service.into(),
        provider.into(),
        id.as_str().into(),
        query.enqueued_at.into(),
        query.newcomer.into(),
    ];
    one(driver, Reads::Records, sql::LANE_POSITION, &params, |row| {
        Ok(LanePosition {
            executing: codec::int(row, 0)?,
            waiting_ahead: codec::int(row, 1)?,
            ranks: None,
            tokens_ahead: 0,
        })
    })
}

/// The statement, or its locking twin where the store locks.
fn locking<D: Driver>(plain: &'static str, locked: &'static str) -> &'static str {
    if D::LOCKS {
        locked
    } else {
        plain
    }
}

impl<D: Driver> Questions for D {
    fn aggregates(&mut self) -> Result<Vec<(AggregateKey, Totals)>, LedgerError> {
        rows(self, Reads::Counters, sql::AGGREGATES, &[], |row| {
            Ok((codec::aggregate_key_from(row)?, codec::totals_from(row, 7)?))
        })
    }

    fn completion_minutes_from(&mut self, minute: i64) -> Result<i64, LedgerError> {
        one(
            self,
            Reads::Counters,
            sql::COMPLETION_MINUTES_FROM,
            &[minute.into()],
            count,
        )
    }

    fn delete_minutes_before(&mut self, minute: i64) -> Result<(), LedgerError> {
        self.execute(Reads::Counters, sql::DELETE_MINUTES_BEFORE, &[minute.into()])
            .map(drop)
    }

    fn tokens_since(&mut self, second: i64) -> Result<Vec<LaneTokens>, LedgerError> {
        let params = [window::RESERVED.into(), second.into()];
        rows(self, Reads::Owners, sql::TOKENS_SINCE, &params, |row| {
            Ok(LaneTokens {
                lane: codec::lane_from(row)?,
                charged: codec::int(row, 2)?,
                reserved: codec::int(row, 3)?,
            })
        })
    }

    fn delete_token_seconds_before(&mut self, second: i64) -> Result<(), LedgerError> {
        self.execute(Reads::Owners, sql::DELETE_TOKEN_SECONDS_BEFORE, &[second.into()])
            .map(drop)
    }

    fn stored_records(&mut self) -> Result<i64, LedgerError> {
        one(self, Reads::Records, sql::STORED_RECORDS, &[], count)
    }

    fn get_owner(&mut self, id: &OwnerId) -> Result<Option<Owner>, LedgerError> {
        let sql = locking::<D>(sql::GET_OWNER, sql::GET_OWNER_LOCKED);
        Ok(rows(self, Reads::Owners, sql, &[id.as_str().into()], codec::owner_from)?.pop())
    }

    fn find_key(&mut self, key: &str) -> Result<Option<(ActivityId, i64)>, LedgerError> {
        let found = rows(self, Reads::Owners, sql::FIND_KEY, &[key.into()], |row| {
            Ok((codec::id_from(row, 0)?, codec::int(row, 1)?))
        })?;
        Ok(found.into_iter().next())
    }

    fn put_owner(&mut self, owner: &Owner) -> Result<(), LedgerError> {
        self.execute(Reads::Owners, sql::PUT_OWNER, &codec::owner_values(owner))
            .map(drop)
    }

    fn lane_known(&mut self, labels: &LabelSet) -> Result<bool, LedgerError> {
        let lane = [labels.service.as_str().into(), labels.provider.as_str().into()];
        one(self, Reads::Aggregates, sql::LANE_KNOWN, &lane, flag)
    }

    fn label_census(&mut self) -> Result<(i64, i64), LedgerError> {
        one(self, Reads::Aggregates, sql::LABEL_CENSUS, &[], |row| {
            Ok((codec::int(row, 0)?, codec::int(row, 1)?))
        })
    }

    fn due(&mut self, now: Timestamp, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        let sql = locking::<D>(sql::DUE, sql::DUE_LOCKED);
        let params = [now.into(), limit_of(limit)];
        records(self, sql, &params).map(shared)
    }

    fn lane_position(&mut self, query: &LaneQuery) -> Result<LanePosition, LedgerError> {
        let mut position = slot_position(self, query)?;
        // Nothing waits ahead, the common case: no estimates to sum.
        let none_ahead = |ahead: Ahead| match (ahead, position.ranks) {
            (Ahead::Interactive, Some(ranks)) => ranks.interactive_ahead == 0,
            _ => position.waiting_ahead == 0,
        };
        if let Some(ahead) = query.tokens.filter(|ahead| !none_ahead(*ahead)) {
            let id = query.activity_id.to_string();
            let params = [
                query.enqueued_at.into(),
                query.newcomer.into(),
                id.as_str().into(),
                query.lane.service.as_str().into(),
                query.lane.provider.as_str().into(),
                (ahead == Ahead::All).into(),
            ];
            position.tokens_ahead = one(self, Reads::Records, sql::TOKENS_AHEAD, &params, |row| {
                codec::int(row, 0)
            })?;
        }
        Ok(position)
    }

    fn window_use(&mut self, lane: &LaneKey, first: i64) -> Result<(WindowUse, WindowUse), LedgerError> {
        let params = [
            lane.service.as_str().into(),
            first.into(),
            lane.provider.as_str().into(),
        ];
        let seconds = rows(self, Reads::Owners, sql::WINDOW_USE, &params, |row| {
            Ok((codec::int(row, 0)?, codec::int(row, 1)?, codec::int(row, 2)?))
        })?;
        Ok(budget::windows(seconds))
    }

    fn lane_state(&mut self, lane: &LaneKey) -> Result<LaneState, LedgerError> {
        let params = [lane.service.as_str().into(), lane.provider.as_str().into()];
        let found = rows(
            self,
            Reads::Owners,
            sql::LANE_STATE,
            &params,
            codec::lane_state_from,
        )?;
        Ok(found.into_iter().next().unwrap_or_default())
    }

    fn put_lane_state(&mut self, lane: &LaneKey, state: LaneState) -> Result<(), LedgerError> {
        let mut params = vec![lane.service.as_str().into(), lane.provider.as_str().into()];
        params.extend(codec::lane_state_values(&state));
        self.execute(Reads::Owners, sql::PUT_LANE_STATE, &params)
            .map(drop)
    }

    fn lane_states(&mut self) -> Result<Vec<(LaneKey, LaneState)>, LedgerError> {
        rows(self, Reads::Owners, sql::LANE_STATES, &[], |row| {
            Ok((codec::lane_from(row)?, codec::lane_state_from_at(row, 2)?))
        })
    }

    fn in_flight(&mut self, limit: usize) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        let sql = if self.lock_in_flight() {
            sql::IN_FLIGHT_LOCKED
        } else {
            sql::IN_FLIGHT
        };
        records(self, sql, &[limit_of(limit)]).map(shared)
    }

    fn in_flight_count(&mut self) -> Result<i64, LedgerError> {
        one(self, Reads::Records, sql::IN_FLIGHT_COUNT, &[], count)
    }

    fn lane_loads(&mut self) -> Result<Vec<LaneLoad>, LedgerError> {
        rows(self, Reads::Records, sql::LANE_LOADS, &[], codec::lane_load_from)
    }

    fn completed(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        let params = [window.since.into(), limit_of(limit)];
        records(self, sql::COMPLETED, &params)
    }

    fn completed_between(&mut self, from: Timestamp, to: Timestamp) -> Result<i64, LedgerError> {
        one(
            self,
            Reads::Records,
            sql::COMPLETED_BETWEEN,
            &[from.into(), to.into()],
            count,
        )
    }

    fn reaped(&mut self, window: Window, limit: usize) -> Result<Vec<ActivityRecord>, LedgerError> {
        let params = [window.since.into(), limit_of(limit)];
        records(self, sql::REAPED, &params)
    }

    fn listed_owners(&mut self, window: Window) -> Result<Vec<Owner>, LedgerError> {
        rows(
            self,
            Reads::Owners,
            sql::LISTED_OWNERS,
            &[window.since.into()],
            codec::owner_from,
        )
    }

    fn expired_owners(&mut self, now: Timestamp) -> Result<Vec<Owner>, LedgerError> {
        let sql = locking::<D>(sql::EXPIRED_OWNERS, sql::EXPIRED_OWNERS_LOCKED);
        rows(self, Reads::Owners, sql, &[now.into()], codec::owner_from)
    }

    fn owner_in_flight(&mut self, id: &OwnerId) -> Result<Vec<Arc<ActivityRecord>>, LedgerError> {
        let sql = locking::<D>(sql::OWNER_IN_FLIGHT, sql::OWNER_IN_FLIGHT_LOCKED);
        records(self, sql, &[id.as_str().into()]).map(shared)
    }

    fn prunable(&mut self, retention: Retention, limit: usize) -> Result<Vec<ActivityId>, LedgerError> {
        let params = [retention.before.into(), limit_of(limit)];
        rows(self, Reads::Records, sql::PRUNABLE, &params, |row| {
            codec::id_from(row, 0)
        })
    }

    fn prune_owners(&mut self, retention: Retention) -> Result<(), LedgerError> {
        self.execute(Reads::Owners, sql::PRUNE_OWNERS, &[retention.before.into()])
            .map(drop)
    }
}
