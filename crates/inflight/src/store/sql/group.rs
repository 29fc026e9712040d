//! One group of commands in one transaction, for both SQL stores (group
//! commit): each command runs in turn and is acknowledged only once the
//! transaction committed.
//!
//! A storage failure must undo only the command it hit. A group first runs
//! without savepoints, which is what nearly every group does; if a command
//! meets a storage failure, the whole transaction is rolled back (nothing
//! was answered yet) and the group runs again with a savepoint per command,
//! so that the failure undoes that command alone. A group of one needs no
//! savepoint: its failure is its own. What else makes a group run again
//! (PostgreSQL's deadlocks, its deferred writes that missed, a wait for an
//! earlier group) is decided here too, once ([`run_group`]); each store
//! says how it begins, runs a command and commits ([`GroupTxn`]).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::domain::capacity::Capacity;
use crate::domain::record::{ActivityRecord, LaneKey};
use crate::domain::transition::Effect;
use crate::error::{ErrorKind, LedgerError};
use crate::stats::{CallSnapshot, CallStats};
use crate::store::sql::slow_log::{Kinds, SlowLog};
use crate::store::Watchers;
use crate::store::{Command, Reply};

use super::counts::PendingCounts;

/// How many times a group is run again after a deadlock or a
/// serialization failure.
const RETRIES: usize = 5;

/// The most commands grouped into one transaction.
pub(crate) const MAX_GROUP: usize = 256;

/// The longest a group waits for the callers of the previous one.
const GROUP_WAIT: Duration = Duration::from_micros(300);

/// The commands of one transaction and their callers.
#[derive(Default)]
pub(crate) struct Batch {
    commands: Vec<Command>,
    replies: Vec<oneshot::Sender<Result<Reply, LedgerError>>>,
}

impl Batch {
    pub(crate) fn push(&mut self, command: Command, reply: oneshot::Sender<Result<Reply, LedgerError>>) {
        self.commands.push(command);
        self.replies.push(reply);
    }

    pub(crate) fn len(&self) -> usize {
        self.commands.len()
    }

    /// Runs the commands with `run` and answers each caller.
    pub(crate) fn run(self, run: impl FnOnce(Vec<Command>) -> Vec<Result<Reply, LedgerError>>) {
        answer(self.replies, run(self.commands));
    }

    /// Runs the commands and then `last` with `run`, answering each caller;
    /// returns `last`'s result.
    #[cfg(feature = "sqlite")]
    pub(crate) fn run_then(
        mut self,
        last: Command,
        run: impl FnOnce(Vec<Command>) -> Vec<Result<Reply, LedgerError>>,
    ) -> Result<Reply, LedgerError> {
        self.commands.push(last);
        let mut results = run(self.commands);
        let own = results.pop().expect("one result per command");
        answer(self.replies, results);
        own
    }

    /// The commands and their callers, in order.
    #[cfg(feature = "sqlite")]
    pub(crate) fn into_parts(self) -> (Vec<Command>, Vec<oneshot::Sender<Result<Reply, LedgerError>>>) {
        (self.commands, self.replies)
    }

    /// Waits for the callers the last commit answered, when the last group
    /// (`last`) was larger than this one: they resubmit within
    /// microseconds, while a commit costs a round trip or a sync, so one
    /// commit then serves them all. A lone caller (a last group of one)
    /// never waits. `more` waits up to the time it is given for commands
    /// and adds them; it answers `false` when no more can come.
    pub(crate) fn wait_for_callers(
        &mut self,
        last: usize,
        mut more: impl FnMut(&mut Self, Duration) -> bool,
    ) {
        let until = Instant::now() + GROUP_WAIT;
        while self.len() < last {
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                return;
            };
            if !more(self, left) {
                return;
            }
        }
    }
}

