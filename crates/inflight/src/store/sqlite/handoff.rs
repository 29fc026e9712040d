//! Who runs a command: the caller itself, when no group is running, or the
//! writer thread, which groups the commands that queue while a transaction
//! is written into the next one (group commit).
//!
//! Handing a command to another thread and its reply back costs two
//! wake-ups of a sleeping thread. On a virtual machine each is an
//! interrupt between virtual processors, and together they cost a lone
//! caller several times its command's SQL (docs/performance.md, "A lone
//! caller runs its own command"). So under `normal`, a caller that finds no
//! group running runs its command on its own thread, after the commands
//! queued before it, in one group: at most [`INLINE_MAX`] commands, each
//! about one record (a begin, a transition, a read of one record) or one
//! owner's lease. It then runs what queued meanwhile, while that stays small,
//! for up to [`INLINE_FOR`], and leaves the rest to the writer thread. Those
//! it answers resubmit within microseconds, so under a few concurrent callers
//! many groups run without a hand-off to the writer thread and back
//! (`normal_8` from about 19,000 to about 26,000 lifecycles a second). A reap
//! pass, a snapshot, a prune or an owner's
//! release can touch any number of records, and always goes to the writer
//! thread: a mass expiry must not hold an async worker. So do groups larger
//! than [`INLINE_MAX`]: once one ran, the writer thread keeps gathering them
//! until a smaller group runs.
//!
//! Under `full`, a commit waits for the disk's sync: a caller on an async
//! runtime's worker must not block that long, so every command goes to the
//! writer thread.
//!
//! Either way one transaction runs at a time (`State::busy`), commands run
//! in the order they were submitted, and each is answered only once the
//! transaction that holds it committed.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::error::LedgerError;
use crate::store::sql::group::{Batch, Published, MAX_GROUP};
use crate::store::{Command, Reply, StoreFuture};

use super::checkpoint::Checkpointer;
use super::rows::Statements;
use super::writer::{apply_journal, begin_without_waiting, rollback, run_group, Begun};

/// The most commands a caller runs on its own thread in one group: about
/// a third of a millisecond's SQL under `normal`.
pub(super) const INLINE_MAX: usize = 32;

/// How long a caller goes on running, on its own thread, the groups that
/// queue while it runs one, before it leaves them to the writer thread.
const INLINE_FOR: Duration = Duration::from_micros(250);

/// What the writer thread is asked to do.
enum Job {
    /// Run a command and answer it.
    Run(Command, oneshot::Sender<Result<Reply, LedgerError>>),
    /// Stop, once every job queued before this one has been answered;
    /// answered once the connection is closed.
    Close(oneshot::Sender<()>),
}

/// The connection, the statements prepared on it and the checkpointer its
/// commits nudge: what runs a group, owned by whoever runs one.
///
/// Self-referential, with `unsafe`, for two measured gains: the statements
/// live as long as the connection and are found by the address of their
/// text (rusqlite's `prepare_cached` hashed each text twice a use, about
/// 40,000 of the writer's 285,000 instructions a lifecycle, 14 %, at
/// `f77409e`); and the core moves to a lone caller's thread, which runs its
/// own command (593 to 610 µs a lifecycle before, 203 to 210 µs after, in
/// session 11: docs/performance.md, "A lone caller runs its own command").
pub(super) struct Core {
    /// Borrows `conn`; dropped first (`Drop`).
    statements: ManuallyDrop<Statements<'static>>,
    /// Leaked by [`Core::new`] so that `statements` can borrow it for as
    /// long as the core lives; taken back and closed by `Drop`.
    conn: NonNull<Connection>,
    checkpointer: Option<Checkpointer>,
}

// SAFETY: a `Core` is only used under the `Handoff::core` mutex, by one
// thread at a time; SQLite's bundled build is threadsafe, and a connection
// with its statements may move between threads as long as no two use them
// at once. (`Statement` is not `Send` only because it borrows the
// connection, which moves with it.)
unsafe impl Send for Core {}

impl Core {
    pub(super) fn new(conn: Connection, checkpointer: Checkpointer) -> Self {
        let conn = NonNull::from(Box::leak(Box::new(conn)));
        // SAFETY: `conn` stays allocated until `Drop`, which drops the
        // statements borrowing it first.
        let statements = Statements::new(unsafe { conn.as_ref() });
        Self {
            statements: ManuallyDrop::new(statements),
            conn,
            checkpointer: Some(checkpointer),
        }
    }

