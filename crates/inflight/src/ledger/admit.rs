//! Admission and waiting: permits that cannot leak.
//!
//! The decision itself is the domain's ([`crate::domain::admission`]), taken
//! by the store in the same transaction that writes the start. This module is
//! the waiting around it: a record waits in line (`super::line`), first come
//! first served by `enqueuedAt`, and asks again when capacity may have come
//! back.

use std::fmt;
#[cfg(test)]
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::line::{recheck_after, InLine};
use crate::domain::record::{ActivityId, ActivityRecord, State};
use crate::domain::timestamp::Timestamp;
use crate::error::{ErrorKind, LedgerError};
use crate::ledger::{ActivityHandle, ActivitySpec, Ledger, Outcome, Settlement};
use crate::stats::Rejection;

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

/// What [`Ledger::begin_idempotent`] answers: the record, and whether an
/// earlier begin with the same idempotency key made it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Begun {
    /// The record, as it stands now.
    pub record: Arc<ActivityRecord>,
    /// An earlier begin with the same key made it; this one recorded
    /// nothing.
    pub replayed: bool,
}

impl Begun {
    /// `record`, answered to a begin that submitted the id `submitted`: a
    /// record of another id is a repeat's.
    pub(super) fn of(record: Arc<ActivityRecord>, submitted: ActivityId) -> Self {
        let replayed = record.activity_id != submitted;
        Self { record, replayed }
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

    /// Refines the call's model to the one it was dispatched to.
    ///
    /// # Errors
    /// As [`Ledger::refine`].
    ///
    /// # Cancel safety
    /// As [`Ledger::refine`]; the permit still cancels the call when
    /// dropped.
    pub async fn refine(&mut self, model: impl Into<String>) -> Result<&ActivityRecord, LedgerError> {
        self.handle.refine(model).await
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

    /// Settles the call as `settlement` says, consuming the permit and
    /// freeing its slot: a provider that refused it with `Retry-After`
    /// ([`Settlement::retry_after`]) cools its lane down.
    ///
    /// # Errors
    /// As [`Ledger::settle`].
    ///
    /// # Cancel safety
    /// As [`Permit::settle`].
    pub async fn settle_with(self, settlement: Settlement) -> Result<Arc<ActivityRecord>, LedgerError> {
        self.handle.settle_with(settlement).await
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
    pub async fn admit(&self, mut spec: ActivitySpec) -> Result<Permit, LedgerError> {
        spec.seal("admit");
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
    pub async fn try_admit(&self, mut spec: ActivitySpec) -> Result<Permit, LedgerError> {
        spec.seal("try_admit");
        let now = self.now();
        let handle = self.begin(spec.enqueued_at(now).started_at(now)).await?;
        Ok(Permit { handle })
    }

    /// Begins a call started now, waiting in line up to `wait` for its lane
    /// to admit it, as [`Ledger::begin_started`] does; returns its permit.
    /// For a caller that holds the call while it runs (a proxy), with a
    /// bound on its wait that [`Ledger::admit`] does not have.
    ///
    /// # Errors
    /// As [`Ledger::begin_started`]: `LaneFull`, `LaneCooling` or
    /// `BudgetExhausted` when the lane has not admitted it within `wait`.
    ///
    /// A record this leaves behind when it, or the permit, is dropped before
    /// the call ends is recorded `cancelled` with `reason_if_dropped`
    /// (`handle dropped` elsewhere), so that the evidence names the cause: a
    /// server whose client went away says `client-disconnected`.
    ///
    /// # Cancel safety
    /// As [`Ledger::begin_started`]: a future dropped before it returns
    /// leaves nothing holding a slot or a place in line, and the record it
    /// submitted is recorded `cancelled` with `reason_if_dropped`.
    pub async fn admit_within(
        &self,
        spec: ActivitySpec,
        wait: Duration,
        reason_if_dropped: &'static str,
    ) -> Result<Permit, LedgerError> {
        let dropped = reason_if_dropped;
        let record = self.begin_idempotent_as(spec, Some(wait), dropped).await?.record;
        Ok(Permit {
            handle: ActivityHandle {
                ledger: self.clone(),
                id: record.activity_id,
                record: Some(record),
                armed: true,
                dropped,
            },
        })
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
        spec: ActivitySpec,
        wait: Duration,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        Ok(self.begin_idempotent(spec, Some(wait)).await?.record)
    }

    /// Begins a call as the HTTP API's `POST /v1/activities` does: as
    /// [`Ledger::begin_record`] when `start_now` is `None`, else as
    /// [`Ledger::begin_started`] with that wait; and says whether an
    /// earlier begin with the same idempotency key
    /// ([`ActivitySpec::idempotency_key`]) made the record. Such a repeat
    /// answers that record as it stands now. When it still waits and this
    /// begin starts now with a wait, the repeat waits in line for it (and
    /// cancels it if its turn does not come within the wait, as the first
    /// begin would have): a retry never queues a second record.
    ///
    /// # Errors
    /// `IdempotencyConflict` when the key was first sent with a different
    /// request (other fields, or another way to start); otherwise as
    /// [`Ledger::begin_record`] and [`Ledger::begin_started`].
    ///
    /// # Cancel safety
    /// As [`Ledger::begin_started`] when it starts now, else as
    /// [`Ledger::begin_record`].
    pub async fn begin_idempotent(
        &self,
        spec: ActivitySpec,
        start_now: Option<Duration>,
    ) -> Result<Begun, LedgerError> {
        self.begin_idempotent_as(spec, start_now, super::spec::HANDLE_DROPPED)
            .await
    }

    /// [`Ledger::begin_idempotent`], a record it leaves behind when dropped
    /// cancelled with the reason `dropped`.
    async fn begin_idempotent_as(
        &self,
        mut spec: ActivitySpec,
        start_now: Option<Duration>,
        dropped: &'static str,
    ) -> Result<Begun, LedgerError> {
        let Some(wait) = start_now else {
            spec.seal(super::spec::BEGIN);
            let id = ActivityId::new();
            let record = self.begin_with_id(&spec, id).await?;
            return Ok(Begun::of(record, id));
        };
        spec.seal(&format!("start=now wait={}", wait.as_millis()));
        let now = self.now();
        // A client's `enqueuedAt` a little ahead of this clock must not put
        // the start before it.
        let started = spec.enqueued_at_set().map_or(now, |enqueued| enqueued.max(now));
        spec.set_started_at(Some(started));
        let mut guard = super::BeginGuard {
            ledger: self,
            id: ActivityId::new(),
            armed: true,
            dropped,
        };
        let at_once = self.begin_uncounted(&spec, guard.id).await;
        guard.armed = false;
        match at_once {
            Err(err) if err.is_refusal() && !wait.is_zero() => {}
            other => {
                let begun = Begun::of(self.count_refusal(other, Rejection::LaneFull)?, guard.id);
                if begun.replayed && begun.record.state == State::Waiting && !wait.is_zero() {
                    // A repeat of a begin still waiting in line: it waits
                    // for that record, never queueing a second.
                    return self.wait_started(begun, wait, dropped).await;
                }
                return Ok(begun);
            }
        }
        // Refused at once: nothing was recorded. Begin it waiting, and wait
        // in line with a handle that cancels it if this future is dropped.
        spec.set_started_at(None);
        let mut guard = super::BeginGuard {
            ledger: self,
            id: ActivityId::new(),
            armed: true,
            dropped,
        };
        let record = self.begin_with_id(&spec, guard.id).await;
        guard.armed = false;
        let begun = Begun::of(record?, guard.id);
        if begun.record.state != State::Waiting {
            // A repeat whose record already left the line.
            return Ok(begun);
        }
        self.wait_started(begun, wait, dropped).await
    }

    /// Waits up to `wait` for the lane to start `begun`'s record, which
    /// waits; cancels it if its turn does not come, so that it holds no
    /// place in line ahead of the caller's retry.
    async fn wait_started(
        &self,
        begun: Begun,
        wait: Duration,
        dropped: &'static str,
    ) -> Result<Begun, LedgerError> {
        let Begun { record, replayed } = begun;
        let mut handle = ActivityHandle {
            ledger: self.clone(),
            id: record.activity_id,
            record: Some(record),
            armed: true,
            dropped,
        };
        match self.start_waiting(handle.id(), None, Some(wait)).await {
            Ok(record) => {
                handle.armed = false;
                Ok(Begun { record, replayed })
            }
            // A repeat's record ended while it waited (the first begin gave
            // up, say): answered as it stands.
            Err(err) if replayed && err.kind() == ErrorKind::Conflict => {
                handle.armed = false;
                let record = self.get(handle.id()).await?;
                Ok(Begun { record, replayed })
            }
            Err(err) if err.is_refusal() => {
                let id = handle.id();
                handle.cancel(Some("wait ended".to_owned())).await?;
                let place = err.line_place();
                let Some(lane) = err.lane().cloned() else {
                    return Err(err);
                };
                let message = format!(
                    "lane {lane} did not admit activity {id} within {}; it is recorded cancelled and \
                     holds no place in line",
                    humantime::format_duration(wait)
                );
                // Answered with the limit that held it last.
                let why = match err.kind() {
                    ErrorKind::LaneCooling => " (the lane is cooling down)",
                    ErrorKind::BudgetExhausted => " (its token budget has no room)",
                    _ => "",
                };
                Err(LedgerError::refused(
                    err.kind(),
                    lane,
                    place,
                    err.retry_after(),
                    format!("{message}{why}"),
                ))
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
        // Joined after the first refusal; see Line::capacity_freed.
        let mut in_line: Option<InLine<'_>> = None;
        loop {
            #[cfg(test)]
            self.inner
                .capacity_changed
                .attempts
                .fetch_add(1, Ordering::SeqCst);
            let attempt = self.try_start(id, at).await;
            match attempt {
                Err(err) if err.is_refusal() => {
                    if let (Some(lane), Some(left)) = (err.lane(), err.retry_after()) {
                        // Capacity comes back with time: the line is woken
                        // when the cooldown ends or the window rolls off,
                        // as by a freed slot.
                        self.wake_line_after(lane, left);
                    }
                    let in_line = match (&mut in_line, err.lane(), err.line_place()) {
                        (Some(in_line), _, _) => {
                            in_line.refused();
                            in_line
                        }
                        (None, Some(lane), Some(place)) => {
                            // A slot freed between the refusal and joining
                            // woke no one: ask once more at once.
                            in_line = Some(self.inner.capacity_changed.join(lane.clone(), place));
                            continue;
                        }
                        _ => return Err(err),
                    };
                    let now = Instant::now();
                    if give_up.is_some_and(|give_up| now >= give_up) {
                        return self.count_refusal(Err(err), Rejection::WaitTimeout);
                    }
                    let recheck = recheck_after(self.inner.store.recheck_within());
                    let poll = give_up.map_or(recheck, |give_up| (give_up - now).min(recheck));
                    in_line.wait(poll).await;
                }
                // Admitted, or failed: leaving the line passes on a
                // wake-up this attempt answered.
                other => return other,
            }
        }
    }
}
