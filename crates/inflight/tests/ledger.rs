//! The ledger's acceptance suite, run against every store.
//!
//! Time comes from a fake clock; no test sleeps.

use std::time::Duration;

use inflight::{
    ActivitySpec, Admission, Disposition, ErrorKind, FailureStage, Outcome, Settlement, Since,
    SnapshotOptions, State,
};

mod common;

use common::*;

against_every_store!(
    executing_record_past_its_class_bound_is_reaped_and_leaves_the_counts,
    waiting_record_past_its_queue_wait_bound_is_reaped_as_abandoned,
    reaped_records_surface_with_disposition_and_counts,
    long_batch_inside_its_own_bound_is_never_reaped,
    switching_provider_leaves_no_residual_count_after_the_reap_interval,
    reaped_record_is_never_counted_as_a_completion_even_when_settled_late,
    unconfigured_class_is_reaped_only_past_the_widest_bound,
    settle_retry_is_harmless_and_a_different_outcome_conflicts,
    starting_an_abandoned_record_resurrects_it_and_unsettled_is_terminal,
    dropped_handle_records_cancelled,
    a_refused_settle_cancels_rather_than_leaks,
    cancel_is_settled_not_leaked,
    bad_labels_are_refused_and_change_nothing,
    bad_timestamps_are_refused_and_change_nothing,
    operation_past_the_bound_sees_the_record_reaped_without_a_reaper_pass,
    reap_never_moves_last_seen_at,
    snapshot_window_never_hides_live_work_and_flags_truncation,
    declared_lane_without_demand_still_appears,
    direct_records_are_not_in_native_admission,
    records_report_when_they_become_reapable,
    reaping_is_idempotent,
    label_sets_spelled_apart_count_in_one_aggregate,
    a_returned_record_keeps_its_version,
    handle_forgets_its_record_when_an_operation_fails,
);

async fn executing_record_past_its_class_bound_is_reaped_and_leaves_the_counts(backend: Backend) {
    let h = Harness::new(backend, config());
    let mut call = h.ledger.begin(embedding()).await.unwrap();
    call.start().await.unwrap();

    h.clock.advance(20 * MIN); // exactly factor x deadline: not yet past it
    let at_bound = snapshot(&h.ledger).await;
    assert_eq!(at_bound.lane("knowledge-base::ollama").unwrap().executing, 1);
    assert_eq!(at_bound.reaped_this_read.total(), 0);

    h.clock.advance(MS);
    let past = snapshot(&h.ledger).await;
    let lane = past.lane("knowledge-base::ollama").unwrap();
    assert_eq!((lane.executing, lane.waiting), (0, 0));
    assert_eq!(lane.reaped.unsettled, 1);
    assert_eq!(past.reaped_this_read.unsettled, 1);
    assert_eq!(past.total_in_flight, 0);
    assert_eq!(past.status, inflight::SnapshotStatus::Degraded);
    std::mem::forget(call); // a leak, as in the incident
}

async fn waiting_record_past_its_queue_wait_bound_is_reaped_as_abandoned(backend: Backend) {
    let h = Harness::new(backend, config());
    let record = h
        .ledger
        .begin_record(ActivitySpec::new("support-bot", "openai").class("chat"))
        .await
        .unwrap();
    h.clock.advance(8 * MIN); // factor 4 x max_queue_wait 2m
    assert_eq!(h.ledger.reap().await.unwrap().total(), 0);
    h.clock.advance(MS);
    let reaped = h.ledger.reap().await.unwrap();
    assert_eq!((reaped.abandoned, reaped.unsettled), (1, 0));
    let record = h.ledger.get(record.activity_id).await.unwrap();
    assert_eq!(record.state, State::Reaped);
    assert_eq!(record.disposition, Some(Disposition::Abandoned));
    let lane = snapshot(&h.ledger).await;
    let lane = lane.lane("support-bot::openai").unwrap();
    assert_eq!((lane.waiting, lane.reaped.abandoned), (0, 1));
}