/// Answers each caller with its command's result.
fn answer(
    replies: Vec<oneshot::Sender<Result<Reply, LedgerError>>>,
    results: Vec<Result<Reply, LedgerError>>,
) {
    for (reply, result) in replies.into_iter().zip(results) {
        // A caller that went away still had its command committed.
        let _ = reply.send(result);
    }
}

/// What a command did that a store publishes once it committed: the effect,
/// what it is about and the capacity it changed, kept until then.
#[derive(Debug, Clone)]
pub(crate) struct Landed {
    /// The record as the command left it: shared, not copied.
    record: Arc<ActivityRecord>,
    effect: Effect,
    /// What it did to its lane's capacity ([`change`](crate::domain::capacity::change)).
    capacity: Option<Capacity>,
}

impl Landed {
    /// `effect`, counted for `record`, if [`CallStats::land`], the
    /// watchers of capacity or those of ends have anything to do with it.
    pub(crate) fn of(
        record: &Arc<ActivityRecord>,
        effect: &Effect,
        capacity: Option<Capacity>,
    ) -> Option<Self> {
        let observed = matches!(
            effect,
            Effect::Reaped { .. } | Effect::Started { .. } | Effect::Settled { .. } | Effect::Resurrected
        );
        (observed || capacity.is_some()).then(|| Self {
            record: Arc::clone(record),
            effect: *effect,
            capacity,
        })
    }

    /// Hands it to `calls`.
    pub(crate) fn publish(&self, calls: &mut CallStats) {
        calls.land(self.record.activity_id, &self.record.labels, &self.effect);
    }

    /// The lane whose capacity it changed, and how, if it did.
    pub(crate) fn capacity(&self) -> Option<(LaneKey, Capacity)> {
        self.capacity
            .map(|change| (LaneKey::of(&self.record.labels), change))
    }
}

/// The [`Store`](crate::store::Store) methods a SQL store answers from its
/// `published` field ([`Published`]), written once for both: invoked inside
/// each store's `impl Store`.
macro_rules! answered_from_published {
    () => {
        fn call_stats(&self) -> crate::stats::CallSnapshot {
            self.published.call_stats()
        }

        fn slow_work(&self, from: std::time::Instant, to: std::time::Instant) -> Vec<crate::store::SlowWork> {
            self.published.slow.between(from, to)
        }

        fn groups_run(&self) -> crate::store::GroupsRun {
            self.published.slow.groups_run()
        }

        fn watch_capacity(&self, wake: crate::store::Wake) {
            self.published.watchers.add(wake);
        }

        fn watch_ends(&self, watch: crate::store::EndWatch) {
            self.published.watchers.add_end_watch(watch);
        }
    };
}
pub(crate) use answered_from_published;

/// Where a SQL store publishes what its committed commands did: to this
/// process's call histograms and reap log, and to the watchers of its
/// capacity; and its slow work (a group, a checkpoint).
#[derive(Default)]
pub(crate) struct Published {
    calls: Mutex<CallStats>,
    pub(crate) watchers: Watchers,
    pub(crate) slow: SlowLog,
}

impl Published {
    /// What `landed` holds, each command's apart.
    fn publish(&self, landed: &[Vec<Landed>]) {
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        for landed in landed.iter().filter(|landed| !landed.is_empty()) {
            for event in landed {
                event.publish(&mut calls);
            }
            calls.finish();
        }
        drop(calls);
        for (lane, change) in landed.iter().flatten().filter_map(Landed::capacity) {
            self.watchers.changed(&lane, change);
        }
        if self.watchers.watching_ends() {
            for event in landed.iter().flatten() {
                self.watchers.ended(&event.record, &event.effect);
            }
        }
    }

    /// The call histograms.
    pub(crate) fn call_stats(&self) -> CallSnapshot {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .snapshot()
    }
}

/// How a transaction undoes a command's storage failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// The whole transaction rolls back.
    Whole,
    /// The command's savepoint rolls back.
    PerCommand,
}

