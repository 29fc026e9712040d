//! What the two SQL stores share, so that a column, a statement or a
//! question is written once: the column lists ([`columns`]), the statements
//! both dialects run ([`statements`]), the row codec ([`codec`]), the
//! counter changes a group adds up ([`counts`]), the group-commit run
//! ([`group`]) and its slow work ([`slow_log`]), and the questions of
//! [`crate::domain::query`] answered over a [`questions::Driver`]
//! ([`questions`]).
//!
//! What truly differs stays with each store: SQLite's journal, aggregate
//! ids and lone-caller path; PostgreSQL's lane locks, pipelined group
//! writes, sharded counters and notifications.

pub(crate) mod codec;
pub(crate) mod columns;
pub(crate) mod counts;
pub(crate) mod group;
pub(crate) mod questions;
pub(crate) mod slow_log;
pub(crate) mod statements;

/// How a statement may read the tables, for the plan checks of both
/// stores.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Reads or writes through indexes only: never a scan of `activities`
    /// or `owners` beyond a partial index of what is in flight or live.
    Indexed,
    /// Meant to walk history (statistics, migrations, the bulk loader).
    WalksHistory,
    /// Not a query of the ledger's tables (transactions, savepoints,
    /// session settings).
    Control,
}
