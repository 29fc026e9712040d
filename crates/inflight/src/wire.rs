//! The one place the ledger's types meet the wire's ([`inflight_api`]):
//! what the server answers (and the CLI prints), and what it reads.
//!
//! The conversions are the trait [`ToApi`] and the functions
//! [`activity_spec`] and [`settlement`]. Every enum is matched
//! exhaustively: a variant added to the ledger fails to compile here until
//! the wire says how it is written.

use inflight_api as api;

use crate as inflight;
use crate::{ActivitySpec, Outcome, Settlement};

/// The wire form of one of the ledger's types.
pub trait ToApi {
    /// The wire type.
    type Api;

    /// Converts to the wire type.
    fn to_api(&self) -> Self::Api;
}

impl ToApi for inflight::ReapedCounts {
    type Api = api::ReapCounts;

    fn to_api(&self) -> api::ReapCounts {
        api::ReapCounts {
            abandoned: self.abandoned,
            unsettled: self.unsettled,
        }
    }
}

impl ToApi for inflight::ActivityRecord {
    type Api = api::ActivityRecord;

    fn to_api(&self) -> api::ActivityRecord {
        let labels = &*self.labels;
        api::ActivityRecord {
            activity_id: self.activity_id.to_string(),
            service: labels.service.to_string(),
            provider: labels.provider.to_string(),
            class: labels.class.to_string(),
            operation_stage: labels.operation_stage.to_string(),
            model: labels.model.to_string(),
            priority: self.priority,
            admission: self.admission,
            state: self.state,
            disposition: self.disposition,
            reap_reason: self.reap_reason,
            owner_id: self.owner_id.clone(),
            enqueued_at: self.enqueued_at,
            started_at: self.started_at,
            completed_at: self.completed_at,
            reaped_at: self.reaped_at,
            deadline_ms: self.deadline_ms,
            reapable_at: self.reapable_at,
            queue_wait_ms: self.queue_wait_ms,
            execution_ms: self.execution_ms,
            success: self.success,
            failure_stage: self.failure_stage,
            late_settle: self.late_settle,
            unstarted_success: self.success == Some(true) && self.started_at.is_none(),
            refined: self.refined,
            input_tokens: self.usage.input_tokens,
            output_tokens: self.usage.output_tokens,
            max_tokens: self.max_tokens,
            cancel_reason: self.cancel_reason.clone(),
            traceparent: self.trace_parent.as_deref().map(ToString::to_string),
            ignored_fields: Vec::new(),
        }
    }
}

impl ToApi for inflight::Owner {
    type Api = api::Owner;

    fn to_api(&self) -> api::Owner {
        api::Owner {
            owner_id: self.owner_id.to_string(),
            name: self.name.to_string(),
            ttl_ms: self.ttl_ms,
            registered_at: self.registered_at,
            renewed_at: self.renewed_at,
            expires_at: self.expires_at,
            state: self.state,
            ended_at: self.ended_at,
            reaped_records: self.reaped_records,
            cancelled_records: self.cancelled_records,
        }
    }
}

impl ToApi for inflight::Snapshot {
    type Api = api::Snapshot;

