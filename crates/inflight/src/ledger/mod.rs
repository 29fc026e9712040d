//! The public face of the library: [`Ledger`], [`ActivitySpec`] and the
//! [`ActivityHandle`] that settles a record or cancels it when dropped.

mod admit;
mod builder;
mod handle;
mod lease;
mod line;
mod reaper;
mod spec;

pub use admit::{Begun, Permit, MAX_START_WAIT};
pub use builder::LedgerBuilder;
pub use handle::ActivityHandle;
pub use lease::OwnerLease;
pub use reaper::ReaperGuard;
pub use spec::{ActivitySpec, Outcome, Settlement};

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use std::sync::{Mutex, PoisonError, RwLock};

use tokio::task::JoinHandle;

use self::line::Line;
use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::domain::counters::ReapedCounts;
use crate::domain::effect::Effect;
use crate::domain::labels::{Label, LabelInterner};
use crate::domain::owner::OwnerId;
use crate::domain::record::{ActivityId, ActivityRecord, LaneKey};
use crate::domain::snapshot::{Snapshot, SnapshotOptions};
use crate::domain::timestamp::Timestamp;
use crate::domain::transition::{NewActivity, Transition};
use crate::error::{ErrorKind, LedgerError};
use crate::stats::{LedgerStats, Rejection, StatsSnapshot};
use crate::store::{self, Command, Store};

/// How many records one prune transaction deletes at most.
const PRUNE_BATCH: usize = 500;

/// The ledger of in-flight provider calls.
///
/// Cheap to clone (an `Arc` inside), `Send` and `Sync`.
///
/// ```
/// # tokio_test_main(async {
/// use inflight::{ActivitySpec, Ledger, LedgerConfig, Outcome};
///
/// let ledger = Ledger::builder(LedgerConfig::default()).store_url("memory:").build()?;
/// let mut call = ledger
///     .begin(ActivitySpec::new("knowledge-base", "ollama").class("embedding"))
///     .await?;
/// call.start().await?;
/// let record = call.settle(Outcome::Success).await?;
/// assert_eq!(record.state.as_str(), "succeeded");
/// # Ok::<(), inflight::LedgerError>(())
/// # });
/// # fn tokio_test_main<F: std::future::Future<Output = Result<(), inflight::LedgerError>>>(f: F) {
/// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f).unwrap();
/// # }
/// ```
#[derive(Clone)]
pub struct Ledger {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) config: Arc<LedgerConfig>,
    pub(crate) clock: Arc<dyn Clock>,
    /// Woken by the store whenever a slot or a place in line comes free
    /// ([`Store::watch_capacity`]).
    pub(crate) capacity_changed: Line,
    /// The owner this process registered with [`Ledger::join_as_owner`];
    /// records begun without an explicit owner are tagged with it.
    pub(crate) default_owner: RwLock<Option<String>>,
    /// The owner the builder asked this ledger to register by itself.
    pub(crate) auto_owner: Option<AutoOwner>,
    /// Label sets already validated, so a repeated call shares them.
    pub(crate) labels: Mutex<LabelInterner>,
    /// Undeclared lanes already warned about (only when some lane is capped).
    pub(crate) undeclared_lanes: Mutex<std::collections::HashSet<crate::domain::record::LaneKey>>,
    /// Refused admissions and reaper passes (the store keeps the call
    /// histograms).
    pub(crate) stats: LedgerStats,
    /// Begins whose labels were folded into `other` (see
    /// [`Ledger::labels_folded`]).
    pub(crate) labels_folded: std::sync::atomic::AtomicU64,
}

/// The most undeclared lanes warned about: enough to show a misspelling,
/// bounded whatever callers send.
const MAX_UNDECLARED_WARNINGS: usize = 64;

