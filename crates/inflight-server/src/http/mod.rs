//! The HTTP API: `inflight serve`'s routes over a [`Ledger`].
//!
//! [`app`] builds the router; `docs/api.md` documents every route, field and
//! error code. Every failure is the JSON shape of [`ApiError`], never a
//! framework's plain-text rejection, and no input answers a 5xx.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use subtle::ConstantTimeEq;

use inflight::Ledger;

pub mod body;
mod dashboard;
pub mod error;
mod handlers;
pub mod metrics;

pub use body::MAX_BODY_BYTES;
pub use error::ApiError;

/// What every request handler shares: the ledger and the bearer token.
#[derive(Clone)]
pub struct AppState {
    ledger: Ledger,
    token: Option<Arc<str>>,
}

impl AppState {
    /// Serves `ledger` with no token required.
    pub fn new(ledger: Ledger) -> Self {
        Self { ledger, token: None }
    }

    /// Requires `Authorization: Bearer <token>` on every `/v1` route and on
    /// `/metrics` (`None` requires nothing).
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token.map(Arc::from);
        self
    }

    /// The ledger it serves.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("ledger", &self.ledger)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// The API's router over `state`.
pub fn app(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/activities", post(handlers::begin))
        .route("/v1/activities/{id}", get(handlers::get))
        .route("/v1/activities/{id}/start", post(handlers::start))
        .route("/v1/activities/{id}/settle", post(handlers::settle))
        .route("/v1/activities/{id}/cancel", post(handlers::cancel))
        .route("/v1/snapshot", get(handlers::snapshot))
        .route("/v1/reap", post(handlers::reap))
        .route("/metrics", get(handlers::metrics))
        .route("/v1/owners", post(handlers::register_owner))
        .route("/v1/owners/{id}/renew", post(handlers::renew_owner))
        .route("/v1/owners/{id}", delete(handlers::release_owner));
    Router::new()
        .route("/healthz", get(handlers::healthz))
        .merge(dashboard::routes())
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(state.clone(), require_token))
        .with_state(state)
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(format!("no route {}; see docs/api.md", uri.path()))
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

/// Whether `path` is behind the token.
fn needs_token(path: &str) -> bool {
    let under = |prefix: &str| {
        path.strip_prefix(prefix)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    };
    under("/v1") || under("/metrics")
}

/// Whether `headers` carry `Authorization: Bearer <token>`, compared in
/// constant time.
fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    let Some(value) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some((scheme, presented)) = value.trim().split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && bool::from(presented.trim().as_bytes().ct_eq(token.as_bytes()))
}

async fn require_token(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(token) = &state.token {
        if needs_token(request.uri().path()) && !bearer_matches(request.headers(), token) {
            let mut response = ApiError::unauthorized().into_response();
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return response;
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_guards_v1_and_metrics_only() {
        for path in ["/v1", "/v1/", "/v1/snapshot", "/metrics", "/metrics/x"] {
            assert!(needs_token(path), "{path}");
        }
        for path in ["/healthz", "/", "/v10", "/metricsx", "/x/v1"] {
            assert!(!needs_token(path), "{path}");
        }
    }

    #[test]
    fn bearer_tokens_must_match_exactly() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().unwrap());
            headers
        };
        assert!(bearer_matches(&with("Bearer s3cret"), "s3cret"));
        assert!(bearer_matches(&with("bearer s3cret"), "s3cret"));
        assert!(!bearer_matches(&with("Bearer s3cre"), "s3cret"));
        assert!(!bearer_matches(&with("Bearer s3cretx"), "s3cret"));
        assert!(!bearer_matches(&with("Basic s3cret"), "s3cret"));
        assert!(!bearer_matches(&with("s3cret"), "s3cret"));
        assert!(!bearer_matches(&HeaderMap::new(), "s3cret"));
    }
}
