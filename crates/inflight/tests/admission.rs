//! Native admission, permits and owner leases, against every store.
//!
//! Time comes from a fake clock (records) and tokio's paused clock (waits);
//! no test sleeps in real time.

mod common;

use std::time::Duration;

use common::*;
use inflight::{
    ActivitySpec, Admission, Disposition, ErrorKind, Ledger, Outcome, OwnerState, ReapReason, State,
};

/// A newcomer is admitted at once, then settles.
async fn assert_a_slot_is_free(ledger: &Ledger) {
    succeed_at_once(ledger, embedding()).await;
}

against_every_store!(
    cap_two_admits_two_and_the_third_gets_lane_full_until_a_settle_or_cancel,
    leaked_record_past_its_bound_does_not_block_the_next_start,
    waiting_records_are_admitted_first_come_first_served,
    newcomer_never_overtakes_a_waiting_record,
    admit_waits_in_line_and_is_woken_by_a_settle,
    permit_drop_releases_capacity,
    admit_future_drop_while_waiting_leaves_the_line,
    panic_inside_guarded_call_releases_capacity,
    direct_records_are_never_admission_controlled,
    owner_renewing_keeps_an_old_record_executing,
    owner_that_stops_renewing_is_reaped_as_owner_lost,
    owner_loss_frees_its_slot_for_the_next_start,
    release_cancels_the_owners_in_flight_records,
    unknown_owner_is_invalid_and_a_lost_owner_conflicts,
    snapshot_shows_longest_wait_and_owners,
    owner_id_in_any_spelling_is_stored_in_one,
    admit_within_waits_its_bound_and_a_drop_records_its_reason,
);

/// `admit_within` admits at once when there is room, waits in line up to its
/// bound otherwise (then the record is cancelled and the answer is a
/// refusal), and every drop, while waiting or holding the permit, records
/// the spec's reason.
async fn admit_within_waits_its_bound_and_a_drop_records_its_reason(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let spec = embedding;
    let gone = "client-disconnected";
    let holder = h
        .ledger
        .admit_within(spec(), Duration::from_secs(1), gone)
        .await
        .unwrap();
    assert_eq!(holder.record().unwrap().state, State::Executing);

    let refused = h
        .ledger
        .admit_within(spec(), Duration::from_millis(300), gone)
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::LaneFull);
    assert!(refused.message().contains("recorded cancelled"), "{refused}");

    // A waiter in line whose future is dropped (a client gone).
    let ledger = h.ledger.clone();
    let waiter =
        tokio::spawn(async move { ledger.admit_within(spec(), Duration::from_secs(20), gone).await });
    while lane_counts(&h.ledger).await != (1, 1) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    tokio::task::yield_now().await;
    assert_eq!(lane_counts(&h.ledger).await, (1, 0));

    let id = holder.id();
    drop(holder);
    tokio::task::yield_now().await;
    let record = h.ledger.get(id).await.unwrap();
    assert_eq!(record.state, State::Cancelled);
    assert_eq!(record.cancel_reason.as_deref(), Some("client-disconnected"));
    let snap = snapshot(&h.ledger).await;
    let reasons: Vec<_> = snap
        .recent_completions
        .iter()
        .map(|record| record.cancel_reason.as_deref().unwrap_or("-"))
        .collect();
    assert_eq!(
        reasons
            .iter()
            .filter(|reason| **reason == "client-disconnected")
            .count(),
        2,
        "the holder and the dropped waiter: {reasons:?}"
    );
    assert_a_slot_is_free(&h.ledger).await;
}

async fn owner_id_in_any_spelling_is_stored_in_one(backend: Backend) {
    let h = Harness::new(backend, capped(2));
    let owner = h
        .ledger
        .register_owner("worker-g", Duration::from_secs(5))
        .await
        .unwrap();
    let spec = embedding().owner_spelled(owner.owner_id.as_str().to_uppercase());
    let record = h.ledger.begin_record(spec.started_at(T0)).await.unwrap();
    assert_eq!(record.owner_id.as_deref(), Some(owner.owner_id.as_str()));
    h.clock.advance(Duration::from_secs(6));
    let record = h.ledger.get(record.activity_id).await.unwrap();
    assert_eq!(record.reap_reason, Some(ReapReason::OwnerLost));
}

