//! A record that ended, as a GenAI client span and its metric samples: one
//! pure function of the record, so that the exporter's loop decides
//! nothing about what a span says.

use std::borrow::Cow;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inflight::domain::record::{ActivityRecord, Disposition, ReapReason, State};
use inflight::Timestamp;
use opentelemetry::trace::{Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{IdGenerator, SpanData, SpanEvents, SpanLinks};

/// A reap that a resurrection took back: kept until the record really
/// ends, for its one span's event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TakenBack {
    pub(super) at: Timestamp,
    pub(super) reason: ReapReason,
}

/// What the metrics record of an ended call.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Samples {
    /// `gen_ai.operation.name`, `gen_ai.provider.name`,
    /// `gen_ai.request.model`, and `error.type` when it did not succeed.
    pub(super) attributes: Vec<KeyValue>,
    /// From its start to its end, for a call that started.
    pub(super) duration_s: Option<f64>,
    pub(super) input_tokens: Option<i64>,
    pub(super) output_tokens: Option<i64>,
}

/// The GenAI operation of a deadline class: the conventions' names for
/// the classes they define, else the class itself.
pub(super) fn operation(class: &str) -> &str {
    match class {
        "chat" => "chat",
        "embedding" | "embeddings" => "embeddings",
        "completion" | "completions" | "text_completion" => "text_completion",
        other => other,
    }
}

/// How `record` ended, as `error.type`; `None` when it succeeded.
fn error_type(record: &ActivityRecord) -> Option<Cow<'static, str>> {
    match record.state {
        State::Succeeded => None,
        State::Failed => Some(record.failure_stage.map_or(Cow::Borrowed("_OTHER"), |stage| {
            Cow::Owned(stage.as_str().to_owned())
        })),
        State::Cancelled => Some(Cow::Borrowed("cancelled")),
        State::Reaped => Some(Cow::Borrowed(match record.disposition {
            Some(Disposition::Abandoned) => "abandoned",
            _ => "unsettled",
        })),
        // Not an end: the exporter is shown ends only.
        _ => Some(Cow::Borrowed("_OTHER")),
    }
}

fn system_time(at: Timestamp) -> SystemTime {
    let millis = u64::try_from(at.as_millis()).unwrap_or(0);
    UNIX_EPOCH + Duration::from_millis(millis)
}

/// When `record` ended: its completion, else its reap.
fn ended_at(record: &ActivityRecord) -> Timestamp {
    record
        .completed_at
        .or(record.reaped_at)
        .unwrap_or_else(|| record.started_at.unwrap_or(record.enqueued_at))
}

/// The metric samples of `record`, which ended.
pub(super) fn samples(record: &ActivityRecord) -> Samples {
    let labels = &record.labels;
    let mut attributes = vec![
        KeyValue::new(
            "gen_ai.operation.name",
            operation(labels.class.as_str()).to_owned(),
        ),
        KeyValue::new("gen_ai.provider.name", labels.provider.as_str().to_owned()),
        KeyValue::new("gen_ai.request.model", labels.model.to_string()),
    ];
    if let Some(error) = error_type(record) {
        attributes.push(KeyValue::new("error.type", error));
    }
    let duration_s = record.started_at.map(|started| {
        let ms = ended_at(record)
            .as_millis()
            .saturating_sub(started.as_millis())
            .max(0);
        ms as f64 / 1000.0
    });
    Samples {
        attributes,
        duration_s,
        input_tokens: record.usage.input_tokens,
        output_tokens: record.usage.output_tokens,
    }
}

