//! The ledger cannot drift: after any sequence of operations, the counts the
//! snapshot reports agree with the records themselves.

mod common;

use std::time::Duration;

use common::*;
use inflight::{
    ActivityId, ActivityRecord, ActivitySpec, FailureStage, Outcome, Settlement, Since, SnapshotOptions,
    State,
};
use proptest::prelude::*;

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
        3 => (0..3usize, 0..3usize, any::<bool>()).prop_map(|(lane, class, started)| Op::Begin { lane, class, started }),
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

async fn run(backend: Backend, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let h = Harness::new(
        backend,
        config().with_lane_cap("knowledge-base::ollama", 2).unwrap(),
    );
    let mut ids: Vec<ActivityId> = Vec::new();
    for op in ops {
        let pick = |i: usize| (!ids.is_empty()).then(|| ids[i % ids.len()]);
        // Refusals (conflicts, a full lane) are part of the game; only
        // storage errors would be a failure.
        let outcome = match op {
            Op::Begin { lane, class, started } => {
                let (service, provider) = LANES[lane];
                let mut spec = ActivitySpec::new(service, provider);
                if let Some(class) = CLASSES[class] {
                    spec = spec.class(class);
                }
                if started {
                    spec = spec.started_at(h.ledger.now());
                }
                h.ledger
                    .begin_record(spec)
                    .await
                    .map(|record| ids.push(record.activity_id))
            }
            Op::Start(i) => match pick(i) {
                Some(id) => h.ledger.start(id, None).await.map(drop),
                None => Ok(()),
            },
            Op::Settle(i, success) => match pick(i) {
                Some(id) => {
                    let settlement = Settlement::new(if success {
                        Outcome::Success
                    } else {
                        Outcome::Failure(FailureStage::Provider)
                    });
                    h.ledger.settle(id, settlement).await.map(drop)
                }
                None => Ok(()),
            },
            Op::Cancel(i) => match pick(i) {
                Some(id) => h.ledger.cancel(id, None).await.map(drop),
                None => Ok(()),
            },
            Op::Advance(minutes) => {
                h.clock.advance(Duration::from_secs(60 * minutes));
                Ok(())
            }
            Op::Reap => h.ledger.reap().await.map(drop),
        };
        if let Err(err) = outcome {
            prop_assert_ne!(err.kind(), inflight::ErrorKind::Storage, "{}", err);
        }
        check(&h, &ids).await?;
    }
    Ok(())
}

async fn check(h: &Harness, ids: &[ActivityId]) -> Result<(), TestCaseError> {
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
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn counts_never_drift_from_the_records_in_memory(ops in proptest::collection::vec(op(), 1..40)) {
        runtime().block_on(run(Backend::Memory, ops))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn counts_never_drift_from_the_records_in_sqlite(ops in proptest::collection::vec(op(), 1..30)) {
        runtime().block_on(run(Backend::Sqlite, ops))?;
    }
}

#[cfg(feature = "postgres")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn counts_never_drift_from_the_records_in_postgres(ops in proptest::collection::vec(op(), 1..30)) {
        runtime().block_on(run(Backend::Postgres, ops))?;
    }
}