/// How a group's transaction runs: its isolation, and whether record
/// writes may wait to go out together (PostgreSQL's deferred writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Attempt {
    pub(crate) isolation: Isolation,
    pub(crate) defer: bool,
    /// The first attempt, whose transaction a store may have begun already.
    pub(crate) first: bool,
    /// Whether the attempt before yielded ([`Failed::Yield`]): the store
    /// waits for the earlier group before it begins.
    pub(crate) yielded: bool,
}

/// Why a transaction was rolled back.
#[derive(Debug)]
// SQLite, with one writer and nothing deferred, needs only the first two.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) enum Failed {
    /// A command hit a storage failure under [`Isolation::Whole`]: its
    /// error.
    Command(LedgerError),
    /// The transaction itself failed (begin, counters, commit).
    Transaction(LedgerError),
    /// A deadlock or serialization failure: run the group again.
    Retry(LedgerError),
    /// Deferred writes did not land as written: run the group again
    /// writing each at once, so that the command at fault is told.
    Redo,
    /// An earlier group of this process did not end in time: roll back,
    /// wait for it without holding locks, and run again.
    Yield,
}

/// What a committed transaction answers, and what each of its commands did
/// that landed.
pub(crate) type Committed = (Vec<Result<Reply, LedgerError>>, Vec<Vec<Landed>>);

/// Runs the group `commands` through `attempt` (one transaction each,
/// begun, run and committed by the store) until one commits or the group
/// fails; publishes what landed to `published` and answers each command.
/// `store` names the store in logs; `reruns` says whether it may ask for a
/// group to run again whole ([`Failed::Retry`], [`Failed::Redo`],
/// [`Failed::Yield`]), so that the commands are copied for another attempt
/// only when one may follow.
pub(crate) fn run_group(
    store: &str,
    commands: Vec<Command>,
    reruns: bool,
    published: &Published,
    attempt: impl FnMut(Vec<Command>, Attempt) -> Result<Committed, Failed>,
) -> Vec<Result<Reply, LedgerError>> {
    let (began, kinds) = (Instant::now(), Kinds::of(&commands));
    let results = attempts(store, commands, reruns, published, attempt);
    published.slow.group_ended(began, kinds);
    results
}

/// [`run_group`]'s attempts, until one commits or the group fails.
fn attempts(
    store: &str,
    commands: Vec<Command>,
    reruns: bool,
    published: &Published,
    mut attempt: impl FnMut(Vec<Command>, Attempt) -> Result<Committed, Failed>,
) -> Vec<Result<Reply, LedgerError>> {
    let count = commands.len();
    let mut spare = Some(commands);
    let mut next = Attempt {
        isolation: Isolation::Whole,
        defer: true,
        first: true,
        yielded: false,
    };
    let mut retries = 0;
    loop {
        let again = reruns || (count > 1 && next.isolation == Isolation::Whole);
        let commands = match spare.take() {
            Some(commands) if again => {
                spare = Some(commands.clone());
                commands
            }
            Some(commands) => commands,
            None => {
                return failed_all(
                    store,
                    count,
                    &LedgerError::new(ErrorKind::Storage, "no attempt left"),
                )
            }
        };
        let ran = attempt(commands, next);
        next.first = false;
        next.yielded = false;
        match ran {
            Ok((results, landed)) => {
                published.publish(&landed);
                return results;
            }
            Err(Failed::Command(_)) if next.isolation == Isolation::Whole && count > 1 => {
                next.isolation = Isolation::PerCommand;
            }
            Err(Failed::Command(err)) if count == 1 => return vec![Err(err)],
            Err(Failed::Redo) if next.defer => next.defer = false,
            Err(Failed::Redo) => {
                let err = LedgerError::new(ErrorKind::Storage, "a record write did not land");
                return failed_all(store, count, &err);
            }
            Err(Failed::Retry(err)) if retries < RETRIES => {
                retries += 1;
                tracing::debug!(error = %err, retries, "{store} group runs again");
                std::thread::sleep(retry_pause(retries));
            }
            // Contention, not a broken store: the callers may try again.
            Err(Failed::Retry(err)) => {
                let err = LedgerError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "the database kept refusing this group for lock contention ({err}) {} times; \
                         retry shortly",
                        RETRIES + 1
                    ),
                );
                return failed_all(store, count, &err);
            }
            // Rolled back: no lock of this group is held while it waits.
            Err(Failed::Yield) => next.yielded = true,
            Err(Failed::Command(err) | Failed::Transaction(err)) => return failed_all(store, count, &err),
        }
    }
}

