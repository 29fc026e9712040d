//! The turn the writers of one store take, so that the commands of this
//! process land in the order they were submitted ([`Order`]).

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// How long a group waits, holding locks, for the earlier groups to end
/// before it rolls back and waits without them ([`Fault::Yield`]).
pub(super) const EARLIER_WAIT: Duration = Duration::from_millis(200);
/// Keeps the commands of this process landing in the order they were
/// submitted when several writers run groups at once.
///
/// One writer at a time holds the turn: it gathers a group, runs its
/// commands, and hands the turn on as it sends the group's writes. The
/// next writer's group runs beside those writes and the commit (on another
/// backend, and so another core). What it can see of the earlier groups is
/// ordered three ways: the records they wrote stay locked until they
/// commit, so locking them waits; before any other read it waits for every
/// earlier group's transaction to end (`PgTxn`); and it sends its own
/// `COMMIT` only once they have ended, so that nothing of it is visible,
/// or answered, before them.
///
/// An earlier group may still have to run again (its writes missed, or a
/// deadlock) and lock records then, some of which the later group may hold
/// while it waits for it: a cycle PostgreSQL cannot see, since one of its
/// edges is in this process. So the later group waits at most
/// [`EARLIER_WAIT`] holding locks; then it rolls back, waits without them,
/// and runs again ([`Fault::Yield`](super::txn::Fault::Yield)).
#[derive(Default)]
pub(super) struct Order {
    /// The turn, and the end of the last group that took it.
    turn: Mutex<Option<Arc<Done>>>,
    /// Whether several writers take it (`pool` above 1).
    pub(super) shared: bool,
}

impl Order {
    /// The order of `writers` writers.
    pub(super) fn of(writers: usize) -> Self {
        Self {
            turn: Mutex::default(),
            shared: writers > 1,
        }
    }
}

/// Whether a group's transaction, and every earlier group's, has ended
/// (committed, rolled back or failed).
#[derive(Default)]
pub(super) struct Done {
    ended: Mutex<bool>,
    changed: Condvar,
}

impl Done {
    /// Returns once the group and every earlier one have ended.
    pub(super) fn wait(&self) {
        let mut ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        while !*ended {
            ended = self.changed.wait(ended).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Whether the group and every earlier one have ended.
    pub(super) fn has_ended(&self) -> bool {
        *self.ended.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the group and every earlier one ended within `timeout`.
    pub(super) fn wait_for(&self, timeout: Duration) -> bool {
        let ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        let (ended, _) = self
            .changed
            .wait_timeout_while(ended, timeout, |ended| !*ended)
            .unwrap_or_else(PoisonError::into_inner);
        *ended
    }

    fn set(&self) {
        *self.ended.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.changed.notify_all();
    }
}

/// A group's turn: held from gathering it to sending its writes.
pub(super) struct Turn<'o> {
    held: Option<MutexGuard<'o, Option<Arc<Done>>>>,
    /// The end of the group that had the turn before.
    previous: Option<Arc<Done>>,
    own: Arc<Done>,
}

impl<'o> Turn<'o> {
    /// Waits for the turn: until the group before sends its writes.
    pub(super) fn take(order: &'o Order) -> Self {
        let mut held = order.turn.lock().unwrap_or_else(PoisonError::into_inner);
        let own = Arc::new(Done::default());
        let previous = held.replace(Arc::clone(&own));
        Self {
            held: Some(held),
            previous,
            own,
        }
    }

    /// Hands the turn on: the group's writes are about to be sent.
    pub(super) fn hand_on(&mut self) {
        self.held = None;
    }

    /// The end of the earlier groups, for reads to wait on.
    pub(super) fn previous(&self) -> Option<&Done> {
        self.previous.as_deref()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.held = None;
        // Ended only once every earlier group has: a later group that waits
        // on this one waits on them all.
        if let Some(previous) = &self.previous {
            previous.wait();
        }
        self.own.set();
    }
}
