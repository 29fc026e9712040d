//! Owner leases: a process's promise that it is alive.
//!
//! Deadline reaping is safe but slow by design (factor x deadline). A process
//! that registers as an owner and keeps renewing its lease lets the ledger
//! reclaim its work within seconds when it dies: once the lease expires
//! unrenewed, its in-flight records are reaped with reason `owner-lost`. A
//! lease only ever makes reclamation faster; records of a live owner still
//! expire past their deadline bound.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;
use uuid::Uuid;

use super::labels::Label;
use super::refusal::Refusal;
use super::timestamp::Timestamp;
use super::ParseError;

/// The default lease time-to-live.
pub const DEFAULT_TTL_MS: i64 = 30_000;
/// The shortest lease accepted.
pub const MIN_TTL_MS: i64 = 100;
/// The longest lease accepted.
pub const MAX_TTL_MS: i64 = 60 * 60 * 1000;

/// The identity of an owner.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct OwnerId(String);

impl OwnerId {
    /// A fresh random identity.
    pub fn new() -> Self {
        Self(Uuid::new_v4().to_string())
    }

    /// The identity as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Wraps an identity read back from a store.
    pub(crate) fn trusted(value: String) -> Self {
        Self(value)
    }
}

impl Default for OwnerId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for OwnerId {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s)
            .map(|id| Self(id.to_string()))
            .map_err(|_| ParseError::new(s, "an owner id (a UUID)"))
    }
}

// Where an owner is in its life: the wire's own enum.
pub use inflight_api::OwnerState;

/// A registered owner and its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Owner {
    /// Its identity.
    pub owner_id: OwnerId,
    /// What it calls itself (a label).
    pub name: Label,
    /// Its lease's time-to-live.
    pub ttl_ms: i64,
    /// When it registered.
    pub registered_at: Timestamp,
    /// When it last renewed.
    pub renewed_at: Timestamp,
    /// When its lease runs out unless renewed.
    pub expires_at: Timestamp,
    /// Live, lost or released.
    pub state: OwnerState,
    /// When it was lost or released.
    pub ended_at: Option<Timestamp>,
    /// Records its loss reaped.
    pub reaped_records: i64,
    /// Records its release cancelled.
    pub cancelled_records: i64,
}

/// Whether a lease time-to-live of `ttl_ms` is accepted: 100 ms to 1 h.
pub fn ttl_in_range(ttl_ms: i64) -> bool {
    (MIN_TTL_MS..=MAX_TTL_MS).contains(&ttl_ms)
}

/// Checks a requested lease time-to-live, as the HTTP API names it.
///
/// # Errors
/// A TTL outside 100 ms to 1 h ([`ttl_in_range`]).
pub fn check_ttl(ttl_ms: i64) -> Result<i64, Refusal> {
    if !ttl_in_range(ttl_ms) {
        return Err(Refusal::Invalid(format!(
            "ttlMs must be between {MIN_TTL_MS} and {MAX_TTL_MS}, got {ttl_ms}"
        )));
    }
    Ok(ttl_ms)
}

impl Owner {
    /// A live owner registered at `now`.
    pub fn register(name: Label, ttl_ms: i64, now: Timestamp) -> Self {
        Self {
            owner_id: OwnerId::new(),
            name,
            ttl_ms,
            registered_at: now,
            renewed_at: now,
            expires_at: now.add_millis(ttl_ms),
            state: OwnerState::Live,
            ended_at: None,
            reaped_records: 0,
            cancelled_records: 0,
        }
    }

    /// Whether its lease has run out at `now` (strictly past `expiresAt`).
    pub fn is_expired(&self, now: Timestamp) -> bool {
        self.state == OwnerState::Live && super::timestamp::is_past(self.expires_at, now)
    }

    /// Marks it lost at `now`.
    pub fn lose(&mut self, now: Timestamp) {
        self.state = OwnerState::Lost;
        self.ended_at = Some(now);
    }

    /// Renews its lease at `now`.
    ///
    /// # Errors
    /// A conflict when it is already lost or released: its records may
    /// already be reaped, so it must register again.
    pub fn renew(&mut self, now: Timestamp) -> Result<(), Refusal> {
        self.check_live()?;
        self.renewed_at = now;
        self.expires_at = now.add_millis(self.ttl_ms);
        Ok(())
    }

    /// Marks it released at `now`.
    ///
    /// # Errors
    /// A conflict when it is already lost; releasing twice is harmless.
    pub fn release(&mut self, now: Timestamp) -> Result<bool, Refusal> {
        match self.state {
            OwnerState::Released => Ok(false),
            OwnerState::Lost => Err(self.ended()),
            OwnerState::Live => {
                self.state = OwnerState::Released;
                self.ended_at = Some(now);
                Ok(true)
            }
        }
    }

    /// Refuses anything but a live owner.
    ///
    /// # Errors
    /// A conflict naming its state.
    pub fn check_live(&self) -> Result<(), Refusal> {
        match self.state {
            OwnerState::Live => Ok(()),
            _ => Err(self.ended()),
        }
    }

    fn ended(&self) -> Refusal {
        Refusal::Conflict(format!(
            "owner {} is already {}; register a new owner",
            self.owner_id,
            self.state.as_str()
        ))
    }
}