/// How long a group waits before its `retries`th run after a deadlock:
/// up to `retries` × 500 µs, spread by the clock's nanoseconds, so that two
/// groups that deadlocked do not meet again in the same order at once.
fn retry_pause(retries: usize) -> Duration {
    let spread = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.subsec_nanos() % 500);
    Duration::from_micros(u64::from(spread) * retries as u64)
}

fn failed_all(store: &str, count: usize, err: &LedgerError) -> Vec<Result<Reply, LedgerError>> {
    if err.kind() == ErrorKind::Unavailable {
        tracing::warn!(error = %err, "{store} is unavailable");
    } else {
        tracing::error!(error = %err, "{store} transaction failed");
    }
    (0..count)
        .map(|_| Err(LedgerError::new(err.kind(), err.message().to_owned())))
        .collect()
}

/// One command's run in a group's transaction.
pub(crate) struct Ran {
    pub(crate) result: Result<Reply, LedgerError>,
    /// Its counter changes, for the group to write.
    pub(crate) counts: PendingCounts,
    /// What it did, to publish once the group is committed.
    pub(crate) landed: Vec<Landed>,
    /// Whether one of its statements failed, whatever the command answered.
    pub(crate) faulted: bool,
    /// What ends the whole transaction at once, if anything does.
    pub(crate) abort: Option<Failed>,
}

impl Ran {
    /// A command's run that ends the transaction at once with `failed`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn aborted(failed: Failed) -> Self {
        Self {
            abort: Some(failed),
            ..Self::of(Err(LedgerError::new(ErrorKind::Storage, "the transaction ended")))
        }
    }

    /// A command's run that ends with `result`.
    pub(crate) fn of(result: Result<Reply, LedgerError>) -> Self {
        Self {
            result,
            counts: PendingCounts::default(),
            landed: Vec::new(),
            faulted: false,
            abort: None,
        }
    }
}

/// A savepoint step of a command run with [`Isolation::PerCommand`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Savepoint {
    Open,
    Release,
    RollBack,
}

/// What a store does for [`run_commands`] inside a group's open
/// transaction.
pub(crate) trait GroupTxn {
    /// Runs `command` in the transaction.
    fn command(&mut self, command: Command) -> Ran;
    /// Opens, releases or rolls back the command's savepoint.
    fn savepoint(&mut self, step: Savepoint) -> Result<(), Failed>;
    /// Forgets what the store kept of what a rolled-back command wrote.
    fn forget(&mut self);
    /// Writes `counts` and forgets them: before a snapshot reads them.
    fn write_counts(&mut self, counts: &mut PendingCounts) -> Result<(), Failed>;
}

/// What the commands of a transaction did, for its store to write and
/// commit.
#[derive(Default)]
pub(crate) struct Outcome {
    pub(crate) results: Vec<Result<Reply, LedgerError>>,
    pub(crate) landed: Vec<Vec<Landed>>,
    /// The counter changes of the commands kept, written once per row.
    pub(crate) counts: PendingCounts,
}

