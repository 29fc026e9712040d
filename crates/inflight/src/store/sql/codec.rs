//! The row codec: records, owners and counters to and from the columns of
//! [`super::columns`], once for both stores. A store reads a row through
//! [`Columns`] and binds [`Value`]s; nothing else knows the column order.

use crate::domain::admission::LaneState;
use crate::domain::counters::{AggregateKey, Totals};
use crate::domain::labels::{ActivityLabels, Label, LabelSet};
use crate::domain::owner::{Owner, OwnerId};
use crate::domain::record::{ActivityId, ActivityRecord, LaneKey};
use crate::domain::snapshot::LaneLoad;
use crate::domain::{ParseError, Timestamp, TraceParent, Usage};
use crate::error::{ErrorKind, LedgerError};
use inflight_api::{ByPriority, PriorityCounts};

use super::columns::{LABEL_COLUMNS, LANE_STATE_COLUMNS, OWNER_COLUMNS, RECORD_COLUMNS, TOTALS_COLUMNS};

/// One bound parameter, as both drivers take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Value<'a> {
    Null,
    Text(&'a str),
    Int(i64),
    Bool(bool),
}

impl<'a> From<&'a str> for Value<'a> {
    fn from(text: &'a str) -> Self {
        Self::Text(text)
    }
}

impl From<i64> for Value<'_> {
    fn from(value: i64) -> Self {
        Self::Int(value)
    }
}

impl From<bool> for Value<'_> {
    fn from(value: bool) -> Self {
        Self::Bool(value)
    }
}

impl From<Timestamp> for Value<'_> {
    fn from(at: Timestamp) -> Self {
        Self::Int(at.as_millis())
    }
}

impl<'a, T: Into<Value<'a>>> From<Option<T>> for Value<'a> {
    fn from(value: Option<T>) -> Self {
        value.map_or(Self::Null, Into::into)
    }
}

/// A row as a driver returns it: each column read by index, NULL as
/// `None`.
pub(crate) trait Columns {
    fn text(&self, index: usize) -> Result<Option<&str>, LedgerError>;
    fn int(&self, index: usize) -> Result<Option<i64>, LedgerError>;
    fn boolean(&self, index: usize) -> Result<Option<bool>, LedgerError>;
}

/// A column that must not be NULL.
fn required<T>(value: Option<T>, index: usize) -> Result<T, LedgerError> {
    value.ok_or_else(|| {
        LedgerError::new(
            ErrorKind::Storage,
            format!("cannot read a column: column {index} is NULL where a value is required"),
        )
    })
}

pub(crate) fn text(row: &dyn Columns, index: usize) -> Result<&str, LedgerError> {
    required(row.text(index)?, index)
}

pub(crate) fn int(row: &dyn Columns, index: usize) -> Result<i64, LedgerError> {
    required(row.int(index)?, index)
}

fn label(row: &dyn Columns, index: usize) -> Result<Label, LedgerError> {
    Ok(Label::trusted(text(row, index)?.to_owned()))
}

fn at(row: &dyn Columns, index: usize) -> Result<Timestamp, LedgerError> {
    int(row, index).map(Timestamp::from_millis)
}

fn at_opt(row: &dyn Columns, index: usize) -> Result<Option<Timestamp>, LedgerError> {
    Ok(row.int(index)?.map(Timestamp::from_millis))
}

fn parsed<T: std::str::FromStr<Err = ParseError>>(row: &dyn Columns, index: usize) -> Result<T, LedgerError> {
    parse(text(row, index)?)
}

fn parsed_opt<T: std::str::FromStr<Err = ParseError>>(
    row: &dyn Columns,
    index: usize,
) -> Result<Option<T>, LedgerError> {
    row.text(index)?.map(parse).transpose()
}

fn parse<T: std::str::FromStr<Err = ParseError>>(text: &str) -> Result<T, LedgerError> {
    text.parse()
        .map_err(|err: ParseError| LedgerError::storage("cannot read a column", err))
}

/// An activity id from its column.
pub(crate) fn id_from(row: &dyn Columns, index: usize) -> Result<ActivityId, LedgerError> {
    text(row, index)?
        .parse()
        .map_err(|err: uuid::Error| LedgerError::storage("cannot read an activity id", err))
}

/// A record from the columns of `record_columns!`, from the first.
pub(crate) fn record_from(row: &dyn Columns) -> Result<ActivityRecord, LedgerError> {
    record_with(row, &mut LastLabels::default())
}

