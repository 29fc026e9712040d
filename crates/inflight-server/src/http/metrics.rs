//! `GET /metrics`: the ledger in the OpenMetrics text format, for
//! Prometheus. `docs/api.md` lists every series and how to aggregate it.
//!
//! Every scrape takes a snapshot, so it reaps first like every other read:
//! a scrape never reports a count the ledger can already see is stale.
//! Two kinds of series come out of it:
//!
//! - **store-wide**: the lanes' gauges, the owners, and the counters read
//!   from the store's own counters ([`Totals`]), which survive restarts and
//!   pruning; every instance on one store reports the same values
//!   (aggregate with `max`);
//! - **per instance**: what this process saw ([`StatsSnapshot`]): refused
//!   admissions, queue-wait and execution histograms, reaper passes
//!   (aggregate with `sum`).

use std::collections::BTreeMap;

use crate::otel::OtelStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use inflight::domain::counters::Totals;
use inflight::domain::owner::OwnerState as Owned;
use inflight::domain::record::{Disposition, ReapReason, State};
use inflight::domain::snapshot::Snapshot;
use inflight::domain::warnings::MAX_NAMED_CLASSES;
use inflight::stats::{Histogram, LaneClass, Rejection, StatsSnapshot};

use super::timing::RouteKey;

/// The content type of the exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What `/metrics` exposes beyond the standard series.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsOptions {
    /// Also expose the series per aggregate, with all seven labels
    /// (`service`, `operation_stage`, `class`, `provider`, `model`,
    /// `priority`, `admission`). Off by default: their cardinality is the
    /// product of every label callers send.
    pub aggregates: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct Lane {
    service: String,
    provider: String,
}