    pub(super) fn statements(&mut self) -> &mut Statements<'static> {
        &mut self.statements
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        // The checkpointer's connection closes first, so that the writer's,
        // the last to close, copies the rest of the log and deletes it.
        if let Some(checkpointer) = self.checkpointer.take() {
            checkpointer.stop();
        }
        // SAFETY: the statements are dropped once, here, before the
        // connection they borrow; the connection was leaked from a `Box` by
        // `new` and is taken back once.
        unsafe {
            ManuallyDrop::drop(&mut self.statements);
            drop(Box::from_raw(self.conn.as_ptr()));
        }
    }
}

/// What the store and its writer thread share.
pub(super) struct Handoff {
    state: Mutex<State>,
    /// The writer thread waits on it for commands.
    work: Condvar,
    /// `None` once the store is closed.
    core: Mutex<Option<Core>>,
    /// Whether a lone caller may run its command itself (`normal`).
    inline: bool,
    config: Arc<LedgerConfig>,
    clock: Arc<dyn Clock>,
    published: Arc<Published>,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// A group is running, on the writer thread or on a caller's.
    busy: bool,
    /// The writer thread is waiting on `work` (for work, or for more
    /// commands to join its group).
    idle: bool,
    /// How many queued commands would complete the group the writer thread
    /// gathers (`busy` is then its own); 0 when it gathers none.
    wanted: usize,
    /// How many commands the last group held.
    last_group: usize,
    /// A close was asked for: no command is taken after it.
    closing: bool,
    /// Those who asked for a close after the first, answered with it.
    also_closing: Vec<oneshot::Sender<()>>,
    /// The connection is closed.
    closed: bool,
}

