//! # inflight
//!
//! A ledger of in-flight AI provider calls that cannot drift.
//!
//! Services that call AI providers record every call: enqueued, started,
//! settled. Executing and waiting counts per `service::provider` lane derive
//! from those records. A record whose settle is lost (client abort, a
//! provider timeout that strands work, a process that died) must not stay
//! "in flight" forever, so here:
//!
//! - every in-flight record expires past a bound derived from its own
//!   deadline class ([`domain::bounds`]), never one global TTL;
//! - reaping happens on every read and on a timer ([`Ledger::spawn_reaper`]);
//! - a reaped record stays as evidence, with its disposition (`abandoned` or
//!   `unsettled`) and a count;
//! - a late settle is absorbed, never counted as a completion.
//!
//! The layout follows the architecture: [`domain`] holds the rules (pure, no
//! I/O), [`store`] persists what they decide (memory, SQLite), and
//! [`Ledger`] is the API on top. `docs/semantics.md` explains each rule.

pub mod clock;
pub mod config;
pub mod domain;
pub mod error;
#[cfg(feature = "tower")]
pub mod layer;
mod ledger;
pub mod store;

pub use clock::{Clock, FakeClock, SystemClock};
pub use config::{ConfigError, LedgerConfig, Settings};
pub use domain::{
    ActivityId, ActivityRecord, Admission, Disposition, FailureStage, Owner, OwnerId, OwnerState, Priority,
    ReapReason, ReapedCounts, Since, Snapshot, SnapshotOptions, SnapshotStatus, State,
};
pub use error::{ErrorKind, LedgerError};
pub use ledger::OwnerLease;
pub use ledger::{ActivityHandle, ActivitySpec, Ledger, LedgerBuilder, Outcome, ReaperGuard, Settlement};
pub use ledger::{Permit, MAX_START_WAIT};

/// The README's Rust examples, compiled by `cargo test --doc`.
#[doc = include_str!("../../../README.md")]
#[cfg(all(doctest, feature = "sqlite", feature = "tower"))]
pub struct ReadmeDoctests;
