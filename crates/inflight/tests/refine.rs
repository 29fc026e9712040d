//! Refinement: a record in flight learns the model its call was dispatched
//! to, and the call counts in the aggregate of its final model, on every
//! store.

mod common;

use std::time::Duration;

use common::{config, embedding, snapshot, Backend, Harness};
use inflight::domain::{Cardinality, Vocabularies};
use inflight::{ErrorKind, Outcome, Settlement, Snapshot, State};

/// The aggregate of `model` in `snap`: (calls, in flight, successes,
/// queue-wait average), or `None` when the snapshot lists none.
fn aggregate(snap: &Snapshot, model: &str) -> Option<(i64, i64, i64, Option<i64>)> {
    snap.aggregates
        .iter()
        .find(|a| &*a.key.model == model)
        .map(|a| (a.calls, a.in_flight, a.successes, a.avg_queue_wait_ms))
}

async fn the_first_refinement_sets_the_model_and_a_different_one_folds_it_for_good(backend: Backend) {
    let h = Harness::new(backend, config());
    let record = h.ledger.begin_record(embedding()).await.unwrap();
    assert!(!record.refined);
    let id = record.activity_id;

    let first = h.ledger.refine(id, "bge-m3").await.unwrap();
    assert_eq!((&*first.labels.model, first.refined), ("bge-m3", true));
    // The same model again changes nothing: a retry is harmless.
    let again = h.ledger.refine(id, " bge-m3 ").await.unwrap();
    assert_eq!(*again, *first);
    // A different one folds it to `unknown`, and nothing brings it back.
    let folded = h.ledger.refine(id, "llama3.1:8b").await.unwrap();
    assert_eq!(&*folded.labels.model, "unknown");
    let still = h.ledger.refine(id, "bge-m3").await.unwrap();
    assert_eq!(&*still.labels.model, "unknown");
    assert_eq!(*h.ledger.get(id).await.unwrap(), *still);
}

async fn a_first_refinement_to_the_begins_model_still_counts_as_the_first(backend: Backend) {
    let h = Harness::new(backend, config());
    let id = h.ledger.begin_record(embedding()).await.unwrap().activity_id;
    let same = h.ledger.refine(id, "nomic-embed-text").await.unwrap();
    assert_eq!((&*same.labels.model, same.refined), ("nomic-embed-text", true));
    let other = h.ledger.refine(id, "bge-m3").await.unwrap();
    assert_eq!(&*other.labels.model, "unknown");
}

async fn only_a_record_in_flight_can_be_refined(backend: Backend) {
    let h = Harness::new(backend, config());
    let mut handle = h.ledger.begin(embedding()).await.unwrap();
    handle.start().await.unwrap();
    // Executing: refined.
    assert_eq!(&*handle.refine("bge-m3").await.unwrap().labels.model, "bge-m3");
    let settled = handle.settle(Outcome::Success).await.unwrap();
    let err = h
        .ledger
        .refine(settled.activity_id, "other-model")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.to_string().contains("in flight"), "{err}");
    assert_eq!(*h.ledger.get(settled.activity_id).await.unwrap(), *settled);

    // Reaped: time passed, so the refinement is refused and the reap kept.
    let waiting = h.ledger.begin_record(embedding()).await.unwrap();
    h.clock.advance(Duration::from_secs(3600));
    let err = h.ledger.refine(waiting.activity_id, "bge-m3").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    let reaped = h.ledger.get(waiting.activity_id).await.unwrap();
    assert_eq!(
        (reaped.state, &*reaped.labels.model),
        (State::Reaped, "nomic-embed-text")
    );

    // No such record, and no model: nothing changes.
    let missing = inflight::ActivityId::new();
    assert_eq!(
        h.ledger.refine(missing, "m").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    let live = h.ledger.begin_record(embedding()).await.unwrap();
    let err = h.ledger.refine(live.activity_id, "  ").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("model"), "names the field: {err}");
    assert_eq!(*h.ledger.get(live.activity_id).await.unwrap(), *live);
}

