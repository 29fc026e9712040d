//! Owner leases from the Rust side: register, renew in the background,
//! release on a clean shutdown.

use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::domain::labels::Label;
use crate::domain::owner::{self, Owner, OwnerId};
use crate::error::{ErrorKind, LedgerError};
use crate::ledger::{Inner, Ledger};
use crate::store::Command;

impl Ledger {
    /// Registers an owner named `name` with a lease of `ttl`.
    ///
    /// # Errors
    /// `InvalidInput` for a bad name or a TTL outside 100 ms to 1 h.
    ///
    /// # Cancel safety
    /// Once first polled, the owner is registered even if the future is
    /// dropped; unrenewed, its lease simply expires.
    pub async fn register_owner(&self, name: &str, ttl: Duration) -> Result<Owner, LedgerError> {
        let name = Label::new("name", name)?;
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        if !owner::ttl_in_range(ttl_ms) {
            return Err(LedgerError::new(
                ErrorKind::InvalidInput,
                format!(
                    "an owner's lease must last between {} and {}, got {}",
                    humantime::format_duration(Duration::from_millis(owner::MIN_TTL_MS.unsigned_abs())),
                    humantime::format_duration(Duration::from_millis(owner::MAX_TTL_MS.unsigned_abs())),
                    humantime::format_duration(ttl)
                ),
            ));
        }
        self.run(Command::RegisterOwner { name, ttl_ms })
            .await?
            .into_owner()
    }

    /// Renews the lease of owner `id`.
    ///
    /// # Errors
    /// `NotFound`; `Conflict` when the owner is already lost or released
    /// (its records may be reaped: register again).
    ///
    /// # Cancel safety
    /// Cancel safe: a renewal either lands or it does not.
    pub async fn renew_owner(&self, id: &OwnerId) -> Result<Owner, LedgerError> {
        self.run(Command::RenewOwner { id: id.clone() })
            .await?
            .into_owner()
    }

    /// Releases the lease of owner `id` and cancels its in-flight records:
    /// a clean shutdown. Releasing twice is harmless.
    ///
    /// # Errors
    /// `NotFound`; `Conflict` when the owner was already lost.
    ///
    /// # Cancel safety
    /// Once first polled, the release lands even if the future is dropped.
    pub async fn release_owner(&self, id: &OwnerId) -> Result<Owner, LedgerError> {
        self.run(Command::ReleaseOwner { id: id.clone() })
            .await?
            .into_owner()
    }

    /// Registers this process as an owner, renews its lease in the
    /// background every third of `ttl`, and tags every record this ledger
    /// (and its clones) begins from now on with the owner's id.
    ///
    /// If the process dies, the lease expires unrenewed and its in-flight
    /// records are reaped as `owner-lost` within `ttl` plus one reap
    /// interval, instead of after their deadline bound.
    ///
    /// # Errors
    /// As [`Ledger::register_owner`].
    ///
    /// # Cancel safety
    /// As [`Ledger::register_owner`].
    pub async fn join_as_owner(&self, name: &str, ttl: Duration) -> Result<OwnerLease, LedgerError> {
        let owner = self.register_owner(name, ttl).await?;
        *self
            .inner
            .default_owner
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(owner.owner_id.to_string());
        let renewals = spawn_renewals(Arc::downgrade(&self.inner), owner.owner_id.clone(), ttl);
        Ok(OwnerLease {
            ledger: self.clone(),
            owner,
            renewals,
            released: false,
        })
    }
}

impl Ledger {
    /// The owner the builder asked for, registered on first use (again if
    /// its lease was lost).
    pub(crate) async fn auto_owner_id(&self) -> Result<OwnerId, LedgerError> {
        let Some(auto) = &self.inner.auto_owner else {
            return Err(LedgerError::invalid("no owner was configured for this ledger"));
        };
        let mut current = auto.current.lock().await;
        if let Some((id, renewals)) = current.as_ref() {
            if !renewals.is_finished() {
                return Ok(id.clone());
            }
        }
        let owner = self.register_owner(auto.name.as_str(), auto.ttl).await?;
        let renewals = spawn_renewals(Arc::downgrade(&self.inner), owner.owner_id.clone(), auto.ttl);
        *current = Some((owner.owner_id.clone(), renewals));
        Ok(owner.owner_id)
    }
}