async fn reaped_records_surface_with_disposition_and_counts(backend: Backend) {
    let h = Harness::new(backend, config());
    let waiting = h.ledger.begin_record(embedding()).await.unwrap();
    let executing = h.ledger.begin_record(embedding().started_at(T0)).await.unwrap();
    let other = h
        .ledger
        .begin_record(
            ActivitySpec::new("memory-core", "ollama")
                .class("embedding")
                .started_at(T0),
        )
        .await
        .unwrap();
    h.clock.advance(21 * MIN);
    let snap = snapshot(&h.ledger).await;

    assert_eq!(snap.total_reaped, 3);
    assert_eq!(snap.total_activities, 3, "nothing disappears");
    assert_eq!(snap.reaped_this_read.abandoned, 1);
    assert_eq!(snap.reaped_this_read.unsettled, 2);
    let kb = snap.lane("knowledge-base::ollama").unwrap();
    assert_eq!((kb.reaped.abandoned, kb.reaped.unsettled), (1, 1));
    assert_eq!(snap.lane("memory-core::ollama").unwrap().reaped.unsettled, 1);
    assert_eq!(snap.reaped.len(), 3);
    for entry in &snap.reaped {
        assert_eq!(entry.record.state, State::Reaped);
        assert_eq!(entry.record.reaped_at, Some(T0 + 21 * 60_000));
        assert_eq!(entry.age_ms, 21 * 60_000);
        let expected = if entry.record.activity_id == waiting.activity_id {
            Disposition::Abandoned
        } else {
            Disposition::Unsettled
        };
        assert_eq!(entry.record.disposition, Some(expected));
    }
    // Still queryable as evidence, and the counts survive later reads.
    for id in [waiting.activity_id, executing.activity_id, other.activity_id] {
        assert_eq!(h.ledger.get(id).await.unwrap().state, State::Reaped);
    }
    let again = snapshot(&h.ledger).await;
    assert_eq!(again.total_reaped, 3);
    assert_eq!(again.reaped_this_read.total(), 0);
    let json = serde_json::to_value(&again).unwrap();
    assert_eq!(
        json["nativeAdmission"]["knowledge-base::ollama"]["reaped"]["abandoned"],
        1
    );
    let mut dispositions: Vec<_> = json["reaped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["disposition"].as_str().unwrap().to_owned())
        .collect();
    dispositions.sort();
    assert_eq!(dispositions, ["abandoned", "unsettled", "unsettled"]);
}

async fn long_batch_inside_its_own_bound_is_never_reaped(backend: Backend) {
    let h = Harness::new(backend, config());
    // A batch that declared a 2h deadline in a 5m class: bound is 8h.
    let mut batch = h
        .ledger
        .begin(embedding().deadline(Duration::from_secs(2 * 3600)))
        .await
        .unwrap();
    batch.start().await.unwrap();
    // An ordinary embedding well inside 4 x 5m.
    let mut ordinary = h.ledger.begin(embedding()).await.unwrap();
    ordinary.start().await.unwrap();

    h.clock.advance(19 * MIN);
    assert_eq!(snapshot(&h.ledger).await.reaped_this_read.total(), 0);
    assert_eq!(
        ordinary.settle(Outcome::Success).await.unwrap().state,
        State::Succeeded
    );

    h.clock.advance(Duration::from_secs(7 * 3600)); // 7h19m: long past any class bound
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.reaped_this_read.total(), 0);
    assert_eq!(snap.lane("knowledge-base::ollama").unwrap().executing, 1);
    let record = batch.settle(Outcome::Success).await.unwrap();
    assert_eq!(record.state, State::Succeeded);
    assert_eq!(record.deadline_ms, 2 * 3600 * 1000);
    assert_eq!(snapshot(&h.ledger).await.total_reaped, 0);
}

