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
//!   query strings [`BeginQuery`], [`StartQuery`] and [`SnapshotQuery`]. Unknown fields are
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
//!
//! With the `openapi` feature (off by default, so that a client pulls in
//! serde and chrono only), every type also has its OpenAPI schema
//! (`utoipa::ToSchema`, and `utoipa::IntoParams` for the query strings): the
//! server's `GET /openapi.json` is generated from them.

#![deny(missing_docs)]

/// A string enum of the wire: each variant's JSON name in one place.
///
/// It is read from a string only, so that a value of another JSON type is
/// refused as a wrong type for the field (a derived enum would let JSON
/// read `true` as a syntax error), and an unknown name lists the known ones.
macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $wire:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every variant, in the order of the documentation.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// Every name on the wire, in the same order.
            pub const NAMES: &'static [&'static str] = &[$($wire),+];

            /// Its name on the wire.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $wire),+ }
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::ParseError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($wire => Ok(Self::$variant),)+
                    other => Err($crate::ParseError::new(
                        other,
                        format!("one of {}", Self::NAMES.join(", ")),
                    )),
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Names;

                impl ::serde::de::Visitor<'_> for Names {
                    type Value = $name;

                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        write!(f, "one of `{}`", $name::NAMES.join("`, `"))
                    }

                    fn visit_str<E: ::serde::de::Error>(self, name: &str) -> Result<$name, E> {
                        match name {
                            $($wire => Ok($name::$variant),)+
                            other => Err(E::unknown_variant(other, $name::NAMES)),
                        }
                    }
                }

                deserializer.deserialize_str(Names)
            }
        }

        // A string with the wire's names as its `enum`, documented as the
        // type's name in the OpenAPI document.
        #[cfg(feature = "openapi")]
        impl ::utoipa::PartialSchema for $name {
            fn schema() -> ::utoipa::openapi::RefOr<::utoipa::openapi::schema::Schema> {
                ::utoipa::openapi::ObjectBuilder::new()
                    .schema_type(::utoipa::openapi::schema::Type::String)
                    .enum_values(Some(Self::NAMES.iter().copied()))
                    .into()
            }
        }

        #[cfg(feature = "openapi")]
        impl ::utoipa::ToSchema for $name {}
    };
}

pub mod error;
mod parse;
pub mod request;
pub mod response;
pub mod table;
pub mod values;

pub use error::{ErrorBody, ErrorCode, ErrorDetail};
pub use parse::ParseError;
pub use request::{
    BeginQuery, BeginRequest, CancelRequest, RefineRequest, RegisterOwnerRequest, SettleRequest,
    SnapshotQuery, StartQuery, StartRequest, Usage,
};
pub use response::{
    ActivityRecord, Aggregate, ByPriority, Health, InFlightRecord, Lane, Owner, PriorityCounts, ReapCounts,
    ReapedRecord, Snapshot, SnapshotWarning, MAX_IGNORED_FIELDS, MAX_IGNORED_FIELD_CHARS,
};
pub use table::{human_duration, render_snapshot, short_ids, SHORT_ID_MIN_LEN};
pub use values::{
    Admission, Disposition, FailureStage, HealthStatus, OwnerState, Priority, ReapReason, SnapshotStatus,
    State, Timestamp,
};
