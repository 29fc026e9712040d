//! The library's error type: a kind that says why, a message for people, and
//! the underlying cause for logs.

use std::fmt;

use crate::domain::labels::LabelError;
use crate::domain::query::LineSpot;
use crate::domain::record::LaneKey;
use crate::domain::trace::TraceParentError;
use crate::domain::transition::Refusal;

/// Why a ledger operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The input was malformed: a bad label, timestamp or setting. Nothing
    /// changed.
    InvalidInput,
    /// No record (or owner) with that identity.
    NotFound,
    /// The request contradicts what the record already says. Nothing changed.
    Conflict,
    /// A begin's idempotency key was first used with a different request.
    /// Nothing changed.
    IdempotencyConflict,
    /// The lane is at its cap; try again later.
    LaneFull,
    /// The lane is cooling down after a provider's refusal (its
    /// `Retry-After`); [`LedgerError::retry_after`] says for how long.
    LaneCooling,
    /// The lane's token budget, or its provider's, has no room for the
    /// call's estimate in the last minute's window;
    /// [`LedgerError::retry_after`] says when it rolls off enough.
    BudgetExhausted,
    /// The ledger was shut down.
    Closed,
    /// The store failed (disk, database). The details are in the source.
    Storage,
    /// The store cannot be reached now (a database server that is down or
    /// restarting): the command may be retried. Whether a command that met
    /// a connection lost at its commit landed is unknown; reading its
    /// record says.
    Unavailable,
}

impl ErrorKind {
    /// A stable snake_case name for the kind.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidInput => "invalid_input",
            Self::NotFound => "not_found",
            Self::Conflict => "conflict",
            Self::IdempotencyConflict => "idempotency_conflict",
            Self::LaneFull => "lane_full",
            Self::LaneCooling => "lane_cooling",
            Self::BudgetExhausted => "budget_exhausted",
            Self::Closed => "closed",
            Self::Storage => "storage",
            Self::Unavailable => "unavailable",
        }
    }
}

/// An error from the ledger.
///
/// One pointer wide: every result of the ledger carries it, and the
/// successful ones, the hot path, should not move a message they lack.
pub struct LedgerError(Box<Inner>);

#[derive(Debug)]
struct Inner {
    kind: ErrorKind,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    /// The lane a `LaneFull` refusal is about.
    lane: Option<LaneKey>,
    /// The refused record's place in its lane's line: its rank when the
    /// lane ranks, then its `enqueuedAt` and id.
    place: Option<LineSpot>,
    /// How long a `LaneCooling` refusal's cooldown had left.
    retry_after: Option<std::time::Duration>,
}

impl fmt::Debug for LedgerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LedgerError")
            .field("kind", &self.0.kind)
            .field("message", &self.0.message)
            .field("source", &self.0.source)
            .finish()
    }
}

impl LedgerError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self(Box::new(Inner {
            kind,
            message: message.into(),
            source: None,
            lane: None,
            place: None,
            retry_after: None,
        }))
    }

    /// A storage failure caused by `source`.
    pub fn storage(context: &str, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Box::new(Inner {
            kind: ErrorKind::Storage,
            message: format!("{context}: {source}"),
            source: Some(Box::new(source)),
            lane: None,
            place: None,
            retry_after: None,
        }))
    }

    /// An error of `kind` caused by `source`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn caused(
        kind: ErrorKind,
        context: &str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        // The whole chain: a driver's own text is often only "db error" or
        // "error connecting to server", with the reason one level down.
        let mut message = format!("{context}: {source}");
        let mut cause = std::error::Error::source(&source);
        while let Some(err) = cause {
            let text = err.to_string();
            if !message.contains(&text) {
                message.push_str(": ");
                message.push_str(&text);
            }
            cause = err.source();
        }
        Self(Box::new(Inner {
            kind,
            message,
            source: Some(Box::new(source)),
            lane: None,
            place: None,
            retry_after: None,
        }))
    }

    /// Why it failed.
    pub fn kind(&self) -> ErrorKind {
        self.0.kind
    }

    /// The message, for people.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// The lane a refusal ([`LedgerError::is_refusal`]) is about.
    pub fn lane(&self) -> Option<&LaneKey> {
        self.0.lane.as_ref()
    }

    /// A refusal of `kind` ([`ErrorKind::LaneFull`], [`ErrorKind::LaneCooling`]
    /// or [`ErrorKind::BudgetExhausted`]) on `lane` of the record at `place`
    /// in its line; `retry_after` is how long the cooldown has left, or
    /// until the token window makes room, for the two that know it.
    pub(crate) fn refused(
        kind: ErrorKind,
        lane: LaneKey,
        place: Option<LineSpot>,
        retry_after: Option<std::time::Duration>,
        message: impl Into<String>,
    ) -> Self {
        debug_assert!(matches!(
            kind,
            ErrorKind::LaneFull | ErrorKind::LaneCooling | ErrorKind::BudgetExhausted
        ));
        let mut err = Self::new(kind, message);
        err.0.lane = Some(lane);
        err.0.place = place;
        err.0.retry_after = retry_after;
        err
    }

    /// How long the cooldown behind a [`ErrorKind::LaneCooling`] refusal
    /// had left when it was decided, or how long until the window of a
    /// [`ErrorKind::BudgetExhausted`] one makes room.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.0.retry_after
    }

    /// Whether it is a refusal of a lane's admission (full, cooling or
    /// out of budget), which waiting in line may outlast.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self.0.kind,
            ErrorKind::LaneFull | ErrorKind::LaneCooling | ErrorKind::BudgetExhausted
        )
    }

    /// Where the record a refusal is about stands in its lane's line.
    pub(crate) fn line_place(&self) -> Option<LineSpot> {
        self.0.place
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }

    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))] // only a store that can close
    pub(crate) fn closed() -> Self {
        Self::new(ErrorKind::Closed, "the ledger is shut down")
    }
}

impl fmt::Display for LedgerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.message)
    }
}

impl std::error::Error for LedgerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0
            .source
            .as_deref()
            .map(|source| source as &(dyn std::error::Error + 'static))
    }
}

impl From<LabelError> for LedgerError {
    fn from(err: LabelError) -> Self {
        Self::invalid(err.to_string())
    }
}

impl From<TraceParentError> for LedgerError {
    fn from(err: TraceParentError) -> Self {
        Self::invalid(err.to_string())
    }
}

impl From<crate::domain::ParseError> for LedgerError {
    fn from(err: crate::domain::ParseError) -> Self {
        Self::new(ErrorKind::InvalidInput, err.to_string())
    }
}

impl From<Refusal> for LedgerError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Invalid(message) => Self::new(ErrorKind::InvalidInput, message),
            Refusal::Conflict(message) => Self::new(ErrorKind::Conflict, message),
        }
    }
}

/// The library's result type.
pub type Result<T, E = LedgerError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Driver(std::io::Error);

    impl fmt::Display for Driver {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("error connecting to server")
        }
    }

    impl std::error::Error for Driver {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_caused_error_says_the_reason_a_driver_keeps_one_level_down() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let err = LedgerError::caused(
            ErrorKind::Unavailable,
            "cannot connect to PostgreSQL",
            Driver(refused),
        );
        assert_eq!(
            err.message(),
            "cannot connect to PostgreSQL: error connecting to server: Connection refused"
        );
    }

    #[test]
    fn a_caused_error_does_not_repeat_a_reason_its_source_already_gave() {
        let io = std::io::Error::other("disk full");
        let err = LedgerError::caused(ErrorKind::Storage, "cannot write", io);
        assert_eq!(err.message(), "cannot write: disk full");
    }
}
