//! The column lists, declared once: macros, so that statements are built
//! with `concat!` at compile time. [`super::codec`] reads and binds them in
//! this order.

/// The record columns, in [`super::codec::record_from`] order.
macro_rules! record_columns {
    () => {
        "activity_id, service, provider, class, operation_stage, model, priority, \
     admission, state, disposition, reap_reason, owner_id, enqueued_at, started_at, completed_at, \
     reaped_at, declared_deadline_ms, deadline_ms, reapable_at, success, failure_stage, late_settle, \
     cancel_reason, refined, input_tokens, output_tokens, max_tokens, trace_parent"
    };
}

/// The owner columns, in [`super::codec::owner_from`] order.
macro_rules! owner_columns {
    () => {
        "owner_id, name, ttl_ms, registered_at, renewed_at, expires_at, state, ended_at, \
     reaped_records, cancelled_records"
    };
}

/// A lane's state, in [`super::codec::lane_state_from`] order.
macro_rules! lane_state_columns {
    () => {
        "overtakes, cooling_until, cooldowns, effective_cap, successes"
    };
}

/// An aggregate's labels, in [`super::codec::aggregate_key_from`] order.
macro_rules! aggregate_labels {
    () => {
        "service, operation_stage, class, provider, model, priority, admission"
    };
}

/// The counter columns of an aggregate, in [`super::codec::totals_from`]
/// order.
#[cfg_attr(not(feature = "sqlite"), allow(unused_macros))]
macro_rules! totals_columns {
    () => {
        "succeeded, failed, cancelled, reaped_abandoned, reaped_unsettled, reaped_owner_lost, \
     late_settles, resurrections, in_flight, queue_wait_count, queue_wait_sum_ms, queue_wait_max_ms, \
     execution_count, execution_sum_ms, execution_max_ms, last_seen_at, reaped_owner_lost_abandoned, \
     succeeded_unstarted, input_tokens_sum, output_tokens_sum"
    };
}

/// The condition of the partial indexes on records in flight. Repeated
/// word for word in the queries that should use them: SQLite picks a
/// partial index only when the query's `WHERE` implies the index's own.
macro_rules! in_flight {
    () => {
        "state IN ('waiting', 'executing')"
    };
}

#[cfg(feature = "sqlite")]
pub(crate) use totals_columns;
pub(crate) use {aggregate_labels, in_flight, lane_state_columns, owner_columns, record_columns};

/// How many columns [`record_columns!`] lists.
pub(crate) const RECORD_COLUMNS: usize = 28;
/// How many columns [`lane_state_columns!`] lists.
pub(crate) const LANE_STATE_COLUMNS: usize = 5;
/// How many columns [`owner_columns!`] lists.
pub(crate) const OWNER_COLUMNS: usize = 10;
/// How many columns [`totals_columns!`] lists.
pub(crate) const TOTALS_COLUMNS: usize = 20;
/// How many columns [`aggregate_labels!`] lists.
pub(crate) const LABEL_COLUMNS: usize = 7;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counts_match_the_lists() {
        let count = |list: &str| list.split(',').count();
        assert_eq!(count(record_columns!()), RECORD_COLUMNS);
        assert_eq!(count(owner_columns!()), OWNER_COLUMNS);
        assert_eq!(count(totals_columns!()), TOTALS_COLUMNS);
        assert_eq!(count(aggregate_labels!()), LABEL_COLUMNS);
    }
}
