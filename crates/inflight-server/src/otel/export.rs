//! The exporter: the ledger's ends, through one bounded queue, to an OTLP
//! collector as spans and GenAI metrics.
//!
//! The ledger shows each end on its store's writer ([`Ledger::watch_ends`]);
//! the watcher only offers it to the queue, and drops and counts it when
//! the queue is full, so export never slows a command. One task drains the
//! queue: it holds abandoned records a while (a late start may bring them
//! back), makes each end a span ([`super::span`]), records the metrics,
//! and sends spans in batches.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use inflight::domain::effect::Effect;
use inflight::domain::record::{ActivityId, ActivityRecord, Disposition, State};
use inflight::Ledger;
use opentelemetry::metrics::{Histogram, MeterProvider};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_http::hyper::HyperClient;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{RandomIdGenerator, SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use tokio::sync::{mpsc, oneshot};

use super::settings::OtelSettings;
use super::span::{self, TakenBack};
use super::OtelStats;

/// The most spans one export sends.
const MAX_BATCH: usize = 512;
/// How often the queue's spans go out when fewer than a batch wait.
const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// How often a failing collector is logged.
const WARN_EVERY: Duration = Duration::from_secs(60);
/// How long a shutdown waits for the last spans to go out.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// The conventions' buckets for `gen_ai.client.operation.duration` (s).
const DURATION_BUCKETS: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];
/// The conventions' buckets for `gen_ai.client.token.usage` (`{token}`).
const TOKEN_BUCKETS: [f64; 14] = [
    1.0,
    4.0,
    16.0,
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262_144.0,
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
    67_108_864.0,
];

/// One end the ledger showed.
struct Ended {
    record: Arc<ActivityRecord>,
    effect: Effect,
}

/// The running export; [`Exporting::shutdown`] sends what is left.
#[derive(Debug)]
#[must_use = "export stops when this is shut down; drop it only after the ledger"]
pub struct Exporting {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Exporting {
    /// Stops taking ends, sends the spans still queued or held (an
    /// abandoned record held for a late start goes out as it is), and the
    /// metrics, waiting at most a few seconds for the collector.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped midway, what was queued may be lost.
    pub async fn shutdown(self) {
        let _ = self.stop.send(());
        if tokio::time::timeout(SHUTDOWN_WAIT * 2, self.task).await.is_err() {
            tracing::warn!("OpenTelemetry export did not finish in time; the last spans may be lost");
        }
    }
}

/// When a failing collector was last logged: at most once a
/// [`WARN_EVERY`], for spans and for metrics alike.
#[derive(Debug, Default)]
struct Warned(Option<Instant>);

impl Warned {
    /// Whether to log now; if so, remembers it.
    fn due(&mut self) -> bool {
        let now = Instant::now();
        let due = self.0.is_none_or(|at| now.duration_since(at) >= WARN_EVERY);
        if due {
            self.0 = Some(now);
        }
        due
    }
}

/// The collector's HTTP client, run on the server's runtime: the metrics'
/// periodic reader exports from a thread of its own, where hyper (which
/// needs tokio) could not run.
#[derive(Debug, Clone)]
struct OnRuntime {
    handle: tokio::runtime::Handle,
    client: HyperClient<hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>>,
    /// The metrics' client only: counts and logs the exports the collector
    /// did not take, which the SDK's reader would drop unheard. The spans'
    /// are counted where they are sent ([`Run::send`]).
    metric_failures: Option<Arc<MetricFailures>>,
}

/// Where a metrics client counts the exports that failed, and when it last
/// warned of one.
#[derive(Debug)]
struct MetricFailures {
    stats: Arc<OtelStats>,
    warned: Mutex<Warned>,
}

#[async_trait::async_trait]
impl HttpClient for OnRuntime {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let sent = self
            .handle
            .spawn(async move { client.send_bytes(request).await })
            .await
            .map_err(|err| HttpError::from(format!("the export task failed: {err}")))
            .and_then(|sent| sent);
        if let Some(failures) = &self.metric_failures {
            let failed = match &sent {
                Ok(response) if response.status().is_success() => None,
                Ok(response) => Some(format!("the collector answered {}", response.status())),
                Err(err) => Some(err.to_string()),
            };
            if let Some(error) = failed {
                let MetricFailures { stats, warned } = &**failures;
                stats.failed_metric_exports.fetch_add(1, Ordering::Relaxed);
                if warned.lock().unwrap_or_else(PoisonError::into_inner).due() {
                    tracing::warn!(
                        %error,
                        failed_total = stats.failed_metric_exports.load(Ordering::Relaxed),
                        "OpenTelemetry: cannot export metrics; dropping them (logged at most once a minute)"
                    );
                }
            }
        }
        sent
    }
}

