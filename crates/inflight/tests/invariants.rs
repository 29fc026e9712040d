//! The ledger cannot drift: after any sequence of operations, the counts the
//! snapshot reports agree with the records themselves, and each operation
//! answers what the records before it call for, refusals included.

mod common;

use std::time::Duration;

use common::*;
use inflight::{
    ActivityId, ActivityRecord, ActivitySpec, Disposition, ErrorKind, FailureStage, Outcome, Settlement,
    Since, SnapshotOptions, State,
};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

#[derive(Debug, Clone)]
enum Op {
    Begin {
        lane: usize,
        class: usize,
        started: bool,
    },
    Start(usize),
    Settle(usize, bool),
    Cancel(usize),
    Advance(u64),
    Reap,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // The capped lane half of the time, so that it fills.
        3 => (prop_oneof![Just(0), 0..3usize], 0..3usize, any::<bool>())
            .prop_map(|(lane, class, started)| Op::Begin { lane, class, started }),
        2 => (0..64usize).prop_map(Op::Start),
        2 => (0..64usize, any::<bool>()).prop_map(|(i, ok)| Op::Settle(i, ok)),
        1 => (0..64usize).prop_map(Op::Cancel),
        2 => (1..30u64).prop_map(Op::Advance),
        1 => Just(Op::Reap),
    ]
}

const LANES: [(&str, &str); 3] = [
    ("knowledge-base", "ollama"),
    ("memory-core", "ollama"),
    ("kb", "openai"),
];
const CLASSES: [Option<&str>; 3] = [Some("embedding"), Some("chat"), None];
/// `LANES[0]`'s cap; the other lanes have none.
const CAP: i64 = 2;

/// How the operations of a run were answered.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Tally {
    ok: usize,
    lane_full: usize,
    conflict: usize,
}

impl Tally {
    fn count(&mut self, answer: Result<(), ErrorKind>) {
        match answer {
            Ok(()) => self.ok += 1,
            Err(ErrorKind::LaneFull) => self.lane_full += 1,
            Err(ErrorKind::Conflict) => self.conflict += 1,
            // Compared with the expected answer before it is counted.
            Err(other) => unreachable!("{other:?} was not expected"),
        }
    }

    fn add(&mut self, other: Tally) {
        self.ok += other.ok;
        self.lane_full += other.lane_full;
        self.conflict += other.conflict;
    }
}

/// What a start of `record` must answer, from the records as they stood:
/// a lane with a cap admits a record while the executing ones and those
/// waiting ahead of it in line (`enqueuedAt`, then id) leave a slot; a
/// `newcomer` (begun started) is behind every waiting one.
fn admission(
    records: &[ActivityRecord],
    lane: (&str, &str),
    place: Option<&ActivityRecord>,
) -> Result<(), ErrorKind> {
    if lane != LANES[0] {
        return Ok(());
    }
    let in_lane = |r: &&ActivityRecord| (r.labels.service.as_str(), r.labels.provider.as_str()) == lane;
    let executing = records
        .iter()
        .filter(in_lane)
        .filter(|r| r.state == State::Executing)
        .count();
    let ahead = records
        .iter()
        .filter(in_lane)
        .filter(|r| r.state == State::Waiting)
        .filter(|r| place.is_none_or(|me| (r.enqueued_at, r.activity_id) < (me.enqueued_at, me.activity_id)))
        .count();
    if (executing + ahead) as i64 >= CAP {
        Err(ErrorKind::LaneFull)
    } else {
        Ok(())
    }
}

/// What a settle (`Some(success)`) or a cancel (`None`) of `record` must
/// answer: in flight, it lands; reaped, it is absorbed as a late settle;
/// settled, it is a no-op when it agrees and a conflict when it does not.
fn ending(record: &ActivityRecord, success: Option<bool>) -> Result<(), ErrorKind> {
    let agrees = matches!(
        (record.state, success),
        (State::Waiting | State::Executing | State::Reaped, _)
            | (State::Succeeded, Some(true))
            | (State::Failed, Some(false))
            | (State::Cancelled, None)
    );
    if agrees {
        Ok(())
    } else {
        Err(ErrorKind::Conflict)
    }
}

/// What a start of `record` must answer: a waiting (or abandoned) record
/// starts when admitted; an executing one is left as it is; any other
/// cannot start.
fn starting(records: &[ActivityRecord], record: &ActivityRecord) -> Result<(), ErrorKind> {
    match (record.state, record.disposition) {
        (State::Waiting, _) | (State::Reaped, Some(Disposition::Abandoned)) => admission(
            records,
            (record.labels.service.as_str(), record.labels.provider.as_str()),
            Some(record),
        ),
        (State::Executing, _) => Ok(()),
        _ => Err(ErrorKind::Conflict),
    }
}

