//! The API's one error type: every failure the server answers with, as the
//! JSON body `{"error": {"code": "...", "message": "..."}}`.
//!
//! Messages are written for the caller; internal details (storage errors,
//! their sources) go to the log only, never into a response.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use inflight::error::{ErrorKind, LedgerError};
use inflight_api::{ErrorBody, ErrorCode};

/// An error the API answers with: a stable code (which says the status) and
/// a message; its body is an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    code: ErrorCode,
    message: String,
    /// `Retry-After`, in whole seconds, when the error knows it.
    retry_after_secs: Option<u64>,
}

/// The message a 500 answers with; the details go to the log.
const INTERNAL_MESSAGE: &str = "internal error; the details are in the server's log";

impl ApiError {
    fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    /// 400 `invalid_request`: malformed JSON, a missing or invalid field.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    /// 401 `unauthorized`: a missing (`missing`) or unknown bearer token;
    /// the two are told apart, so that a caller knows whether to add a
    /// token or fix the one it sends.
    pub fn unauthorized(missing: bool) -> Self {
        let message = if missing {
            "this route requires a token: send the header `Authorization: Bearer <token>`"
        } else {
            "the bearer token sent is not one of the server's tokens"
        };
        Self::new(ErrorCode::Unauthorized, message)
    }

    /// 401 `unauthorized` on a proxy route, whose token travels in
    /// `X-Inflight-Token` (`Authorization` is the upstream's).
    pub fn unauthorized_proxy(missing: bool) -> Self {
        let message = if missing {
            "this proxy route requires a token: send the header `X-Inflight-Token: <token>` \
             (`Authorization` is forwarded to the upstream)"
        } else {
            "the X-Inflight-Token sent is not one of the server's tokens"
        };
        Self::new(ErrorCode::Unauthorized, message)
    }

    /// 403 `forbidden`: a known token whose scope does not cover the
    /// request; the message names what it lacks.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Forbidden, message)
    }

    /// 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// 405 `method_not_allowed`.
    pub fn method_not_allowed() -> Self {
        Self::new(
            ErrorCode::MethodNotAllowed,
            "this method is not allowed on this route; see docs/api.md",
        )
    }

    /// 409 `conflict`: the request contradicts what the record says.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message)
    }

    /// 413 `payload_too_large`: a body over the limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            ErrorCode::PayloadTooLarge,
            format!("the request body exceeds the limit of {limit} bytes"),
        )
    }

    /// 429 `lane_full`: the lane is at its cap.
    pub fn lane_full(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::LaneFull, message)
    }

    /// 408 `request_timeout`: the body did not arrive in time.
    pub fn request_timeout(timeout: std::time::Duration) -> Self {
        Self::new(
            ErrorCode::RequestTimeout,
            format!(
                "the request body did not arrive within {}",
                humantime::format_duration(timeout)
            ),
        )
    }

    /// 503 `unavailable`: the server is at a limit, or its store cannot be
    /// reached; answered with `Retry-After`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Unavailable, message)
    }

    /// 502 `upstream_unreachable`: a proxy route's upstream cannot be
    /// reached.
    pub fn upstream_unreachable(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::UpstreamUnreachable, message)
    }

    /// 504 `upstream_timeout`: a proxy route's upstream did not answer in
    /// time.
    pub fn upstream_timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::UpstreamTimeout, message)
    }

    /// 500 `internal`, with a generic message. Log the cause before
    /// answering with it.
    pub fn internal() -> Self {
        Self::new(ErrorCode::Internal, INTERNAL_MESSAGE)
    }

    /// The HTTP status, as its code says.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The stable error code's name (`invalid_request`, `not_found`, ...).
    pub fn code(&self) -> &'static str {
        self.code.as_str()
    }

    /// The stable error code.
    pub fn error_code(&self) -> ErrorCode {
        self.code
    }

    /// The message for the caller.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<LedgerError> for ApiError {
    fn from(err: LedgerError) -> Self {
        match err.kind() {
            ErrorKind::InvalidInput => Self::invalid(err.message()),
            ErrorKind::NotFound => Self::not_found(err.message()),
            ErrorKind::Conflict => Self::conflict(err.message()),
            // 409 `idempotency_conflict`: a key first sent with another request.
            ErrorKind::IdempotencyConflict => Self::new(ErrorCode::IdempotencyConflict, err.message()),
            ErrorKind::LaneFull => Self::lane_full(err.message()),
            kind @ (ErrorKind::LaneCooling | ErrorKind::BudgetExhausted) => {
                // The seconds left, rounded up: asked again then, the lane
                // grants (its cooldown over, or its window rolled off).
                let left = err.retry_after().unwrap_or_default();
                let secs = left.as_millis().div_ceil(1000).max(1);
                let code = if kind == ErrorKind::LaneCooling {
                    ErrorCode::LaneCooling
                } else {
                    ErrorCode::BudgetExhausted
                };
                Self {
                    retry_after_secs: Some(u64::try_from(secs).unwrap_or(u64::MAX)),
                    ..Self::new(code, err.message())
                }
            }
            ErrorKind::Unavailable => {
                tracing::warn!(error = %err, "the store is unavailable");
                Self::unavailable("the store cannot be reached now; retry later")
            }
            kind => {
                // The message carries its causes (`LedgerError::caused`).
                tracing::error!(kind = kind.as_str(), error = %err, "ledger operation failed");
                Self::internal()
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, Json(ErrorBody::new(self.code, self.message))).into_response();
        if let Some(secs) = self.retry_after_secs {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(secs),
            );
        } else if matches!(self.code, ErrorCode::LaneFull | ErrorCode::Unavailable) {
            // A hint, not a promise: capacity may come back sooner.
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}