async fn cap_two_admits_two_and_the_third_gets_lane_full_until_a_settle_or_cancel(backend: Backend) {
    let h = Harness::new(backend, capped(2));
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(h.ledger.begin_record(embedding()).await.unwrap().activity_id);
        h.clock.advance(MS);
    }
    h.ledger.start(ids[0], None).await.unwrap();
    h.ledger.start(ids[1], None).await.unwrap();
    let full = h.ledger.start(ids[2], None).await.unwrap_err();
    assert_eq!(full.kind(), ErrorKind::LaneFull);
    assert_eq!(
        h.ledger.get(ids[2]).await.unwrap().state,
        State::Waiting,
        "keeps its place"
    );
    assert_eq!(lane_counts(&h.ledger).await, (2, 1));

    h.ledger.settle(ids[0], Outcome::Success.into()).await.unwrap();
    h.ledger.start(ids[2], None).await.unwrap();
    assert_eq!(lane_counts(&h.ledger).await, (2, 0));

    // A cancel frees a slot just the same.
    let fourth = h.ledger.begin_record(embedding()).await.unwrap().activity_id;
    assert_eq!(
        h.ledger.start(fourth, None).await.unwrap_err().kind(),
        ErrorKind::LaneFull
    );
    h.ledger.cancel(ids[1], None).await.unwrap();
    h.ledger.start(fourth, None).await.unwrap();
    let snap = snapshot(&h.ledger).await;
    let lane = snap.lane(LANE).unwrap();
    assert_eq!((lane.cap, lane.executing, lane.waiting), (Some(2), 2, 0));
}

async fn leaked_record_past_its_bound_does_not_block_the_next_start(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let leaked = h.ledger.try_admit(embedding()).await.unwrap();
    let leaked_id = leaked.id();
    std::mem::forget(leaked); // the settle is lost, as in the incident
    assert_eq!(
        h.ledger.try_admit(embedding()).await.unwrap_err().kind(),
        ErrorKind::LaneFull
    );

    h.clock.advance(21 * MIN);
    // No reaper, no read: the admission decision itself reaps the leak.
    let next = h.ledger.try_admit(embedding()).await.unwrap();
    let leaked = h.ledger.get(leaked_id).await.unwrap();
    assert_eq!(leaked.disposition, Some(Disposition::Unsettled));
    assert_eq!(lane_counts(&h.ledger).await, (1, 0));
    next.settle(Outcome::Success).await.unwrap();
}

async fn waiting_records_are_admitted_first_come_first_served(backend: Backend) {
    let h = Harness::new(backend, capped(2));
    let mut ids = Vec::new();
    for _ in 0..6 {
        ids.push(h.ledger.begin_record(embedding()).await.unwrap().activity_id);
        h.clock.advance(MS);
    }
    // The two oldest are admitted whichever asks first; the third waits.
    h.ledger.start(ids[1], None).await.unwrap();
    assert_eq!(
        h.ledger.start(ids[5], None).await.unwrap_err().kind(),
        ErrorKind::LaneFull
    );
    assert_eq!(
        h.ledger.start(ids[2], None).await.unwrap_err().kind(),
        ErrorKind::LaneFull
    );
    h.ledger.start(ids[0], None).await.unwrap();
    assert_eq!(
        h.ledger.start(ids[2], None).await.unwrap_err().kind(),
        ErrorKind::LaneFull
    );
    h.ledger.settle(ids[1], Outcome::Success.into()).await.unwrap();
    assert_eq!(
        h.ledger.start(ids[3], None).await.unwrap_err().kind(),
        ErrorKind::LaneFull
    );
    h.ledger.start(ids[2], None).await.unwrap();
    assert_eq!(lane_counts(&h.ledger).await, (2, 3));
}

async fn newcomer_never_overtakes_a_waiting_record(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let running = h.ledger.try_admit(embedding()).await.unwrap();
    let waiting = h.ledger.begin_record(embedding()).await.unwrap();
    running.settle(Outcome::Success).await.unwrap();
    // A slot is free, but a record waits ahead of any newcomer.
    let err = h.ledger.try_admit(embedding()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LaneFull);
    assert_eq!(
        snapshot(&h.ledger).await.total_activities,
        2,
        "a refused try_admit records nothing"
    );
    h.ledger.start(waiting.activity_id, None).await.unwrap();
}

async fn admit_waits_in_line_and_is_woken_by_a_settle(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let first = h.ledger.admit(embedding()).await.unwrap();
    let ledger = h.ledger.clone();
    let second = tokio::spawn(async move { ledger.admit(embedding()).await });
    while lane_counts(&h.ledger).await != (1, 1) {
        tokio::task::yield_now().await;
    }
    first.settle(Outcome::Success).await.unwrap();
    let second = second.await.unwrap().unwrap();
    assert_eq!(second.record().unwrap().state, State::Executing);
    assert_eq!(lane_counts(&h.ledger).await, (1, 0));
    second.settle(Outcome::Success).await.unwrap();
}