/// Runs `ops`; every answer must be the one the records before it call for
/// (refusals included), and the counts must agree with the records after
/// each.
async fn run(backend: Backend, ops: Vec<Op>) -> Result<Tally, TestCaseError> {
    let h = Harness::new(
        backend,
        config()
            .with_lane_cap("knowledge-base::ollama", CAP as u32)
            .unwrap(),
    );
    let mut ids: Vec<ActivityId> = Vec::new();
    let mut records: Vec<ActivityRecord> = Vec::new();
    let mut tally = Tally::default();
    for op in ops {
        let pick = |i: usize| (!records.is_empty()).then(|| &records[i % records.len()]);
        let (expected, outcome) = match op {
            Op::Begin { lane, class, started } => {
                let (service, provider) = LANES[lane];
                let mut spec = ActivitySpec::new(service, provider);
                if let Some(class) = CLASSES[class] {
                    spec = spec.class(class);
                }
                let expected = if started {
                    spec = spec.started_at(h.ledger.now());
                    admission(&records, LANES[lane], None)
                } else {
                    Ok(())
                };
                let begun = h.ledger.begin_record(spec).await;
                if let Ok(record) = &begun {
                    ids.push(record.activity_id);
                }
                (expected, begun.map(drop))
            }
            Op::Start(i) => match pick(i) {
                Some(record) => (
                    starting(&records, record),
                    h.ledger.start(record.activity_id, None).await.map(drop),
                ),
                None => continue,
            },
            Op::Settle(i, success) => match pick(i) {
                Some(record) => {
                    let settlement = Settlement::new(if success {
                        Outcome::Success
                    } else {
                        Outcome::Failure(FailureStage::Provider)
                    });
                    (
                        ending(record, Some(success)),
                        h.ledger.settle(record.activity_id, settlement).await.map(drop),
                    )
                }
                None => continue,
            },
            Op::Cancel(i) => match pick(i) {
                Some(record) => (
                    ending(record, None),
                    h.ledger.cancel(record.activity_id, None).await.map(drop),
                ),
                None => continue,
            },
            Op::Advance(minutes) => {
                h.clock.advance(Duration::from_secs(60 * minutes));
                (Ok(()), Ok(()))
            }
            Op::Reap => (Ok(()), h.ledger.reap().await.map(drop)),
        };
        let answered = outcome.as_ref().map(|_| ()).map_err(|err| err.kind());
        prop_assert_eq!(
            answered,
            expected,
            "{:?} answered {:?}",
            op,
            outcome.err().map(|err| err.to_string())
        );
        tally.count(answered);
        records = check(&h, &ids).await?;
    }
    Ok(tally)
}

/// Checks the counts against the records, and returns the records.
async fn check(h: &Harness, ids: &[ActivityId]) -> Result<Vec<ActivityRecord>, TestCaseError> {
    let snap = h
        .ledger
        .snapshot(
            SnapshotOptions::default()
                .with_since(Since::At(inflight::Timestamp::MIN))
                .with_limit(10_000)
                .unwrap(),
        )
        .await
        .unwrap();
    let mut records: Vec<ActivityRecord> = Vec::new();
    for id in ids {
        records.push(ActivityRecord::clone(&h.ledger.get(*id).await.unwrap()));
    }
    let count = |pred: &dyn Fn(&ActivityRecord) -> bool| records.iter().filter(|r| pred(r)).count() as i64;
    let now = h.ledger.now();

    prop_assert_eq!(snap.total_activities, records.len() as i64);
    prop_assert_eq!(snap.total_in_flight, count(&|r| r.state.is_in_flight()));
    prop_assert_eq!(snap.total_reaped, count(&|r| r.state == State::Reaped));
    prop_assert_eq!(snap.total_late_settles, count(&|r| r.late_settle));
    for record in records.iter().filter(|r| r.state.is_in_flight()) {
        prop_assert!(
            record.reapable_at.unwrap() >= now,
            "a record past its bound is still in flight"
        );
    }
    for (key, lane) in &snap.native_admission {
        let in_lane = |r: &ActivityRecord| format!("{}::{}", r.labels.service, r.labels.provider) == *key;
        prop_assert_eq!(
            lane.executing,
            count(&|r| in_lane(r) && r.state == State::Executing)
        );
        prop_assert_eq!(lane.waiting, count(&|r| in_lane(r) && r.state == State::Waiting));
        if let Some(cap) = lane.cap {
            prop_assert!(lane.executing <= i64::from(cap), "{} over its cap", key);
        }
    }
    let mut calls = 0;
    for aggregate in &snap.aggregates {
        calls += aggregate.calls;
        let ended = aggregate.successes + aggregate.failures + aggregate.cancelled + aggregate.reaped.total();
        prop_assert_eq!(
            aggregate.calls,
            ended + aggregate.in_flight,
            "every call is in exactly one place"
        );
        prop_assert!(aggregate.in_flight >= 0);
    }
    prop_assert_eq!(calls, records.len() as i64);
    prop_assert_eq!(
        snap.aggregates.iter().map(|a| a.successes).sum::<i64>(),
        count(&|r| r.state == State::Succeeded)
    );
    Ok(records)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `cases` random games of up to `most` operations on `backend`; each
/// kind of refusal must have come up in some of them, or the games test
/// less than they seem to.
fn games(backend: Backend, cases: u32, most: usize) {
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let total = std::cell::Cell::new(Tally::default());
    let result = runner.run(&proptest::collection::vec(op(), 1..most), |ops| {
        let tally = runtime().block_on(run(backend, ops))?;
        let mut sum = total.get();
        sum.add(tally);
        total.set(sum);
        Ok(())
    });
    if let Err(err) = result {
        panic!("{err}");
    }
    let total = total.get();
    eprintln!("{backend:?}: {total:?}");
    assert!(total.lane_full > 0 && total.conflict > 0, "{total:?}");
}

#[test]
fn counts_never_drift_from_the_records_in_memory() {
    games(Backend::Memory, 1024, 40);
}

#[test]
fn counts_never_drift_from_the_records_in_sqlite() {
    games(Backend::Sqlite, 256, 40);
}

#[cfg(feature = "postgres")]
#[test]
fn counts_never_drift_from_the_records_in_postgres() {
    games(Backend::Postgres, 48, 40);
}