/// The labels of the row read last. The rows of one answer mostly share a
/// few label sets, and a set read anew costs six allocations and a hash:
/// reused, a SQLite snapshot of 100 records in flight and 100 completed on
/// one label set took 0.306 ms against 0.338 (median of four interleaved
/// runs of 2,000 snapshots each; the pairs 0.85x to 0.97x, session 16).
#[derive(Default)]
pub(crate) struct LastLabels(Option<ActivityLabels>);

impl LastLabels {
    fn of(&mut self, row: &dyn Columns) -> Result<ActivityLabels, LedgerError> {
        let texts = [
            text(row, 1)?,
            text(row, 2)?,
            text(row, 3)?,
            text(row, 4)?,
            text(row, 5)?,
        ];
        if let Some(last) = &self.0 {
            let known = [
                last.service.as_str(),
                last.provider.as_str(),
                last.class.as_str(),
                last.operation_stage.as_str(),
                &*last.model,
            ];
            if known == texts {
                return Ok(last.clone());
            }
        }
        let [service, provider, class, operation_stage, model] = texts;
        let labels = ActivityLabels::new(LabelSet {
            service: Label::trusted(service.to_owned()),
            provider: Label::trusted(provider.to_owned()),
            class: Label::trusted(class.to_owned()),
            operation_stage: Label::trusted(operation_stage.to_owned()),
            model: model.into(),
        });
        self.0 = Some(labels.clone());
        Ok(labels)
    }
}

/// A record from `row`, its labels shared with the row before when they
/// are the same.
pub(crate) fn record_with(row: &dyn Columns, last: &mut LastLabels) -> Result<ActivityRecord, LedgerError> {
    let mut record = ActivityRecord {
        activity_id: id_from(row, 0)?,
        labels: last.of(row)?,
        priority: parsed(row, 6)?,
        admission: parsed(row, 7)?,
        state: parsed(row, 8)?,
        disposition: parsed_opt(row, 9)?,
        reap_reason: parsed_opt(row, 10)?,
        owner_id: row.text(11)?.map(str::to_owned),
        enqueued_at: at(row, 12)?,
        started_at: at_opt(row, 13)?,
        completed_at: at_opt(row, 14)?,
        reaped_at: at_opt(row, 15)?,
        declared_deadline_ms: row.int(16)?,
        deadline_ms: int(row, 17)?,
        reapable_at: at_opt(row, 18)?,
        queue_wait_ms: None,
        execution_ms: None,
        success: row.boolean(19)?,
        failure_stage: parsed_opt(row, 20)?,
        late_settle: required(row.boolean(21)?, 21)?,
        cancel_reason: row.text(22)?.map(str::to_owned),
        refined: required(row.boolean(23)?, 23)?,
        usage: Usage {
            input_tokens: row.int(24)?,
            output_tokens: row.int(25)?,
        },
        max_tokens: row.int(26)?,
        trace_parent: match row.text(27)? {
            None => None,
            Some(text) => Some(Box::new(TraceParent::parse(text).map_err(|error| {
                LedgerError::new(
                    ErrorKind::Storage,
                    format!("cannot read a stored record: {error}"),
                )
            })?)),
        },
    };
    // Not stored: implied by the instants.
    record.derive_durations();
    Ok(record)
}

/// The columns of `record_columns!` for `record`, whose id reads `id`.
pub(crate) fn record_values<'a>(record: &'a ActivityRecord, id: &'a str) -> [Value<'a>; RECORD_COLUMNS] {
    let labels = &record.labels;
    [
        id.into(),
        labels.service.as_str().into(),
        labels.provider.as_str().into(),
        labels.class.as_str().into(),
        labels.operation_stage.as_str().into(),
        (&*labels.model).into(),
        record.priority.as_str().into(),
        record.admission.as_str().into(),
        record.state.as_str().into(),
        record.disposition.map(|d| d.as_str()).into(),
        record.reap_reason.map(|r| r.as_str()).into(),
        record.owner_id.as_deref().into(),
        record.enqueued_at.into(),
        record.started_at.into(),
        record.completed_at.into(),
        record.reaped_at.into(),
        record.declared_deadline_ms.into(),
        record.deadline_ms.into(),
        record.reapable_at.into(),
        record.success.into(),
        record.failure_stage.map(|s| s.as_str()).into(),
        record.late_settle.into(),
        record.cancel_reason.as_deref().into(),
        record.refined.into(),
        record.usage.input_tokens.into(),
        record.usage.output_tokens.into(),
        record.max_tokens.into(),
        record.trace_parent.as_deref().map(TraceParent::as_str).into(),
    ]
}