async fn switching_provider_leaves_no_residual_count_after_the_reap_interval(backend: Backend) {
    let h = Harness::new(backend, config());
    let mut reaper = h.ledger.spawn_reaper();
    for _ in 0..3 {
        std::mem::forget(h.ledger.begin(embedding().started_at(T0)).await.unwrap());
    }
    // The role moves to another provider; the old one sees no traffic.
    h.clock.advance(30 * MIN);
    let mut live = h
        .ledger
        .begin(ActivitySpec::new("knowledge-base", "openai").class("embedding"))
        .await
        .unwrap();
    live.start().await.unwrap();

    // One reap interval passes with no reader at all. Counted from now:
    // while a store's thread answers, paused tokio time auto-advances, so
    // the reaper may already have run passes that read the clock before the
    // advance above, and one may be under way; the second pass from here
    // surely began after it.
    let passes = reaper.passes();
    tokio::time::advance(h.ledger.config().reap_interval()).await;
    reaper.wait_for_passes(passes + 2).await;

    // The reaper did the work: a read now finds nothing left to reap.
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.reaped_this_read.total(), 0);
    let old = snap.lane("knowledge-base::ollama").unwrap();
    assert_eq!((old.executing, old.waiting, old.reaped.unsettled), (0, 0, 3));
    assert_eq!(snap.lane("knowledge-base::openai").unwrap().executing, 1);
    live.settle(Outcome::Success).await.unwrap();
}

async fn reaped_record_is_never_counted_as_a_completion_even_when_settled_late(backend: Backend) {
    let h = Harness::new(backend, config());
    let mut call = h.ledger.begin(embedding()).await.unwrap();
    call.start().await.unwrap();
    let id = call.id();
    h.clock.advance(21 * MIN);
    assert_eq!(h.ledger.reap().await.unwrap().unsettled, 1);

    let late = call.settle(Outcome::Success).await.unwrap();
    assert_eq!(late.state, State::Reaped);
    assert!(late.late_settle);
    assert_eq!(late.success, None);
    // A retry of the late settle, a late failure and a late cancel change nothing more.
    let failure = Settlement::new(Outcome::Failure(FailureStage::Provider));
    assert_eq!(h.ledger.settle(id, failure).await.unwrap().state, State::Reaped);
    assert_eq!(h.ledger.cancel(id, None).await.unwrap().state, State::Reaped);

    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_recent_completions, 0);
    assert!(snap.recent_completions.is_empty());
    assert_eq!(snap.total_late_settles, 1);
    assert_eq!(snap.total_reaped, 1);
    let lane = snap.lane("knowledge-base::ollama").unwrap();
    assert_eq!(lane.late_settles, 1);
    let aggregate = &snap.aggregates[0];
    assert_eq!(
        (aggregate.successes, aggregate.failures, aggregate.cancelled),
        (0, 0, 0)
    );
    assert_eq!(aggregate.reaped.unsettled, 1);
}

async fn unconfigured_class_is_reaped_only_past_the_widest_bound(backend: Backend) {
    let h = Harness::new(backend, config());
    // Widest bound: 4 x max(5m, 10m, 2m) = 40m, for waiting and executing alike.
    let waiting = h
        .ledger
        .begin_record(ActivitySpec::new("unknown", "ollama"))
        .await
        .unwrap();
    let running = h
        .ledger
        .begin_record(
            ActivitySpec::new("unknown", "ollama")
                .class("rerank")
                .started_at(T0),
        )
        .await
        .unwrap();
    assert_eq!(waiting.labels.class.as_str(), "unknown");
    h.clock.advance(40 * MIN);
    assert_eq!(h.ledger.reap().await.unwrap().total(), 0);
    h.clock.advance(MS);
    let reaped = h.ledger.reap().await.unwrap();
    assert_eq!((reaped.abandoned, reaped.unsettled), (1, 1));
    assert_eq!(
        h.ledger.get(running.activity_id).await.unwrap().disposition,
        Some(Disposition::Unsettled)
    );
}