/// Runs `commands` in the open transaction, from the first to the last.
/// A refusal keeps what time forced (a reap); a storage failure keeps
/// nothing of its command, its counts included.
pub(crate) fn run_commands(
    group: &mut impl GroupTxn,
    commands: Vec<Command>,
    isolation: Isolation,
) -> Result<Outcome, Failed> {
    let mut out = Outcome::default();
    for command in commands {
        if matches!(command, Command::Snapshot { .. }) {
            group.write_counts(&mut out.counts)?;
        }
        if isolation == Isolation::PerCommand {
            group.savepoint(Savepoint::Open)?;
        }
        let ran = group.command(command);
        if let Some(abort) = ran.abort {
            return Err(abort);
        }
        let keep = !ran.faulted && !matches!(&ran.result, Err(err) if err.kind() == ErrorKind::Storage);
        match isolation {
            Isolation::Whole if keep => {}
            Isolation::Whole => return Err(Failed::Command(failure(ran.result))),
            Isolation::PerCommand if keep => group.savepoint(Savepoint::Release)?,
            Isolation::PerCommand => {
                // What the command wrote is undone.
                group.savepoint(Savepoint::RollBack)?;
                group.savepoint(Savepoint::Release)?;
                group.forget();
            }
        }
        if keep {
            out.counts.merge(ran.counts);
            out.results.push(ran.result);
            out.landed.push(ran.landed);
        } else {
            out.results.push(Err(failure(ran.result)));
        }
    }
    Ok(out)
}