async fn permit_drop_releases_capacity(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let permit = h.ledger.admit(embedding()).await.unwrap();
    let id = permit.id();
    assert_eq!(lane_counts(&h.ledger).await, (1, 0));
    drop(permit);
    tokio::task::yield_now().await;
    assert_eq!(h.ledger.get(id).await.unwrap().state, State::Cancelled);
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
    assert_a_slot_is_free(&h.ledger).await;
}

async fn admit_future_drop_while_waiting_leaves_the_line(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let holder = h.ledger.admit(embedding()).await.unwrap();
    let before = lane_counts(&h.ledger).await;
    let waited = tokio::time::timeout(Duration::from_secs(1), h.ledger.admit(embedding())).await;
    assert!(waited.is_err(), "still waiting when the timeout dropped it");
    tokio::task::yield_now().await;
    assert_eq!(lane_counts(&h.ledger).await, before);
    let snap = snapshot(&h.ledger).await;
    assert_eq!(
        snap.aggregates[0].cancelled, 1,
        "the dropped waiter recorded cancelled"
    );
    holder.settle(Outcome::Success).await.unwrap();
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
}

async fn panic_inside_guarded_call_releases_capacity(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let before = lane_counts(&h.ledger).await;
    let ledger = h.ledger.clone();
    let crashed = tokio::spawn(async move {
        let _permit = ledger.admit(embedding()).await.unwrap();
        panic!("the provider client panicked");
    })
    .await;
    assert!(crashed.unwrap_err().is_panic());
    tokio::task::yield_now().await;
    assert_eq!(lane_counts(&h.ledger).await, before);
    assert_a_slot_is_free(&h.ledger).await;
}

async fn direct_records_are_never_admission_controlled(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let _held = h.ledger.try_admit(embedding()).await.unwrap();
    for _ in 0..3 {
        h.ledger
            .begin_record(embedding().admission(Admission::Direct).started_at(T0))
            .await
            .unwrap();
    }
    assert_eq!(lane_counts(&h.ledger).await, (1, 0));
    assert_eq!(snapshot(&h.ledger).await.total_in_flight, 4);
}

async fn owner_renewing_keeps_an_old_record_executing(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let owner = h
        .ledger
        .register_owner("worker-a", Duration::from_secs(30))
        .await
        .unwrap();
    let mut spec = embedding().deadline(Duration::from_secs(3600));
    spec = spec.owner(&owner.owner_id);
    let record = h.ledger.begin_record(spec.started_at(T0)).await.unwrap();
    assert_eq!(record.owner_id.as_deref(), Some(owner.owner_id.as_str()));
    for _ in 0..40 {
        h.clock.advance(Duration::from_secs(10));
        h.ledger.renew_owner(&owner.owner_id).await.unwrap();
        assert_eq!(h.ledger.reap().await.unwrap().total(), 0);
    }
    // 400 s: far older than the 30 s lease, still executing.
    assert_eq!(
        h.ledger.get(record.activity_id).await.unwrap().state,
        State::Executing
    );
}

async fn owner_that_stops_renewing_is_reaped_as_owner_lost(backend: Backend) {
    let h = Harness::new(backend, capped(4));
    let lease = h
        .ledger
        .join_as_owner("worker-b", Duration::from_secs(30))
        .await
        .unwrap();
    let executing = h.ledger.begin_record(embedding().started_at(T0)).await.unwrap();
    let waiting = h.ledger.begin_record(embedding()).await.unwrap();
    let owner_id = lease.owner().owner_id.clone();
    lease.abandon(); // the process dies: no renewals, no release
                     // A renewal sent just before the death still lands (stores are FIFO):
                     // let it, so that the lease runs from a known time.
    h.ledger.reap().await.unwrap();
    h.clock.advance(Duration::from_secs(30));
    assert_eq!(
        h.ledger.reap().await.unwrap().total(),
        0,
        "at the TTL, not past it"
    );
    h.clock.advance(MS);
    let reaped = h.ledger.reap().await.unwrap();
    assert_eq!((reaped.abandoned, reaped.unsettled), (1, 1));
    let record = h.ledger.get(executing.activity_id).await.unwrap();
    assert_eq!(record.reap_reason, Some(ReapReason::OwnerLost));
    assert_eq!(record.disposition, Some(Disposition::Unsettled));
    let record = h.ledger.get(waiting.activity_id).await.unwrap();
    assert_eq!(record.disposition, Some(Disposition::Abandoned));
    let json = serde_json::to_value(&record).unwrap();
    assert_eq!(json["reapReason"], "owner-lost");
    let renew = h.ledger.renew_owner(&owner_id).await.unwrap_err();
    assert_eq!(renew.kind(), ErrorKind::Conflict);
}

