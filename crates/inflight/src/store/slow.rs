//! What a store says of its slow work, so that a slow request can say what
//! it waited on: each piece past [`SLOW_WORK`] ([`SlowWork`]: a group of
//! commands, a checkpoint), and every group counted with its time
//! ([`GroupsRun`]). The SQL stores keep them (`sql::slow_log`); the memory
//! store runs on the caller's task and has none.

use std::fmt;
use std::time::{Duration, Instant};

/// Work of the store that took at least this long is kept.
pub const SLOW_WORK: Duration = Duration::from_millis(100);

/// A piece of the store's work that took at least [`SLOW_WORK`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlowWork {
    /// When it began.
    pub began: Instant,
    /// How long it took.
    pub took: Duration,
    /// What it was, in words: `a group of 3 commands (2 begin, 1 prune)`,
    /// `a checkpoint`.
    pub what: String,
}

impl SlowWork {
    /// Whether it ran at some time between `from` and `to`.
    #[must_use]
    pub fn overlaps(&self, from: Instant, to: Instant) -> bool {
        self.began <= to && self.began + self.took >= from
    }
}

impl fmt::Display for SlowWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} took {} ms", self.what, self.took.as_millis())
    }
}

/// The groups a store ran since it opened, and their time in all: read
/// before and after a request, the difference says how busy the store was
/// meanwhile. On PostgreSQL, several writers' groups overlap, so their time
/// may add up to more than the time that passed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupsRun {
    /// How many groups of commands committed or failed.
    pub groups: u64,
    /// Their time, added up.
    pub time: Duration,
}

impl GroupsRun {
    /// What ran between `earlier` and this.
    #[must_use]
    pub fn since(self, earlier: Self) -> Self {
        Self {
            groups: self.groups.saturating_sub(earlier.groups),
            time: self.time.saturating_sub(earlier.time),
        }
    }
}