/// The columns of `record_columns!` that can change after a begin, in
/// the order `statements::UPDATE_RECORD` binds them (the id last). A
/// refinement changes the model, and the stage when label limits fold it.
const CHANGING: [usize; 18] = [8, 9, 10, 13, 14, 15, 17, 18, 19, 20, 21, 22, 4, 5, 23, 24, 25, 0];

/// The parameters of `statements::UPDATE_RECORD`: what can change after a
/// begin, then the id.
pub(crate) fn record_changes<'a>(record: &'a ActivityRecord, id: &'a str) -> [Value<'a>; 18] {
    let values = record_values(record, id);
    CHANGING.map(|column| values[column])
}

/// An owner from the columns of `owner_columns!`.
pub(crate) fn owner_from(row: &dyn Columns) -> Result<Owner, LedgerError> {
    Ok(Owner {
        owner_id: OwnerId::trusted(text(row, 0)?.to_owned()),
        name: label(row, 1)?,
        ttl_ms: int(row, 2)?,
        registered_at: at(row, 3)?,
        renewed_at: at(row, 4)?,
        expires_at: at(row, 5)?,
        state: parsed(row, 6)?,
        ended_at: at_opt(row, 7)?,
        reaped_records: int(row, 8)?,
        cancelled_records: int(row, 9)?,
    })
}

/// The columns of `owner_columns!` for `owner`.
pub(crate) fn owner_values(owner: &Owner) -> [Value<'_>; OWNER_COLUMNS] {
    [
        owner.owner_id.as_str().into(),
        owner.name.as_str().into(),
        owner.ttl_ms.into(),
        owner.registered_at.into(),
        owner.renewed_at.into(),
        owner.expires_at.into(),
        owner.state.as_str().into(),
        owner.ended_at.into(),
        owner.reaped_records.into(),
        owner.cancelled_records.into(),
    ]
}

/// The lane of a row's first two columns, `service` and `provider`.
pub(crate) fn lane_from(row: &dyn Columns) -> Result<LaneKey, LedgerError> {
    LaneKey::parse(&format!("{}::{}", text(row, 0)?, text(row, 1)?))
        .map_err(|err| LedgerError::new(ErrorKind::Storage, format!("a stored lane: {err}")))
}

/// A lane's state from the columns of `lane_state_columns!`, the first at
/// `first`.
pub(crate) fn lane_state_from_at(row: &dyn Columns, first: usize) -> Result<LaneState, LedgerError> {
    let small = |index: usize| -> Result<u32, LedgerError> {
        Ok(u32::try_from(int(row, index)?).unwrap_or(u32::MAX))
    };
    Ok(LaneState {
        overtakes: small(first)?,
        cooling_until: at_opt(row, first + 1)?,
        cooldowns: int(row, first + 2)?,
        effective_cap: row
            .int(first + 3)?
            .map(|cap| u32::try_from(cap).unwrap_or(u32::MAX)),
        successes: small(first + 4)?,
    })
}

/// A lane's state from the columns of `lane_state_columns!`.
pub(crate) fn lane_state_from(row: &dyn Columns) -> Result<LaneState, LedgerError> {
    lane_state_from_at(row, 0)
}

/// The columns of `lane_state_columns!` for `state`.
pub(crate) fn lane_state_values(state: &LaneState) -> [Value<'static>; LANE_STATE_COLUMNS] {
    [
        i64::from(state.overtakes).into(),
        state.cooling_until.into(),
        state.cooldowns.into(),
        state.effective_cap.map(i64::from).into(),
        i64::from(state.successes).into(),
    ]
}

/// Totals from the columns of `totals_columns!`, the first at `first`.
pub(crate) fn totals_from(row: &dyn Columns, first: usize) -> Result<Totals, LedgerError> {
    let n = |offset: usize| int(row, first + offset);
    Ok(Totals {
        succeeded: n(0)?,
        failed: n(1)?,
        cancelled: n(2)?,
        reaped_abandoned: n(3)?,
        reaped_unsettled: n(4)?,
        reaped_owner_lost: n(5)?,
        late_settles: n(6)?,
        resurrections: n(7)?,
        in_flight: n(8)?,
        queue_wait_count: n(9)?,
        queue_wait_sum_ms: n(10)?,
        queue_wait_max_ms: n(11)?,
        execution_count: n(12)?,
        execution_sum_ms: n(13)?,
        execution_max_ms: n(14)?,
        last_seen_at: at_opt(row, first + 15)?,
        reaped_owner_lost_abandoned: n(16)?,
        succeeded_unstarted: n(17)?,
        input_tokens: n(18)?,
        output_tokens: n(19)?,
    })
}