impl Lane {
    fn of(lane: &inflight::domain::record::LaneKey) -> Self {
        Self {
            service: lane.service.to_string(),
            provider: lane.provider.to_string(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct Provider {
    provider: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneState {
    #[prometheus(flatten)]
    lane: Lane,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneReap {
    #[prometheus(flatten)]
    lane: Lane,
    disposition: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneOutcome {
    #[prometheus(flatten)]
    lane: Lane,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneTokens {
    #[prometheus(flatten)]
    lane: Lane,
    /// `input` or `output`.
    r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneRejection {
    #[prometheus(flatten)]
    lane: Lane,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneClassLabels {
    #[prometheus(flatten)]
    lane: Lane,
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OwnerState {
    state: &'static str,
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
struct AggregateReap {
    #[prometheus(flatten)]
    aggregate: Aggregate,
    disposition: &'static str,
    reason: &'static str,
}

const DISPOSITIONS: [Disposition; 2] = [Disposition::Abandoned, Disposition::Unsettled];
const REASONS: [ReapReason; 2] = [ReapReason::Deadline, ReapReason::OwnerLost];
const REJECTIONS: [Rejection; 4] = [
    Rejection::LaneFull,
    Rejection::WaitTimeout,
    Rejection::LaneCooling,
    Rejection::BudgetExhausted,
];

fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

#[allow(clippy::cast_precision_loss)] // milliseconds: exact in an f64
fn seconds(ms: i64) -> f64 {
    ms as f64 / 1000.0
}

/// The outcomes a record settles with, and its count of each in `totals`.
fn outcomes(totals: &Totals) -> [(&'static str, i64); 3] {
    [
        (State::Succeeded.as_str(), totals.succeeded),
        (State::Failed.as_str(), totals.failed),
        (State::Cancelled.as_str(), totals.cancelled),
    ]
}

/// Renders `snapshot` (taken with the whole history window, so that every
/// aggregate is listed) and this process's `stats` as OpenMetrics text.
pub(crate) fn render(
    snapshot: &Snapshot,
    stats: &StatsSnapshot,
    requests: Vec<(RouteKey, Histogram)>,
    options: MetricsOptions,
    otel: Option<&OtelStats>,
) -> String {
    let mut registry = Registry::with_prefix("inflight");
    if let Some(otel) = otel {
        register_otel(&mut registry, otel);
    }
    register_requests(&mut registry, requests);
    register_lanes(&mut registry, snapshot);
    register_counters(&mut registry, snapshot, stats);
    register_owners(&mut registry, snapshot);
    register_unknown_classes(&mut registry, snapshot);
    register_stats(&mut registry, stats);
    if options.aggregates {
        register_aggregates(&mut registry, snapshot);
    }
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut text, &registry);
    sorted_series(&text)
}

/// `text` with each family's series in the order of their labels.
/// prometheus-client writes a family's series in its hash map's order, so
/// that a lane moved between two scrapes, and a person reading the scrape
/// or diffing two could not find one. A series keeps its lines together and
/// in their order (a histogram's `_sum`, `_count` and buckets): lines are
/// ordered by their labels less `le`, stably.
fn sorted_series(text: &str) -> String {
    /// A line's labels less `le` (wherever prometheus-client put it).
    fn series(line: &str) -> String {
        let labels = line.find('{').map_or("", |at| &line[at..]);
        let labels = labels.rfind('}').map_or(labels, |end| &labels[..=end]);
        let label_start = |&(at, _): &(usize, &str)| at > 0 && matches!(&labels[at - 1..at], "{" | ",");
        let Some((at, _)) = labels.match_indices("le=\"").find(label_start) else {
            return labels.to_owned();
        };
        let end = labels[at + 4..]
            .find('"')
            .map_or(labels.len(), |close| at + 4 + close + 1);
        // The comma after it, or else the one before it, goes with it.
        let (from, to) = if labels[end..].starts_with(',') {
            (at, end + 1)
        } else {
            (at - 1, end)
        };
        let from = if labels[from..].starts_with('{') {
            from + 1
        } else {
            from
        };
        format!("{}{}", &labels[..from], &labels[to..])
    }
    let mut out = String::with_capacity(text.len());
    let mut samples: Vec<&str> = Vec::new();
    let flush = |samples: &mut Vec<&str>, out: &mut String| {
        samples.sort_by_cached_key(|line| series(line));
        for line in samples.drain(..) {
            out.push_str(line);
            out.push('\n');
        }
    };
    for line in text.lines() {
        if line.starts_with('#') {
            flush(&mut samples, &mut out);
            out.push_str(line);
            out.push('\n');
        } else {
            samples.push(line);
        }
    }
    flush(&mut samples, &mut out);
    out
}

/// The lanes' gauges (store-wide), over `queued` records as admission
/// counts them.
fn register_lanes(registry: &mut Registry, snapshot: &Snapshot) {
    let in_flight = Family::<LaneState, Gauge>::default();
    let cap = Family::<Lane, Gauge>::default();
    let longest_wait = Family::<Lane, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let reap_in = Family::<Lane, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let effective_cap = Family::<Lane, Gauge>::default();
    let cooling = Family::<Lane, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let cooldowns = Family::<Lane, Counter>::default();
    let (tokens_last_minute, tokens_reserved) =
        (Family::<Lane, Gauge>::default(), Family::<Lane, Gauge>::default());
    let (token_budget, provider_budget) = (
        Family::<Lane, Gauge>::default(),
        Family::<Provider, Gauge>::default(),
    );
    for view in snapshot.native_admission.values() {
        let lane = Lane {
            service: view.service.clone(),
            provider: view.provider.clone(),
        };
        for (state, value) in [
            (State::Executing.as_str(), view.executing),
            (State::Waiting.as_str(), view.waiting),
        ] {
            in_flight
                .get_or_create(&LaneState {
                    lane: lane.clone(),
                    state,
                })
                .set(value);
        }
        if let Some(lane_cap) = view.cap {
            cap.get_or_create(&lane).set(i64::from(lane_cap));
            // Capped lanes only: cooldowns and adaptive caps are admission's.
            if let Some(effective) = view.effective_cap {
                effective_cap.get_or_create(&lane).set(i64::from(effective));
            }
            let left = view
                .cooling_until
                .map_or(0, |until| until.millis_since(snapshot.at).max(0));
            cooling.get_or_create(&lane).set(seconds(left));
            cooldowns.get_or_create(&lane).inc_by(count(view.cooldowns));
        }
        longest_wait
            .get_or_create(&lane)
            .set(seconds(view.longest_wait_ms));
        // The token window a budget admits by: what the last minute charged
        // and what executing calls reserve.
        tokens_last_minute
            .get_or_create(&lane)
            .set(view.tokens_last_minute);
        tokens_reserved.get_or_create(&lane).set(view.tokens_reserved);
        if let Some(budget) = view.tokens_per_minute {
            token_budget.get_or_create(&lane).set(i64::from(budget));
        }
        if let Some(budget) = view.provider_tokens_per_minute {
            let provider = Provider {
                provider: view.provider.clone(),
            };
            provider_budget.get_or_create(&provider).set(i64::from(budget));
        }
        if let Some(ms) = view.next_waiting_reap_in_ms {
            reap_in.get_or_create(&lane).set(seconds(ms));
        }
    }
    registry.register(
        "in_flight",
        "Queued records in flight on the lane, by state (executing or waiting)",
        in_flight,
    );
    registry.register("lane_cap", "The lane's declared cap on executing records", cap);
    registry.register(
        "lane_effective_cap",
        "The lane's cap in force: its cap, or an adaptive lane's cap lowered by a provider's refusals",
        effective_cap,
    );
    registry.register(
        "lane_cooling_seconds",
        "Seconds left of the lane's cooldown after a provider's Retry-After (0 when not cooling)",
        cooling,
    );
    registry.register(
        "cooldowns",
        "Cooldowns the lane began after a provider's Retry-After",
        cooldowns,
    );
    registry.register(
        "lane_tokens_last_minute",
        "Tokens the lane's calls charged in the last minute (reported, else the estimate of a call that ran)",
        tokens_last_minute,
    );
    registry.register(
        "lane_tokens_reserved",
        "The token estimates of the lane's calls executing",
        tokens_reserved,
    );
    registry.register(
        "lane_token_budget",
        "The lane's own token budget, tokens_per_minute (absent without one)",
        token_budget,
    );
    registry.register(
        "provider_token_budget",
        "The provider's token budget, tokens_per_minute, shared by its lanes (absent without one)",
        provider_budget,
    );
    registry.register(
        "lane_longest_wait_seconds",
        "How long the lane's oldest waiting record has waited (0 when none waits)",
        longest_wait,
    );
    registry.register(
        "lane_waiting_reap_in_seconds",
        "Seconds until the first of the lane's waiting records is reaped abandoned unless it starts (absent when none waits)",
        reap_in,
    );
}

/// The store's counters (store-wide), per lane over every record of the
/// lane, `queued` and `direct`.
fn register_counters(registry: &mut Registry, snapshot: &Snapshot, stats: &StatsSnapshot) {
    let mut lanes: BTreeMap<Lane, Totals> = BTreeMap::new();
    for view in snapshot.native_admission.values() {
        let lane = Lane {
            service: view.service.clone(),
            provider: view.provider.clone(),
        };
        lanes.entry(lane).or_default();
    }
    for aggregate in &snapshot.aggregates {
        let lane = Lane {
            service: aggregate.key.service.to_string(),
            provider: aggregate.key.provider.to_string(),
        };
        lanes.entry(lane).or_default().add(&aggregate.totals);
    }
    let reaped = Family::<LaneReap, Counter>::default();
    let settled = Family::<LaneOutcome, Counter>::default();
    let late_settles = Family::<Lane, Counter>::default();
    let resurrections = Family::<Lane, Counter>::default();
    let tokens = Family::<LaneTokens, Counter>::default();
    for (lane, totals) in &lanes {
        for disposition in DISPOSITIONS {
            for reason in REASONS {
                let labels = LaneReap {
                    lane: lane.clone(),
                    disposition: disposition.as_str(),
                    reason: reason.as_str(),
                };
                reaped
                    .get_or_create(&labels)
                    .inc_by(count(totals.reaps_ever(disposition, reason)));
            }
        }
        for (outcome, value) in outcomes(totals) {
            let labels = LaneOutcome {
                lane: lane.clone(),
                outcome,
            };
            settled.get_or_create(&labels).inc_by(count(value));
        }
        late_settles
            .get_or_create(lane)
            .inc_by(count(totals.late_settles));
        resurrections
            .get_or_create(lane)
            .inc_by(count(totals.resurrections));
        for (r#type, spent) in [("input", totals.input_tokens), ("output", totals.output_tokens)] {
            let labels = LaneTokens {
                lane: lane.clone(),
                r#type,
            };
            tokens.get_or_create(&labels).inc_by(count(spent));
        }
    }
    registry.register(
        "reaped",
        "Records reaped on the lane, ever, by disposition (abandoned: never started; unsettled: started, never settled) and reason (deadline or owner-lost)",
        reaped,
    );
    registry.register(
        "settled",
        "Records settled on the lane, ever, by outcome (succeeded, failed, cancelled)",
        settled,
    );
    registry.register(
        "late_settles",
        "Settles or cancels absorbed on the lane after their record was reaped",
        late_settles,
    );
    registry.register(
        "resurrections",
        "Abandoned records on the lane that started after all",
        resurrections,
    );
    registry.register(
        "tokens",
        "Tokens the lane's calls reported at settle (late settles included), by type (input or output)",
        tokens,
    );

    // Per instance: every capped lane, and every lane this process refused
    // on, so that a rate starts from zero.
    let rejected = Family::<LaneRejection, Counter>::default();
    let capped = snapshot
        .native_admission
        .values()
        .filter(|view| view.cap.is_some())
        .map(|view| Lane {
            service: view.service.clone(),
            provider: view.provider.clone(),
        });
    for lane in capped {
        for why in REJECTIONS {
            let labels = LaneRejection {
                lane: lane.clone(),
                reason: why.as_str(),
            };
            rejected.get_or_create(&labels).inc_by(0);
        }
    }
    for ((lane, why), value) in &stats.rejected {
        let labels = LaneRejection {
            lane: Lane::of(lane),
            reason: why.as_str(),
        };
        rejected.get_or_create(&labels).inc_by(*value);
    }
    registry.register(
        "admission_rejected",
        "Admissions this instance refused on the lane, by reason (lane_full, lane_cooling or budget_exhausted: at once; wait_timeout: after waiting in line)",
        rejected,
    );
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Class {
    class: String,
}

/// Calls of classes the configuration does not know (store-wide, from the
/// aggregates): the first classes by name each with its own series, the
/// rest in `other`, so that callers cannot grow the scrape without bound.
fn register_unknown_classes(registry: &mut Registry, snapshot: &Snapshot) {
    let unknown = Family::<Class, Counter>::default();
    for (index, (class, calls)) in snapshot.unknown_classes.iter().enumerate() {
        let class = if index < MAX_NAMED_CLASSES {
            class.clone()
        } else {
            inflight::domain::cardinality::OTHER.to_owned()
        };
        unknown.get_or_create(&Class { class }).inc_by(count(*calls));
    }
    registry.register(
        "unknown_class",
        "Calls of a class the configuration does not know, which get the widest bound (a call without a class is not counted)",
        unknown,
    );
}

fn register_owners(registry: &mut Registry, snapshot: &Snapshot) {
    let owners = Family::<OwnerState, Gauge>::default();
    for state in [Owned::Live, Owned::Lost, Owned::Released] {
        let count = snapshot.owners.iter().filter(|o| o.state == state).count();
        owners
            .get_or_create(&OwnerState {
                state: state.as_str(),
            })
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }
    registry.register(
        "owners",
        "Owners the store holds, by state (live; lost or released within the retention period)",
        owners,
    );
}

/// What `[otel]` export did, when it is on.
fn register_otel(registry: &mut Registry, otel: &OtelStats) {
    for (name, help, value) in [
        ("otel_exported_spans", "Spans of ended records this instance sent to the OpenTelemetry collector", &otel.exported),
        (
            "otel_dropped",
            "Ended records this instance did not export: its queue was full, or the collector did not take them",
            &otel.dropped,
        ),
        ("otel_failed_exports", "Exports of spans the OpenTelemetry collector did not take", &otel.failed_exports),
        (
            "otel_failed_metric_exports",
            "Exports of GenAI metrics the OpenTelemetry collector did not take",
            &otel.failed_metric_exports,
        ),
    ] {
        let counter = Counter::<u64>::default();
        counter.inc_by(value.load(std::sync::atomic::Ordering::Relaxed));
        registry.register(name, help, counter);
    }
}

/// This process's own statistics (per instance).
fn register_stats(registry: &mut Registry, stats: &StatsSnapshot) {
    let runs = Counter::<u64>::default();
    runs.inc_by(stats.reaper_runs);
    registry.register(
        "reaper_runs",
        "Background reaper passes this instance completed",
        runs,
    );
    let folded = Counter::<u64>::default();
    folded.inc_by(stats.labels_folded);
    registry.register(
        "labels_folded",
        "Begins through this instance whose labels were folded into `other`: outside a vocabulary, or past the limit on distinct lanes or label sets",
        folded,
    );
    let by_lane_class = |histograms: &BTreeMap<LaneClass, Histogram>| {
        histograms
            .iter()
            .map(|(key, histogram)| {
                let labels = LaneClassLabels {
                    lane: Lane::of(&key.lane),
                    class: key.class.to_string(),
                };
                (Some(labels), histogram.clone())
            })
            .collect::<Vec<_>>()
    };
    registry.register_collector(Box::new(Histograms {
        name: "queue_wait_seconds",
        help: "How long calls this instance started waited in line (startedAt - enqueuedAt)",
        series: by_lane_class(&stats.queue_wait),
    }));
    registry.register_collector(Box::new(Histograms {
        name: "execution_seconds",
        help: "How long calls this instance settled ran (completedAt - startedAt)",
        series: by_lane_class(&stats.execution),
    }));
    registry.register_collector(Box::new(Histograms::<Lane> {
        name: "reap_duration_seconds",
        help: "How long each background reaper pass of this instance took",
        series: vec![(None, stats.reap_duration.clone())],
    }));
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    method: &'static str,
    route: String,
    /// `true` for a request that asked to wait in line (`wait=`).
    waits: &'static str,
}

/// The server's own time per request, by route and method.
fn register_requests(registry: &mut Registry, requests: Vec<(RouteKey, Histogram)>) {
    let series = requests
        .into_iter()
        .map(|(key, histogram)| {
            let labels = RouteLabels {
                method: key.method,
                route: key.route,
                waits: if key.waits { "true" } else { "false" },
            };
            (Some(labels), histogram)
        })
        .collect();
    registry.register_collector(Box::new(Histograms {
        name: "http_request_duration_seconds",
        help: "How long this instance took to answer each request, from its headers read to its answer, by route and method; `waits` marks requests that asked to wait in line",
        series,
    }));
}

/// The optional series per aggregate (store-wide), with all seven labels.
fn register_aggregates(registry: &mut Registry, snapshot: &Snapshot) {
    let calls = Family::<Aggregate, Counter>::default();
    let in_flight = Family::<Aggregate, Gauge>::default();
    let settled = Family::<AggregateOutcome, Counter>::default();
    let reaped = Family::<AggregateReap, Counter>::default();
    for aggregate in &snapshot.aggregates {
        let key = &aggregate.key;
        let totals = &aggregate.totals;
        let labels = Aggregate {
            service: key.service.to_string(),
            operation_stage: key.operation_stage.to_string(),
            class: key.class.to_string(),
            provider: key.provider.to_string(),
            model: key.model.to_string(),
            priority: key.priority.as_str(),
            admission: key.admission.as_str(),
        };
        calls.get_or_create(&labels).inc_by(count(totals.ends_ever()));
        in_flight.get_or_create(&labels).set(totals.in_flight);
        for (outcome, value) in outcomes(totals) {
            let outcome = AggregateOutcome {
                aggregate: labels.clone(),
                outcome,
            };
            settled.get_or_create(&outcome).inc_by(count(value));
        }
        for disposition in DISPOSITIONS {
            for reason in REASONS {
                let reap = AggregateReap {
                    aggregate: labels.clone(),
                    disposition: disposition.as_str(),
                    reason: reason.as_str(),
                };
                reaped
                    .get_or_create(&reap)
                    .inc_by(count(totals.reaps_ever(disposition, reason)));
            }
        }
    }
    registry.register(
        "aggregate_calls",
        "Calls that ended (settled, cancelled or reaped), per aggregate, counted under the model they ended with; a call reaped abandoned and then started counts its reap and its end",
        calls,
    );
    registry.register(
        "aggregate_in_flight",
        "Records in flight now, per aggregate",
        in_flight,
    );
    registry.register(
        "aggregate_settled",
        "Records settled, per aggregate and outcome",
        settled,
    );
    registry.register(
        "aggregate_reaped",
        "Records reaped, per aggregate, disposition and reason",
        reaped,
    );
}

/// One histogram family, from histograms counted elsewhere (the library
/// keeps them; it depends on no metrics crate). A series without labels
/// has `None`.
#[derive(Debug)]
struct Histograms<S> {
    name: &'static str,
    help: &'static str,
    series: Vec<(Option<S>, Histogram)>,
}

impl<S: EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static> Collector for Histograms<S> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if self.series.is_empty() {
            return Ok(());
        }
        let mut family = encoder.encode_descriptor(self.name, self.help, None, MetricType::Histogram)?;
        for (labels, histogram) in &self.series {
            let buckets: Vec<(f64, u64)> = histogram.buckets().collect();
            let (sum, count) = (histogram.sum(), histogram.count());
            match labels {
                Some(labels) => family
                    .encode_family(labels)?
                    .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?,
                None => family.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?,
            }
        }
        Ok(())
    }
}
