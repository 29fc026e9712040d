//! Admission and waiting: permits that cannot leak.
//!
//! The decision itself is the domain's ([`crate::domain::admission`]), taken
//! by the store in the same transaction that writes the start. This module is
//! the waiting machinery around it: a record waits in line, first come first
//! served by `enqueuedAt`, and is woken when capacity may have come back.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::futures::Notified;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::domain::record::{ActivityId, ActivityRecord};
use crate::domain::timestamp::Timestamp;
use crate::error::{ErrorKind, LedgerError};
use crate::ledger::{ActivityHandle, ActivitySpec, Ledger, Outcome};
use crate::stats::Rejection;

/// How long a record waiting in line sleeps before it asks again, unwoken:
/// a random time between half of `within` (the store's
/// [`Store::recheck_within`](crate::store::Store::recheck_within)) and all
/// of it, so that waiters that went to sleep together do not all ask the
/// store in the same instant.
fn recheck_after(within: Duration) -> Duration {
    use std::hash::BuildHasher;
    let random = foldhash::fast::RandomState::default().hash_one(std::time::Instant::now());
    within / 2 + within.mul_f64((random % 1024) as f64 / 2048.0)
}

/// Where records waiting in line in this process are woken when capacity
/// may have come back (a settle, a cancel, a reap).
#[derive(Debug, Default)]
pub(crate) struct Line {
    woken: Notify,
    /// How many starts are waiting in line now. A settle with no one
    /// waiting skips the wake-up, which takes `Notify`'s lock.
    waiting: AtomicUsize,
}

impl Line {
    /// Wakes every record waiting in line, if any is.
    ///
    /// Skipping the wake-up when none is waiting loses nothing: a waiter
    /// counts itself in before it tries to start, so one this settle did not
    /// see tries after the settle landed (it took the store's lock after the
    /// settle released it) and finds the slot free.
    pub(crate) fn capacity_freed(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.woken.notify_waiters();
        }
    }

    /// Counts the caller in line until the guard is dropped.
    fn join(&self) -> InLine<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        InLine(self)
    }
}

/// One start waiting in line; counted out when dropped.
struct InLine<'a>(&'a Line);

impl InLine<'_> {
    /// A future woken by the next capacity freed.
    fn woken(&self) -> Notified<'_> {
        self.0.woken.notified()
    }
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The longest a by-id start may wait in line (the HTTP `?wait=` bound).
pub const MAX_START_WAIT: Duration = Duration::from_secs(30);

/// An admitted call: its record is executing and holds one slot of its lane.
///
/// Settle it with [`Permit::settle`]. Dropping it unsettled (an error path, a
/// panic, a dropped future, a client disconnect) records the call
/// `cancelled` and frees the slot at once.
#[must_use = "dropping the permit cancels the call and frees its slot"]
pub struct Permit {
    handle: ActivityHandle,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit").field("id", &self.handle.id()).finish()
    }
}

impl Permit {
    /// The record's identity.
    pub fn id(&self) -> ActivityId {
        self.handle.id()
    }

    /// The record as admitted.
    pub fn record(&self) -> Option<&ActivityRecord> {
        self.handle.record()
    }

    /// Settles the call, consuming the permit and freeing its slot.
    ///
    /// # Errors
    /// As [`Ledger::settle`].
    ///
    /// # Cancel safety
    /// Once first polled, the settle is submitted and lands even if the
    /// future is dropped; a future dropped before its first poll cancels the
    /// call instead. Either way the slot is freed.
    pub async fn settle(self, outcome: Outcome) -> Result<Arc<ActivityRecord>, LedgerError> {
        self.handle.settle(outcome).await
    }

    /// Cancels the call, consuming the permit and freeing its slot.
    ///
    /// # Errors
    /// As [`Ledger::cancel`].
    ///
    /// # Cancel safety
    /// As [`Permit::settle`].
    pub async fn cancel(self, reason: Option<String>) -> Result<Arc<ActivityRecord>, LedgerError> {
        self.handle.cancel(reason).await
    }
}