async fn settle_retry_is_harmless_and_a_different_outcome_conflicts(backend: Backend) {
    let h = Harness::new(backend, config());
    let record = h.ledger.begin_record(embedding().started_at(T0)).await.unwrap();
    let id = record.activity_id;
    let success = Settlement::new(Outcome::Success);
    h.clock.advance(MIN);
    let first = h.ledger.settle(id, success).await.unwrap();
    h.clock.advance(MIN);
    let retry = h.ledger.settle(id, success).await.unwrap();
    assert_eq!(first, retry, "a retry changes nothing, not even completedAt");
    let failure = Settlement::new(Outcome::Failure(FailureStage::Unknown));
    let err = h.ledger.settle(id, failure).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert_eq!(
        h.ledger.cancel(id, None).await.unwrap_err().kind(),
        ErrorKind::Conflict
    );
    assert_eq!(
        h.ledger.start(id, None).await.unwrap_err().kind(),
        ErrorKind::Conflict
    );
    assert_eq!(h.ledger.get(id).await.unwrap(), first);
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_recent_completions, 1);
    assert_eq!(snap.aggregates[0].successes, 1);
    assert_eq!(snap.aggregates[0].failures, 0);
}

async fn starting_an_abandoned_record_resurrects_it_and_unsettled_is_terminal(backend: Backend) {
    let h = Harness::new(backend, config());
    let abandoned = h.ledger.begin_record(embedding()).await.unwrap();
    let unsettled = h.ledger.begin_record(embedding().started_at(T0)).await.unwrap();
    h.clock.advance(21 * MIN);
    assert_eq!(h.ledger.reap().await.unwrap().total(), 2);

    let resurrected = h.ledger.start(abandoned.activity_id, None).await.unwrap();
    assert_eq!(resurrected.state, State::Executing);
    assert_eq!(resurrected.disposition, None);
    assert_eq!(resurrected.reaped_at, None);
    let err = h.ledger.start(unsettled.activity_id, None).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);

    let snap = snapshot(&h.ledger).await;
    let lane = snap.lane("knowledge-base::ollama").unwrap();
    assert_eq!(
        (lane.executing, lane.reaped.abandoned, lane.reaped.unsettled),
        (1, 0, 1)
    );
    assert_eq!(lane.resurrections, 1);
    assert_eq!(snap.total_reaped, 1);
    assert_eq!(snap.total_resurrections, 1);
}

async fn dropped_handle_records_cancelled(backend: Backend) {
    let h = Harness::new(backend, config());
    let mut call = h.ledger.begin(embedding()).await.unwrap();
    call.start().await.unwrap();
    let id = call.id();
    drop(call);
    let record = h.ledger.get(id).await.unwrap();
    assert_eq!(record.state, State::Cancelled);
    assert_eq!(record.cancel_reason.as_deref(), Some("handle dropped"));
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.lane("knowledge-base::ollama").unwrap().executing, 0);
    assert_eq!(snap.total_reaped, 0, "an observed abort is not a leak");
    assert_eq!(snap.aggregates[0].cancelled, 1);
}

