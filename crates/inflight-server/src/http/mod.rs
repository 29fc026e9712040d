//! The HTTP API: `inflight serve`'s routes over a [`Ledger`].
//!
//! [`app`] builds the router; `docs/api.md` documents every route, field and
//! error code, and `GET /openapi.json` ([`openapi::document`]) describes the
//! same routes as OpenAPI 3.1. Every failure is the JSON shape of [`ApiError`], never a
//! framework's plain-text rejection, and no input answers a 5xx.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use inflight::Ledger;
use tokio::sync::Semaphore;

use crate::limits::Limits;
use crate::otel::OtelStats;
use crate::proxy::{self, Routes};
use auth::{log_refusal, Grant, Identity};

pub mod auth;
pub mod body;
mod dashboard;
pub mod error;
mod handlers;
pub mod metrics;
pub mod openapi;
mod timing;

pub use auth::Tokens;
pub use body::MAX_BODY_BYTES;
pub use error::ApiError;
pub use metrics::MetricsOptions;

/// What every request handler shares: the ledger, the bearer tokens, the
/// server's limits, and what `/metrics` exposes.
#[derive(Clone)]
pub struct AppState {
    ledger: Ledger,
    /// `None`: no token is required.
    tokens: Option<Arc<Tokens>>,
    limits: Limits,
    /// One permit per request being handled ([`Limits::max_requests`]).
    requests: Arc<Semaphore>,
    metrics: MetricsOptions,
    /// The server's own time per request, for `/metrics`.
    times: Arc<timing::RequestTimes>,
    /// The `/proxy/NAME` routes.
    proxies: Arc<Routes>,
    /// What `[otel]` export did, when it is on.
    otel: Option<Arc<OtelStats>>,
}

impl AppState {
    /// Serves `ledger` with no token required, within the default limits.
    pub fn new(ledger: Ledger) -> Self {
        let limits = Limits::default();
        Self {
            ledger,
            tokens: None,
            limits,
            requests: Arc::new(Semaphore::new(limits.max_requests())),
            metrics: MetricsOptions::default(),
            times: Arc::default(),
            proxies: Arc::default(),
            otel: None,
        }
    }

    /// Shows what `[otel]` export does (`stats`) on `/metrics`.
    pub fn with_otel(mut self, stats: Arc<OtelStats>) -> Self {
        self.otel = Some(stats);
        self
    }

    /// Serves `routes` under `/proxy/NAME/`.
    pub fn with_proxies(mut self, routes: impl Into<Arc<Routes>>) -> Self {
        self.proxies = routes.into();
        self
    }

    /// The `/proxy/NAME` routes.
    pub fn proxies(&self) -> &Routes {
        &self.proxies
    }

    /// What `/metrics` exposes beyond the standard series.
    pub fn with_metrics(mut self, metrics: MetricsOptions) -> Self {
        self.metrics = metrics;
        self
    }

    /// Serves within `limits`.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.requests = Arc::new(Semaphore::new(limits.max_requests()));
        self.limits = limits;
        self
    }

    /// Requires `Authorization: Bearer <token>` on every `/v1` route and on
    /// `/metrics` (`None` requires nothing): one write token for every
    /// service.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.tokens = token.map(|token| {
            let specs = vec![auth::TokenSpec::write_all(token)];
            Arc::new(Tokens::load(specs).expect("an inline token reads no file"))
        });
        self
    }

    /// Requires one of `tokens` on every `/v1` route and on `/metrics`,
    /// each within its scope; no tokens at all requires nothing.
    pub fn with_tokens(mut self, tokens: impl Into<Arc<Tokens>>) -> Self {
        let tokens = tokens.into();
        self.tokens = (!tokens.specs().is_empty()).then_some(tokens);
        self
    }

    /// The tokens in force, to [`Tokens::reload`] their files.
    pub fn tokens(&self) -> Option<&Arc<Tokens>> {
        self.tokens.as_ref()
    }

    /// The ledger it serves.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Whether a token is required.
    pub fn has_token(&self) -> bool {
        self.tokens.is_some()
    }

    /// The limits it serves within.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// What `/metrics` exposes beyond the standard series.
    pub fn metrics(&self) -> MetricsOptions {
        self.metrics
    }
}

/// What the proxy's handler reads of the state.
impl axum::extract::FromRef<AppState> for proxy::ProxyState {
    fn from_ref(state: &AppState) -> Self {
        proxy::ProxyState {
            ledger: state.ledger.clone(),
            routes: Arc::clone(&state.proxies),
            body_timeout: state.limits.body_timeout(),
            has_tokens: state.tokens.is_some(),
        }
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("ledger", &self.ledger)
            .field("tokens", &self.tokens)
            .field("limits", &self.limits)
            .field("metrics", &self.metrics)
            .field("proxies", &self.proxies)
            .finish()
    }
}

/// Every route of the API, each with its OpenAPI operation: the router and
/// `/openapi.json` are both made from this one list, so neither has a route
/// the other lacks. Add a route here, with `#[utoipa::path]` on its handler.
fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(handlers::healthz))
        .routes(routes!(dashboard::page))
        .routes(routes!(dashboard::script))
        .routes(routes!(dashboard::style))
        .routes(routes!(openapi::openapi_json))
        .routes(routes!(handlers::begin))
        .routes(routes!(handlers::get))
        .routes(routes!(handlers::start))
        .routes(routes!(handlers::settle))
        .routes(routes!(handlers::cancel))
        .routes(routes!(handlers::refine))
        .routes(routes!(handlers::snapshot))
        .routes(routes!(handlers::reap))
        .routes(routes!(handlers::metrics))
        .routes(routes!(handlers::register_owner))
        .routes(routes!(handlers::renew_owner))
        .routes(routes!(handlers::release_owner))
}