/// Starts exporting `ledger`'s ends as `settings` say, counting into
/// `stats`. Must run on the server's tokio runtime.
///
/// # Errors
/// The exporters cannot be built (an endpoint variable that is not a URL,
/// the system's certificates unreadable), named.
pub fn start(settings: &OtelSettings, ledger: &Ledger, stats: Arc<OtelStats>) -> Result<Exporting, String> {
    let tls = inflight::store::client_tls("otel.endpoint", None).map_err(|err| err.to_string())?;
    let client = OnRuntime {
        handle: tokio::runtime::Handle::current(),
        client: HyperClient::new(crate::tls::client_connector(tls), settings.timeout, None),
        metric_failures: None,
    };
    let headers: HashMap<String, String> = settings.headers.clone().into_iter().collect();
    let resource = Resource::builder()
        .with_service_name(settings.service_name.clone())
        .build();

    let mut spans = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_http_client(client.clone())
        .with_headers(headers.clone())
        .with_timeout(settings.timeout);
    if let Some(url) = settings.signal_url("/v1/traces") {
        spans = spans.with_endpoint(url);
    }
    let mut spans = spans
        .build()
        .map_err(|err| format!("otel: cannot export spans: {err}"))?;
    spans.set_resource(&resource);

    let mut metrics = opentelemetry_otlp::MetricExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_http_client(OnRuntime {
            metric_failures: Some(Arc::new(MetricFailures {
                stats: Arc::clone(&stats),
                warned: Mutex::default(),
            })),
            ..client
        })
        .with_headers(headers)
        .with_timeout(settings.timeout);
    if let Some(url) = settings.signal_url("/v1/metrics") {
        metrics = metrics.with_endpoint(url);
    }
    let metrics = metrics
        .build()
        .map_err(|err| format!("otel: cannot export metrics: {err}"))?;
    // The interval is OTEL_METRIC_EXPORT_INTERVAL's, else a minute.
    let meters = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(metrics).build())
        .with_resource(resource)
        .build();

    let (sender, queue) = mpsc::channel(settings.queue);
    let counted = Arc::clone(&stats);
    ledger.watch_ends(move |record, effect| {
        let ended = Ended {
            record: Arc::clone(record),
            effect: *effect,
        };
        if let Err(mpsc::error::TrySendError::Full(_)) = sender.try_send(ended) {
            counted.dropped.fetch_add(1, Ordering::Relaxed);
        }
    });
    let (stop, stopped) = oneshot::channel();
    let run = Run::new(ledger.clone(), settings, spans, meters, stats);
    let task = tokio::spawn(run.drain(queue, stopped));
    Ok(Exporting { stop, task })
}

/// The draining task's state.
struct Run {
    /// To read a held record again when its hold ends.
    ledger: Ledger,
    spans: opentelemetry_otlp::SpanExporter,
    meters: SdkMeterProvider,
    duration: Histogram<f64>,
    tokens: Histogram<u64>,
    stats: Arc<OtelStats>,
    ids: RandomIdGenerator,
    scope: InstrumentationScope,
    /// Spans ready to go.
    batch: Vec<SpanData>,
    /// Records reaped `abandoned`, each until its hold ends, oldest first.
    held: HashMap<ActivityId, Arc<ActivityRecord>>,
    held_order: VecDeque<(Instant, ActivityId)>,
    /// Reaps that a late start took back, until the record ends.
    taken_back: HashMap<ActivityId, TakenBack>,
    hold: Duration,
    /// At most this many held, and as many taken back.
    room: usize,
    warned: Warned,
}

impl Run {
    fn new(
        ledger: Ledger,
        settings: &OtelSettings,
        spans: opentelemetry_otlp::SpanExporter,
        meters: SdkMeterProvider,
        stats: Arc<OtelStats>,
    ) -> Self {
        let scope = InstrumentationScope::builder("inflight")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let meter = meters.meter_with_scope(scope.clone());
        let duration = meter
            .f64_histogram("gen_ai.client.operation.duration")
            .with_unit("s")
            .with_description("GenAI operation duration")
            .with_boundaries(DURATION_BUCKETS.to_vec())
            .build();
        let tokens = meter
            .u64_histogram("gen_ai.client.token.usage")
            .with_unit("{token}")
            .with_description("Measures number of input and output tokens used")
            .with_boundaries(TOKEN_BUCKETS.to_vec())
            .build();
        Self {
            ledger,
            spans,
            meters,
            duration,
            tokens,
            stats,
            ids: RandomIdGenerator::default(),
            scope,
            batch: Vec::new(),
            held: HashMap::new(),
            held_order: VecDeque::new(),
            taken_back: HashMap::new(),
            hold: settings.hold_abandoned,
            room: settings.queue,
            warned: Warned::default(),
        }
    }

