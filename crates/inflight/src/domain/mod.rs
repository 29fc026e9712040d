//! The domain: records, states, bounds and reaping rules.
//!
//! Pure and synchronous: no I/O and no clock of its own. Every rule of
//! `docs/semantics.md` lives here, in exactly one place; stores persist what
//! these functions decide.

pub mod admission;
pub mod bounds;
pub mod budget;
pub mod capacity;
pub mod cardinality;
pub mod counters;
pub mod effect;
pub mod idempotency;
pub mod labels;
pub mod owner;
pub mod query;
pub mod record;
pub mod refusal;
pub mod snapshot;
pub mod timestamp;
pub mod trace;
pub mod transition;
pub mod usage;
pub mod warnings;
pub mod window;

pub use bounds::{ClassBounds, ReapPolicy};
pub use cardinality::{Cardinality, Overflow, Vocabularies};
pub use counters::{AggregateKey, ReapedCounts, Totals};
pub use inflight_api::ParseError;
pub use labels::Label;
pub use owner::{Owner, OwnerId, OwnerState};
pub use record::{
    ActivityId, ActivityRecord, Admission, Disposition, FailureStage, LaneKey, Priority, ReapReason, State,
};
pub use snapshot::{Since, Snapshot, SnapshotOptions, Status as SnapshotStatus};
pub use timestamp::Timestamp;
pub use trace::TraceParent;
pub use usage::Usage;
