//! [`Refusal`]: why the domain refused a request. A leaf, so that every rule
//! that refuses (transitions, owners, cardinality) names it without
//! depending on another rule's module.

/// Why a request was refused. A refused request changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The request itself is malformed (a bad timestamp, say).
    Invalid(String),
    /// The request contradicts what the record already says.
    Conflict(String),
}
