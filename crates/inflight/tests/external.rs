//! `external` admission: calls a caller's own limiter admitted, whose start
//! it reports as a fact. Executing, they take their lane's slots; waiting,
//! they hold no place in line; they are never refused. And a success
//! without a start is counted apart. On every store.

mod common;

use common::{capped, embedding, lane_counts, snapshot, Backend, Harness};
use inflight::{Admission, ErrorKind, Outcome, Settlement, State};

async fn an_external_start_takes_a_slot_and_is_never_refused(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let now = h.ledger.now();
    let external = || embedding().admission(Admission::External).started_at(now);
    let first = h.ledger.begin_record(external()).await.unwrap();
    assert_eq!(first.state, State::Executing);
    // A queued call sees the slot taken.
    let err = h.ledger.try_admit(embedding()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LaneFull);
    // Another external start is a fact, not a request: recorded, past the cap.
    let second = h.ledger.begin_record(external()).await.unwrap();
    assert_eq!(second.state, State::Executing);
    let snap = snapshot(&h.ledger).await;
    let lane = snap.lane(common::LANE).unwrap();
    assert_eq!(
        (lane.executing, lane.cap),
        (2, Some(1)),
        "the snapshot shows the lane past its cap"
    );
    // Settled, they free their slots for the queued call.
    for id in [first.activity_id, second.activity_id] {
        h.ledger
            .settle(id, Settlement::new(Outcome::Success))
            .await
            .unwrap();
    }
    let permit = h.ledger.try_admit(embedding()).await.unwrap();
    permit.settle(Outcome::Success).await.unwrap();
}

async fn an_external_record_waiting_holds_no_place_in_line(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let waiting = h
        .ledger
        .begin_record(embedding().admission(Admission::External))
        .await
        .unwrap();
    assert_eq!(waiting.state, State::Waiting);
    assert_eq!(lane_counts(&h.ledger).await, (0, 0), "not in the line");
    // The queued call is first in line, though it came later.
    let permit = h.ledger.try_admit(embedding()).await.unwrap();
    // Its start reported anyway: a fact, taking the lane past its cap.
    let started = h.ledger.start(waiting.activity_id, None).await.unwrap();
    assert_eq!(started.state, State::Executing);
    assert_eq!(lane_counts(&h.ledger).await, (2, 0));
    permit.settle(Outcome::Success).await.unwrap();
}

async fn a_success_without_a_start_is_counted_apart(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let unstarted = h
        .ledger
        .begin_record(embedding().admission(Admission::External))
        .await
        .unwrap();
    let settled = h
        .ledger
        .settle(unstarted.activity_id, Settlement::new(Outcome::Success))
        .await
        .unwrap();
    assert_eq!((settled.success, settled.started_at), (Some(true), None));
    let normal = h.ledger.admit(embedding()).await.unwrap();
    normal.settle(Outcome::Success).await.unwrap();
    // A failure without a start is an ordinary one (a queue failure).
    let failed = h.ledger.begin_record(embedding()).await.unwrap();
    h.ledger
        .settle(
            failed.activity_id,
            Settlement::new(Outcome::Failure(inflight::FailureStage::Queue)),
        )
        .await
        .unwrap();
    let snap = snapshot(&h.ledger).await;
    assert_eq!((snap.total_succeeded, snap.total_succeeded_unstarted), (2, 1));
    let unstarted_in: i64 = snap.aggregates.iter().map(|a| a.successes_unstarted).sum();
    assert_eq!(unstarted_in, 1);
    let external = snap
        .aggregates
        .iter()
        .find(|a| a.key.admission == Admission::External)
        .unwrap();
    assert_eq!((external.successes, external.successes_unstarted), (1, 1));
}

against_every_store!(
    an_external_start_takes_a_slot_and_is_never_refused,
    an_external_record_waiting_holds_no_place_in_line,
    a_success_without_a_start_is_counted_apart,
);