impl Ledger {
    /// Drops the builder's owner `id` (lost), so the next record registers a
    /// new one.
    pub(crate) async fn forget_auto_owner(&self, id: &OwnerId) {
        let Some(auto) = &self.inner.auto_owner else {
            return;
        };
        let mut current = auto.current.lock().await;
        if current.as_ref().is_some_and(|(current, _)| current == id) {
            if let Some((_, renewals)) = current.take() {
                renewals.abort();
            }
        }
    }
}

/// Renews the lease of `id` every third of `ttl` while the ledger lives.
/// Holds the ledger weakly, so that a renewal never keeps it alive.
fn spawn_renewals(inner: Weak<Inner>, id: OwnerId, ttl: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval((ttl / 3).max(Duration::from_millis(10)));
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let Some(inner) = inner.upgrade() else { return };
            let ledger = Ledger { inner };
            // Submitted at once, it lands however long the answer takes; a
            // store that does not answer by the next renewal is said, not
            // waited on in silence while the lease runs out.
            let Ok(renewed) = tokio::time::timeout(ttl / 3, ledger.renew_owner(&id)).await else {
                tracing::warn!(owner = %id, ttl = ?ttl, "lease renewal unanswered after a third of the lease; renewing again");
                continue;
            };
            match renewed {
                Ok(_) => {}
                Err(err) if err.kind() == ErrorKind::Conflict || err.kind() == ErrorKind::NotFound => {
                    tracing::error!(owner = %id, error = %err, "owner lease lost; its records were reaped");
                    // New records must not be tagged with a lost owner.
                    untag(&ledger.inner, &id);
                    return;
                }
                Err(err) => tracing::warn!(owner = %id, error = %err, "lease renewal failed; retrying"),
            }
        }
    })
}

/// This process's owner lease. Renews itself until released or dropped;
/// dropping it releases the lease too (a clean end), cancelling the owner's
/// in-flight records.
#[must_use = "dropping the lease releases it and cancels the owner's in-flight records"]
pub struct OwnerLease {
    ledger: Ledger,
    owner: Owner,
    renewals: JoinHandle<()>,
    released: bool,
}

impl fmt::Debug for OwnerLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnerLease")
            .field("owner_id", &self.owner.owner_id)
            .finish()
    }
}

impl OwnerLease {
    /// The owner as registered.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Stops renewing without releasing, as if the process had died: the
    /// lease expires after its TTL. For tests and drills.
    pub fn abandon(mut self) {
        self.renewals.abort();
        self.released = true;
    }

    /// Releases the lease and cancels the owner's in-flight records.
    ///
    /// # Errors
    /// As [`Ledger::release_owner`].
    ///
    /// # Cancel safety
    /// Once first polled, the release lands even if the future is dropped.
    pub async fn release(mut self) -> Result<Owner, LedgerError> {
        self.renewals.abort();
        self.released = true;
        self.clear_default();
        self.ledger.release_owner(&self.owner.owner_id).await
    }

    fn clear_default(&self) {
        untag(&self.ledger.inner, &self.owner.owner_id);
    }
}

/// Stops tagging new records with owner `id`, if the ledger still does.
fn untag(inner: &Inner, id: &OwnerId) {
    let mut default = inner
        .default_owner
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if default.as_deref() == Some(id.as_str()) {
        *default = None;
    }
}

impl Drop for OwnerLease {
    fn drop(&mut self) {
        self.renewals.abort();
        if !self.released {
            self.clear_default();
            self.ledger.run_detached(Command::ReleaseOwner {
                id: self.owner.owner_id.clone(),
            });
        }
    }
}