/// The error of a command whose statement failed, whatever it answered.
fn failure(result: Result<Reply, LedgerError>) -> LedgerError {
    result
        .err()
        .unwrap_or_else(|| LedgerError::new(ErrorKind::Storage, "a statement failed"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::record::ActivityId;

    fn get() -> Command {
        Command::Get {
            id: ActivityId::new(),
        }
    }

    fn storage(message: &str) -> LedgerError {
        LedgerError::new(ErrorKind::Storage, message.to_owned())
    }

    /// Runs a group of `count` commands whose attempts answer `answers` in
    /// turn; returns the answers and the attempts made.
    fn run(
        count: usize,
        reruns: bool,
        answers: Vec<Result<Committed, Failed>>,
    ) -> (Vec<Result<Reply, LedgerError>>, Vec<Attempt>) {
        let published = Published::default();
        let mut answers = answers.into_iter();
        let mut attempts = Vec::new();
        let results = run_group(
            "test",
            (0..count).map(|_| get()).collect(),
            reruns,
            &published,
            |commands, attempt| {
                assert_eq!(commands.len(), count);
                attempts.push(attempt);
                answers.next().expect("no attempt beyond those answered")
            },
        );
        (results, attempts)
    }

    fn committed(count: usize) -> Result<Committed, Failed> {
        Ok((
            (0..count).map(|_| Ok(Reply::Pruned(0))).collect(),
            vec![Vec::new(); count],
        ))
    }

    #[test]
    fn a_storage_failure_in_a_larger_group_runs_it_again_with_a_savepoint_per_command() {
        let (results, attempts) = run(2, false, vec![Err(Failed::Command(storage("x"))), committed(2)]);
        assert!(results.iter().all(Result::is_ok));
        assert_eq!(
            attempts
                .iter()
                .map(|a| (a.isolation, a.first))
                .collect::<Vec<_>>(),
            [(Isolation::Whole, true), (Isolation::PerCommand, false)]
        );
    }

    #[test]
    fn a_storage_failure_of_a_lone_command_is_its_answer() {
        let (results, attempts) = run(1, false, vec![Err(Failed::Command(storage("lone")))]);
        assert_eq!(attempts.len(), 1);
        assert_eq!(results[0].as_ref().unwrap_err().message(), "lone");
    }

    #[test]
    fn a_failed_transaction_fails_every_command_with_its_kind() {
        let unavailable = LedgerError::new(ErrorKind::Unavailable, "gone".to_owned());
        let (results, _) = run(3, true, vec![Err(Failed::Transaction(unavailable))]);
        assert_eq!(results.len(), 3);
        assert!(results
            .iter()
            .all(|result| result.as_ref().unwrap_err().kind() == ErrorKind::Unavailable));
    }

    #[test]
    fn a_deadlock_runs_the_group_again_a_bounded_number_of_times() {
        let deadlocks = (0..=RETRIES)
            .map(|_| Err(Failed::Retry(storage("deadlock"))))
            .collect();
        let (results, attempts) = run(1, true, deadlocks);
        assert_eq!(attempts.len(), RETRIES + 1);
        // Contention past the retries is the store being busy, not broken:
        // a 503 the caller may retry, never a 500.
        let err = results[0].as_ref().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unavailable);
        assert!(err.message().contains("(deadlock) 6 times"), "{err}");
        let (results, attempts) = run(
            1,
            true,
            vec![Err(Failed::Retry(storage("deadlock"))), committed(1)],
        );
        assert!(results[0].is_ok());
        assert_eq!(attempts.len(), 2);
    }

    #[test]
    fn writes_that_missed_run_the_group_again_undeferred_then_fail_it() {
        let (results, attempts) = run(2, true, vec![Err(Failed::Redo), Err(Failed::Redo)]);
        assert_eq!(
            attempts.iter().map(|a| a.defer).collect::<Vec<_>>(),
            [true, false]
        );
        assert!(results.iter().all(Result::is_err));
    }

    #[test]
    fn a_yield_waits_before_the_next_attempt_only() {
        let (results, attempts) = run(
            1,
            true,
            vec![Err(Failed::Yield), Err(Failed::Yield), committed(1)],
        );
        assert!(results[0].is_ok());
        assert_eq!(
            attempts.iter().map(|a| a.yielded).collect::<Vec<_>>(),
            [false, true, true]
        );
    }

    /// A store whose commands answer as told, counting savepoint steps.
    #[derive(Default)]
    struct Scripted {
        answers: Vec<Ran>,
        steps: Vec<Savepoint>,
        forgotten: usize,
    }

    impl GroupTxn for Scripted {
        fn command(&mut self, _command: Command) -> Ran {
            self.answers.remove(0)
        }
        fn savepoint(&mut self, step: Savepoint) -> Result<(), Failed> {
            self.steps.push(step);
            Ok(())
        }
        fn forget(&mut self) {
            self.forgotten += 1;
        }
        fn write_counts(&mut self, _counts: &mut PendingCounts) -> Result<(), Failed> {
            Ok(())
        }
    }

    #[test]
    fn a_command_that_failed_alone_is_undone_and_the_others_kept() {
        let refused = LedgerError::new(ErrorKind::NotFound, "no such record".to_owned());
        let mut store = Scripted {
            answers: vec![
                Ran::of(Ok(Reply::Pruned(1))),
                Ran::of(Err(storage("disk"))),
                Ran::of(Err(refused)),
            ],
            ..Scripted::default()
        };
        let outcome = run_commands(&mut store, vec![get(), get(), get()], Isolation::PerCommand).unwrap();
        use Savepoint::{Open, Release, RollBack};
        assert_eq!(
            store.steps,
            [Open, Release, Open, RollBack, Release, Open, Release]
        );
        assert_eq!(store.forgotten, 1);
        let kinds: Vec<_> = outcome
            .results
            .iter()
            .map(|r| r.as_ref().err().map(LedgerError::kind))
            .collect();
        assert_eq!(kinds, [None, Some(ErrorKind::Storage), Some(ErrorKind::NotFound)]);
        // The undone command landed nothing; a refusal keeps what time forced.
        assert_eq!(outcome.landed.len(), 2);
    }

    #[test]
    fn a_storage_failure_without_savepoints_fails_the_transaction_at_once() {
        let mut store = Scripted {
            answers: vec![Ran::of(Err(storage("disk"))), Ran::of(Ok(Reply::Pruned(1)))],
            ..Scripted::default()
        };
        let failed = run_commands(&mut store, vec![get(), get()], Isolation::Whole);
        assert!(matches!(failed, Err(Failed::Command(err)) if err.message() == "disk"));
        assert_eq!(store.answers.len(), 1, "the second command never ran");
    }
}