/// An owner registered on first use and renewed in the background; a new
/// one replaces it if its lease is ever lost.
pub(crate) struct AutoOwner {
    pub(crate) name: Label,
    pub(crate) ttl: Duration,
    pub(crate) current: tokio::sync::Mutex<Option<(OwnerId, JoinHandle<()>)>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle on this ledger is gone: a clean end. Release the
        // owner so its unfinished records are cancelled now rather than
        // reaped when the lease runs out.
        let Some(auto) = &self.auto_owner else { return };
        let Ok(mut current) = auto.current.try_lock() else {
            return;
        };
        if let Some((id, renewals)) = current.take() {
            renewals.abort();
            drop(self.store.execute(Command::ReleaseOwner { id }));
        }
    }
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger")
            .field("store", &self.inner.store)
            .field("clock", &self.inner.clock)
            .finish_non_exhaustive()
    }
}

/// A store command's reply that is a record.
#[must_use = "the reply is lost unless awaited (the command itself is submitted)"]
struct RecordReply(store::StoreFuture);

impl Future for RecordReply {
    type Output = Result<Arc<ActivityRecord>, LedgerError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let reply = ready!(Pin::new(&mut self.0).poll(cx));
        Poll::Ready(reply.and_then(store::Reply::into_record))
    }
}

impl Ledger {
    /// Starts building a ledger under `config`, on `memory:` and the system
    /// clock unless told otherwise.
    pub fn builder(config: LedgerConfig) -> LedgerBuilder {
        LedgerBuilder::new(config)
    }

    /// Calls `watch` after each command this ledger commits, for each
    /// record the command ended (settled, cancelled or reaped) or brought
    /// back ([`Effect::Resurrected`]), with the record as the command left
    /// it: an exporter's feed (the server's `[otel]` spans). Never for a
    /// command undone. Commands of other processes sharing the store are
    /// not shown; each is shown to its own process.
    ///
    /// `watch` runs on the store's writer, in commit order, so it must not
    /// block: hand the record to a bounded queue and return.
    pub fn watch_ends(&self, watch: impl Fn(&Arc<ActivityRecord>, &Effect) + Send + Sync + 'static) {
        self.inner.store.watch_ends(Arc::new(watch));
    }

    /// The configuration it runs under.
    pub fn config(&self) -> &LedgerConfig {
        &self.inner.config
    }

    /// The ledger's current time.
    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// Submits `command` now, and returns a future of its reply. Submitting
    /// at the call rather than at the first poll changes nothing for
    /// callers, which await it at once, and keeps the command out of their
    /// futures. What the command frees wakes the line from the store, once
    /// committed ([`Store::watch_capacity`]).
    pub(crate) fn run(&self, command: Command) -> store::StoreFuture {
        self.inner.store.execute(command)
    }

    /// Records a new activity and returns a handle that settles it, or
    /// cancels it when dropped.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::error::ErrorKind::InvalidInput) for a bad
    /// label, a timestamp more than 5 minutes ahead, or a `startedAt` before
    /// the `enqueuedAt`; [`ErrorKind::Storage`](crate::error::ErrorKind::Storage).
    ///
    /// # Cancel safety
    /// Cancel safe: if the future is dropped before it resolves, a record
    /// that was submitted still lands and is then recorded `cancelled`, as if
    /// the handle had been dropped.
    pub async fn begin(&self, mut spec: ActivitySpec) -> Result<ActivityHandle, LedgerError> {
        spec.seal(spec::BEGIN);
        // The guard exists before the record is submitted, so a future
        // dropped mid-flight still cancels what it began.
        let dropped = spec::HANDLE_DROPPED;
        let mut guard = BeginGuard {
            ledger: self,
            id: ActivityId::new(),
            armed: true,
            dropped,
        };
        let begun = self.begin_with_id(&spec, guard.id).await;
        guard.armed = false;
        let record = begun?;
        // A repeat of an idempotent begin answers the first one's record.
        Ok(ActivityHandle {
            ledger: self.clone(),
            id: record.activity_id,
            record: Some(record),
            armed: true,
            dropped,
        })
    }

    /// Records a new activity and returns the record, with no handle: for
    /// callers (such as the HTTP API) that settle it by id later.
    ///
    /// # Errors
    /// As [`Ledger::begin`].
    ///
    /// # Cancel safety
    /// Once first polled, the record is submitted and lands even if the
    /// future is dropped; with no handle, nothing cancels it, and its bound
    /// reaps it as `abandoned` or `unsettled`.
    pub async fn begin_record(&self, spec: ActivitySpec) -> Result<Arc<ActivityRecord>, LedgerError> {
        Ok(self.begin_idempotent(spec, None).await?.record)
    }

