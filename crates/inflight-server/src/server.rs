//! `inflight serve`: settings precedence, the listener, the background
//! reaper and graceful shutdown around the [`http`](crate::http) router.
//!
//! Precedence is flag > environment > file > default. Clap merges the first
//! two into [`Overrides`]; [`ServerSettings::merge`] applies them over the
//! file.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use inflight_api::{ErrorBody, ErrorCode};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::limits::Limits;
use crate::linger::{close_when_body_unread, Lingering};
use crate::otel::OtelSettings;
use crate::proxy::Routes;
use crate::reload::Reload;
use crate::tls::{Tls, TlsFiles};

use crate::http::auth::token_specs;
use crate::http::{app, AppState, MetricsOptions, Tokens};
use inflight::config::{ConfigError, ConfigWarning, LedgerConfig, Settings};
use inflight::error::ErrorKind;
use inflight::Ledger;

/// The address served on by default: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7878";
/// The store used by default, relative to the working directory.
pub const DEFAULT_STORE: &str = inflight::store::DEFAULT_URL;

/// Settings given as flags or environment variables; each wins over the file.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--config` / `INFLIGHT_CONFIG`: the configuration file.
    pub config: Option<PathBuf>,
    /// `--listen` / `INFLIGHT_LISTEN`.
    pub listen: Option<String>,
    /// `--store` / `INFLIGHT_STORE`.
    pub store: Option<String>,
    /// `--token` / `INFLIGHT_TOKEN`.
    pub token: Option<String>,
    /// `--metrics-aggregates` / `INFLIGHT_METRICS_AGGREGATES`.
    pub metrics_aggregates: Option<bool>,
    /// `--tls-cert` / `INFLIGHT_TLS_CERT`: `[server.tls] cert`.
    pub tls_cert: Option<PathBuf>,
    /// `--tls-key` / `INFLIGHT_TLS_KEY`: `[server.tls] key`.
    pub tls_key: Option<PathBuf>,
}

impl fmt::Debug for Overrides {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Overrides")
            .field("config", &self.config)
            .field("listen", &self.listen)
            .field("store", &self.store)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("metrics_aggregates", &self.metrics_aggregates)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .finish()
    }
}

/// What the server runs with, once every source is merged.
#[derive(Clone, PartialEq)]
pub struct ServerSettings {
    /// The address to listen on (`host:port`; port 0 picks a free one).
    pub listen: String,
    /// The store URL.
    pub store: String,
    /// The bearer token the API requires, if any (`token`, `--token`): a
    /// write token for every service.
    pub token: Option<String>,
    /// Every token the API takes: `token` first, then the `[[tokens]]`
    /// entries, each with its scope.
    /// Loaded once here: their files are read when the settings are, so
    /// that `check-config` and `serve` refuse the same one, and `serve`
    /// does not read them again.
    pub tokens: Arc<Tokens>,
    /// Connections, requests in flight and timeouts (`[server]`).
    pub limits: Limits,
    /// The certificate and key to serve HTTPS with (`[server.tls]`), or
    /// `None` for plain HTTP.
    pub tls: Option<TlsFiles>,
    /// What `/metrics` exposes beyond the standard series.
    pub metrics: MetricsOptions,
    /// The ledger's classes, factor, reap interval and lanes.
    pub ledger: LedgerConfig,
    /// The `/proxy/NAME` routes (`[proxy.NAME]`).
    pub proxies: Arc<Routes>,
    /// OpenTelemetry export (`[otel]` or the `OTEL_EXPORTER_OTLP_*`
    /// variables), when on.
    pub otel: Option<OtelSettings>,
    /// What the file says that is valid but most likely not meant:
    /// `check-config` prints them, `serve` logs them at start-up.
    pub warnings: Vec<ConfigWarning>,
}

impl fmt::Debug for ServerSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerSettings")
            .field("listen", &self.listen)
            .field("store", &self.store)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tokens", &self.tokens)
            .field("tls", &self.tls)
            .field("metrics", &self.metrics)
            .field("ledger", &self.ledger)
            .field("proxies", &self.proxies)
            .field("otel", &self.otel)
            .field("warnings", &self.warnings)
            .finish()
    }
}

