//! Every error the server answers with has one shape:
//! `{"error": {"code": "invalid_request", "message": "..."}}`.

use serde::{Deserialize, Serialize};

/// The body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// The stable code, for programs.
    pub code: ErrorCode,
    /// What happened, for people; never internal details.
    pub message: String,
}

wire_enum! {
    /// The stable error codes, each with its HTTP status
    /// ([`ErrorCode::http_status`]).
    ErrorCode {
        /// 400: malformed JSON, a missing or invalid field, parameter or id.
        InvalidRequest => "invalid_request",
        /// 401: a token is configured and the request lacks it.
        Unauthorized => "unauthorized",
        /// 403: the token is known but its scope does not cover the
        /// request (a read token on a write, or a write token bound to
        /// other services); the message names what it lacks.
        Forbidden => "forbidden",
        /// 404: no such activity, owner or route.
        NotFound => "not_found",
        /// 405: the route exists but not with that method.
        MethodNotAllowed => "method_not_allowed",
        /// 408: the request's body did not arrive within the server's body
        /// timeout.
        RequestTimeout => "request_timeout",
        /// 409: the request contradicts the record or the owner.
        Conflict => "conflict",
        /// 409: an `Idempotency-Key` first used with a different request.
        IdempotencyConflict => "idempotency_conflict",
        /// 413: a body over 64 KiB.
        PayloadTooLarge => "payload_too_large",
        /// 429: the lane is at its cap for this record.
        LaneFull => "lane_full",
        /// 429: the lane is cooling down after a provider's `Retry-After`;
        /// retry after the `Retry-After` seconds.
        LaneCooling => "lane_cooling",
        /// 429: the lane's token budget, or its provider's, has no room
        /// for the call's estimate in the last minute; retry after the
        /// `Retry-After` seconds, when enough of the window rolls off.
        BudgetExhausted => "budget_exhausted",
        /// 500: the store failed; the details are in the server's log.
        Internal => "internal",
        /// 503: the server is at a limit (connections, requests in
        /// flight) or its store cannot be reached; retry after the
        /// `Retry-After` seconds.
        Unavailable => "unavailable",
        /// 502: a proxy route's upstream cannot be reached (refused,
        /// reset, TLS); the call is recorded failed.
        UpstreamUnreachable => "upstream_unreachable",
        /// 504: a proxy route's upstream did not answer within the call's
        /// class deadline; the call is recorded failed.
        UpstreamTimeout => "upstream_timeout",
    }
}

impl ErrorCode {
    /// The HTTP status it is answered with.
    pub fn http_status(self) -> u16 {
        match self {
            Self::InvalidRequest => 400,
            Self::Unauthorized => 401,
            Self::Forbidden => 403,
            Self::NotFound => 404,
            Self::MethodNotAllowed => 405,
            Self::RequestTimeout => 408,
            Self::Conflict | Self::IdempotencyConflict => 409,
            Self::PayloadTooLarge => 413,
            Self::LaneFull | Self::LaneCooling | Self::BudgetExhausted => 429,
            Self::Internal => 500,
            Self::UpstreamUnreachable => 502,
            Self::Unavailable => 503,
            Self::UpstreamTimeout => 504,
        }
    }
}