async fn a_refused_settle_cancels_rather_than_leaks(backend: Backend) {
    let h = Harness::new(backend, config());
    let mut call = h.ledger.begin(embedding()).await.unwrap();
    call.start().await.unwrap();
    let id = call.id();
    // A Retry-After is a failure's: with a success the settle is refused.
    let refused = call
        .settle_with(Settlement::new(Outcome::Success).retry_after(Duration::from_secs(1)))
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::InvalidInput, "{refused}");
    let record = h.ledger.get(id).await.unwrap();
    assert_eq!(record.state, State::Cancelled, "the call ended all the same");
    assert_eq!(record.cancel_reason.as_deref(), Some("settle refused"));
    let snap = snapshot(&h.ledger).await;
    assert_eq!(
        snap.lane("knowledge-base::ollama").unwrap().executing,
        0,
        "no slot held"
    );

    // Refused for another reason (it ended otherwise), nothing more is done.
    let mut call = h.ledger.begin(embedding()).await.unwrap();
    call.start().await.unwrap();
    let id = call.id();
    h.ledger.cancel(id, Some("elsewhere".into())).await.unwrap();
    let conflict = call.settle(Outcome::Success).await.unwrap_err();
    assert_eq!(conflict.kind(), ErrorKind::Conflict, "{conflict}");
    let record = h.ledger.get(id).await.unwrap();
    assert_eq!(record.cancel_reason.as_deref(), Some("elsewhere"));
}

async fn cancel_is_settled_not_leaked(backend: Backend) {
    let h = Harness::new(backend, config());
    let call = h.ledger.begin(embedding()).await.unwrap();
    let record = call.cancel(Some("client went away".into())).await.unwrap();
    assert_eq!(record.state, State::Cancelled);
    assert_eq!(record.success, None);
    assert_eq!(record.completed_at, Some(T0));
    assert_eq!(
        h.ledger.cancel(record.activity_id, None).await.unwrap(),
        record,
        "retry"
    );
    h.clock.advance(Duration::from_secs(24 * 3600));
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_reaped, 0);
    assert_eq!(snap.total_in_flight, 0);
}

async fn bad_labels_are_refused_and_change_nothing(backend: Backend) {
    let h = Harness::new(backend, config());
    let cases = [
        ActivitySpec::new("", "ollama"),
        ActivitySpec::new("knowledge base", "ollama"),
        ActivitySpec::new("kb", "http://ollama:11434"),
        ActivitySpec::new("kb", "ollama").class("x".repeat(65)),
        ActivitySpec::new("kb", "ollama").operation_stage("stage/with/slashes"),
    ];
    for spec in cases {
        let err = h.ledger.begin_record(spec.clone()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{spec:?}");
    }
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_activities, 0);
    assert!(snap.native_admission.is_empty());

    let redacted = h
        .ledger
        .begin_record(ActivitySpec::new("kb", "openai").model("sk-live-0123456789"))
        .await
        .unwrap();
    assert_eq!(&*redacted.labels.model, "redacted");
}

async fn bad_timestamps_are_refused_and_change_nothing(backend: Backend) {
    let h = Harness::new(backend, config());
    let future = T0 + 5 * 60_000 + 1;
    for spec in [
        embedding().enqueued_at(future),
        embedding().enqueued_at(T0).started_at(T0 - 1),
        embedding().started_at(future),
    ] {
        let err = h.ledger.begin_record(spec).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
    }
    let record = h
        .ledger
        .begin_record(embedding().enqueued_at(T0 - 1000))
        .await
        .unwrap();
    let err = h
        .ledger
        .start(record.activity_id, Some(T0 - 2000))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert_eq!(h.ledger.get(record.activity_id).await.unwrap(), record);
    assert_eq!(snapshot(&h.ledger).await.total_activities, 1);
}

async fn operation_past_the_bound_sees_the_record_reaped_without_a_reaper_pass(backend: Backend) {
    let h = Harness::new(backend, config());
    let executing = h.ledger.begin_record(embedding().started_at(T0)).await.unwrap();
    let waiting = h.ledger.begin_record(embedding()).await.unwrap();
    h.clock.advance(21 * MIN);
    // No reap has run: the settle itself sees the bound has passed.
    let late = h
        .ledger
        .settle(executing.activity_id, Settlement::new(Outcome::Success))
        .await
        .unwrap();
    assert_eq!((late.state, late.late_settle), (State::Reaped, true));
    assert_eq!(late.disposition, Some(Disposition::Unsettled));
    let seen = h.ledger.get(waiting.activity_id).await.unwrap();
    assert_eq!(seen.disposition, Some(Disposition::Abandoned));
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_reaped, 2);
    assert_eq!(
        snap.reaped_this_read.total(),
        0,
        "both were reaped by the operations themselves"
    );
    assert_eq!(snap.total_recent_completions, 0);
}

