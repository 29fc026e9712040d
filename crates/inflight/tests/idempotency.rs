//! Idempotent begins: a retry with the same key answers the record the first
//! begin made, on every store; it never makes a second one.

mod common;

use std::time::Duration;

use common::{capped, config, embedding, snapshot, Backend, Harness, MIN};
use inflight::{ErrorKind, Outcome, State};

async fn a_repeat_answers_the_first_record_and_records_nothing(backend: Backend) {
    let h = Harness::new(backend, config());
    let first = h
        .ledger
        .begin_idempotent(embedding().idempotency_key("call-1"), None)
        .await
        .unwrap();
    assert!(!first.replayed);
    h.clock.advance(Duration::from_secs(1));
    let again = h
        .ledger
        .begin_idempotent(embedding().idempotency_key("call-1"), None)
        .await
        .unwrap();
    assert!(again.replayed);
    assert_eq!(*again.record, *first.record);
    // Through every way to begin, the same request is the same record.
    let record = h
        .ledger
        .begin_record(embedding().idempotency_key("call-1"))
        .await
        .unwrap();
    assert_eq!(record.activity_id, first.record.activity_id);
    let handle = h
        .ledger
        .begin(embedding().idempotency_key("call-1"))
        .await
        .unwrap();
    assert_eq!(handle.id(), first.record.activity_id);
    drop(handle); // cancels the one record, as its handle
    let snap = snapshot(&h.ledger).await;
    assert_eq!((snap.total_activities, snap.total_cancelled), (1, 1));
}

async fn the_same_key_with_another_request_is_refused_and_records_nothing(backend: Backend) {
    let h = Harness::new(backend, config());
    h.ledger
        .begin_record(embedding().idempotency_key("call-1"))
        .await
        .unwrap();
    for other in [
        embedding().model("bge-m3").idempotency_key("call-1"),
        embedding().deadline(MIN).idempotency_key("call-1"),
    ] {
        let err = h.ledger.begin_record(other).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::IdempotencyConflict, "{err}");
        assert!(err.to_string().contains("call-1"), "{err}");
    }
    // Starting now is another request than a plain begin.
    let err = h
        .ledger
        .begin_idempotent(embedding().idempotency_key("call-1"), Some(Duration::ZERO))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::IdempotencyConflict);
    assert_eq!(snapshot(&h.ledger).await.total_activities, 1);
}

async fn a_repeat_of_a_begin_whose_record_ended_answers_it_ended(backend: Backend) {
    let h = Harness::new(backend, config());
    let first = h.ledger.begin(embedding().idempotency_key("k")).await.unwrap();
    let id = first.id();
    first.settle(Outcome::Success).await.unwrap();
    let again = h
        .ledger
        .begin_idempotent(embedding().idempotency_key("k"), None)
        .await
        .unwrap();
    assert!(again.replayed);
    assert_eq!(
        (again.record.activity_id, again.record.state),
        (id, State::Succeeded)
    );
    // And one past its bound is answered reaped.
    let waiting = h
        .ledger
        .begin_record(embedding().idempotency_key("w"))
        .await
        .unwrap();
    h.clock.advance(60 * MIN);
    let reaped = h
        .ledger
        .begin_record(embedding().idempotency_key("w"))
        .await
        .unwrap();
    assert_eq!(
        (reaped.activity_id, reaped.state),
        (waiting.activity_id, State::Reaped)
    );
}

async fn a_repeat_waiting_to_start_waits_for_the_same_record(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let holder = h.ledger.admit(embedding()).await.unwrap();
    let begin = || {
        let ledger = h.ledger.clone();
        tokio::spawn(async move {
            ledger
                .begin_idempotent(
                    embedding().idempotency_key("queued"),
                    Some(Duration::from_secs(5)),
                )
                .await
        })
    };
    let first = begin();
    // The stores' writers run on threads of their own: wait until it waits.
    for _ in 0..500 {
        if common::lane_counts(&h.ledger).await == (1, 1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(common::lane_counts(&h.ledger).await, (1, 1), "one record waits");
    let repeat = begin();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        common::lane_counts(&h.ledger).await,
        (1, 1),
        "still one record waits"
    );
    holder.settle(Outcome::Success).await.unwrap();
    let (first, repeat) = (first.await.unwrap().unwrap(), repeat.await.unwrap().unwrap());
    assert_eq!(first.record.activity_id, repeat.record.activity_id);
    assert_eq!((first.replayed, repeat.replayed), (false, true));
    assert_eq!(repeat.record.state, State::Executing);
    assert_eq!(snapshot(&h.ledger).await.total_activities, 2);
}

async fn concurrent_begins_with_one_key_make_one_record(backend: Backend) {
    let h = Harness::new(backend, config());
    let begins: Vec<_> = (0..8)
        .map(|_| {
            let ledger = h.ledger.clone();
            tokio::spawn(async move { ledger.begin_record(embedding().idempotency_key("once")).await })
        })
        .collect();
    let mut ids = Vec::new();
    for begin in begins {
        ids.push(begin.await.unwrap().unwrap().activity_id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(snapshot(&h.ledger).await.total_activities, 1);
}

async fn a_key_is_kept_as_long_as_its_record(backend: Backend) {
    let h = Harness::new(backend, config().with_retention(MIN).unwrap());
    let first = h.ledger.begin(embedding().idempotency_key("kept")).await.unwrap();
    let first = first.settle(Outcome::Success).await.unwrap();
    h.clock.advance(MIN / 2);
    assert_eq!(h.ledger.prune().await.unwrap(), 0);
    let kept = h
        .ledger
        .begin_record(embedding().idempotency_key("kept"))
        .await
        .unwrap();
    assert_eq!(kept.activity_id, first.activity_id);
    h.clock.advance(MIN);
    assert_eq!(h.ledger.prune().await.unwrap(), 1);
    // Its record pruned, the key is free: a begin with it is a new record.
    let fresh = h
        .ledger
        .begin_record(embedding().idempotency_key("kept"))
        .await
        .unwrap();
    assert_ne!(fresh.activity_id, first.activity_id);
    assert_eq!(fresh.state, State::Waiting);
}

async fn a_malformed_key_is_refused_naming_the_header(backend: Backend) {
    let h = Harness::new(backend, config());
    for bad in [
        String::new(),
        "k".repeat(256),
        "tab\tkey".to_owned(),
        "é".to_owned(),
    ] {
        let err = h
            .ledger
            .begin_record(embedding().idempotency_key(bad.clone()))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{bad:?}");
        assert!(err.to_string().contains("Idempotency-Key"), "{err}");
    }
    assert_eq!(snapshot(&h.ledger).await.total_activities, 0);
}

against_every_store!(
    a_repeat_answers_the_first_record_and_records_nothing,
    the_same_key_with_another_request_is_refused_and_records_nothing,
    a_repeat_of_a_begin_whose_record_ended_answers_it_ended,
    a_repeat_waiting_to_start_waits_for_the_same_record,
    concurrent_begins_with_one_key_make_one_record,
    a_key_is_kept_as_long_as_its_record,
    a_malformed_key_is_refused_naming_the_header,
);
