//! Instants: [`Timestamp`], epoch milliseconds inside, RFC 3339 UTC with
//! milliseconds outside. The library and the wire share the one type.

pub use inflight_api::Timestamp;

/// Whether `now` is past `bound`: strictly after it. A record is reapable
/// *after* `reapableAt`, and an owner lost *after* `expiresAt`, never at
/// the instant itself; every store and index asks this.
#[inline]
pub fn is_past(bound: Timestamp, now: Timestamp) -> bool {
    now > bound
}