async fn owner_loss_frees_its_slot_for_the_next_start(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let dead = h
        .ledger
        .register_owner("worker-a", Duration::from_secs(5))
        .await
        .unwrap();
    let mut spec = embedding();
    spec = spec.owner(&dead.owner_id);
    let _held = h.ledger.begin_record(spec.started_at(T0)).await.unwrap();
    let b = h.ledger.begin_record(embedding()).await.unwrap();
    assert_eq!(
        h.ledger.start(b.activity_id, None).await.unwrap_err().kind(),
        ErrorKind::LaneFull
    );
    h.clock.advance(Duration::from_secs(6));
    // The admission decision itself notices the expired lease.
    h.ledger.start(b.activity_id, None).await.unwrap();
    let snap = snapshot(&h.ledger).await;
    let lane = snap.lane(LANE).unwrap();
    assert_eq!((lane.cap, lane.executing), (Some(1), 1));
    assert_eq!(lane.reaped_owner_lost, 1);
    let owner = snap.owners.iter().find(|o| o.owner_id == dead.owner_id).unwrap();
    assert_eq!((owner.state, owner.reaped_records), (OwnerState::Lost, 1));
}

async fn release_cancels_the_owners_in_flight_records(backend: Backend) {
    let h = Harness::new(backend, capped(2));
    let lease = h
        .ledger
        .join_as_owner("worker-c", Duration::from_secs(30))
        .await
        .unwrap();
    let a = h.ledger.begin_record(embedding().started_at(T0)).await.unwrap();
    let b = h.ledger.begin_record(embedding()).await.unwrap();
    let owner = lease.release().await.unwrap();
    assert_eq!((owner.state, owner.cancelled_records), (OwnerState::Released, 2));
    for id in [a.activity_id, b.activity_id] {
        assert_eq!(h.ledger.get(id).await.unwrap().state, State::Cancelled);
    }
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
    assert_eq!(snapshot(&h.ledger).await.total_reaped, 0);
    // New records are no longer tagged with the released owner.
    let later = h.ledger.begin_record(embedding()).await.unwrap();
    assert_eq!(later.owner_id, None);
}

async fn unknown_owner_is_invalid_and_a_lost_owner_conflicts(backend: Backend) {
    let h = Harness::new(backend, capped(2));
    let mut spec = embedding();
    spec = spec.owner(&inflight::OwnerId::new());
    let err = h.ledger.begin_record(spec.clone()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    spec = spec.owner_spelled("not-a-uuid");
    assert_eq!(
        h.ledger.begin_record(spec.clone()).await.unwrap_err().kind(),
        ErrorKind::InvalidInput
    );

    let owner = h
        .ledger
        .register_owner("worker-d", Duration::from_secs(1))
        .await
        .unwrap();
    h.clock.advance(Duration::from_secs(2));
    spec = spec.owner(&owner.owner_id);
    assert_eq!(
        h.ledger.begin_record(spec).await.unwrap_err().kind(),
        ErrorKind::Conflict
    );
    assert_eq!(snapshot(&h.ledger).await.total_activities, 0);
    let bad_ttl = h
        .ledger
        .register_owner("worker-e", Duration::from_millis(10))
        .await;
    assert_eq!(bad_ttl.unwrap_err().kind(), ErrorKind::InvalidInput);
}

async fn snapshot_shows_longest_wait_and_owners(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let _lease = h
        .ledger
        .join_as_owner("worker-f", Duration::from_secs(30))
        .await
        .unwrap();
    let _held = h.ledger.try_admit(embedding()).await.unwrap();
    h.ledger.begin_record(embedding()).await.unwrap();
    h.clock.advance(Duration::from_secs(7));
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.lane(LANE).unwrap().longest_wait_ms, 7_000);
    assert_eq!(snap.owners.len(), 1);
    let json = serde_json::to_value(&snap).unwrap();
    assert_eq!(json["owners"][0]["state"], "live");
    assert_eq!(json["nativeAdmission"][LANE]["longestWaitMs"], 7000);
    assert_eq!(json["inFlight"][0]["ownerId"], json["owners"][0]["ownerId"]);
}