/// Why `inflight serve` could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The configuration file could not be read.
    #[error("cannot read the configuration file {}: {source}", path.display())]
    ReadConfig {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A setting is invalid; the error names the key.
    #[error("invalid configuration{}: {error}", origin.as_ref().map(|p| format!(" in {}", p.display())).unwrap_or_default())]
    Config {
        /// The file it came from, when it came from one.
        origin: Option<PathBuf>,
        /// The key and the problem.
        error: ConfigError,
    },
    /// The store could not be opened.
    #[error("cannot open the store {url}: {message}")]
    Store {
        /// The store URL, without its password.
        url: String,
        /// Why.
        message: String,
    },
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The server stopped with an I/O error.
    #[error("the server stopped: {0}")]
    Serve(std::io::Error),
}

impl ServeError {
    /// Whether it is a configuration error (exit code 2).
    pub fn is_config(&self) -> bool {
        matches!(self, Self::ReadConfig { .. } | Self::Config { .. })
    }
}

/// Reads and validates the configuration file at `path`.
///
/// # Errors
/// [`ServeError::ReadConfig`] or [`ServeError::Config`], naming the key.
pub fn load_file(path: &Path) -> Result<Settings, ServeError> {
    let text = std::fs::read_to_string(path).map_err(|source| ServeError::ReadConfig {
        path: path.to_owned(),
        source,
    })?;
    Settings::from_toml(&text).map_err(|error| ServeError::Config {
        origin: Some(path.to_owned()),
        error,
    })
}

fn config_error(key: &str, problem: String) -> ServeError {
    ServeError::Config {
        origin: None,
        error: ConfigError {
            key: key.to_owned(),
            problem,
        },
    }
}

impl ServerSettings {
    /// Merges every source: reads the file named by `overrides.config` (if
    /// any), then applies the overrides over it, then the defaults.
    ///
    /// # Errors
    /// An unreadable or invalid file, or an invalid override, naming the key.
    pub fn resolve(overrides: &Overrides) -> Result<Self, ServeError> {
        let file = match &overrides.config {
            Some(path) => load_file(path)?,
            None => Settings::default(),
        };
        Self::merge(overrides, file)
    }

    /// Applies `overrides` over `file`, then the defaults. Empty override
    /// values count as unset.
    ///
    /// # Errors
    /// A `listen` that is not `host:port`, or an empty token, naming the key.
    pub fn merge(overrides: &Overrides, file: Settings) -> Result<Self, ServeError> {
        let pick = |over: &Option<String>, file: Option<String>| {
            over.clone().filter(|value| !value.is_empty()).or(file)
        };
        let listen = pick(&overrides.listen, file.listen).unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        let store = pick(&overrides.store, file.store).unwrap_or_else(|| DEFAULT_STORE.to_owned());
        let token = pick(&overrides.token, file.token);
        check_listen(&listen)?;
        if token.as_deref().is_some_and(|token| token.trim().is_empty()) {
            return Err(config_error("token", "must not be empty".to_owned()));
        }
        if store.trim().is_empty() {
            return Err(config_error("store", "must not be empty".to_owned()));
        }
        let in_file = |error| ServeError::Config {
            origin: overrides.config.clone(),
            error,
        };
        let specs = token_specs(token.as_deref(), &file.tokens).map_err(in_file)?;
        let tokens = Arc::new(Tokens::load(specs).map_err(in_file)?);
        let mut warnings = file.warnings;
        let limits = match &file.server {
            Some(table) => Limits::from_table(table, &mut warnings).map_err(|error| ServeError::Config {
                origin: overrides.config.clone(),
                error,
            })?,
            None => Limits::default(),
        };
        let tls = TlsFiles::resolve(
            overrides.tls_cert.as_deref(),
            overrides.tls_key.as_deref(),
            file.server.as_ref(),
        )
        .map_err(|error| ServeError::Config {
            origin: overrides.config.clone(),
            error,
        })?;
        // Read the files now, so that `check-config` refuses what `serve`
        // would.
        if let Some(files) = &tls {
            Tls::load(files).map_err(|error| ServeError::Config { origin: None, error })?;
        }
        let proxies =
            Routes::from_tables(&file.proxy, &mut warnings).map_err(|error| ServeError::Config {
                origin: overrides.config.clone(),
                error,
            })?;
        let otel = OtelSettings::resolve(
            file.otel.as_ref(),
            &|name| std::env::var(name).ok(),
            &mut warnings,
        )
        .map_err(|error| ServeError::Config {
            origin: overrides.config.clone(),
            error,
        })?;
        if otel.is_some() && !cfg!(feature = "otel") {
            warnings.push(ConfigWarning::new(
                "otel",
                "this build has no OpenTelemetry export (inflight-server's `otel` feature): nothing is exported",
            ));
        }
        let metrics = MetricsOptions {
            aggregates: overrides
                .metrics_aggregates
                .or(file.metrics_aggregates)
                .unwrap_or(false),
        };
        Ok(Self {
            listen,
            store,
            token,
            tokens,
            limits,
            tls,
            metrics,
            ledger: file.ledger,
            proxies: Arc::new(proxies),
            otel,
            warnings,
        })
    }
}