    fn to_api(&self) -> api::Snapshot {
        let lanes = self.native_admission.iter().map(|(key, lane)| {
            let lane = api::Lane {
                service: lane.service.clone(),
                provider: lane.provider.clone(),
                cap: lane.cap,
                executing: lane.executing,
                waiting: lane.waiting,
                reaped: lane.reaped.to_api(),
                reaped_owner_lost: lane.reaped_owner_lost,
                late_settles: lane.late_settles,
                resurrections: lane.resurrections,
                longest_wait_ms: lane.longest_wait_ms,
                effective_cap: lane.effective_cap,
                cooling_until: lane.cooling_until,
                cooldowns: lane.cooldowns,
                by_priority: lane.by_priority,
                tokens_last_minute: lane.tokens_last_minute,
                tokens_reserved: lane.tokens_reserved,
                tokens_per_minute: lane.tokens_per_minute,
                provider_tokens_per_minute: lane.provider_tokens_per_minute,
            };
            (key.clone(), lane)
        });
        let aggregates = self.aggregates.iter().map(|aggregate| {
            let key = &aggregate.key;
            api::Aggregate {
                service: key.service.to_string(),
                operation_stage: key.operation_stage.to_string(),
                class: key.class.to_string(),
                provider: key.provider.to_string(),
                model: key.model.to_string(),
                priority: key.priority,
                admission: key.admission,
                calls: aggregate.calls,
                successes: aggregate.successes,
                successes_unstarted: aggregate.successes_unstarted,
                failures: aggregate.failures,
                cancelled: aggregate.cancelled,
                reaped: aggregate.reaped.to_api(),
                late_settles: aggregate.late_settles,
                in_flight: aggregate.in_flight,
                avg_queue_wait_ms: aggregate.avg_queue_wait_ms,
                max_queue_wait_ms: aggregate.max_queue_wait_ms,
                avg_execution_ms: aggregate.avg_execution_ms,
                max_execution_ms: aggregate.max_execution_ms,
                last_seen_at: aggregate.last_seen_at,
                input_tokens: aggregate.input_tokens,
                output_tokens: aggregate.output_tokens,
            }
        });
        api::Snapshot {
            status: self.status,
            at: self.at,
            since: self.since,
            native_admission: lanes.collect(),
            total_activities: self.total_activities,
            total_succeeded: self.total_succeeded,
            total_succeeded_unstarted: self.total_succeeded_unstarted,
            total_failed: self.total_failed,
            total_cancelled: self.total_cancelled,
            total_in_flight: self.total_in_flight,
            total_recent_completions: self.total_recent_completions,
            total_reaped: self.total_reaped,
            total_reaped_owner_lost: self.total_reaped_owner_lost,
            total_late_settles: self.total_late_settles,
            total_resurrections: self.total_resurrections,
            reaped_this_read: self.reaped_this_read.to_api(),
            in_flight: self
                .in_flight
                .iter()
                .map(|entry| api::InFlightRecord {
                    record: entry.record.to_api(),
                    elapsed_ms: entry.elapsed_ms,
                })
                .collect(),
            recent_completions: self.recent_completions.iter().map(ToApi::to_api).collect(),
            reaped: self
                .reaped
                .iter()
                .map(|entry| api::ReapedRecord {
                    record: entry.record.to_api(),
                    age_ms: entry.age_ms,
                })
                .collect(),
            in_flight_truncated: self.in_flight_truncated,
            recent_completions_truncated: self.recent_completions_truncated,
            reaped_truncated: self.reaped_truncated,
            aggregates: aggregates.collect(),
            owners: self.owners.iter().map(ToApi::to_api).collect(),
            warnings: self
                .warnings
                .iter()
                .map(|warning| api::SnapshotWarning {
                    code: warning.code.to_owned(),
                    message: warning.message.clone(),
                })
                .collect(),
        }
    }
}

/// The call a begin asks for. The ledger validates it: labels, the skew of
/// its timestamps, a positive deadline, a registered owner.
pub fn activity_spec(request: api::BeginRequest) -> ActivitySpec {
    let mut spec = ActivitySpec::new(request.service, request.provider);
    if let Some(class) = request.class {
        spec = spec.class(class);
    }
    if let Some(stage) = request.operation_stage {
        spec = spec.operation_stage(stage);
    }
    if let Some(model) = request.model {
        spec = spec.model(model);
    }
    if let Some(priority) = request.priority {
        spec = spec.priority(priority);
    }
    if let Some(admission) = request.admission {
        spec = spec.admission(admission);
    }
    if let Some(at) = request.enqueued_at {
        spec = spec.enqueued_at(at);
    }
    if let Some(at) = request.started_at {
        spec = spec.started_at(at);
    }
    // Set as sent, for the ledger to judge: a deadline that is not positive
    // is refused by its rule (a `Duration` cannot carry it there), and an
    // owner id is checked against the registered owners.
    if let Some(deadline_ms) = request.deadline_ms {
        spec = spec.deadline_ms(deadline_ms);
    }
    if let Some(tokens) = request.max_tokens {
        spec = spec.max_tokens(tokens);
    }
    if let Some(owner) = request.owner_id {
        spec = spec.owner_spelled(owner);
    }
    spec
}

/// The settle a request asks for.
pub fn settlement(request: &api::SettleRequest) -> Settlement {
    let outcome = if request.success {
        Outcome::Success
    } else {
        let stage = request.failure_stage;
        Outcome::Failure(stage.unwrap_or(inflight::FailureStage::Unknown))
    };
    let mut settlement = Settlement::new(outcome);
    if let Some(at) = request.completed_at {
        settlement = settlement.completed_at(at);
    }
    if let Some(ms) = request.retry_after_ms {
        settlement = settlement.retry_after_ms(ms);
    }
    if let Some(usage) = request.usage {
        settlement = settlement.usage(inflight::Usage {
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
        });
    }
    settlement
}

/// The operator's table ([`inflight_api::render_snapshot`]): lanes,
/// outcomes, the oldest records in flight, the reaped evidence and owners.
impl std::fmt::Display for crate::Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.to_api(), f)
    }
}