#[tokio::test(start_paused = true)]
async fn waiting_record_is_still_reaped_as_abandoned_past_its_queue_bound() {
    let h = Harness::new(Backend::Memory, capped(1));
    let _held = h
        .ledger
        .try_admit(embedding().deadline(Duration::from_secs(3600)))
        .await
        .unwrap();
    let waiting = h.ledger.begin_record(embedding()).await.unwrap();
    h.clock.advance(21 * MIN);
    h.ledger.reap().await.unwrap();
    let record = h.ledger.get(waiting.activity_id).await.unwrap();
    assert_eq!(record.disposition, Some(Disposition::Abandoned));
    assert_eq!(record.reap_reason, Some(ReapReason::Deadline));
}

#[tokio::test(start_paused = true)]
async fn builder_owner_tags_records_and_registers_anew_after_a_loss() {
    let clock = inflight::FakeClock::at(T0);
    let ledger = Ledger::builder(capped(2))
        .clock(clock.clone())
        .owner("worker-auto", Duration::from_secs(5))
        .build()
        .unwrap();
    let first = ledger.begin_record(embedding().started_at(T0)).await.unwrap();
    let a = first.owner_id.clone().expect("tagged with the builder's owner");
    let snap = snapshot(&ledger).await;
    assert_eq!(snap.owners.len(), 1);
    assert_eq!(
        (snap.owners[0].name.as_str(), snap.owners[0].state),
        ("worker-auto", OwnerState::Live)
    );

    // No renewal reached the store for longer than the lease: it is lost,
    // and the process, still alive, registers anew on its next record.
    clock.advance(Duration::from_secs(6));
    let second = ledger.begin_record(embedding()).await.unwrap();
    let b = second.owner_id.clone().unwrap();
    assert_ne!(a, b);
    let first = ledger.get(first.activity_id).await.unwrap();
    assert_eq!(first.reap_reason, Some(ReapReason::OwnerLost));
    let snap = snapshot(&ledger).await;
    let states: Vec<_> = snap
        .owners
        .iter()
        .map(|o| (o.owner_id.as_str() == a, o.state))
        .collect();
    assert!(states.contains(&(true, OwnerState::Lost)) && states.contains(&(false, OwnerState::Live)));

    assert!(Ledger::builder(capped(2))
        .owner("bad name", Duration::from_secs(5))
        .build()
        .is_err());
    assert!(Ledger::builder(capped(2))
        .owner("w", Duration::from_millis(1))
        .build()
        .is_err());
}

#[tokio::test]
async fn dropping_the_last_ledger_clone_releases_its_builder_owner() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("shared.db").display());
    let ledger = Ledger::builder(capped(2))
        .store_url(url.clone())
        .owner("worker-auto", Duration::from_secs(30))
        .build()
        .unwrap();
    let record = ledger.begin_record(embedding()).await.unwrap();
    let clone = ledger.clone();
    drop(ledger);
    drop(clone); // the last handle: a clean end

    let observer = Ledger::builder(capped(2)).store_url(url).build().unwrap();
    let mut state = State::Waiting;
    for _ in 0..100 {
        state = observer.get(record.activity_id).await.unwrap().state;
        if state == State::Cancelled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        state,
        State::Cancelled,
        "the release cancelled the owner's in-flight record"
    );
    let snap = snapshot(&observer).await;
    assert_eq!(snap.owners[0].state, OwnerState::Released);
    assert_eq!(snap.owners[0].cancelled_records, 1);
}

/// A cap declared from the spec the calls use cannot be spelled apart
/// from them.
#[tokio::test(start_paused = true)]
async fn a_cap_declared_from_the_calls_spec_holds_for_those_calls() {
    let spec = ActivitySpec::new("svc", "fake-provider");
    let config = config().with_cap(&spec.lane().unwrap(), std::num::NonZeroU32::new(1).unwrap());
    let h = Harness::new(Backend::Memory, config);
    let first = h.ledger.try_admit(spec.clone()).await.unwrap();
    let refused = h.ledger.try_admit(spec.clone()).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::LaneFull);
    first.settle(Outcome::Success).await.unwrap();
    assert!(ActivitySpec::new("bad service!", "p").lane().is_err());
}

/// The Rust API speaks of durations, not of the HTTP body's `ttlMs`.
#[tokio::test]
async fn a_lease_out_of_range_is_refused_in_rust_words() {
    let h = Harness::default(Backend::Memory);
    let err = h
        .ledger
        .register_owner("w", Duration::from_millis(10))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert_eq!(
        err.to_string(),
        "an owner's lease must last between 100ms and 1h, got 10ms"
    );
}