impl Handoff {
    pub(super) fn new(
        core: Core,
        inline: bool,
        config: Arc<LedgerConfig>,
        clock: Arc<dyn Clock>,
        published: Arc<Published>,
    ) -> Self {
        Self {
            state: Mutex::new(State {
                last_group: 1,
                ..State::default()
            }),
            work: Condvar::new(),
            core: Mutex::new(Some(core)),
            inline,
            config,
            clock,
            published,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `command` on this thread, after the small commands queued
    /// before it, when no group is running (see the module's doc); or queues
    /// it for the writer thread.
    pub(super) fn submit(&self, command: Command) -> StoreFuture {
        let mut state = self.state();
        if state.closing {
            return StoreFuture::ready(Err(LedgerError::closed()));
        }
        if self.inline && !state.busy && state.last_group <= INLINE_MAX && is_small(&command) {
            if let Some(queued) = take_small(&mut state.queue, INLINE_MAX - 1) {
                state.busy = true;
                drop(state);
                return self.run_here(queued, command);
            }
        }
        let (reply, answer) = oneshot::channel();
        state.queue.push_back(Job::Run(command, reply));
        self.wake_writer(&state);
        drop(state);
        answered(answer)
    }

    /// Runs `queued` and then `command` as one group on this thread, then
    /// what queued meanwhile for up to [`INLINE_FOR`], holding `busy`.
    fn run_here(&self, queued: Batch, command: Command) -> StoreFuture {
        // Clears `busy` however this ends, a panic included, and hands what
        // is left queued to the writer thread.
        let mut busy = Release {
            handoff: self,
            largest: 1,
        };
        let mut core = self.core.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(core) = core.as_mut() else {
            return StoreFuture::ready(Err(LedgerError::closed()));
        };
        if !matches!(begin_without_waiting(core.statements()), Ok(true)) {
            // Another process holds the write lock (or BEGIN failed): the
            // writer thread waits for it, or meets the error, in this
            // caller's stead. Queued again before `busy` is cleared, ahead
            // of what queued since, so that nothing submitted later runs
            // first.
            let (reply, answer) = oneshot::channel();
            let mut state = self.state();
            state.queue.push_front(Job::Run(command, reply));
            give_back(&mut state.queue, queued);
            return answered(answer);
        }
        busy.largest = queued.len() + 1;
        let own = queued.run_then(command, |commands| self.run_group(core, commands, Begun::Yes));
        // Those answered resubmit within microseconds: running their next
        // commands here spares the writer thread's wake-up and theirs. The
        // clock is read only once there are some: a lone caller pays one
        // look at the queue.
        let mut until = None;
        loop {
            // Taken in a statement of its own: a guard made in a `while let`
            // condition would hold the state's lock through the group (every
            // submitter would block on it) and deadlock the give-back below.
            let taken = take_small(&mut self.state().queue, INLINE_MAX);
            let Some(batch) = taken.filter(|batch| batch.len() > 0) else {
                break;
            };
            let until = *until.get_or_insert_with(|| Instant::now() + INLINE_FOR);
            if !matches!(begin_without_waiting(core.statements()), Ok(true)) {
                give_back(&mut self.state().queue, batch);
                break;
            }
            busy.largest = busy.largest.max(batch.len());
            batch.run(|commands| self.run_group(core, commands, Begun::Yes));
            if Instant::now() >= until {
                break;
            }
        }
        if let Some(checkpointer) = &core.checkpointer {
            checkpointer.nudge();
        }
        StoreFuture::ready(own)
    }

    /// Queues `command` without waking the writer thread, as a command
    /// queued during a group is found once it ends.
    #[cfg(test)]
    pub(super) fn queue_quietly(&self, command: Command) -> StoreFuture {
        let (reply, answer) = oneshot::channel();
        self.state().queue.push_back(Job::Run(command, reply));
        answered(answer)
    }

    /// Runs `commands` as one group on `core`'s connection.
    fn run_group(
        &self,
        core: &mut Core,
        commands: Vec<Command>,
        begun: Begun,
    ) -> Vec<Result<Reply, LedgerError>> {
        run_group(
            core.statements(),
            &self.config,
            self.clock.as_ref(),
            &self.published,
            commands,
            begun,
        )
    }

    /// Wakes the writer thread if it sleeps while commands wait: for work,
    /// or for more commands to join the group it is gathering.
    fn wake_writer(&self, state: &State) {
        // While a caller runs a group, the writer would find it busy and
        // sleep again: that caller wakes it once done (`Release`).
        let gathering = state.wanted > 0;
        if state.idle
            && (!state.busy && !state.queue.is_empty() || gathering && state.queue.len() >= state.wanted)
        {
            self.work.notify_one();
        }
    }

    /// Asks the writer thread to stop once every command queued before has
    /// been answered; `done` hears once the connection is closed.
    pub(super) fn close(&self, done: oneshot::Sender<()>) {
        let mut state = self.state();
        if state.closed {
            let _ = done.send(());
            return;
        }
        if state.closing {
            // Answered once the first close is done.
            state.also_closing.push(done);
            return;
        }
        state.closing = true;
        state.queue.push_back(Job::Close(done));
        // A gathering writer stops waiting for callers: none may come.
        if state.idle {
            self.work.notify_one();
        }
    }

    /// The writer thread: runs what callers queue, in groups, until a close.
    pub(super) fn write_loop(&self) {
        let _stopped = Stopped(self);
        let mut state = self.state();
        loop {
            while state.queue.is_empty() || state.busy {
                state.idle = true;
                state = self.work.wait(state).unwrap_or_else(PoisonError::into_inner);
                state.idle = false;
            }
            let mut group = Group::default();
            group.take(&mut state.queue);
            state.busy = true;
            if group.closing.is_none() {
                let last = state.last_group;
                let mut held = Some(state);
                let Group { batch, closing } = &mut group;
                batch.wait_for_callers(last, |batch, left| {
                    let mut state = held.take().expect("the state is held between waits");
                    let wanted = last - batch.len();
                    if state.queue.len() < wanted {
                        // Woken once the group is complete, not by each
                        // caller: it starts no earlier.
                        state.idle = true;
                        state.wanted = wanted;
                        state = self
                            .work
                            .wait_timeout(state, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                        state.idle = false;
                        state.wanted = 0;
                    }
                    take(batch, closing, &mut state.queue);
                    held = Some(state);
                    closing.is_none()
                });
                state = held.expect("the state is held after the wait");
            }
            drop(state);
            let ran = group.batch.len();
            let mut core = self.core.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(core) = core.as_mut() {
                if ran > 0 {
                    group
                        .batch
                        .run(|commands| self.run_group(core, commands, Begun::No));
                    if let Some(checkpointer) = &core.checkpointer {
                        checkpointer.nudge();
                    }
                }
            }
            if let Some(done) = group.closing {
                // Closed before the caller of `close` hears of it; commands
                // queued after the close are dropped with the queue, and
                // their callers told the store closed.
                if let Some(core) = core.as_mut() {
                    if let Err(err) = apply_journal(core.statements()) {
                        tracing::warn!(error = %err, "SQLite rows written ahead not applied at close; the next writer applies them");
                    }
                }
                // Nothing is queued after a close: `submit` refuses once it
                // is asked for.
                *core = None;
                drop(core);
                let mut state = self.state();
                state.closed = true;
                let also = std::mem::take(&mut state.also_closing);
                drop(state);
                for done in std::iter::once(done).chain(also) {
                    let _ = done.send(());
                }
                return;
            }
            drop(core);
            state = self.state();
            state.busy = false;
            state.last_group = ran.max(1);
        }
    }
}

/// Closes the store if the writer thread ends by a panic: what the group
/// wrote is undone and the connection closed, so that no other process
/// waits on a write lock no one will release; callers queued and to come
/// are told it closed rather than left waiting.
struct Stopped<'a>(&'a Handoff);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let core = self.0.core.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(mut core) = core {
                rollback(core.statements());
            }
            let mut state = self.0.state();
            state.closing = true;
            state.closed = true;
            let queued = std::mem::take(&mut state.queue);
            let also = std::mem::take(&mut state.also_closing);
            drop(state);
            drop((queued, also));
        }
    }
}