/// The columns of `totals_columns!` for `d`.
pub(crate) fn totals_values(d: &Totals) -> [Value<'static>; TOTALS_COLUMNS] {
    [
        d.succeeded.into(),
        d.failed.into(),
        d.cancelled.into(),
        d.reaped_abandoned.into(),
        d.reaped_unsettled.into(),
        d.reaped_owner_lost.into(),
        d.late_settles.into(),
        d.resurrections.into(),
        d.in_flight.into(),
        d.queue_wait_count.into(),
        d.queue_wait_sum_ms.into(),
        d.queue_wait_max_ms.into(),
        d.execution_count.into(),
        d.execution_sum_ms.into(),
        d.execution_max_ms.into(),
        d.last_seen_at.into(),
        d.reaped_owner_lost_abandoned.into(),
        d.succeeded_unstarted.into(),
        d.input_tokens.into(),
        d.output_tokens.into(),
    ]
}

/// An aggregate's key from the columns of `aggregate_labels!`.
pub(crate) fn aggregate_key_from(row: &dyn Columns) -> Result<AggregateKey, LedgerError> {
    Ok(AggregateKey {
        service: text(row, 0)?.into(),
        operation_stage: text(row, 1)?.into(),
        class: text(row, 2)?.into(),
        provider: text(row, 3)?.into(),
        model: text(row, 4)?.into(),
        priority: parsed(row, 5)?,
        admission: parsed(row, 6)?,
    })
}

/// The columns of `aggregate_labels!` for `key`.
pub(crate) fn aggregate_key_values(key: &AggregateKey) -> [Value<'_>; LABEL_COLUMNS] {
    [
        (&*key.service).into(),
        (&*key.operation_stage).into(),
        (&*key.class).into(),
        (&*key.provider).into(),
        (&*key.model).into(),
        key.priority.as_str().into(),
        key.admission.as_str().into(),
    ]
}