/// The API's router over `state`.
pub fn app(state: AppState) -> Router {
    let (routes, _) = api_routes().split_for_parts();
    routes
        // The proxy's routes pass the upstream's API through; they are not
        // this API's, so not in its OpenAPI document (docs/api.md, "Proxy").
        .route(proxy::PATH, axum::routing::any(proxy::forward))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        // One layer for both guards: each `from_fn` layer boxes and clones
        // the rest of the stack for every request.
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(format!("no route {}; see docs/api.md", uri.path()))
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

/// Whether requests to `path` count against [`Limits::max_requests`] (and
/// so may be answered 503): all but `/healthz`.
fn is_limited(path: &str) -> bool {
    path != "/healthz"
}

/// Whether `path` is `prefix` or under it.
fn under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Whether `path` is behind the token.
fn needs_token(path: &str) -> bool {
    under(path, "/v1") || under(path, "/metrics") || is_proxied(path)
}

/// Whether `path` is the proxy's, whose token comes in `X-Inflight-Token`:
/// `Authorization` belongs to the upstream.
fn is_proxied(path: &str) -> bool {
    under(path, "/proxy")
}

/// Holds one of [`Limits::max_requests`] permits while a request is
/// handled, and answers 503 when none is left; `/healthz` is exempt, so that
/// a liveness probe does not restart a server that is only busy. Tells the
/// body extractors how long a body may take to arrive. Then, when a token
/// is set, answers 401 to a request for a route behind it that carries no
/// known token, and 403 to one whose token's scope does not cover its
/// method; a granted request carries its [`Grant`] to the handlers (after
/// the limit, as when they were two layers).
///
/// Around all of that, it times the request ([`timing`]).
async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let began = timing::Began::now(state.ledger());
    let method = timing::method_label(request.method());
    let wait = timing::asked_to_wait(request.uri().query());
    // The route as the router matched it (`{id}`, not the id); a request
    // no route matched shares one series.
    let matched = request.extensions().get::<MatchedPath>().cloned();
    let response = guarded(&state, request, next).await;
    let took = began.elapsed();
    let route = matched.as_ref().map_or("unmatched", MatchedPath::as_str);
    let status = response.status().as_u16();
    // A proxied call's time is mostly its upstream's, not this server's.
    if route != proxy::PATH {
        timing::log_if_slow(
            state.ledger(),
            (method, route),
            status,
            began,
            took,
            wait.unwrap_or_default(),
        );
    }
    state.times.observe(method, route, wait.is_some(), took);
    response
}

async fn guarded(state: &AppState, mut request: Request, next: Next) -> Response {
    let path = request.uri().path();
    if !is_limited(path) {
        return next.run(request).await;
    }
    let Ok(_permit) = state.requests.try_acquire() else {
        return ApiError::unavailable(format!(
            "the server is handling its limit of {} requests at once; retry shortly",
            state.limits.max_requests()
        ))
        .into_response();
    };
    if let Some(tokens) = &state.tokens {
        if needs_token(path) {
            let proxied = is_proxied(path);
            let identity = if proxied {
                tokens.identify_by(request.headers(), proxy::TOKEN_HEADER)
            } else {
                tokens.identify(request.headers())
            };
            match identity {
                Identity::Known(grant) => {
                    if let Some(why) = grant.refuses_method(request.method()) {
                        log_refusal(&grant, &format!("{} {path}", request.method()), &why);
                        return ApiError::forbidden(why).into_response();
                    }
                    request.extensions_mut().insert(grant);
                }
                identity => {
                    tracing::info!(method = %request.method(), path,
                        token = if identity == Identity::Missing { "none" } else { "unknown" },
                        "refused a request without a known token");
                    let missing = identity == Identity::Missing;
                    let refusal = if proxied {
                        ApiError::unauthorized_proxy(missing)
                    } else {
                        ApiError::unauthorized(missing)
                    };
                    let mut response = refusal.into_response();
                    response.headers_mut().insert(
                        header::WWW_AUTHENTICATE,
                        header::HeaderValue::from_static("Bearer"),
                    );
                    return response;
                }
            }
        }
    }
    request
        .extensions_mut()
        .insert(body::BodyTimeout(state.limits.body_timeout()));
    next.run(request).await
}

/// The handlers' view of the request's [`Grant`]: everything on a server
/// without tokens. On one with tokens the guard always attaches it; were it
/// missing, the request is refused rather than granted (fail closed).
impl axum::extract::FromRequestParts<AppState> for Grant {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        if state.tokens.is_none() {
            return Ok(Grant::everything());
        }
        parts
            .extensions
            .get::<Grant>()
            .cloned()
            .ok_or_else(|| ApiError::forbidden("this route is not open to this request's token"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_guards_v1_and_metrics_only() {
        for path in [
            "/v1",
            "/v1/",
            "/v1/snapshot",
            "/metrics",
            "/metrics/x",
            "/proxy/o/api/chat",
        ] {
            assert!(needs_token(path), "{path}");
        }
        for path in ["/healthz", "/", "/v10", "/metricsx", "/x/v1", "/proxyx"] {
            assert!(!needs_token(path), "{path}");
        }
    }
}