/// Checks that `listen` is `host:port`.
fn check_listen(listen: &str) -> Result<(), ServeError> {
    if listen.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let valid = listen
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && !host.contains(':') && port.parse::<u16>().is_ok());
    if valid {
        Ok(())
    } else {
        Err(config_error(
            "listen",
            format!("{listen:?} is not an address of the form host:port, e.g. \"127.0.0.1:7878\""),
        ))
    }
}

/// Opens the store and builds the ledger `settings` describe.
///
/// # Errors
/// An unsupported store URL is a configuration error (`store`); a store that
/// cannot be opened is [`ServeError::Store`].
pub fn open_ledger(settings: &ServerSettings) -> Result<Ledger, ServeError> {
    Ledger::builder(settings.ledger.clone())
        .store_url(settings.store.clone())
        .build()
        .map_err(|err| match err.kind() {
            ErrorKind::InvalidInput => config_error("store", err.message().to_owned()),
            _ => ServeError::Store {
                url: inflight::store::redacted_url(&settings.store),
                message: err.to_string(),
            },
        })
}

/// Serves the API with `settings` until SIGTERM or SIGINT, with the
/// background reaper running. Logs `listening on http://ADDR` (or
/// `https://`) once bound.
///
/// SIGHUP re-reads the TLS certificate and key and the `token_file`s: this
/// is where the server's one [`Reload`] is made and fed, and where whatever
/// else is re-read on SIGHUP subscribes to it (see [`crate::reload`]).
///
/// # Errors
/// See [`ServeError`].
///
/// # Cancel safety
/// Not cancel safe: dropping the future stops accepting connections but
/// skips the orderly end that SIGTERM or SIGINT gives. Requests under way
/// are not waited for, and the store is not closed: what it was given
/// still lands, and the SQLite store applies what it wrote ahead when it
/// is next opened.
pub async fn serve(settings: ServerSettings) -> Result<(), ServeError> {
    // From here on a SIGHUP re-reads files instead of ending the process.
    let reload = Reload::new();
    let _sighup = reload.on_sighup();
    let tls = match &settings.tls {
        Some(files) => {
            let tls = Tls::load(files).map_err(|error| ServeError::Config { origin: None, error })?;
            tls.reload_on(&reload);
            Some(tls)
        }
        None => None,
    };
    for warning in &settings.warnings {
        tracing::warn!(key = %warning.key, "configuration: {warning}");
    }
    let ledger = open_ledger(&settings)?;
    tracing::info!(store = %inflight::store::redacted_url(&settings.store), "opened the store");
    let listener = TcpListener::bind(&settings.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: settings.listen.clone(),
            source,
        })?;
    let local = listener.local_addr().map_err(ServeError::Serve)?;
    let state = AppState::new(ledger)
        .with_tokens(settings.tokens)
        .with_limits(settings.limits)
        .with_metrics(settings.metrics)
        .with_proxies(settings.proxies);
    #[cfg(feature = "otel")]
    let (state, exporting) = export(settings.otel.as_ref(), state)?;
    if let Some(tokens) = state.tokens() {
        let tokens = Arc::clone(tokens);
        reload.each(move || {
            tokens.reload();
        });
    }
    serve_listener(listener, state, tls, shutdown_signal()).await?;
    // After the store closed: every end it committed was shown.
    #[cfg(feature = "otel")]
    if let Some(exporting) = exporting {
        exporting.shutdown().await;
    }
    tracing::info!(addr = %local, "stopped");
    Ok(())
}

