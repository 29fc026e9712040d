//! The SQL stores' slow work, kept for a while so that a slow request can
//! say what it waited on: a group of commands (a retention prune, a reap
//! pass, a commit that checkpointed the log) or a checkpoint of SQLite's own
//! thread. Only work past [`SLOW_WORK`] is kept, in a short ring; beside it,
//! every group is counted with its time ([`GroupsRun`]), so that a request
//! held up by many groups, none of them slow, can say so too. A group pays
//! two clock reads and two atomic additions.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::store::{Command, GroupsRun, SlowWork, SLOW_WORK};

/// How many pieces of slow work are kept: the latest.
const KEPT: usize = 64;

/// The latest slow work of one store, and its groups counted.
#[derive(Debug, Default)]
pub(crate) struct SlowLog {
    kept: Mutex<VecDeque<SlowWork>>,
    groups: AtomicU64,
    group_us: AtomicU64,
}

impl SlowLog {
    /// Counts a group begun at `began` and keeps it if it was slow.
    pub(crate) fn group_ended(&self, began: Instant, kinds: Kinds) {
        let took = began.elapsed();
        self.groups.fetch_add(1, Ordering::Relaxed);
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.group_us.fetch_add(us, Ordering::Relaxed);
        self.keep(began, took, || kinds.describe());
    }

    /// The groups counted so far.
    pub(crate) fn groups_run(&self) -> GroupsRun {
        GroupsRun {
            groups: self.groups.load(Ordering::Relaxed),
            time: Duration::from_micros(self.group_us.load(Ordering::Relaxed)),
        }
    }

    /// Keeps the work begun at `began`, which took `took`, if it was slow;
    /// `what` is asked only then.
    pub(crate) fn keep(&self, began: Instant, took: Duration, what: impl FnOnce() -> String) {
        if took < SLOW_WORK {
            return;
        }
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.len() == KEPT {
            kept.pop_front();
        }
        kept.push_back(SlowWork {
            began,
            took,
            what: what(),
        });
    }

    /// The slow work that ran at some time between `from` and `to`, oldest
    /// first.
    pub(crate) fn between(&self, from: Instant, to: Instant) -> Vec<SlowWork> {
        let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        kept.iter()
            .filter(|work| work.overlaps(from, to))
            .cloned()
            .collect()
    }
}

/// The commands of a group, counted by kind, as a slow group names them.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Kinds([u16; Kinds::NAMES.len()]);

impl Kinds {
    const NAMES: [&'static str; 10] = [
        "begin",
        "transition",
        "get",
        "reap",
        "snapshot",
        "prune",
        "stats",
        "register",
        "renew",
        "release",
    ];

    pub(crate) fn of(commands: &[Command]) -> Self {
        let mut kinds = Self::default();
        for command in commands {
            let index = match command {
                Command::Begin { .. } => 0,
                Command::Transition { .. } | Command::Refine { .. } => 1,
                Command::Get { .. } => 2,
                Command::Reap => 3,
                Command::Snapshot { .. } => 4,
                Command::Prune { .. } => 5,
                Command::Stats => 6,
                Command::RegisterOwner { .. } => 7,
                Command::RenewOwner { .. } => 8,
                Command::ReleaseOwner { .. } => 9,
            };
            kinds.0[index] = kinds.0[index].saturating_add(1);
        }
        kinds
    }

    /// `a group of N commands (2 begin, 1 prune)`.
    pub(crate) fn describe(self) -> String {
        let total: u32 = self.0.iter().map(|count| u32::from(*count)).sum();
        let parts: Vec<String> = Self::NAMES
            .iter()
            .zip(self.0)
            .filter(|(_, count)| *count > 0)
            .map(|(name, count)| format!("{count} {name}"))
            .collect();
        let noun = if total == 1 { "command" } else { "commands" };
        format!("a group of {total} {noun} ({})", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_slow_work_is_kept_and_found_by_the_time_it_ran() {
        let log = SlowLog::default();
        log.keep(Instant::now(), Duration::from_millis(1), || {
            unreachable!("fast work is not described")
        });
        let began = Instant::now() - Duration::from_millis(250);
        log.keep(began, began.elapsed(), || "a checkpoint".to_owned());
        let kept = log.between(began, began);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].what, "a checkpoint");
        assert!(kept[0].took >= Duration::from_millis(250));
        assert!(log
            .between(began - Duration::from_secs(2), began - Duration::from_secs(1))
            .is_empty());
        assert!(log
            .between(
                Instant::now() + Duration::from_secs(1),
                Instant::now() + Duration::from_secs(2)
            )
            .is_empty());
    }

    #[test]
    fn the_ring_keeps_the_latest() {
        let log = SlowLog::default();
        let began = Instant::now() - Duration::from_secs(1);
        for n in 0..KEPT + 3 {
            log.keep(began, began.elapsed(), || n.to_string());
        }
        let kept = log.between(began, Instant::now());
        assert_eq!(kept.len(), KEPT);
        assert_eq!(kept[0].what, "3");
    }

    #[test]
    fn every_group_is_counted_with_its_time_and_a_checkpoint_is_not() {
        let log = SlowLog::default();
        let start = log.groups_run();
        log.group_ended(
            Instant::now() - Duration::from_millis(30),
            Kinds::of(&[Command::Reap]),
        );
        log.group_ended(
            Instant::now() - Duration::from_millis(20),
            Kinds::of(&[Command::Stats]),
        );
        log.keep(
            Instant::now() - Duration::from_millis(500),
            Duration::from_millis(500),
            || "a checkpoint".to_owned(),
        );
        let ran = log.groups_run().since(start);
        assert_eq!(ran.groups, 2);
        assert!(
            ran.time >= Duration::from_millis(50) && ran.time < Duration::from_millis(500),
            "{ran:?}"
        );
        // Neither group was slow: only the checkpoint is kept.
        assert_eq!(
            log.between(Instant::now() - Duration::from_secs(1), Instant::now())
                .len(),
            1
        );
    }

    #[test]
    fn a_group_names_its_commands_by_kind() {
        let kinds = Kinds::of(&[Command::Reap, Command::Prune { limit: 1 }, Command::Reap]);
        assert_eq!(kinds.describe(), "a group of 3 commands (2 reap, 1 prune)");
        assert_eq!(
            Kinds::of(&[Command::Stats]).describe(),
            "a group of 1 command (1 stats)"
        );
    }
}
