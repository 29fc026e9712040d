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
//! - a late settle is absorbed, never counted as a completion;
//! - a lane's cap is enforced from the same records ([`Ledger::admit`]);
//! - an owner lease reclaims a dead process's work in seconds
//!   ([`Ledger::join_as_owner`]).
//!
//! ## A call, from begin to settle
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), inflight::LedgerError> {
//! use std::num::NonZeroU32;
//! use std::time::Duration;
//!
//! use inflight::{ActivitySpec, FailureStage, Ledger, LedgerConfig, Outcome};
//!
//! let embed = ActivitySpec::new("knowledge-base", "ollama").class("embedding");
//! // The cap is declared on the lane the calls use: no spelling can differ.
//! let config = LedgerConfig::default().with_cap(&embed.lane()?, NonZeroU32::new(2).unwrap());
//! let ledger = Ledger::builder(config).build()?; // `memory:`; `sqlite://FILE` with `sqlite`
//! let _reaper = ledger.spawn_reaper();
//!
//! // This process as an owner: if it dies, its calls are reaped within the lease.
//! let lease = ledger.join_as_owner("kb-worker", Duration::from_secs(30)).await?;
//!
//! // Waits in line, first come first served, for one of the lane's 2 slots.
//! let permit = ledger.admit(embed.clone()).await?;
//! // ... call the provider ...
//! permit.settle(Outcome::Failure(FailureStage::Provider)).await?;
//!
//! // Dropped on any path (an error, a panic, a cancelled future): `cancelled`.
//! let call = ledger.admit(embed).await?;
//! drop(call);
//!
//! println!("{:?}", ledger.snapshot(Default::default()).await?.status);
//! lease.release().await?;
//! ledger.close().await?;
//! # Ok(())
//! # }
//! ```
//!
//! With the feature `tower`, [`layer::LedgerLayer`] puts the same lifecycle
//! in front of any `tower` service in one line.
//!
//! ## Features
//!
//! - `sqlite` (default): the embedded store on one SQLite file
//!   ([`store::SqliteStore`], bundled SQLite), safe to share between
//!   processes on one host.
//! - `tower`: [`layer::LedgerLayer`].
//!
//! With no features the library holds the memory store only, and pulls in
//! none of the server's dependencies.
//!
//! ## Time
//!
//! Every instant is a [`Timestamp`]: epoch milliseconds inside, RFC 3339
//! when written, convertible to and from
//! [`SystemTime`](std::time::SystemTime). It is the same type as
//! `inflight_api::Timestamp`, so a record read from the library and one read
//! over HTTP carry the same instants. Durations are
//! [`Duration`](std::time::Duration)s in the API, and whole milliseconds in
//! the records' `*_ms` fields, as on the wire. Time comes from a [`Clock`]:
//! tests advance a [`FakeClock`] rather than sleep.
//!
//! ## Runtime
//!
//! The ledger runs on Tokio and needs a runtime with its timers enabled
//! (`rt` or `rt-multi-thread`, and `time`): waiting in line, owner leases
//! and the background reaper use them. The SQLite store runs its writer on
//! its own thread.
//!
//! ## Layout
//!
//! [`domain`] holds the rules (pure, no I/O), [`store`] persists what they
//! decide, and [`Ledger`] is the API on top. `docs/semantics.md` explains
//! each rule and where it lives; `docs/architecture.md` the layering.

#![deny(missing_docs)]

pub mod clock;
pub mod config;
pub mod domain;
pub mod error;
mod ids;
#[cfg(feature = "tower")]
pub mod layer;
mod ledger;
pub mod stats;
pub mod store;
mod store_url;
pub mod wire;

pub use clock::{Clock, FakeClock, SystemClock};
pub use config::{ConfigError, LedgerConfig, Settings};
pub use domain::{
    ActivityId, ActivityRecord, Admission, Disposition, FailureStage, Owner, OwnerId, OwnerState, Priority,
    ReapReason, ReapedCounts, Since, Snapshot, SnapshotOptions, SnapshotStatus, State, Timestamp, Usage,
};
pub use error::{ErrorKind, LedgerError};
pub use ledger::OwnerLease;
pub use ledger::{ActivityHandle, ActivitySpec, Ledger, LedgerBuilder, Outcome, ReaperGuard, Settlement};
pub use ledger::{Begun, Permit, MAX_START_WAIT};

/// The README's Rust examples, compiled by `cargo test --doc`.
#[doc = include_str!("../../../README.md")]
#[cfg(all(doctest, feature = "sqlite", feature = "tower"))]
pub struct ReadmeDoctests;