/// Starts exporting `state`'s ledger's ends as `otel` says, if it is set,
/// and shows the export's counts on `/metrics`.
#[cfg(feature = "otel")]
fn export(
    otel: Option<&OtelSettings>,
    state: AppState,
) -> Result<(AppState, Option<crate::otel::Exporting>), ServeError> {
    let Some(otel) = otel else {
        return Ok((state, None));
    };
    let stats = Arc::new(crate::otel::OtelStats::default());
    let exporting = crate::otel::start(otel, state.ledger(), Arc::clone(&stats))
        .map_err(|message| config_error("otel", message))?;
    tracing::info!(
        endpoint = otel
            .endpoint
            .as_deref()
            .unwrap_or("from OTEL_EXPORTER_OTLP_* or http://localhost:4318"),
        service_name = %otel.service_name,
        "exporting ended records as OpenTelemetry spans and GenAI metrics"
    );
    Ok((state.with_otel(stats), Some(exporting)))
}

/// Serves `ledger` on `listener` within `limits` until `shutdown` resolves,
/// with the background reaper running; in-flight requests finish first.
///
/// Connections are HTTP/1.1. A connection whose request header does not
/// arrive within the header timeout (and an idle keep-alive connection, after
/// as long) is closed; one past `max_connections` is answered 503 and closed.
///
/// # Errors
/// [`ServeError::Serve`] when the listener fails.
///
/// # Cancel safety
/// Not cancel safe: dropping the future stops accepting connections but
/// skips the orderly end, which only `shutdown` resolving gives. Requests
/// under way are not waited for, and the store is not closed: what it was
/// given still lands, and the SQLite store applies what it wrote ahead
/// when it is next opened.
pub async fn serve_on(
    listener: TcpListener,
    ledger: Ledger,
    token: Option<String>,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let state = AppState::new(ledger).with_token(token).with_limits(limits);
    serve_state(listener, state, shutdown).await
}

/// Serves the API over `state` (its ledger, token, limits and metrics
/// options) on `listener` until `shutdown` resolves, as [`serve_on`] does.
///
/// # Errors
/// [`ServeError::Serve`] when the listener fails.
///
/// # Cancel safety
/// Not cancel safe: dropping the future stops accepting connections but
/// skips the orderly end, which only `shutdown` resolving gives. Requests
/// under way are not waited for, and the store is not closed: what it was
/// given still lands, and the SQLite store applies what it wrote ahead
/// when it is next opened.
pub async fn serve_state(
    listener: TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_listener(listener, state, None, shutdown).await
}

/// Serves the API over `state` on `listener` over TLS until `shutdown`
/// resolves, as [`serve_state`] does over plain HTTP. A reload of `tls`
/// ([`Tls::reload`], or a [`Reload`] it follows) changes the certificate
/// new connections get.
///
/// # Errors
/// [`ServeError::Serve`] when the listener fails.
///
/// # Cancel safety
/// Not cancel safe: dropping the future stops accepting connections but
/// skips the orderly end, which only `shutdown` resolving gives. Requests
/// under way are not waited for, and the store is not closed: what it was
/// given still lands, and the SQLite store applies what it wrote ahead
/// when it is next opened.
pub async fn serve_tls(
    listener: TcpListener,
    state: AppState,
    tls: Tls,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_listener(listener, state, Some(tls), shutdown).await
}

