//! Every error the server answers with has one shape:
//! `{"error": {"code": "invalid_request", "message": "..."}}`.

use serde::{Deserialize, Serialize};

/// The body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

impl ErrorBody {
    /// The body for `code` with `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            error: ErrorDetail {
                code,
                message: message.into(),
            },
        }
    }
}

/// The error inside an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// The stable code, for programs.
    pub code: ErrorCode,
    /// What happened, for people; never internal details.
    pub message: String,
}

/// The stable error codes, each with its HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: malformed JSON, a missing or invalid field, parameter or id.
    InvalidRequest,
    /// 401: a token is configured and the request lacks it.
    Unauthorized,
    /// 404: no such activity, owner or route.
    NotFound,
    /// 405: the route exists but not with that method.
    MethodNotAllowed,
    /// 409: the request contradicts the record or the owner.
    Conflict,
    /// 413: a body over 64 KiB.
    PayloadTooLarge,
    /// 429: the lane is at its cap for this record.
    LaneFull,
    /// 500: the store failed; the details are in the server's log.
    Internal,
}

impl ErrorCode {
    /// Every code, in the order of the documentation.
    pub const ALL: &'static [Self] = &[
        Self::InvalidRequest,
        Self::Unauthorized,
        Self::NotFound,
        Self::MethodNotAllowed,
        Self::Conflict,
        Self::PayloadTooLarge,
        Self::LaneFull,
        Self::Internal,
    ];

    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::Unauthorized => "unauthorized",
            Self::NotFound => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::Conflict => "conflict",
            Self::PayloadTooLarge => "payload_too_large",
            Self::LaneFull => "lane_full",
            Self::Internal => "internal",
        }
    }

    /// The HTTP status it is answered with.
    pub fn http_status(self) -> u16 {
        match self {
            Self::InvalidRequest => 400,
            Self::Unauthorized => 401,
            Self::NotFound => 404,
            Self::MethodNotAllowed => 405,
            Self::Conflict => 409,
            Self::PayloadTooLarge => 413,
            Self::LaneFull => 429,
            Self::Internal => 500,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