async fn reap_never_moves_last_seen_at(backend: Backend) {
    let h = Harness::new(backend, config());
    h.ledger.begin_record(embedding().started_at(T0)).await.unwrap();
    h.clock.advance(3 * MIN);
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.aggregates[0].last_seen_at, Some(T0));
    h.clock.advance(Duration::from_secs(3600));
    let snap = h
        .ledger
        .snapshot(SnapshotOptions::default().with_since(Since::At(T0)))
        .await
        .unwrap();
    assert_eq!(snap.reaped_this_read.unsettled, 1);
    assert_eq!(snap.aggregates[0].last_seen_at, Some(T0));
    assert_eq!(snap.aggregates[0].in_flight, 0);
}

async fn snapshot_window_never_hides_live_work_and_flags_truncation(backend: Backend) {
    let h = Harness::new(backend, config());
    // A long batch enqueued long ago, still inside its own bound.
    h.ledger
        .begin_record(
            embedding()
                .deadline(Duration::from_secs(10 * 3600))
                .started_at(T0),
        )
        .await
        .unwrap();
    h.clock.advance(Duration::from_secs(3 * 3600));
    for _ in 0..3 {
        let call = h.ledger.begin(embedding()).await.unwrap();
        call.settle(Outcome::Success).await.unwrap();
    }
    let options = SnapshotOptions::default()
        .with_limit(2)
        .unwrap()
        .with_since(Since::Ago(Duration::from_secs(3600)));
    let snap = h.ledger.snapshot(options).await.unwrap();
    assert_eq!(
        snap.in_flight.len(),
        1,
        "older than the window, still live demand"
    );
    assert_eq!(snap.in_flight[0].elapsed_ms, 3 * 3600 * 1000);
    assert!(!snap.in_flight_truncated);
    assert_eq!(snap.total_recent_completions, 3);
    assert_eq!(snap.recent_completions.len(), 2);
    assert!(snap.recent_completions_truncated);
    assert!(snap.recent_completions[0].completed_at >= snap.recent_completions[1].completed_at);
    assert!(SnapshotOptions::default().with_limit(0).is_err());
    assert!(SnapshotOptions::default().with_limit(10_001).is_err());

    h.clock.advance(Duration::from_secs(2 * 3600));
    let later = h
        .ledger
        .snapshot(SnapshotOptions::default().with_since(Since::Ago(Duration::from_secs(3600))))
        .await
        .unwrap();
    assert_eq!(later.total_recent_completions, 0, "completions left the window");
    assert_eq!(later.total_activities, 4, "but the totals keep them");
}

async fn declared_lane_without_demand_still_appears(backend: Backend) {
    let config = config().with_lane_cap("knowledge-base::ollama", 4).unwrap();
    let h = Harness::new(backend, config);
    let snap = snapshot(&h.ledger).await;
    let lane = snap.lane("knowledge-base::ollama").unwrap();
    assert_eq!((lane.cap, lane.executing, lane.waiting), (Some(4), 0, 0));
    let json = serde_json::to_value(&snap).unwrap();
    assert_eq!(json["nativeAdmission"]["knowledge-base::ollama"]["cap"], 4);
    h.ledger.begin_record(ActivitySpec::new("x", "y")).await.unwrap();
    let json = serde_json::to_value(snapshot(&h.ledger).await).unwrap();
    assert!(json["nativeAdmission"]["x::y"]["cap"].is_null());
}