/// [`serve_state`] over plain HTTP, or over TLS when `tls` is given.
async fn serve_listener(
    listener: TcpListener,
    state: AppState,
    tls: Option<Tls>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let ledger = state.ledger().clone();
    let limits = state.limits();
    let local = listener.local_addr().map_err(ServeError::Serve)?;
    let reaper = ledger.spawn_reaper();
    let classes: Vec<String> = ledger
        .config()
        .policy()
        .classes()
        .iter()
        .map(|(name, bounds)| format!("{name}={}ms", bounds.deadline_ms()))
        .collect();
    tracing::info!(
        addr = %local,
        auth = if state.has_token() { "bearer token" } else { "none" },
        metrics_aggregates = state.metrics().aggregates,
        classes = %classes.join(","),
        factor = ledger.config().policy().factor(),
        reap_interval_ms = u64::try_from(ledger.config().reap_interval().as_millis()).unwrap_or(u64::MAX),
        max_connections = limits.max_connections(),
        max_requests = limits.max_requests(),
        header_timeout_ms = u64::try_from(limits.header_timeout().as_millis()).unwrap_or(u64::MAX),
        "listening on {scheme}://{local}",
        scheme = if tls.is_some() { "https" } else { "http" },
    );
    for route in state.proxies().iter() {
        tracing::info!(
            route = route.name(),
            upstream = %route.upstream(),
            provider = route.provider(),
            "proxying /proxy/{}/ to {}",
            route.name(),
            route.upstream()
        );
    }
    if tls.is_none() && state.has_token() && !local.ip().is_loopback() {
        tracing::warn!(
            addr = %local,
            "serving plain HTTP beyond this machine with a token: the token crosses the network in \
             the clear; set [server.tls] (or --tls-cert and --tls-key), or put a TLS proxy in front"
        );
    }
    let router = app(state);
    let result = accept_loop(listener, router, limits, tls.map(|tls| tls.acceptor()), shutdown).await;
    drop(reaper);
    // What the last requests and dropped handles submitted lands before
    // the process ends.
    if let Err(err) = ledger.close().await {
        tracing::warn!(error = %err, "cannot close the store cleanly");
    }
    result
}