/// The span of `record`, which ended: a CLIENT span named
/// `{operation} {model}`, from its start (or its enqueue, if it never
/// started) to its end, a child of the caller's span when its begin
/// carried a `traceparent`. `None` when that parent was not sampled: the
/// caller's sampling decision holds.
pub(super) fn span(
    record: &ActivityRecord,
    taken_back: Option<TakenBack>,
    ids: &dyn IdGenerator,
    scope: &InstrumentationScope,
) -> Option<SpanData> {
    let labels = &record.labels;
    let (trace_id, parent_span_id, remote) = match record.trace_parent.as_deref() {
        Some(parent) if !parent.sampled() => return None,
        Some(parent) => (
            TraceId::from_bytes(parent.trace_id()),
            SpanId::from_bytes(parent.span_id()),
            true,
        ),
        None => (ids.new_trace_id(), SpanId::INVALID, false),
    };
    let operation = operation(labels.class.as_str());
    let start = record.started_at.unwrap_or(record.enqueued_at);
    let mut attributes = samples(record).attributes;
    attributes.extend([
        KeyValue::new("inflight.activity_id", record.activity_id.to_string()),
        KeyValue::new(
            "inflight.lane",
            format!("{}::{}", labels.service.as_str(), labels.provider.as_str()),
        ),
        KeyValue::new("inflight.service", labels.service.as_str().to_owned()),
        KeyValue::new("inflight.class", labels.class.as_str().to_owned()),
        KeyValue::new(
            "inflight.operation_stage",
            labels.operation_stage.as_str().to_owned(),
        ),
        KeyValue::new("inflight.priority", record.priority.as_str()),
        KeyValue::new("inflight.state", record.state.as_str()),
    ]);
    if record.refined {
        attributes.push(KeyValue::new("gen_ai.response.model", labels.model.to_string()));
    }
    if let Some(tokens) = record.usage.input_tokens {
        attributes.push(KeyValue::new("gen_ai.usage.input_tokens", tokens));
    }
    if let Some(tokens) = record.usage.output_tokens {
        attributes.push(KeyValue::new("gen_ai.usage.output_tokens", tokens));
    }
    if let Some(wait) = record.queue_wait_ms {
        attributes.push(KeyValue::new("inflight.queue_wait_ms", wait));
    }
    if let Some(disposition) = record.disposition {
        attributes.push(KeyValue::new("inflight.disposition", disposition.as_str()));
    }
    if let Some(reason) = record.reap_reason {
        attributes.push(KeyValue::new("inflight.reap_reason", reason.as_str()));
    }
    if let Some(reason) = &record.cancel_reason {
        attributes.push(KeyValue::new("inflight.cancel_reason", reason.clone()));
    }
    if record.late_settle {
        attributes.push(KeyValue::new("inflight.late_settle", true));
    }
    let mut events = Vec::new();
    if let (Some(started), Some(wait)) = (record.started_at, record.queue_wait_ms) {
        events.push(Event::new(
            "inflight.queue_wait",
            system_time(started),
            vec![
                KeyValue::new("inflight.queue_wait_ms", wait),
                KeyValue::new("inflight.enqueued_at_unix_ms", record.enqueued_at.as_millis()),
            ],
            0,
        ));
    }
    if let Some(reap) = taken_back {
        events.push(Event::new(
            "inflight.reaped",
            system_time(reap.at),
            vec![
                KeyValue::new("inflight.disposition", Disposition::Abandoned.as_str()),
                KeyValue::new("inflight.reap_reason", reap.reason.as_str()),
                KeyValue::new("inflight.resurrected", true),
            ],
            0,
        ));
        attributes.push(KeyValue::new("inflight.resurrected", true));
    }
    let status = match error_type(record) {
        None => Status::Unset,
        Some(error) => Status::error(error),
    };
    Some(SpanData {
        span_context: SpanContext::new(
            trace_id,
            ids.new_span_id(),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        ),
        parent_span_id,
        parent_span_is_remote: remote,
        span_kind: SpanKind::Client,
        name: Cow::Owned(format!("{operation} {}", labels.model)),
        start_time: system_time(start),
        end_time: system_time(ended_at(record).max(start)),
        attributes,
        dropped_attributes_count: 0,
        events: {
            let mut all = SpanEvents::default();
            all.events = events;
            all
        },
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use inflight::domain::labels::{ActivityLabels, RawLabels};
    use inflight::domain::TraceParent;
    use inflight::{ActivityId, Admission, FailureStage, Priority, Usage};
    use opentelemetry_sdk::trace::RandomIdGenerator;

    fn record(state: State) -> ActivityRecord {
        let labels = ActivityLabels::validate(&RawLabels {
            service: "kb",
            provider: "ollama",
            class: Some("embedding"),
            operation_stage: None,
            model: Some("bge-m3"),
        })
        .unwrap();
        ActivityRecord {
            activity_id: ActivityId::new(),
            labels,
            priority: Priority::Batch,
            admission: Admission::Queued,
            state,
            disposition: None,
            reap_reason: None,
            owner_id: None,
            enqueued_at: Timestamp::from_millis(1_000),
            started_at: Some(Timestamp::from_millis(1_250)),
            completed_at: Some(Timestamp::from_millis(2_750)),
            reaped_at: None,
            declared_deadline_ms: None,
            deadline_ms: 60_000,
            reapable_at: None,
            queue_wait_ms: Some(250),
            execution_ms: Some(1_500),
            success: Some(state == State::Succeeded),
            failure_stage: (state == State::Failed).then_some(FailureStage::Provider),
            late_settle: false,
            cancel_reason: None,
            refined: false,
            usage: Usage::default(),
            max_tokens: None,
            trace_parent: None,
        }
    }

    fn scope() -> InstrumentationScope {
        InstrumentationScope::builder("inflight").build()
    }

    fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a opentelemetry::Value> {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| &kv.value)
    }

    #[test]
    fn classes_name_the_conventions_operations() {
        assert_eq!(operation("chat"), "chat");
        assert_eq!(operation("embedding"), "embeddings");
        assert_eq!(operation("completion"), "text_completion");
        assert_eq!(operation("rerank"), "rerank");
    }

    #[test]
    fn a_span_runs_from_its_start_to_its_end_and_a_failure_is_an_error() {
        let ids = RandomIdGenerator::default();
        let ok = span(&record(State::Succeeded), None, &ids, &scope()).unwrap();
        assert_eq!(ok.name, "embeddings bge-m3");
        assert_eq!(ok.start_time, system_time(Timestamp::from_millis(1_250)));
        assert_eq!(ok.end_time, system_time(Timestamp::from_millis(2_750)));
        assert_eq!(ok.status, Status::Unset);
        assert!(attribute(&ok, "error.type").is_none());
        assert_eq!(ok.parent_span_id, SpanId::INVALID, "a root of its own");
        assert_eq!(samples(&record(State::Succeeded)).duration_s, Some(1.5));

        let failed = span(&record(State::Failed), None, &ids, &scope()).unwrap();
        assert_eq!(
            attribute(&failed, "error.type")
                .map(ToString::to_string)
                .as_deref(),
            Some("provider")
        );
        assert!(matches!(failed.status, Status::Error { .. }));
    }

    #[test]
    fn a_call_that_never_started_spans_its_wait_and_has_no_duration_sample() {
        let mut waited = record(State::Cancelled);
        (waited.started_at, waited.queue_wait_ms, waited.execution_ms) = (None, None, None);
        let span = span(&waited, None, &RandomIdGenerator::default(), &scope()).unwrap();
        assert_eq!(span.start_time, system_time(Timestamp::from_millis(1_000)));
        assert!(span.events.is_empty(), "no queue wait: it never started");
        assert_eq!(samples(&waited).duration_s, None);
    }

    #[test]
    fn the_callers_sampling_holds_and_a_taken_back_reap_is_an_event() {
        let mut traced = record(State::Succeeded);
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        traced.trace_parent = Some(Box::new(TraceParent::parse(parent).unwrap()));
        let reap = TakenBack {
            at: Timestamp::from_millis(1_100),
            reason: ReapReason::Deadline,
        };
        let span = span(&traced, Some(reap), &RandomIdGenerator::default(), &scope()).unwrap();
        assert_eq!(
            span.span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(span.parent_span_id.to_string(), "00f067aa0ba902b7");
        let names: Vec<&str> = span.events.iter().map(|e| e.name.as_ref()).collect();
        assert_eq!(names, ["inflight.queue_wait", "inflight.reaped"]);

        let unsampled = parent.replace("-01", "-00");
        traced.trace_parent = Some(Box::new(TraceParent::parse(&unsampled).unwrap()));
        assert!(super::span(&traced, None, &RandomIdGenerator::default(), &scope()).is_none());
    }
}
