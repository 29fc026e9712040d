//! # inflight-api
//!
//! The wire format of the inflight HTTP API, defined once: every request
//! body and query string a client sends, and every answer the server gives
//! (the record, the snapshot, owners, reap counts, errors). The server reads
//! and writes these types; the `inflight` CLI reads them back; a client in
//! Rust can use them without the ledger. `docs/api.md` documents every route
//! with the same names.
//!
//! All types are `Serialize + Deserialize` with the JSON field names of the
//! API (camelCase). Serializing a value and deserializing the text gives the
//! same value back.
//!
//! - Requests ([`request`]): [`BeginRequest`], [`StartRequest`],
//!   [`SettleRequest`], [`CancelRequest`], [`RegisterOwnerRequest`], and the
//!   query strings [`StartQuery`] and [`SnapshotQuery`]. Unknown fields are
//!   ignored, and a field set to `null` is the same as a missing one.
//! - Answers ([`response`]): [`ActivityRecord`], [`Snapshot`] (with its
//!   [`Lane`]s, [`InFlightRecord`]s, [`ReapedRecord`]s and [`Aggregate`]s),
//!   [`Owner`], [`ReapCounts`] and [`Health`].
//! - Errors ([`error`]): [`ErrorBody`], `{"error": {"code", "message"}}`,
//!   with its stable [`ErrorCode`].
//! - The values fields take ([`values`]): the string enums ([`State`],
//!   [`Priority`], ...) and [`Timestamp`].
//!
//! What the types do not check is the ledger's to decide: labels, the
//! 5-minute skew, a `startedAt` before `enqueuedAt`, the range of `limit` or
//! `ttlMs`. The server answers those as `invalid_request` too.
//!
//! A field added later is added with a default, so that a client reads an
//! older server's answers and a server reads an older client's requests.

#![deny(missing_docs)]

pub mod error;
pub mod request;
pub mod response;
pub mod values;

pub use error::{ErrorBody, ErrorCode, ErrorDetail};
pub use request::{
    BeginRequest, CancelRequest, RegisterOwnerRequest, SettleRequest, SnapshotQuery, StartQuery, StartRequest,
};
pub use response::{
    ActivityRecord, Aggregate, Health, InFlightRecord, Lane, Owner, ReapCounts, ReapedRecord, Snapshot,
};
pub use values::{
    Admission, Disposition, FailureStage, HealthStatus, OwnerState, Priority, ReapReason, SnapshotStatus,
    State, Timestamp,
};