async fn direct_records_are_not_in_native_admission(backend: Backend) {
    let h = Harness::new(backend, config());
    h.ledger
        .begin_record(embedding().admission(Admission::Direct).started_at(T0))
        .await
        .unwrap();
    let snap = snapshot(&h.ledger).await;
    assert!(snap.lane("knowledge-base::ollama").is_none());
    assert_eq!(snap.total_in_flight, 1);
    h.clock.advance(21 * MIN);
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_reaped, 1, "direct records are reaped all the same");
    assert!(snap.lane("knowledge-base::ollama").is_none());
}

async fn records_report_when_they_become_reapable(backend: Backend) {
    let h = Harness::new(backend, config());
    let waiting = h
        .ledger
        .begin_record(ActivitySpec::new("bot", "openai").class("chat"))
        .await
        .unwrap();
    assert_eq!(waiting.reapable_at, Some(T0 + 8 * 60_000));
    assert_eq!(waiting.deadline_ms, 10 * 60_000);
    h.clock.advance(MIN);
    let started = h.ledger.start(waiting.activity_id, None).await.unwrap();
    assert_eq!(started.reapable_at, Some(T0 + 60_000 + 40 * 60_000));
    assert_eq!(started.queue_wait_ms, Some(60_000));
    let json = serde_json::to_value(&started).unwrap();
    assert_eq!(json["state"], "executing");
    assert!(json["reapableAt"].as_str().unwrap().ends_with('Z'));
    assert!(json["disposition"].is_null());
    h.clock.advance(MIN);
    let settled = h
        .ledger
        .settle(
            started.activity_id,
            Settlement::new(Outcome::Failure(FailureStage::Provider)),
        )
        .await
        .unwrap();
    assert_eq!(settled.reapable_at, None);
    assert_eq!(settled.execution_ms, Some(60_000));
    assert_eq!(settled.failure_stage, Some(FailureStage::Provider));
    assert_eq!(settled.success, Some(false));
}

async fn reaping_is_idempotent(backend: Backend) {
    let h = Harness::new(backend, config());
    for _ in 0..1200 {
        h.ledger.begin_record(embedding().started_at(T0)).await.unwrap();
    }
    h.clock.advance(21 * MIN);
    let (a, b) = tokio::join!(h.ledger.reap(), h.ledger.reap());
    assert_eq!(a.unwrap().unsettled + b.unwrap().unsettled, 1200);
    assert_eq!(h.ledger.reap().await.unwrap().total(), 0);
    assert_eq!(snapshot(&h.ledger).await.total_reaped, 1200);
}

#[tokio::test]
async fn reopening_under_a_changed_class_rebounds_records_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let clock = inflight::FakeClock::at(T0);
    let open = |config: inflight::LedgerConfig| {
        inflight::Ledger::builder(config)
            .store_url(url.clone())
            .clock(clock.clone())
            .build()
            .unwrap()
    };
    let record = open(config())
        .begin_record(embedding().started_at(T0))
        .await
        .unwrap();
    assert_eq!(record.reapable_at, Some(T0 + 20 * 60_000));

    // The operator lengthens the embedding deadline to 1 h and restarts.
    let longer = inflight::Settings::from_toml("[classes.embedding]\ndeadline = \"1h\"\n")
        .unwrap()
        .ledger;
    let ledger = open(longer);
    clock.advance(21 * MIN);
    let record = ledger.get(record.activity_id).await.unwrap();
    assert_eq!(
        record.state,
        State::Executing,
        "the new bound applies to work already in flight"
    );
    assert_eq!(record.reapable_at, Some(T0 + 4 * 3_600_000));
    assert_eq!(record.deadline_ms, 3_600_000);
}

async fn label_sets_spelled_apart_count_in_one_aggregate(backend: Backend) {
    let h = Harness::default(backend);
    // A missing class and `unknown` are the same label set, remembered under
    // two spellings: the counters must not split them.
    let implicit = ActivitySpec::new("kb", "ollama");
    let explicit = ActivitySpec::new("kb", "ollama").class("unknown");
    for spec in [implicit.clone(), explicit, implicit] {
        let call = h.ledger.begin(spec).await.unwrap();
        call.settle(Outcome::Success).await.unwrap();
    }
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.aggregates.len(), 1, "{:?}", snap.aggregates);
    assert_eq!((snap.aggregates[0].calls, snap.aggregates[0].successes), (3, 3));
}