/// Accepts connections until `shutdown`, then lets the open ones finish
/// their requests. With `tls`, each connection's handshake must end within
/// the header timeout, as a request head must.
async fn accept_loop(
    listener: TcpListener,
    router: axum::Router,
    limits: Limits,
    tls: Option<TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let router = router.layer(tower::util::MapResponseLayer::new(close_when_body_unread));
    let connections = Arc::new(Semaphore::new(limits.max_connections()));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout())
        // A request head past the buffer is answered 431: a client cannot
        // make the server hold hyper's default of about 400 KiB per
        // connection.
        .max_buf_size(MAX_HEAD_BYTES)
        .keep_alive(true);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of descriptors or a connection reset before it was
                    // accepted: the listener itself is fine. Pause so that
                    // a descriptor shortage is not a busy loop.
                    tracing::warn!(error = %err, "cannot accept a connection");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
            tokio::spawn(refuse(stream, tls.clone()));
            continue;
        };
        // Small request-response exchanges: send each answer at once.
        let _ = stream.set_nodelay(true);
        // However the connection ends, it lingers before it closes, and
        // holds its place among the open ones until then.
        let stream = Lingering::new(stream, Some(permit));
        let service = TowerToHyperService::new(router.clone());
        // Watched from now on: a shutdown waits for a handshake under way.
        let watcher = graceful.watcher();
        let incoming = match &tls {
            None => Incoming::Plain(stream),
            Some(acceptor) => Incoming::Tls(Box::new(acceptor.accept(stream))),
        };
        let (http, timeout) = (http.clone(), limits.header_timeout());
        tokio::spawn(async move {
            let result = match incoming {
                Incoming::Plain(stream) => watcher
                    .watch(http.serve_connection(TokioIo::new(stream), service))
                    .await
                    .map_err(ConnectionError::Http),
                Incoming::Tls(handshake) => match tokio::time::timeout(timeout, handshake).await {
                    Ok(Ok(stream)) => watcher
                        .watch(http.serve_connection(TokioIo::new(stream), service))
                        .await
                        .map_err(ConnectionError::Http),
                    Ok(Err(err)) => Err(ConnectionError::Handshake(err)),
                    Err(_) => Err(ConnectionError::HandshakeTimeout),
                },
            };
            if let Err(err) = result {
                tracing::debug!(%peer, error = %err, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// An accepted connection: plain, or its TLS handshake to come.
enum Incoming {
    Plain(Lingering),
    // Boxed: a handshake's state is over a kilobyte.
    Tls(Box<tokio_rustls::Accept<Lingering>>),
}

/// Why a connection ended early: logged at debug, as a client's doing.
#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    #[error("TLS handshake failed: {0}")]
    Handshake(std::io::Error),
    #[error("no TLS handshake within the header timeout")]
    HandshakeTimeout,
    #[error(transparent)]
    Http(hyper::Error),
}

/// The largest request head (request line and headers) read, in bytes.
pub const MAX_HEAD_BYTES: usize = 32 * 1024;

/// How long the accept loop pauses after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// How long a refused connection gets to take its 503.
const REFUSE_TIMEOUT: Duration = Duration::from_secs(1);

/// Answers a connection past `max_connections` with a 503 (over TLS after
/// its handshake, with `tls`) and closes it, without reading its request
/// (past what lingering discards: the unread request would otherwise turn
/// the close into a reset that loses the 503).
async fn refuse(stream: TcpStream, tls: Option<TlsAcceptor>) {
    let body = serde_json::to_string(&ErrorBody::new(
        ErrorCode::Unavailable,
        "the server is at its limit of open connections; retry shortly",
    ))
    .unwrap_or_default();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let stream = Lingering::new(stream, None);
    let _ = tokio::time::timeout(REFUSE_TIMEOUT, async {
        match tls {
            None => send_and_close(stream, response.as_bytes()).await,
            Some(acceptor) => send_and_close(acceptor.accept(stream).await?, response.as_bytes()).await,
        }
    })
    .await;
}

async fn send_and_close(mut stream: impl AsyncWrite + Unpin, bytes: &[u8]) -> std::io::Result<()> {
    stream.write_all(bytes).await?;
    stream.shutdown().await
}

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM.
///
/// # Cancel safety
/// Cancel safe: dropping it loses nothing. A signal is seen only by a
/// future already polled when it arrives (tokio's `ctrl_c` and `signal`):
/// one sent while none is polled is lost, and, once one was, no longer
/// ends the process by itself.
pub async fn shutdown_signal() {
    let interrupt = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %err, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => tracing::info!("SIGINT received; shutting down"),
        () = terminate => tracing::info!("SIGTERM received; shutting down"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overrides(listen: Option<&str>, store: Option<&str>, token: Option<&str>) -> Overrides {
        Overrides {
            config: None,
            listen: listen.map(str::to_owned),
            store: store.map(str::to_owned),
            token: token.map(str::to_owned),
            metrics_aggregates: None,
            ..Overrides::default()
        }
    }

    #[test]
    fn tls_needs_both_files_and_readable_ones() {
        let cert_alone = Overrides {
            tls_cert: Some("server.crt".into()),
            ..Overrides::default()
        };
        match ServerSettings::merge(&cert_alone, Settings::default()) {
            Err(err @ ServeError::Config { .. }) => {
                assert!(err.is_config());
                assert!(err.to_string().contains("server.tls.key: is missing"), "{err}");
            }
            other => panic!("expected a config error, got {other:?}"),
        }
        let dir = tempfile::tempdir().unwrap();
        let file = Settings::from_toml(&format!(
            "[server]\nmax_requests = 10\n[server.tls]\ncert = {:?}\nkey = {:?}\n",
            dir.path().join("absent.crt"),
            dir.path().join("absent.key"),
        ))
        .unwrap();
        match ServerSettings::merge(&Overrides::default(), file) {
            Err(err @ ServeError::Config { .. }) => {
                let message = err.to_string();
                assert!(message.contains("server.tls.cert"), "{message}");
                assert!(message.contains("absent.crt cannot be read"), "{message}");
            }
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_apply_when_nothing_is_said() {
        let settings = ServerSettings::merge(&Overrides::default(), Settings::default()).unwrap();
        assert_eq!(settings.listen, DEFAULT_LISTEN);
        assert_eq!(settings.store, DEFAULT_STORE);
        assert_eq!(settings.token, None);
        assert_eq!(settings.ledger, LedgerConfig::default());
    }

    #[test]
    fn overrides_win_over_the_file_and_the_file_over_defaults() {
        let file = Settings::from_toml(
            "listen = \"127.0.0.1:9000\"\nstore = \"memory:\"\ntoken = \"from-file\"\n[reap]\nfactor = 2\n",
        )
        .unwrap();
        let from_file = ServerSettings::merge(&Overrides::default(), file.clone()).unwrap();
        assert_eq!(from_file.listen, "127.0.0.1:9000");
        assert_eq!(from_file.store, "memory:");
        assert_eq!(from_file.token.as_deref(), Some("from-file"));
        assert_eq!(from_file.ledger.policy().factor(), 2.0);

        let over = overrides(Some("0.0.0.0:1"), Some("sqlite://x.db"), Some("flag"));
        let merged = ServerSettings::merge(&over, file.clone()).unwrap();
        assert_eq!(merged.listen, "0.0.0.0:1");
        assert_eq!(merged.store, "sqlite://x.db");
        assert_eq!(merged.token.as_deref(), Some("flag"));
        assert_eq!(
            merged.ledger.policy().factor(),
            2.0,
            "the ledger comes from the file"
        );

        let empty = overrides(Some(""), None, Some(""));
        let merged = ServerSettings::merge(&empty, file).unwrap();
        assert_eq!(merged.listen, "127.0.0.1:9000", "an empty value counts as unset");
        assert_eq!(merged.token.as_deref(), Some("from-file"));
    }

    #[test]
    fn series_per_aggregate_are_off_unless_the_file_or_a_flag_turns_them_on() {
        let off = ServerSettings::merge(&Overrides::default(), Settings::default()).unwrap();
        assert!(!off.metrics.aggregates);
        let file = Settings::from_toml("[metrics]\naggregates = true\n").unwrap();
        let on = ServerSettings::merge(&Overrides::default(), file.clone()).unwrap();
        assert!(on.metrics.aggregates);
        let over = Overrides {
            metrics_aggregates: Some(false),
            ..Overrides::default()
        };
        assert!(!ServerSettings::merge(&over, file).unwrap().metrics.aggregates);
        assert!(Settings::from_toml("[metrics]\nseries = 1\n").is_err());
    }

    #[test]
    fn bad_overrides_name_the_key() {
        for (over, key) in [
            (overrides(Some("7878"), None, None), "listen"),
            (overrides(Some("localhost"), None, None), "listen"),
            (overrides(None, Some(" "), None), "store"),
            (overrides(None, None, Some("  ")), "token"),
        ] {
            match ServerSettings::merge(&over, Settings::default()) {
                Err(ServeError::Config { error, .. }) => assert_eq!(error.key, key),
                other => panic!("{over:?}: expected a config error, got {other:?}"),
            }
        }
        assert!(
            ServerSettings::merge(&overrides(Some("localhost:0"), None, None), Settings::default()).is_ok()
        );
        assert!(
            ServerSettings::merge(&overrides(Some("[::1]:7878"), None, None), Settings::default()).is_ok()
        );
    }

    #[test]
    fn an_unsupported_store_is_a_config_error() {
        let settings =
            ServerSettings::merge(&overrides(None, Some("mysql://x"), None), Settings::default()).unwrap();
        match open_ledger(&settings) {
            Err(err @ ServeError::Config { .. }) => assert!(err.is_config()),
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn a_store_that_cannot_be_opened_is_named_without_its_password() {
        // Nothing listens on port 1: the connection is refused at once.
        let url = "postgres://app:s3cret@127.0.0.1:1/ledger";
        let settings = ServerSettings::merge(&overrides(None, Some(url), None), Settings::default()).unwrap();
        let err = open_ledger(&settings).expect_err("nothing listens on port 1");
        let message = err.to_string();
        assert!(!message.contains("s3cret"), "{message}");
        assert!(
            message.contains("postgres://app:***@127.0.0.1:1/ledger"),
            "{message}"
        );
        // The reason, not only the driver's "error connecting to server".
        assert!(message.to_lowercase().contains("refused"), "{message}");
    }
}
