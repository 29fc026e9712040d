//! Bounded storage: settled and reaped records are pruned past their
//! retention, and what operators count survives the pruning.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use inflight::domain::{ClassBounds, ReapPolicy};
use inflight::{ActivitySpec, ErrorKind, LedgerConfig, Outcome, Settlement, SnapshotOptions};

/// embedding: deadline 10 s (bound 40 s); records kept 60 s.
fn short_retention() -> LedgerConfig {
    let classes = BTreeMap::from([(
        "embedding".to_owned(),
        ClassBounds::new(Duration::from_secs(10), None).unwrap(),
    )]);
    LedgerConfig::new(ReapPolicy::new(classes, 4.0).unwrap())
        .with_retention(Duration::from_secs(60))
        .unwrap()
}

fn spec() -> ActivitySpec {
    ActivitySpec::new("knowledge-base", "ollama").class("embedding")
}

against_every_store!(pruning_keeps_counts_and_deletes_only_what_is_past_retention);

async fn pruning_keeps_counts_and_deletes_only_what_is_past_retention(backend: Backend) {
    let h = Harness::new(backend, short_retention());
    let owner = h
        .ledger
        .register_owner("worker", Duration::from_secs(30))
        .await
        .unwrap();
    h.ledger.release_owner(&owner.owner_id).await.unwrap();
    let leaked = h.ledger.begin_record(spec().started_at(T0)).await.unwrap();
    let settled = h.ledger.begin_record(spec().started_at(T0)).await.unwrap();
    h.ledger
        .settle(settled.activity_id, Outcome::Success.into())
        .await
        .unwrap();
    h.clock.advance(Duration::from_secs(41));
    assert_eq!(h.ledger.reap().await.unwrap().unsettled, 1);
    let recent = h
        .ledger
        .begin_record(spec().started_at(T0 + 41_000))
        .await
        .unwrap();
    h.ledger
        .settle(recent.activity_id, Outcome::Success.into())
        .await
        .unwrap();

    h.clock.advance(Duration::from_secs(30)); // settled one: 71 s old; reaped one: 30 s
    assert_eq!(h.ledger.prune().await.unwrap(), 1);
    assert_eq!(
        h.ledger.get(settled.activity_id).await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    assert_eq!(h.ledger.stored_records().await.unwrap(), 2);

    h.clock.advance(Duration::from_secs(60));
    assert_eq!(h.ledger.prune().await.unwrap(), 2);
    assert_eq!(
        h.ledger.get(leaked.activity_id).await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    assert_eq!(h.ledger.stored_records().await.unwrap(), 0);
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_activities, 3);
    assert_eq!(
        snap.total_reaped, 1,
        "a reaped record's count survives the pruning of the record"
    );
    assert_eq!(snap.lane("knowledge-base::ollama").unwrap().reaped.unsettled, 1);
    let all = h
        .ledger
        .snapshot(SnapshotOptions::default().with_since(inflight::Since::At(inflight::Timestamp::MIN)))
        .await
        .unwrap();
    assert_eq!(all.aggregates[0].successes, 2);
    assert!(
        all.owners.is_empty(),
        "owners that ended past retention are pruned too"
    );
}

#[tokio::test]
async fn a_million_lifecycles_through_a_short_retention_keep_storage_bounded_and_totals_exact() {
    let h = Harness::new(Backend::Memory, short_retention());
    let mut most_stored = 0;
    let mut leaks = 0;
    let failure = Settlement::new(Outcome::Failure(inflight::FailureStage::Provider));
    for i in 0..1_000_000_u32 {
        let id = h.ledger.begin_record(spec()).await.unwrap().activity_id;
        h.ledger.start(id, None).await.unwrap();
        match i % 1000 {
            0 => leaks += 1, // its settle is lost
            1..=99 => drop(h.ledger.settle(id, failure).await.unwrap()),
            _ => drop(h.ledger.settle(id, Outcome::Success.into()).await.unwrap()),
        }
        h.clock.advance(Duration::from_millis(1));
        if i % 10_000 == 9_999 {
            h.ledger.reap().await.unwrap();
            h.ledger.prune().await.unwrap();
            most_stored = most_stored.max(h.ledger.stored_records().await.unwrap());
        }
    }
    // 60 s of retention at one lifecycle per millisecond, plus one pruning
    // interval: never the million.
    assert!(most_stored <= 70_000 + 100, "stored {most_stored}");
    h.clock.advance(Duration::from_secs(3600));
    h.ledger.reap().await.unwrap();
    h.clock.advance(Duration::from_secs(61)); // the last reaped pass their retention too
    h.ledger.prune().await.unwrap();
    assert_eq!(h.ledger.stored_records().await.unwrap(), 0);

    let snap = h
        .ledger
        .snapshot(SnapshotOptions::default().with_since(inflight::Since::At(inflight::Timestamp::MIN)))
        .await
        .unwrap();
    assert_eq!(snap.total_activities, 1_000_000);
    assert_eq!(snap.total_reaped, leaks);
    assert_eq!(
        snap.lane("knowledge-base::ollama").unwrap().reaped.unsettled,
        leaks
    );
    let aggregate = &snap.aggregates[0];
    assert_eq!(aggregate.calls, 1_000_000);
    assert_eq!(aggregate.failures, 99_000);
    assert_eq!(aggregate.successes, 1_000_000 - 99_000 - leaks);
    assert_eq!(aggregate.in_flight, 0);
}