    async fn begin_with_id(
        &self,
        spec: &ActivitySpec,
        id: ActivityId,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        let begun = self.begin_uncounted(spec, id).await;
        // A begin already started is an admission decision, taken at once.
        self.count_refusal(begun, Rejection::LaneFull)
    }

    /// Records a new activity `id`; a `LaneFull` refusal is not counted in
    /// the statistics, for a caller that waits in line after it.
    pub(crate) async fn begin_uncounted(
        &self,
        spec: &ActivitySpec,
        id: ActivityId,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        let mut new = spec.validate(id, &self.inner.labels, &|labels| self.warn_if_undeclared(labels))?;
        if new.owner_id.is_none() {
            new.owner_id = self
                .inner
                .default_owner
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
        }
        let begun = if new.owner_id.is_some() || self.inner.auto_owner.is_none() {
            let sent = new.labels.identity();
            let begun = self
                .run(Command::Begin { new })
                .await
                .and_then(store::Reply::into_record);
            if let Ok(record) = &begun {
                self.count_if_folded(sent, record);
            }
            begun
        } else {
            // Rare, and a large future (it may register an owner): boxed, so
            // the common path's future stays small and cheap to move.
            Box::pin(self.begin_as_auto_owner(spec, new)).await
        };
        begun
    }

    /// Counts `result` in the statistics if it is a `LaneFull` refusal.
    pub(crate) fn count_refusal<T>(
        &self,
        result: Result<T, LedgerError>,
        why: Rejection,
    ) -> Result<T, LedgerError> {
        if let Err(err) = &result {
            if let Some(lane) = err.lane() {
                // Refused at once by a cooldown: counted as that.
                let why = match (why, err.kind()) {
                    (Rejection::LaneFull, ErrorKind::LaneCooling) => Rejection::LaneCooling,
                    (Rejection::LaneFull, ErrorKind::BudgetExhausted) => Rejection::BudgetExhausted,
                    _ => why,
                };
                self.inner.stats.rejected(lane.clone(), why);
            }
        }
        result
    }