    async fn drain(mut self, mut queue: mpsc::Receiver<Ended>, mut stopped: oneshot::Receiver<()>) {
        let mut tick = tokio::time::interval(FLUSH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                ended = queue.recv() => match ended {
                    Some(ended) => self.take(ended),
                    None => break,
                },
                _ = tick.tick() => {
                    self.release_held().await;
                    self.send().await;
                }
                _ = &mut stopped => break,
            }
            if self.batch.len() >= MAX_BATCH {
                self.send().await;
            }
        }
        // What is queued, then what is held, goes out now, as it is: the
        // store is closed.
        queue.close();
        while let Ok(ended) = queue.try_recv() {
            self.take(ended);
        }
        while !self.held.is_empty() {
            self.release_oldest();
        }
        self.send().await;
        let meters = self.meters.clone();
        let flushed = tokio::task::spawn_blocking(move || meters.shutdown());
        if tokio::time::timeout(SHUTDOWN_WAIT, flushed).await.is_err() {
            tracing::warn!("OpenTelemetry: the last metrics were not sent in time");
        }
    }

    /// One end, shown by the ledger.
    fn take(&mut self, Ended { record, effect }: Ended) {
        let id = record.activity_id;
        match effect {
            Effect::Reaped {
                disposition: Disposition::Abandoned,
                ..
            } => {
                if self.held.len() >= self.room {
                    // Full: the oldest goes out as it is.
                    self.release_oldest();
                }
                self.held.insert(id, record);
                self.held_order.push_back((Instant::now() + self.hold, id));
            }
            Effect::Resurrected => {
                if let Some(reaped) = self.held.remove(&id) {
                    if let (Some(at), Some(reason)) = (reaped.reaped_at, reaped.reap_reason) {
                        if self.taken_back.len() < self.room {
                            self.taken_back.insert(id, TakenBack { at, reason });
                        }
                    }
                }
            }
            _ => {
                let taken_back = self.taken_back.remove(&id);
                self.end(&record, taken_back);
            }
        }
    }

    /// `record` ended for good: its span and its samples.
    fn end(&mut self, record: &ActivityRecord, taken_back: Option<TakenBack>) {
        let samples = span::samples(record);
        if let Some(seconds) = samples.duration_s {
            self.duration.record(seconds, &samples.attributes);
        }
        for (kind, count) in [("input", samples.input_tokens), ("output", samples.output_tokens)] {
            if let Some(count) = count.and_then(|count| u64::try_from(count).ok()) {
                let mut attributes = samples.attributes.clone();
                attributes.push(KeyValue::new("gen_ai.token.type", kind));
                self.tokens.record(count, &attributes);
            }
        }
        if let Some(span) = span::span(record, taken_back, &self.ids, &self.scope) {
            self.batch.push(span);
        }
    }

    /// Held records whose hold ended go out as abandoned, if they still
    /// are: each is read again first, because another process sharing the
    /// store may have brought it back (its span then comes from where it
    /// ends). Abandoned reaps are rare, so the reads are too.
    async fn release_held(&mut self) {
        let now = Instant::now();
        while let Some(&(until, id)) = self.held_order.front() {
            if until > now {
                break;
            }
            self.held_order.pop_front();
            let Some(held) = self.held.remove(&id) else {
                // Brought back here since.
                continue;
            };
            match self.ledger.get(id).await {
                Ok(current)
                    if current.state == State::Reaped
                        && current.disposition == Some(Disposition::Abandoned) =>
                {
                    self.end(&current, None);
                }
                // Brought back by another process: not ended, or ended there.
                Ok(_) => {}
                // Unreadable (pruned, the store down): as it was.
                Err(_) => self.end(&held, None),
            }
        }
    }

    /// The oldest record held goes out as it is.
    fn release_oldest(&mut self) {
        while let Some((_, id)) = self.held_order.pop_front() {
            // Skipped: brought back since.
            if let Some(record) = self.held.remove(&id) {
                self.end(&record, None);
                return;
            }
        }
    }

    /// Sends the batch; a failure drops it and counts it.
    async fn send(&mut self) {
        while !self.batch.is_empty() {
            let take = self.batch.len().min(MAX_BATCH);
            let batch: Vec<SpanData> = self.batch.drain(..take).collect();
            let count = batch.len() as u64;
            match self.spans.export(batch).await {
                Ok(()) => {
                    self.stats.exported.fetch_add(count, Ordering::Relaxed);
                }
                Err(err) => {
                    self.stats.dropped.fetch_add(count, Ordering::Relaxed);
                    self.stats.failed_exports.fetch_add(1, Ordering::Relaxed);
                    if self.warned.due() {
                        tracing::warn!(
                            error = %err,
                            dropped_total = self.stats.dropped.load(Ordering::Relaxed),
                            "OpenTelemetry: cannot export spans; dropping them (logged at most once a minute)"
                        );
                    }
                }
            }
        }
    }
}