impl Ledger {
    /// Begins a call and waits in line until its lane admits it.
    ///
    /// The call is recorded `waiting` at once; capacity goes to waiting
    /// records first come, first served by `enqueuedAt`, across every process
    /// sharing the store. On a lane with no cap it is admitted at once.
    ///
    /// # Errors
    /// As [`Ledger::begin`] and [`Ledger::start`]; never `LaneFull` (it
    /// waits instead).
    ///
    /// # Cancel safety
    /// Cancel safe. If the future is dropped while waiting, the call leaves
    /// the line and its record is recorded `cancelled`; if it is dropped
    /// after admission but before it returns the permit, the record is
    /// cancelled and the slot freed. No slot is ever held by a dropped future.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use inflight::{ActivitySpec, Ledger, LedgerConfig, Outcome};
    ///
    /// let config = LedgerConfig::default().with_lane_cap("knowledge-base::ollama", 2)?;
    /// let ledger = Ledger::builder(config).build()?;
    /// let permit = ledger.admit(ActivitySpec::new("knowledge-base", "ollama").class("embedding")).await?;
    /// // ... call the provider while holding the slot ...
    /// permit.settle(Outcome::Success).await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn admit(&self, spec: ActivitySpec) -> Result<Permit, LedgerError> {
        let mut handle = self.begin(spec).await?;
        let record = self.start_waiting(handle.id(), None, None).await?;
        handle.record = Some(record);
        Ok(Permit { handle })
    }

    /// Begins a call already started, if its lane admits it now.
    ///
    /// # Errors
    /// `LaneFull` when the lane is at its cap or records wait in line; the
    /// call is then not recorded at all. Otherwise as [`Ledger::begin`].
    ///
    /// # Cancel safety
    /// As [`Ledger::begin`]: a future dropped after its first poll may still
    /// record the call, and the handle it was building then cancels it.
    pub async fn try_admit(&self, spec: ActivitySpec) -> Result<Permit, LedgerError> {
        let now = self.now();
        let handle = self.begin(spec.enqueued_at(now).started_at(now)).await?;
        Ok(Permit { handle })
    }

    /// Begins a call started now, on this ledger's clock, waiting in line
    /// up to `wait` for its lane to admit it; returns the record, executing.
    /// For callers that settle it by id later (the HTTP API's
    /// `POST /v1/activities?start=now`).
    ///
    /// First one begin already started: when the lane admits it at once (no
    /// cap, room and no one waiting, or `direct` admission) that is the whole
    /// cost, one command. When the lane refuses and `wait` is longer than
    /// zero, the call is begun `waiting` and waits in line as
    /// [`Ledger::start_waiting`] does. If its turn has not come within
    /// `wait`, the record is cancelled, so that it holds no place in line
    /// ahead of the caller's retry, and the answer is `LaneFull`. A
    /// `startedAt` on `spec` is replaced by now.
    ///
    /// # Errors
    /// `LaneFull` when the lane has not admitted the call within `wait`:
    /// with no wait nothing is recorded, after a wait the record is
    /// `cancelled` (its id is in the message). Otherwise as
    /// [`Ledger::begin`] and [`Ledger::start`].
    ///
    /// # Cancel safety
    /// Cancel safe for the lane: a future dropped before it returns leaves
    /// nothing holding a slot or a place in line. A record it submitted is
    /// then recorded `cancelled` (as a dropped [`ActivityHandle`] is).
    pub async fn begin_started(
        &self,
        mut spec: ActivitySpec,
        wait: Duration,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        let now = self.now();
        // A client's `enqueuedAt` a little ahead of this clock must not put
        // the start before it.
        let started = spec.enqueued_at_set().map_or(now, |enqueued| enqueued.max(now));
        spec.set_started_at(Some(started));
        let mut guard = super::BeginGuard {
            ledger: self,
            id: ActivityId::new(),
            armed: true,
        };
        let at_once = self.begin_uncounted(&spec, guard.id).await;
        guard.armed = false;
        match at_once {
            Err(err) if err.kind() == ErrorKind::LaneFull && !wait.is_zero() => {}
            other => return self.count_refusal(other, Rejection::LaneFull),
        }
        // Refused at once: nothing was recorded. Begin it waiting, and wait
        // in line with a handle that cancels it if this future is dropped.
        spec.set_started_at(None);
        let mut handle = self.begin(spec).await?;
        match self.start_waiting(handle.id(), None, Some(wait)).await {
            Ok(record) => {
                handle.armed = false;
                Ok(record)
            }
            Err(err) if err.kind() == ErrorKind::LaneFull => {
                let id = handle.id();
                handle.cancel(Some("wait ended".to_owned())).await?;
                let lane = err.lane().cloned().ok_or(err)?;
                let message = format!(
                    "lane {lane} did not admit activity {id} within {}; it is recorded cancelled and \
                     holds no place in line",
                    humantime::format_duration(wait)
                );
                Err(LedgerError::lane_full(lane, message))
            }
            Err(err) => Err(err),
        }
    }

    /// Starts the record `id`, waiting in line up to `wait` for its turn
    /// (forever when `None`).
    ///
    /// # Errors
    /// `LaneFull` when its turn has not come within `wait`; otherwise as
    /// [`Ledger::start`].
    ///
    /// # Cancel safety
    /// Dropping the future stops the waiting; the record keeps its place in
    /// line (it stays `waiting`). A start attempt already submitted when the
    /// future is dropped still lands and may start the record. Use
    /// [`Ledger::admit`] for a record that leaves the line when its future is
    /// dropped.
    pub async fn start_waiting(
        &self,
        id: ActivityId,
        at: Option<Timestamp>,
        wait: Option<Duration>,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        let give_up = wait.map(|wait| Instant::now() + wait);
        // Counted in line before the first attempt; see Line::capacity_freed.
        let in_line = self.inner.capacity_changed.join();
        loop {
            // Registered before the attempt, so a settle that lands in
            // between still wakes us.
            let woken = in_line.woken();
            tokio::pin!(woken);
            woken.as_mut().enable();
            match self.try_start(id, at).await {
                Err(err) if err.kind() == ErrorKind::LaneFull => {
                    let now = Instant::now();
                    if give_up.is_some_and(|give_up| now >= give_up) {
                        return self.count_refusal(Err(err), Rejection::WaitTimeout);
                    }
                    let recheck = recheck_after(self.inner.store.recheck_within());
                    let poll = give_up.map_or(recheck, |give_up| (give_up - now).min(recheck));
                    tokio::select! {
                        () = &mut woken => {}
                        () = tokio::time::sleep(poll) => {}
                    }
                }
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    #[test]
    fn a_waiter_asks_again_between_half_and_all_of_the_stores_recheck() {
        let within = Duration::from_millis(1000);
        let pauses: Vec<Duration> = (0..200).map(|_| recheck_after(within)).collect();
        assert!(
            pauses.iter().all(|p| *p >= within / 2 && *p <= within),
            "{pauses:?}"
        );
        // Jittered: waiters that slept together do not all wake together.
        let distinct: std::collections::HashSet<_> = pauses.iter().collect();
        assert!(distinct.len() > 20, "{} distinct pauses", distinct.len());
    }

    #[test]
    fn capacity_freed_wakes_a_start_counted_in_line() {
        let line = Line::default();
        let in_line = line.join();
        let woken = in_line.woken();
        line.capacity_freed();
        assert!(woken.now_or_never().is_some());
    }

    #[test]
    fn leaving_the_line_counts_the_start_out() {
        let line = Line::default();
        let first = line.join();
        let second = line.join();
        drop(first);
        assert_eq!(line.waiting.load(Ordering::SeqCst), 1);
        drop(second);
        assert_eq!(line.waiting.load(Ordering::SeqCst), 0);
        // No one counted in line: the wake-up is skipped, so not even a
        // future registered before it (without joining) is woken.
        let bystander = line.woken.notified();
        line.capacity_freed();
        assert!(bystander.now_or_never().is_none());
    }
}