    /// Wakes this ledger's waiters on `lane` in `after` (a cooldown's
    /// end, or a budget's window rolling off), as a freed slot would:
    /// capacity that comes back with time.
    /// One timer a lane at a time; a later cooldown arms it again.
    pub(crate) fn wake_line_after(&self, lane: &LaneKey, after: Duration) {
        let at = tokio::time::Instant::now() + after;
        if !self.inner.capacity_changed.arm(lane, at) {
            return;
        }
        let (inner, lane) = (Arc::downgrade(&self.inner), lane.clone());
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            if let Some(inner) = inner.upgrade() {
                inner.capacity_changed.fire(&lane, at);
            }
        });
    }

    /// What this process saw happen: its calls' queue waits and execution
    /// times, the admissions it refused, its reaper's passes. Per process;
    /// the store's counters (in the [`Snapshot`]) are the ledger's own.
    pub fn stats(&self) -> StatsSnapshot {
        let mut stats = self.inner.stats.snapshot(self.inner.store.call_stats());
        stats.labels_folded = self.labels_folded();
        stats
    }

    /// The store's work that took at least [`SLOW_WORK`](store::SLOW_WORK)
    /// (a group of commands, a checkpoint) and ran at some time between
    /// `from` and `to`, among the latest it kept: what a request slow over
    /// that time may have waited on. Empty when nothing the store did was
    /// slow then, so that the time went elsewhere (the machine, the
    /// runtime, the network).
    pub fn slow_work(&self, from: Instant, to: Instant) -> Vec<store::SlowWork> {
        self.inner.store.slow_work(from, to)
    }

    /// The groups of commands the store ran since it opened, with their
    /// time in all: read before and after a request, the difference
    /// ([`GroupsRun::since`](store::GroupsRun::since)) says how busy the
    /// store was meanwhile, slow groups or not.
    pub fn groups_run(&self) -> store::GroupsRun {
        self.inner.store.groups_run()
    }

    /// Says once per lane, as a warning, that a call runs on a lane the
    /// configuration does not declare while it caps others: most often a
    /// lane spelled one way in the cap and another in the calls, which
    /// would silently admit every call. Called for a label set the first
    /// time it is validated, so a call with known labels pays nothing.
    fn warn_if_undeclared(&self, labels: &crate::domain::labels::LabelSet) {
        if self.inner.config.lanes().is_empty() {
            return;
        }
        let lane = crate::domain::record::LaneKey::of(labels);
        if self.inner.config.lanes().contains_key(&lane) {
            return;
        }
        let first = {
            let mut warned = self
                .inner
                .undeclared_lanes
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            warned.len() < MAX_UNDECLARED_WARNINGS && warned.insert(lane.clone())
        };
        // Logged with the lock released: a subscriber may call the ledger.
        if first {
            let capped: Vec<String> = self
                .inner
                .config
                .lanes()
                .keys()
                .map(ToString::to_string)
                .collect();
            tracing::warn!(
                lane = %lane,
                capped = %capped.join(", "),
                "a call runs on lane {lane}, which has no cap, next to capped lanes: check the lane's spelling \
                 in the calls and in the configuration, or declare it without a cap"
            );
        }
    }

    async fn begin_as_auto_owner(
        &self,
        spec: &ActivitySpec,
        mut new: NewActivity,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        let id = new.activity_id;
        let owner = self.auto_owner_id().await?;
        new.owner_id = Some(owner.to_string());
        let sent = new.labels.identity();
        let record = match self.run(Command::Begin { new }).await {
            // The lease ran out before a renewal noticed (a long pause, say):
            // this process is alive, so it registers anew and begins again.
            Err(err) if err.kind() == crate::error::ErrorKind::Conflict => {
                self.forget_auto_owner(&owner).await;
                let mut new =
                    spec.validate(id, &self.inner.labels, &|labels| self.warn_if_undeclared(labels))?;
                new.owner_id = Some(self.auto_owner_id().await?.to_string());
                let again = new.labels.identity();
                let record = self.run(Command::Begin { new }).await?.into_record()?;
                self.count_if_folded(again, &record);
                return Ok(record);
            }
            other => other?.into_record(),
        }?;
        self.count_if_folded(sent, &record);
        Ok(record)
    }

    /// Counts a begin whose labels the store folded. The engine records a
    /// begin under the very label set it was sent unless it folds them
    /// (`store::engine::bound_labels`), so comparing which set the record
    /// holds is enough, and costs an unfolded begin one comparison.
    fn count_if_folded(&self, sent: usize, record: &ActivityRecord) {
        if record.labels.identity() != sent {
            self.inner
                .labels_folded
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// How many begins through this ledger had labels folded into `other`
    /// because they were outside a vocabulary or past a limit on distinct
    /// lanes or label sets (`[labels]`, [`Cardinality`](crate::domain::Cardinality)).
    /// Counted by this ledger since it was built, not by the store: sum it
    /// over the processes that share one.
    pub fn labels_folded(&self) -> u64 {
        self.inner
            .labels_folded
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Marks the record `id` executing (at `at`, or now).
    ///
    /// Starting an executing record changes nothing; starting an `abandoned`
    /// record resurrects it.
    ///
    /// # Errors
    /// `NotFound`; `Conflict` for a settled or `unsettled` record;
    /// `InvalidInput` for a bad timestamp.
    ///
    /// # Cancel safety
    /// The start is submitted when the future is first polled; dropping
    /// the future after that does not withdraw it.
    pub async fn start(
        &self,
        id: ActivityId,
        at: Option<Timestamp>,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        let started = self.transition(id, Transition::Start { at }).await;
        self.count_refusal(started, Rejection::LaneFull)
    }

    /// One attempt to start `id`, its refusal not counted: the caller
    /// waits in line and counts only the refusal it gives up on.
    pub(crate) fn try_start(
        &self,
        id: ActivityId,
        at: Option<Timestamp>,
    ) -> impl Future<Output = Result<Arc<ActivityRecord>, LedgerError>> + '_ {
        self.transition(id, Transition::Start { at })
    }

    /// Settles the record `id`. A settle for a reaped record is absorbed as
    /// a late settle: the record stays reaped, with `late_settle` set.
    ///
    /// # Errors
    /// `NotFound`; `Conflict` when a different outcome already landed;
    /// `InvalidInput` for a bad timestamp.
    ///
    /// # Cancel safety
    /// The settle is submitted when the future is first polled; dropping
    /// the future after that does not withdraw it.
    pub async fn settle(
        &self,
        id: ActivityId,
        settlement: Settlement,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        self.transition(id, settlement.into()).await
    }

    /// Cancels the record `id`: an abort the ledger observed, settled and not
    /// leaked.
    ///
    /// # Errors
    /// `NotFound`; `Conflict` when it already succeeded or failed.
    ///
    /// # Cancel safety
    /// The cancel is submitted when the future is first polled; dropping
    /// the future after that does not withdraw it.
    pub async fn cancel(
        &self,
        id: ActivityId,
        reason: Option<String>,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        self.transition(id, Transition::Cancel { reason, at: None }).await
    }

    /// Refines the model of the record `id`, in flight, to `model`: the one
    /// its call was dispatched to. The first refinement replaces the
    /// begin's model; the same model again changes nothing; a different one
    /// folds it to `unknown`, for good. The model is redacted and kept
    /// within the label limits as a begin's is, and the call counts in the
    /// aggregate of its final model.
    ///
    /// # Errors
    /// `Invalid` for an empty model; `NotFound`; `Conflict` when the record
    /// is no longer in flight.
    ///
    /// # Cancel safety
    /// The refinement is submitted when the future is first polled;
    /// dropping the future after that does not withdraw it.
    pub async fn refine(
        &self,
        id: ActivityId,
        model: impl Into<String>,
    ) -> Result<Arc<ActivityRecord>, LedgerError> {
        let model = model.into();
        self.run(Command::Refine { id, model }).await?.into_record()
    }

    /// Submits `transition` of the record `id` now; the future resolves with
    /// the record as it landed. A plain future rather than an `async fn`, so
    /// that the futures of starts and settles built on it stay small.
    fn transition(&self, id: ActivityId, transition: Transition) -> RecordReply {
        RecordReply(self.run(Command::Transition { id, transition }))
    }

    /// The record `id`, reaped first if it is past its bound.
    ///
    /// # Errors
    /// `NotFound`.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future loses only the answer.
    pub async fn get(&self, id: ActivityId) -> Result<Arc<ActivityRecord>, LedgerError> {
        self.run(Command::Get { id }).await?.into_record()
    }

    /// Reaps every record past its bound and reports what it reaped.
    ///
    /// # Errors
    /// `Storage`.
    ///
    /// # Cancel safety
    /// Cancel safe: the pass runs to completion; only the answer is lost.
    pub async fn reap(&self) -> Result<ReapedCounts, LedgerError> {
        self.run(Command::Reap).await?.into_reaped()
    }

    /// Reaps, then reports the ledger as operators read it.
    ///
    /// # Errors
    /// `Storage`.
    ///
    /// # Cancel safety
    /// Cancel safe: the reap runs to completion; only the answer is lost.
    pub async fn snapshot(&self, options: SnapshotOptions) -> Result<Snapshot, LedgerError> {
        let mut snapshot = self.run(Command::Snapshot { options }).await?.into_snapshot()?;
        // Here rather than in the store: off the store's thread.
        let config = &self.inner.config;
        snapshot.note_mismatches(config.lanes(), config.policy());
        Ok(snapshot)
    }

    /// Deletes settled and reaped records older than the retention period,
    /// in small batches (one transaction each) so that writers are never
    /// stalled behind it. Returns how many it deleted. The counters those
    /// records were counted in (calls, outcomes, reaps, late settles) are
    /// never lowered.
    ///
    /// # Errors
    /// `Storage`.
    ///
    /// # Cancel safety
    /// Cancel safe: every batch is atomic; a dropped future stops between
    /// batches.
    pub async fn prune(&self) -> Result<usize, LedgerError> {
        let mut total = 0;
        loop {
            let deleted = self
                .run(Command::Prune { limit: PRUNE_BATCH })
                .await?
                .into_pruned()?;
            total += deleted;
            if deleted < PRUNE_BATCH {
                return Ok(total);
            }
            tokio::task::yield_now().await;
        }
    }

    /// How many records the store holds (in flight, settled or reaped).
    ///
    /// # Errors
    /// `Storage`.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn stored_records(&self) -> Result<i64, LedgerError> {
        Ok(self.run(Command::Stats).await?.into_stats()?.stored_records)
    }

    /// Shuts the ledger down cleanly: releases the owner the builder
    /// registered (its unfinished records are cancelled now, not reaped
    /// when the lease runs out), then waits until every command already
    /// submitted has landed, cancels from dropped handles included, and
    /// closes the store (for SQLite: the transitions written ahead are
    /// applied to the tables, its writer thread stops and the file is
    /// closed). Every clone of this ledger shares the store, so every
    /// clone is closed.
    ///
    /// # Errors
    /// None of its own: a release that fails is logged, and closing a
    /// closed ledger is a no-op. Commands submitted afterwards fail with
    /// [`ErrorKind::Closed`](crate::error::ErrorKind::Closed) (the memory store,
    /// with nothing to flush, keeps serving).
    ///
    /// # Cancel safety
    /// Not cancel safe in effect: the close is submitted at the first poll
    /// and goes on if this future is dropped; only the wait is lost.
    pub async fn close(&self) -> Result<(), LedgerError> {
        if let Some(auto) = &self.inner.auto_owner {
            let current = auto.current.lock().await.take();
            if let Some((id, renewals)) = current {
                renewals.abort();
                if let Err(err) = self.run(Command::ReleaseOwner { id }).await {
                    tracing::warn!(error = %err, "cannot release this process's owner at close");
                }
            }
        }
        self.inner.store.close().await?;
        Ok(())
    }

    pub(crate) fn cancel_detached(&self, id: ActivityId, reason: &str) {
        self.run_detached(Command::Transition {
            id,
            transition: Transition::Cancel {
                reason: Some(reason.to_owned()),
                at: None,
            },
        });
    }

    /// Submits `command` from a synchronous context (a `Drop`). The store
    /// applies it whether or not anyone awaits the answer, and wakes the
    /// line for what it frees; a failure is logged when a runtime is there
    /// to watch it.
    pub(crate) fn run_detached(&self, command: Command) {
        let landed = self.inner.store.execute(command);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                match landed.await {
                    // A begin that was refused left nothing to cancel.
                    Err(err) if err.kind() != crate::error::ErrorKind::NotFound => {
                        tracing::warn!(error = %err, "a command from a dropped handle failed");
                    }
                    _ => {}
                }
            });
        }
    }
}

