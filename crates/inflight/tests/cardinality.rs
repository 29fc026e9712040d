//! Bounded cardinality: callers that send new label values on every call
//! create at most the configured number of lanes and label sets; past it,
//! calls are recorded under `other` (or refused, when so configured).

mod common;

use std::collections::BTreeSet;
use std::num::NonZeroU32;

use common::{config, snapshot, Backend, Harness};
use inflight::domain::{Cardinality, Overflow, Vocabularies};
use inflight::{ActivitySpec, ErrorKind, LedgerConfig, Outcome, State};

fn bounded(max_lanes: u32, max_aggregates: u32) -> LedgerConfig {
    config().with_cardinality(
        Cardinality::default()
            .with_max_lanes(NonZeroU32::new(max_lanes).unwrap())
            .with_max_aggregates(NonZeroU32::new(max_aggregates).unwrap()),
    )
}

fn call(service: &str, model: &str) -> ActivitySpec {
    ActivitySpec::new(service.to_owned(), "ollama")
        .class("embedding")
        .operation_stage("ingest")
        .model(model.to_owned())
}

/// The distinct lanes and label sets a snapshot's aggregates hold.
async fn census(h: &Harness) -> (usize, usize) {
    let snap = snapshot(&h.ledger).await;
    let lanes: BTreeSet<_> = snap
        .aggregates
        .iter()
        .map(|a| (a.key.service.clone(), a.key.provider.clone()))
        .collect();
    (lanes.len(), snap.aggregates.len())
}

async fn a_new_lane_past_the_limit_is_recorded_as_other_other(backend: Backend) {
    let h = Harness::new(backend, bounded(3, 1_000));
    for i in 0..10 {
        let record = h
            .ledger
            .begin_record(call(&format!("svc-{i}"), "m"))
            .await
            .unwrap();
        let lane = (record.labels.service.as_str(), record.labels.provider.as_str());
        if i < 3 {
            assert_eq!(lane, (format!("svc-{i}").as_str(), "ollama"), "call {i}");
        } else {
            assert_eq!(lane, ("other", "other"), "call {i}");
            assert_eq!(
                record.labels.class.as_str(),
                "embedding",
                "the class keeps its bounds"
            );
        }
        assert_eq!(record.state, State::Waiting);
    }
    assert_eq!(h.ledger.labels_folded(), 7);
    // Three lanes and the overflow lane; every call counted.
    assert_eq!(census(&h).await, (4, 4));
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_activities, 10);
    assert_eq!(snap.lane("other::other").unwrap().waiting, 7);
}

async fn a_new_label_set_past_the_limit_keeps_its_lane_and_folds_stage_and_model(backend: Backend) {
    let h = Harness::new(backend, bounded(100, 5));
    for i in 0..20 {
        let mut handle = h.ledger.begin(call("kb", &format!("model-{i}"))).await.unwrap();
        handle.start().await.unwrap();
        let record = handle.settle(Outcome::Success).await.unwrap();
        let expected = if i < 5 {
            format!("model-{i}")
        } else {
            "other".to_owned()
        };
        assert_eq!(&*record.labels.model, expected, "call {i}");
        assert_eq!(record.labels.service.as_str(), "kb");
    }
    assert_eq!(h.ledger.labels_folded(), 15);
    assert_eq!(census(&h).await, (1, 6));
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_succeeded, 20);
}

async fn a_declared_lane_is_never_folded(backend: Backend) {
    let config = bounded(1, 1_000).with_lane_cap("declared::ollama", 2).unwrap();
    let h = Harness::new(backend, config);
    h.ledger.begin_record(call("first", "m")).await.unwrap();
    let record = h
        .ledger
        .begin_record(ActivitySpec::new("declared", "ollama").class("embedding"))
        .await
        .unwrap();
    assert_eq!(record.labels.service.as_str(), "declared");
    assert_eq!(h.ledger.labels_folded(), 0);
}

async fn refuse_mode_refuses_past_the_limit_and_records_nothing(backend: Backend) {
    let config = config().with_cardinality(
        Cardinality::default()
            .with_max_lanes(NonZeroU32::new(1).unwrap())
            .with_overflow(Overflow::Refuse),
    );
    let h = Harness::new(backend, config);
    h.ledger.begin_record(call("first", "m")).await.unwrap();
    let err = h.ledger.begin_record(call("second", "m")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.message().contains("limit of 1 lanes"), "{err}");
    // A known lane is still served.
    h.ledger.begin_record(call("first", "other-model")).await.unwrap();
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_activities, 2);
    assert_eq!(h.ledger.labels_folded(), 0);
}

async fn vocabularies_fold_unlisted_values(backend: Backend) {
    let config = config().with_cardinality(Cardinality::default().with_vocabularies(Vocabularies {
        service: Some(["knowledge-base".to_owned(), "memory-core".to_owned()].into()),
        ..Vocabularies::default()
    }));
    let h = Harness::new(backend, config);
    let kept = h.ledger.begin_record(call("memory-core", "m")).await.unwrap();
    assert_eq!(kept.labels.service.as_str(), "memory-core");
    let folded = h.ledger.begin_record(call("tenant-42", "m")).await.unwrap();
    assert_eq!(
        (folded.labels.service.as_str(), folded.labels.provider.as_str()),
        ("other", "ollama")
    );
    assert_eq!(h.ledger.labels_folded(), 1);
}

against_every_store!(
    a_new_lane_past_the_limit_is_recorded_as_other_other,
    a_new_label_set_past_the_limit_keeps_its_lane_and_folds_stage_and_model,
    a_declared_lane_is_never_folded,
    refuse_mode_refuses_past_the_limit_and_records_nothing,
    vocabularies_fold_unlisted_values,
);

/// A million distinct label values (four per call) leave the ledger with
/// at most its limits of lanes and label sets, plus the overflow ones.
#[tokio::test]
async fn a_million_distinct_label_values_stay_within_the_limits() {
    const CALLS: usize = 250_000;
    let h = Harness::new(Backend::Memory, bounded(64, 1_000));
    for i in 0..CALLS {
        let spec = ActivitySpec::new(format!("s{i}"), format!("p{i}"))
            .class("embedding")
            .operation_stage(format!("o{i}"))
            .model(format!("m{i}"));
        let mut handle = h.ledger.begin(spec).await.unwrap();
        handle.start().await.unwrap();
        handle.settle(Outcome::Success).await.unwrap();
    }
    let (lanes, aggregates) = census(&h).await;
    eprintln!(
        "{CALLS} calls, {} distinct values: {lanes} lanes, {aggregates} label sets",
        CALLS * 4
    );
    assert!(lanes <= 64 + 1, "{lanes} lanes");
    assert!(aggregates <= 1_000 + 1, "{aggregates} label sets");
    assert_eq!(h.ledger.labels_folded(), (CALLS - 64) as u64);
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_succeeded, CALLS as i64, "every call is counted");
}