async fn a_refined_model_is_redacted_and_kept_within_its_vocabulary(backend: Backend) {
    let config = config().with_cardinality(Cardinality::default().with_vocabularies(Vocabularies {
        model: Some(["nomic-embed-text".to_owned(), "bge-m3".to_owned()].into()),
        ..Vocabularies::default()
    }));
    let h = Harness::new(backend, config);
    let secret = h.ledger.begin_record(embedding()).await.unwrap();
    let redacted = h
        .ledger
        .refine(secret.activity_id, "sk-live-abc123")
        .await
        .unwrap();
    // `redacted` is outside the vocabulary too: folded, with the stage.
    assert_eq!(&*redacted.labels.model, "other");
    assert_eq!(redacted.labels.operation_stage.as_str(), "other");
    let listed = h.ledger.begin_record(embedding()).await.unwrap();
    let kept = h.ledger.refine(listed.activity_id, "bge-m3").await.unwrap();
    assert_eq!(&*kept.labels.model, "bge-m3");
    // The same unlisted model twice folds the same way, so it is "the same
    // model again", not a second one.
    let unlisted = h.ledger.begin_record(embedding()).await.unwrap();
    h.ledger.refine(unlisted.activity_id, "mxbai").await.unwrap();
    let twice = h.ledger.refine(unlisted.activity_id, "mxbai").await.unwrap();
    assert_eq!(&*twice.labels.model, "other");
}

async fn a_call_counts_in_the_aggregate_of_its_final_model(backend: Backend) {
    let h = Harness::new(backend, config());
    let mut moved = h.ledger.begin(embedding()).await.unwrap();
    let stays = h.ledger.begin(embedding()).await.unwrap();
    h.clock.advance(Duration::from_millis(400));
    moved.start().await.unwrap();
    let before = snapshot(&h.ledger).await;
    assert_eq!(aggregate(&before, "nomic-embed-text"), Some((2, 2, 0, None)));

    moved.refine("bge-m3").await.unwrap();
    let after = snapshot(&h.ledger).await;
    assert_eq!(aggregate(&after, "nomic-embed-text"), Some((1, 1, 0, None)));
    assert_eq!(aggregate(&after, "bge-m3"), Some((1, 1, 0, None)));
    assert_eq!(after.total_activities, before.total_activities);
    assert_eq!(after.total_in_flight, 2);

    // Its queue wait and outcome count where it ended.
    moved.settle(Outcome::Success).await.unwrap();
    let ended = snapshot(&h.ledger).await;
    assert_eq!(aggregate(&ended, "bge-m3"), Some((1, 0, 1, Some(400))));
    assert_eq!(aggregate(&ended, "nomic-embed-text"), Some((1, 1, 0, None)));
    let ends = |snap: &Snapshot, model: &str| {
        snap.aggregates
            .iter()
            .find(|a| &*a.key.model == model)
            .map_or(0, |a| a.totals.ends_ever())
    };
    assert_eq!(ends(&ended, "bge-m3"), 1);
    assert_eq!(ends(&ended, "nomic-embed-text"), 0);
    stays.cancel(None).await.unwrap();
    assert_eq!(ends(&snapshot(&h.ledger).await, "nomic-embed-text"), 1);
}

async fn a_permit_refines_its_call(backend: Backend) {
    let h = Harness::new(backend, common::capped(1));
    let mut permit = h.ledger.admit(embedding()).await.unwrap();
    let record = permit.refine("bge-m3").await.unwrap();
    assert_eq!(
        (&*record.labels.model, record.state),
        ("bge-m3", State::Executing)
    );
    let settled = permit.settle(Outcome::Success).await.unwrap();
    assert_eq!(&*settled.labels.model, "bge-m3");
    // A settle through the ledger by id keeps it too.
    let id = h.ledger.begin_record(embedding()).await.unwrap().activity_id;
    h.ledger.refine(id, "bge-m3").await.unwrap();
    let done = h
        .ledger
        .settle(id, Settlement::new(Outcome::Success))
        .await
        .unwrap();
    assert_eq!(&*done.labels.model, "bge-m3");
}

against_every_store!(
    the_first_refinement_sets_the_model_and_a_different_one_folds_it_for_good,
    a_first_refinement_to_the_begins_model_still_counts_as_the_first,
    only_a_record_in_flight_can_be_refined,
    a_refined_model_is_redacted_and_kept_within_its_vocabulary,
    a_call_counts_in_the_aggregate_of_its_final_model,
    a_permit_refines_its_call,
);