/// A lane's load from a row of `statements::LANE_LOADS`.
pub(crate) fn lane_load_from(row: &dyn Columns) -> Result<LaneLoad, LedgerError> {
    Ok(LaneLoad {
        lane: LaneKey {
            service: label(row, 0)?,
            provider: label(row, 1)?,
        },
        executing: int(row, 2)?,
        waiting: int(row, 3)?,
        oldest_waiting_since: at_opt(row, 4)?,
        next_waiting_reapable_at: at_opt(row, 5)?,
        by_priority: ByPriority {
            interactive: PriorityCounts {
                executing: int(row, 6)?,
                waiting: int(row, 7)?,
            },
            batch: PriorityCounts {
                executing: int(row, 8)?,
                waiting: int(row, 9)?,
            },
            unknown: PriorityCounts {
                executing: int(row, 10)?,
                waiting: int(row, 11)?,
            },
        },
    })
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use rusqlite::types::{ToSqlOutput, ValueRef};

    use super::{Columns, Value};
    use crate::error::{ErrorKind, LedgerError};

    impl rusqlite::ToSql for Value<'_> {
        fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
            Ok(ToSqlOutput::Borrowed(match *self {
                Self::Null => ValueRef::Null,
                Self::Text(text) => ValueRef::Text(text.as_bytes()),
                Self::Int(value) => ValueRef::Integer(value),
                Self::Bool(value) => ValueRef::Integer(i64::from(value)),
            }))
        }
    }

    fn column<'r>(row: &'r rusqlite::Row<'_>, index: usize) -> Result<ValueRef<'r>, LedgerError> {
        row.get_ref(index)
            .map_err(|err| LedgerError::storage("cannot read a column", err))
    }

    fn mismatch(index: usize, wanted: &str) -> LedgerError {
        LedgerError::new(
            ErrorKind::Storage,
            format!("cannot read a column: column {index} does not hold {wanted}"),
        )
    }

    impl Columns for rusqlite::Row<'_> {
        fn text(&self, index: usize) -> Result<Option<&str>, LedgerError> {
            match column(self, index)? {
                ValueRef::Null => Ok(None),
                ValueRef::Text(bytes) => std::str::from_utf8(bytes)
                    .map(Some)
                    .map_err(|err| LedgerError::storage("cannot read a column", err)),
                _ => Err(mismatch(index, "text")),
            }
        }

        fn int(&self, index: usize) -> Result<Option<i64>, LedgerError> {
            match column(self, index)? {
                ValueRef::Null => Ok(None),
                ValueRef::Integer(value) => Ok(Some(value)),
                _ => Err(mismatch(index, "an integer")),
            }
        }

        fn boolean(&self, index: usize) -> Result<Option<bool>, LedgerError> {
            Ok(self.int(index)?.map(|value| value != 0))
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::error::Error;

    use bytes::BytesMut;
    use postgres::types::{IsNull, ToSql, Type};

    use super::{Columns, Value};
    use crate::error::LedgerError;

    impl ToSql for Value<'_> {
        fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn Error + Sync + Send>> {
            match *self {
                Self::Null => Ok(IsNull::Yes),
                Self::Text(text) if <&str as ToSql>::accepts(ty) => text.to_sql(ty, out),
                Self::Int(value) if <i64 as ToSql>::accepts(ty) => value.to_sql(ty, out),
                Self::Bool(value) if <bool as ToSql>::accepts(ty) => value.to_sql(ty, out),
                other => Err(format!("{other:?} cannot be sent as {ty}").into()),
            }
        }

        fn accepts(ty: &Type) -> bool {
            <&str as ToSql>::accepts(ty) || <i64 as ToSql>::accepts(ty) || <bool as ToSql>::accepts(ty)
        }

        postgres::types::to_sql_checked!();
    }

    fn column<'r, T: postgres::types::FromSql<'r>>(
        row: &'r postgres::Row,
        index: usize,
    ) -> Result<Option<T>, LedgerError> {
        row.try_get(index)
            .map_err(|err| LedgerError::storage("cannot read a column", err))
    }

    impl Columns for postgres::Row {
        fn text(&self, index: usize) -> Result<Option<&str>, LedgerError> {
            column(self, index)
        }

        fn int(&self, index: usize) -> Result<Option<i64>, LedgerError> {
            column(self, index)
        }

        fn boolean(&self, index: usize) -> Result<Option<bool>, LedgerError> {
            column(self, index)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::columns::record_columns;
    use super::super::statements::UPDATE_RECORD;
    use super::CHANGING;

    use super::{record_values, record_with, Columns, LastLabels, Value};
    use crate::domain::record::ActivityRecord;
    use crate::domain::timestamp::Timestamp;
    use crate::domain::transition::{begin, NewActivity};
    use crate::error::LedgerError;

    /// A row as a driver would hand it over: the values a record binds.
    struct Row<'a>(Vec<Value<'a>>);

    impl Columns for Row<'_> {
        fn text(&self, index: usize) -> Result<Option<&str>, LedgerError> {
            Ok(match self.0[index] {
                Value::Text(text) => Some(text),
                _ => None,
            })
        }
        fn int(&self, index: usize) -> Result<Option<i64>, LedgerError> {
            Ok(match self.0[index] {
                Value::Int(int) => Some(int),
                _ => None,
            })
        }
        fn boolean(&self, index: usize) -> Result<Option<bool>, LedgerError> {
            Ok(match self.0[index] {
                Value::Bool(flag) => Some(flag),
                _ => None,
            })
        }
    }

    fn record(class: &str) -> ActivityRecord {
        let config = crate::config::LedgerConfig::default();
        let new = NewActivity::fixture(class);
        begin(new, Timestamp::from_millis(1_000), config.policy())
            .unwrap()
            .record
    }

    #[test]
    fn rows_in_a_row_with_the_same_labels_share_them() {
        let (a, b, c) = (record("embedding"), record("embedding"), record("chat"));
        let ids: Vec<String> = [&a, &b, &c].iter().map(|r| r.activity_id.to_string()).collect();
        let mut last = LastLabels::default();
        let read: Vec<ActivityRecord> = [&a, &b, &c, &a]
            .iter()
            .zip(ids.iter().chain(std::iter::once(&ids[0])))
            .map(|(record, id)| record_with(&Row(record_values(record, id).to_vec()), &mut last).unwrap())
            .collect();
        assert_eq!(read[0], a);
        assert_eq!(read[2], c);
        assert_eq!(
            read[0].labels.identity(),
            read[1].labels.identity(),
            "the same set, read once"
        );
        assert_ne!(read[1].labels.identity(), read[2].labels.identity());
        assert_ne!(read[2].labels.identity(), read[3].labels.identity());
        assert_eq!(*read[3].labels, *a.labels);
    }

    #[test]
    fn the_update_binds_the_columns_it_names() {
        let columns: Vec<&str> = record_columns!().split(',').map(str::trim).collect();
        let set = UPDATE_RECORD
            .split_once(" SET ")
            .and_then(|(_, rest)| rest.split_once(" WHERE "))
            .unwrap();
        let mut named: Vec<&str> = set
            .0
            .split(',')
            .map(|pair| pair.split('=').next().unwrap().trim())
            .collect();
        named.push(set.1.split('=').next().unwrap().trim());
        let bound: Vec<&str> = CHANGING.iter().map(|&column| columns[column]).collect();
        assert_eq!(named, bound);
    }
}