/// Whether `command` is about one record or one owner's lease, so that a
/// caller may run it on its own thread.
fn is_small(command: &Command) -> bool {
    match command {
        Command::Begin { .. }
        | Command::Transition { .. }
        | Command::Refine { .. }
        | Command::Get { .. }
        | Command::RegisterOwner { .. }
        | Command::RenewOwner { .. } => true,
        Command::Reap
        | Command::Snapshot { .. }
        | Command::Prune { .. }
        | Command::Stats
        | Command::ReleaseOwner { .. } => false,
    }
}

/// Clears `busy` when a caller's groups end, records the largest as the
/// last group, and hands what queued meanwhile to the writer thread.
struct Release<'a> {
    handoff: &'a Handoff,
    /// The largest group run: 1 when none ran, as after a lone caller's.
    largest: usize,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The command panicked mid-transaction: what it wrote is undone,
            // so that the next group begins on a clean connection.
            let mut core = self.handoff.core.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(core) = core.as_mut() {
                rollback(core.statements());
            }
        }
        let mut state = self.handoff.state();
        state.busy = false;
        state.last_group = self.largest;
        self.handoff.wake_writer(&state);
    }
}

/// The commands of one transaction and their callers, and a close that
/// ends it.
#[derive(Default)]
struct Group {
    batch: Batch,
    closing: Option<oneshot::Sender<()>>,
}

impl Group {
    /// Moves queued jobs into the group.
    fn take(&mut self, queue: &mut VecDeque<Job>) {
        take(&mut self.batch, &mut self.closing, queue);
    }
}

/// Moves queued jobs into `batch`, up to [`MAX_GROUP`] commands, stopping at
/// a close.
fn take(batch: &mut Batch, closing: &mut Option<oneshot::Sender<()>>, queue: &mut VecDeque<Job>) {
    while batch.len() < MAX_GROUP && closing.is_none() {
        match queue.pop_front() {
            Some(Job::Run(command, reply)) => batch.push(command, reply),
            Some(Job::Close(done)) => *closing = Some(done),
            None => return,
        }
    }
}

/// Moves every queued job into a batch when there are at most `most` and
/// each is a small command (`is_small`), which a caller may run on its own
/// thread; `None` otherwise.
fn take_small(queue: &mut VecDeque<Job>, most: usize) -> Option<Batch> {
    let small = queue.len() <= most
        && queue
            .iter()
            .all(|job| matches!(job, Job::Run(command, _) if is_small(command)));
    small.then(|| {
        let mut batch = Batch::default();
        let mut closing = None;
        take(&mut batch, &mut closing, queue);
        batch
    })
}

/// Puts a batch taken from the front of the queue back there, in order.
fn give_back(queue: &mut VecDeque<Job>, batch: Batch) {
    let (commands, replies) = batch.into_parts();
    for (command, reply) in commands.into_iter().zip(replies).rev() {
        queue.push_front(Job::Run(command, reply));
    }
}

/// The future of a queued command's answer; a store that closed before
/// answering it says so.
fn answered(answer: oneshot::Receiver<Result<Reply, LedgerError>>) -> StoreFuture {
    StoreFuture::pending(async move { answer.await.map_err(|_| LedgerError::closed())? })
}