async fn a_returned_record_keeps_its_version(backend: Backend) {
    let h = Harness::new(backend, config());
    // Records are shared with the store that keeps them; a later transition
    // must never show through a reply already handed out.
    let begun = h.ledger.begin_record(embedding()).await.unwrap();
    let started = h.ledger.start(begun.activity_id, None).await.unwrap();
    let settled = h
        .ledger
        .settle(begun.activity_id, Outcome::Success.into())
        .await
        .unwrap();
    assert_eq!(
        (begun.state, started.state, settled.state),
        (State::Waiting, State::Executing, State::Succeeded)
    );
    assert_eq!(begun.started_at, None);
    assert_eq!(started.completed_at, None);
}

async fn handle_forgets_its_record_when_an_operation_fails(backend: Backend) {
    let h = Harness::new(backend, config());
    let mut call = h.ledger.begin(embedding().started_at(T0)).await.unwrap();
    assert_eq!(call.record().unwrap().state, State::Executing);
    h.clock.advance(21 * MIN);
    assert_eq!(h.ledger.reap().await.unwrap().unsettled, 1);
    // Reaped as unsettled: a start is refused, and the handle keeps no stale
    // copy that would still say "executing".
    assert_eq!(call.start().await.unwrap_err().kind(), ErrorKind::Conflict);
    assert!(call.record().is_none());
    let now = h.ledger.get(call.id()).await.unwrap();
    assert_eq!(now.state, State::Reaped);
}

/// `Ledger::close` lands what dropped handles submitted, then closes the
/// file: a reopened ledger finds every cancel, and the closed one refuses.
#[tokio::test]
async fn close_lands_the_cancels_of_dropped_handles_and_closes_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let clock = inflight::FakeClock::at(T0);
    let open = || {
        inflight::Ledger::builder(config())
            .store_url(url.clone())
            .clock(clock.clone())
            .build()
            .unwrap()
    };
    let ledger = open();
    let mut ids = Vec::new();
    for _ in 0..20 {
        let mut call = ledger.begin(embedding()).await.unwrap();
        call.start().await.unwrap();
        ids.push(call.id());
        drop(call); // its cancel is submitted from Drop, not awaited
    }
    ledger.close().await.unwrap();
    let refused = ledger.begin(embedding()).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Closed);
    ledger.close().await.unwrap(); // twice is harmless

    let reopened = open();
    for id in ids {
        assert_eq!(reopened.get(id).await.unwrap().state, State::Cancelled);
    }
}

/// A snapshot prints as the operator's table, with its outcome counts.
#[tokio::test]
async fn a_snapshot_prints_as_the_operators_table() {
    let h = Harness::new(Backend::Memory, config());
    let ok = h.ledger.begin(embedding()).await.unwrap();
    ok.settle(Outcome::Success).await.unwrap();
    let failed = h.ledger.begin(embedding()).await.unwrap();
    failed
        .settle(Outcome::Failure(FailureStage::Provider))
        .await
        .unwrap();
    drop(h.ledger.begin(embedding()).await.unwrap());
    let snap = snapshot(&h.ledger).await;
    assert_eq!(
        (snap.total_succeeded, snap.total_failed, snap.total_cancelled),
        (1, 1, 1)
    );
    let table = snap.to_string();
    assert!(
        table.contains("ever: 1 succeeded, 1 failed, 1 cancelled, 0 reaped"),
        "{table}"
    );
    assert!(table.contains("knowledge-base::ollama"), "{table}");
    assert!(table.lines().count() < 40, "readable at a glance:\n{table}");
}
