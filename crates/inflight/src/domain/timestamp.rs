//! Instants: [`Timestamp`], epoch milliseconds inside, RFC 3339 UTC with
//! milliseconds outside. The library and the wire share the one type.

pub use inflight_api::Timestamp;
