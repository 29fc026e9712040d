//! The API's one error type: every failure the server answers with, as the
//! JSON body `{"error": {"code": "...", "message": "..."}}`.
//!
//! Messages are written for the caller; internal details (storage errors,
//! their sources) go to the log only, never into a response.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use inflight::error::{ErrorKind, LedgerError};

/// An error the API answers with: a status, a stable code and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

/// The message a 500 answers with; the details go to the log.
const INTERNAL_MESSAGE: &str = "internal error; the details are in the server's log";

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    /// 400 `invalid_request`: malformed JSON, a missing or invalid field.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// 401 `unauthorized`: a missing or wrong bearer token.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "this route requires the header `Authorization: Bearer <token>` with the server's token",
        )
    }

    /// 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 405 `method_not_allowed`.
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "this method is not allowed on this route; see docs/api.md",
        )
    }

    /// 409 `conflict`: the request contradicts what the record says.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 413 `payload_too_large`: a body over the limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the request body exceeds the limit of {limit} bytes"),
        )
    }

    /// 429 `lane_full`: the lane is at its cap.
    pub fn lane_full(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "lane_full", message)
    }

    /// 500 `internal`, with a generic message. Log the cause before
    /// answering with it.
    pub fn internal() -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", INTERNAL_MESSAGE)
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable error code (`invalid_request`, `not_found`, ...).
    pub fn code(&self) -> &'static str {
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
            ErrorKind::LaneFull => Self::lane_full(err.message()),
            kind => {
                let source = std::error::Error::source(&err).map(ToString::to_string);
                tracing::error!(
                    kind = kind.as_str(),
                    error = %err,
                    source = source.as_deref().unwrap_or(""),
                    "ledger operation failed"
                );
                Self::internal()
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({ "error": { "code": self.code, "message": self.message } });
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // A hint, not a promise: capacity may come back sooner.
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}
