//! `[otel]`: each record that ends becomes an OpenTelemetry span under the
//! GenAI semantic conventions, and feeds the GenAI client metrics, sent
//! over OTLP/HTTP (protobuf) to a collector.
//!
//! The settings ([`OtelSettings`]) are read in every build, so that
//! `check-config` refuses what `serve` would; the export itself needs the
//! `otel` feature, which the `inflight` binary turns on.

use std::sync::atomic::AtomicU64;

#[cfg(feature = "otel")]
mod export;
mod settings;
#[cfg(feature = "otel")]
mod span;

#[cfg(feature = "otel")]
pub use export::{start, Exporting};
pub use settings::{OtelSettings, DEFAULT_SERVICE_NAME};

/// What the export did, for `/metrics`.
#[derive(Debug, Default)]
pub struct OtelStats {
    /// Spans sent to the collector.
    pub exported: AtomicU64,
    /// Ends dropped: the queue was full, or their export failed.
    pub dropped: AtomicU64,
    /// Exports of spans the collector did not take.
    pub failed_exports: AtomicU64,
    /// Exports of metrics the collector did not take (cumulative by
    /// default: the next export carries what this one lost).
    pub failed_metric_exports: AtomicU64,
}
