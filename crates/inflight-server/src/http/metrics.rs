//! `GET /metrics`: the snapshot in the OpenMetrics text format, for
//! Prometheus.
//!
//! Every scrape takes a snapshot, so it reaps first like every other read:
//! a scrape never reports a count the ledger can already see is stale.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use inflight::domain::owner::OwnerState as Owned;
use inflight::domain::record::{Disposition, State};
use inflight::domain::snapshot::Snapshot;

/// The content type of the exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Lane {
    service: String,
    provider: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneDisposition {
    #[prometheus(flatten)]
    lane: Lane,
    disposition: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Aggregate {
    service: String,
    operation_stage: String,
    class: String,
    provider: String,
    model: String,
    priority: &'static str,
    admission: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AggregateOutcome {
    #[prometheus(flatten)]
    aggregate: Aggregate,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OwnerState {
    state: &'static str,
}

fn counter(value: i64) -> Counter {
    let counter = Counter::default();
    counter.inc_by(u64::try_from(value).unwrap_or(0));
    counter
}

fn gauge(value: i64) -> Gauge {
    let gauge = Gauge::default();
    gauge.set(value);
    gauge
}

/// Renders `snapshot` (taken with the whole history window, so that every
/// aggregate is listed) as OpenMetrics text.
pub fn render(snapshot: &Snapshot) -> String {
    let mut registry = Registry::with_prefix("inflight");

    let executing = Family::<Lane, Gauge>::default();
    let waiting = Family::<Lane, Gauge>::default();
    let cap = Family::<Lane, Gauge>::default();
    let longest_wait = Family::<Lane, Gauge>::default();
    let reaped = Family::<LaneDisposition, Counter>::default();
    let owner_lost = Family::<Lane, Counter>::default();
    let late_settles = Family::<Lane, Counter>::default();
    for lane in snapshot.native_admission.values() {
        let key = Lane {
            service: lane.service.clone(),
            provider: lane.provider.clone(),
        };
        executing.get_or_create(&key).set(lane.executing);
        waiting.get_or_create(&key).set(lane.waiting);
        if let Some(lane_cap) = lane.cap {
            cap.get_or_create(&key).set(i64::from(lane_cap));
        }
        longest_wait.get_or_create(&key).set(lane.longest_wait_ms);
        for (disposition, count) in [
            (Disposition::Abandoned.as_str(), lane.reaped.abandoned),
            (Disposition::Unsettled.as_str(), lane.reaped.unsettled),
        ] {
            let labels = LaneDisposition {
                lane: key.clone(),
                disposition,
            };
            reaped
                .get_or_create(&labels)
                .inc_by(u64::try_from(count).unwrap_or(0));
        }
        owner_lost
            .get_or_create(&key)
            .inc_by(u64::try_from(lane.reaped_owner_lost).unwrap_or(0));
        late_settles
            .get_or_create(&key)
            .inc_by(u64::try_from(lane.late_settles).unwrap_or(0));
    }
    registry.register(
        "lane_executing",
        "Queued records executing on the lane",
        executing,
    );
    registry.register("lane_waiting", "Queued records waiting on the lane", waiting);
    registry.register("lane_cap", "The lane's declared cap", cap);
    registry.register(
        "lane_longest_wait_milliseconds",
        "How long the lane's oldest waiting record has waited",
        longest_wait,
    );
    registry.register(
        "lane_reaped",
        "Queued records that ended reaped, by disposition",
        reaped,
    );
    registry.register(
        "lane_reaped_owner_lost",
        "Queued records reaped because their owner's lease expired",
        owner_lost,
    );
    registry.register(
        "lane_late_settles",
        "Settles or cancels absorbed after the record was reaped",
        late_settles,
    );

    let calls = Family::<Aggregate, Counter>::default();
    let outcomes = Family::<AggregateOutcome, Counter>::default();
    let in_flight = Family::<Aggregate, Gauge>::default();
    for aggregate in &snapshot.aggregates {
        let key = &aggregate.key;
        let labels = Aggregate {
            service: key.service.to_string(),
            operation_stage: key.operation_stage.to_string(),
            class: key.class.to_string(),
            provider: key.provider.to_string(),
            model: key.model.to_string(),
            priority: key.priority.as_str(),
            admission: key.admission.as_str(),
        };
        calls
            .get_or_create(&labels)
            .inc_by(u64::try_from(aggregate.calls).unwrap_or(0));
        in_flight.get_or_create(&labels).set(aggregate.in_flight);
        for (outcome, count) in [
            (State::Succeeded.as_str(), aggregate.successes),
            (State::Failed.as_str(), aggregate.failures),
            (State::Cancelled.as_str(), aggregate.cancelled),
            (State::Reaped.as_str(), aggregate.reaped.total()),
        ] {
            let labels = AggregateOutcome {
                aggregate: labels.clone(),
                outcome,
            };
            outcomes
                .get_or_create(&labels)
                .inc_by(u64::try_from(count).unwrap_or(0));
        }
    }
    registry.register("calls", "Records begun", calls);
    registry.register("outcomes", "Records that ended, by outcome", outcomes);
    registry.register("in_flight", "Records in flight now", in_flight);

    let owners = Family::<OwnerState, Gauge>::default();
    for state in [Owned::Live, Owned::Lost, Owned::Released] {
        let count = snapshot.owners.iter().filter(|o| o.state == state).count();
        owners
            .get_or_create(&OwnerState {
                state: state.as_str(),
            })
            .set(count as i64);
    }
    registry.register("owners", "Owners registered with this ledger, by state", owners);
    registry.register(
        "reaped_this_scrape",
        "Records this scrape's own reap found past their bound",
        gauge(snapshot.reaped_this_read.total()),
    );
    registry.register(
        "activities",
        "Records ever begun",
        counter(snapshot.total_activities),
    );

    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut text, &registry);
    text
}
