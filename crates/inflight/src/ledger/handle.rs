//! [`ActivityHandle`]: a record this process began, cancelled if dropped.

use std::fmt;
use std::sync::Arc;

use crate::domain::record::{ActivityId, ActivityRecord};
use crate::error::{ErrorKind, LedgerError};

use crate::domain::transition::Transition;

use super::{Ledger, Outcome, Settlement};

/// A record this process began. Settle it, or it is recorded `cancelled`
/// when dropped: never a silent leak inside the process.
#[must_use = "dropping the handle cancels the activity"]
pub struct ActivityHandle {
    pub(crate) ledger: Ledger,
    pub(crate) id: ActivityId,
    pub(crate) record: Option<Arc<ActivityRecord>>,
    /// Whether dropping the handle must still cancel the record.
    pub(super) armed: bool,
    /// The cancel reason a drop records.
    pub(super) dropped: &'static str,
}

impl fmt::Debug for ActivityHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActivityHandle").field("id", &self.id).finish()
    }
}

impl ActivityHandle {
    /// The record's identity.
    pub fn id(&self) -> ActivityId {
        self.id
    }

    /// The record as of the handle's last operation, or `None` when its
    /// last operation failed or was dropped before it answered: ask
    /// [`Ledger::get`] for the record as it is now.
    pub fn record(&self) -> Option<&ActivityRecord> {
        self.record.as_deref()
    }

    /// Marks it executing now.
    ///
    /// # Errors
    /// As [`Ledger::start`].
    ///
    /// # Cancel safety
    /// The start is submitted when first polled; the handle still cancels
    /// the record when dropped.
    pub async fn start(&mut self) -> Result<&ActivityRecord, LedgerError> {
        // Let go of the old version first: once the store replaces it, it is
        // freed at once rather than kept alive by this handle.
        self.record = None;
        let record = self
            .ledger
            .transition(self.id, Transition::Start { at: None })
            .await?;
        Ok(self.record.insert(record))
    }

    /// Refines its model to the one the call was dispatched to.
    ///
    /// # Errors
    /// As [`Ledger::refine`].
    ///
    /// # Cancel safety
    /// As [`Ledger::refine`]; the handle still cancels the record when
    /// dropped.
    pub async fn refine(&mut self, model: impl Into<String>) -> Result<&ActivityRecord, LedgerError> {
        self.record = None;
        let record = self.ledger.refine(self.id, model).await?;
        Ok(self.record.insert(record))
    }

    /// Settles it with `outcome`, consuming the handle.
    ///
    /// # Errors
    /// As [`Ledger::settle`].
    ///
    /// # Cancel safety
    /// Once first polled, the settle is submitted: if the future is dropped
    /// after that, the settle still lands and no cancel follows. A future
    /// dropped before its first poll cancels the record, like the handle.
    pub async fn settle(self, outcome: Outcome) -> Result<Arc<ActivityRecord>, LedgerError> {
        self.settle_with(Settlement::from(outcome)).await
    }

    /// Settles it as `settlement` says (a refusing provider's
    /// [`Settlement::retry_after`], say), consuming the handle.
    ///
    /// A settlement the ledger refuses as given (`InvalidInput`: usage out
    /// of range, a `retry_after` with a success, a time out of range) still
    /// ends the call: the record is cancelled, with the reason
    /// `"settle refused"`, rather than left holding its slot until its
    /// bound, and the refusal is returned.
    ///
    /// # Errors
    /// As [`Ledger::settle`].
    ///
    /// # Cancel safety
    /// As [`ActivityHandle::settle`]; a future dropped after the settle was
    /// submitted but before it was refused leaves the record in flight.
    pub async fn settle_with(mut self, settlement: Settlement) -> Result<Arc<ActivityRecord>, LedgerError> {
        self.armed = false;
        self.record = None;
        let settled = self.ledger.transition(self.id, settlement.into()).await;
        if settled
            .as_ref()
            .is_err_and(|err| err.kind() == ErrorKind::InvalidInput)
        {
            // Cancelled as the handle goes, submitted before this returns.
            self.armed = true;
            self.dropped = SETTLE_REFUSED;
        }
        settled
    }

    /// Cancels it, consuming the handle.
    ///
    /// # Errors
    /// As [`Ledger::cancel`].
    ///
    /// # Cancel safety
    /// As [`ActivityHandle::settle`].
    pub async fn cancel(mut self, reason: Option<String>) -> Result<Arc<ActivityRecord>, LedgerError> {
        self.armed = false;
        self.record = None;
        self.ledger.cancel(self.id, reason).await
    }
}

/// The cancel reason of a call whose settle the ledger refused as given.
const SETTLE_REFUSED: &str = "settle refused";

impl Drop for ActivityHandle {
    fn drop(&mut self) {
        if self.armed {
            self.ledger.cancel_detached(self.id, self.dropped);
        }
    }
}