/// Cancels the record a [`Ledger::begin`] submitted if its future is dropped
/// before the handle exists.
struct BeginGuard<'a> {
    ledger: &'a Ledger,
    id: ActivityId,
    armed: bool,
    /// The cancel reason a drop records.
    dropped: &'static str,
}

impl Drop for BeginGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.ledger.cancel_detached(self.id, self.dropped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LedgerConfig;

    #[tokio::test]
    async fn a_lane_next_to_capped_lanes_is_warned_about_once() {
        let config = LedgerConfig::default()
            .with_lane_cap("svc::fake-provider", 2)
            .unwrap();
        let ledger = Ledger::builder(config).build().unwrap();
        for _ in 0..3 {
            let call = ledger
                .begin(ActivitySpec::new("svc", "fakeprovider"))
                .await
                .unwrap();
            call.settle(Outcome::Success).await.unwrap();
        }
        let _capped = ledger
            .begin(ActivitySpec::new("svc", "fake-provider"))
            .await
            .unwrap();
        let warned = ledger.inner.undeclared_lanes.lock().unwrap();
        let lanes: Vec<String> = warned.iter().map(ToString::to_string).collect();
        assert_eq!(lanes, ["svc::fakeprovider"], "the capped lane is declared");
    }

    #[tokio::test]
    async fn two_ledgers_on_one_thread_each_warn_of_an_undeclared_lane() {
        // The same literals, on the same thread: the second ledger must not
        // take the first one's labels as already checked.
        let config = || LedgerConfig::default().with_lane_cap("svc::capped", 1).unwrap();
        let ledgers = [
            Ledger::builder(config()).build().unwrap(),
            Ledger::builder(config()).build().unwrap(),
        ];
        for ledger in &ledgers {
            let call = ledger.begin(ActivitySpec::new("svc", "uncapped")).await.unwrap();
            call.settle(Outcome::Success).await.unwrap();
        }
        for ledger in &ledgers {
            let warned = ledger.inner.undeclared_lanes.lock().unwrap();
            let lanes: Vec<String> = warned.iter().map(ToString::to_string).collect();
            assert_eq!(lanes, ["svc::uncapped"]);
        }
    }

    /// A ledger capping `kb::ollama` at one on `url`, and the lanes its
    /// store wakes, as a watcher beside the ledger's own hears them.
    fn watched(url: &str) -> (Ledger, crate::clock::FakeClock, Arc<Mutex<Vec<Option<String>>>>) {
        let config = LedgerConfig::default().with_lane_cap("kb::ollama", 1).unwrap();
        let clock = crate::clock::FakeClock::at(Timestamp::from_millis(1_786_000_000_000));
        let ledger = Ledger::builder(config)
            .store_url(url)
            .clock(clock.clone())
            .build()
            .unwrap();
        let woken = Arc::new(Mutex::new(Vec::new()));
        let heard = Arc::clone(&woken);
        ledger.inner.store.watch_capacity(Arc::new(move |lane| {
            heard.lock().unwrap().push(lane.map(ToString::to_string));
        }));
        (ledger, clock, woken)
    }

    #[tokio::test]
    async fn each_slot_or_place_freed_on_a_capped_lane_wakes_once_and_nothing_else_does() {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = format!("sqlite://{}", dir.path().join("ledger.db").display());
        for url in ["memory:", sqlite.as_str()] {
            let (ledger, clock, woken) = watched(url);
            let taken = || std::mem::take(&mut *woken.lock().unwrap());
            let capped = || ActivitySpec::new("kb", "ollama");
            // A grant wakes no one: the waiter admitted passes its turn on.
            let mut first = ledger.begin(capped()).await.unwrap();
            first.start().await.unwrap();
            let second = ledger.begin(capped()).await.unwrap();
            assert_eq!(taken(), [None::<String>; 0], "{url}: a begin and a grant");
            // A waiting record that leaves the line frees a place in it.
            second.cancel(None).await.unwrap();
            assert_eq!(taken(), [Some("kb::ollama".to_owned())], "{url}: a cancel");
            first.settle(Outcome::Success).await.unwrap();
            assert_eq!(taken(), [Some("kb::ollama".to_owned())], "{url}: a settle");
            // No one waits on a lane without a cap, nor on a direct call.
            let mut free = ledger.begin(ActivitySpec::new("kb", "other")).await.unwrap();
            free.start().await.unwrap();
            free.settle(Outcome::Success).await.unwrap();
            let mut direct = ledger
                .begin(capped().admission(crate::domain::record::Admission::Direct))
                .await
                .unwrap();
            direct.start().await.unwrap();
            direct.settle(Outcome::Success).await.unwrap();
            assert_eq!(taken(), [None::<String>; 0], "{url}: uncapped and direct calls");
            // A leak reaped frees its slot.
            let mut leaked = ledger.begin(capped()).await.unwrap();
            leaked.start().await.unwrap();
            std::mem::forget(leaked);
            clock.advance(Duration::from_secs(7 * 86_400));
            assert_eq!(ledger.reap().await.unwrap().total(), 1);
            assert_eq!(taken(), [Some("kb::ollama".to_owned())], "{url}: a reap");
        }
    }

    #[tokio::test]
    async fn without_caps_no_lane_is_tracked() {
        let ledger = Ledger::builder(LedgerConfig::default()).build().unwrap();
        let _call = ledger.begin(ActivitySpec::new("svc", "p")).await.unwrap();
        assert!(ledger.inner.undeclared_lanes.lock().unwrap().is_empty());
    }
}
