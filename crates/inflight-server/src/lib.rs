//! # inflight-server
//!
//! The HTTP service of [`inflight`]: the API that services in any language
//! use ([`http::app`], testable in process with `tower::ServiceExt::oneshot`),
//! `/metrics`, and `inflight serve` ([`serve`]), with its settings, its
//! background reaper and its graceful shutdown. `docs/api.md` documents
//! every route.

pub mod http;
pub mod limits;
mod linger;
pub mod otel;
pub mod proxy;
pub mod reload;
mod server;
mod settings;
pub mod tls;

pub use reload::Reload;
pub use server::{
    load_file, open_ledger, serve, serve_on, serve_state, serve_tls, shutdown_signal, Overrides, ServeError,
    ServerSettings, DEFAULT_LISTEN, DEFAULT_STORE,
};

pub use limits::Limits;
pub use tls::{Tls, TlsFiles};
