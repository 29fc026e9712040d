//! Usage (`docs/semantics.md` §8, "Tokens"): a settle may report the
//! tokens its call spent. The record keeps them, its aggregate sums them
//! when the call ends (a late settle's included: the call ran), and a
//! count out of range refuses the settle, leaving the store as it was.

mod common;

use std::time::Duration;

use common::{config, embedding, snapshot, Backend, Harness, LANE, MIN};
use inflight::{ErrorKind, FailureStage, Outcome, Settlement, State, Usage};

fn usage(input: Option<i64>, output: Option<i64>) -> Usage {
    Usage {
        input_tokens: input,
        output_tokens: output,
    }
}

/// Settles `id` with success, reporting `spent`.
async fn settle_reporting(
    h: &Harness,
    id: inflight::ActivityId,
    spent: Usage,
) -> std::sync::Arc<inflight::ActivityRecord> {
    h.ledger
        .settle(id, Settlement::new(Outcome::Success).usage(spent))
        .await
        .unwrap()
}

/// The tokens summed over every aggregate of the snapshot.
async fn summed(h: &Harness) -> (i64, i64) {
    let snapshot = snapshot(&h.ledger).await;
    snapshot.aggregates.iter().fold((0, 0), |(input, output), a| {
        (input + a.input_tokens, output + a.output_tokens)
    })
}

async fn a_settle_keeps_its_usage_and_the_aggregate_sums_it(backend: Backend) {
    let h = Harness::default(backend);
    let permit = h.ledger.try_admit(embedding()).await.unwrap();
    let record = permit
        .settle_with(Settlement::new(Outcome::Success).usage(usage(Some(120), Some(30))))
        .await
        .unwrap();
    assert_eq!(record.usage, usage(Some(120), Some(30)));
    // A failure may have spent tokens too; one count alone is kept alone.
    let permit = h.ledger.try_admit(embedding()).await.unwrap();
    let failed = permit
        .settle_with(Settlement::new(Outcome::Failure(FailureStage::Provider)).usage(usage(Some(7), None)))
        .await
        .unwrap();
    assert_eq!(failed.usage, usage(Some(7), None));
    // A call that reports nothing keeps nothing, and adds nothing.
    let permit = h.ledger.try_admit(embedding()).await.unwrap();
    let silent = permit.settle(Outcome::Success).await.unwrap();
    assert_eq!(silent.usage, Usage::default());
    assert_eq!(summed(&h).await, (127, 30));
    // Read back from the store, not from the reply.
    assert_eq!(
        h.ledger.get(record.activity_id).await.unwrap().usage,
        usage(Some(120), Some(30))
    );
    // A retry of the same settle is harmless and counts nothing again.
    settle_reporting(&h, record.activity_id, usage(Some(120), Some(30))).await;
    assert_eq!(summed(&h).await, (127, 30));
}

async fn a_count_out_of_range_refuses_the_settle_and_changes_nothing(backend: Backend) {
    let h = Harness::default(backend);
    let permit = h.ledger.try_admit(embedding()).await.unwrap();
    let id = permit.id();
    for (bad, field) in [
        (usage(Some(-1), None), "usage.inputTokens"),
        (usage(Some(1), Some(1_000_000_001)), "usage.outputTokens"),
    ] {
        let err = h
            .ledger
            .settle(id, Settlement::new(Outcome::Success).usage(bad))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(err.to_string().contains(field), "{err}");
    }
    let record = h.ledger.get(id).await.unwrap();
    assert_eq!((record.state, record.usage), (State::Executing, Usage::default()));
    assert_eq!(summed(&h).await, (0, 0));
    // The limits themselves are accepted.
    let record = permit
        .settle_with(Settlement::new(Outcome::Success).usage(usage(Some(0), Some(1_000_000_000))))
        .await
        .unwrap();
    assert_eq!(record.usage, usage(Some(0), Some(1_000_000_000)));
    assert_eq!(summed(&h).await, (0, 1_000_000_000));
}

/// A call of `spec` started, then past its bound (an embedding's 5 min
/// deadline, times the factor) reaped `unsettled`.
async fn reaped_unsettled(h: &Harness, spec: inflight::ActivitySpec) -> inflight::ActivityId {
    let id = h.ledger.begin_record(spec).await.unwrap().activity_id;
    h.ledger.start(id, None).await.unwrap();
    h.clock.advance(30 * MIN);
    assert_eq!(h.ledger.reap().await.unwrap().unsettled, 1);
    id
}

async fn a_late_settle_counts_its_usage_once(backend: Backend) {
    let h = Harness::new(backend, config());
    let id = reaped_unsettled(&h, embedding()).await;
    let late = settle_reporting(&h, id, usage(Some(40), Some(2))).await;
    assert!(late.late_settle);
    assert_eq!(late.state, State::Reaped);
    assert_eq!(late.usage, usage(Some(40), Some(2)));
    assert_eq!(summed(&h).await, (40, 2));
    // Only the first late settle counts.
    h.clock.advance(Duration::from_secs(1));
    let again = settle_reporting(&h, id, usage(Some(99), None)).await;
    assert_eq!(again.usage, usage(Some(40), Some(2)));
    assert_eq!(summed(&h).await, (40, 2));
}

/// The lane's token window: `tokensLastMinute` and `tokensReserved`.
async fn window(h: &Harness) -> (i64, i64) {
    snapshot(&h.ledger)
        .await
        .lane(LANE)
        .map_or((0, 0), |lane| (lane.tokens_last_minute, lane.tokens_reserved))
}

/// The lane's `tokensLastMinute`.
async fn last_minute(h: &Harness) -> i64 {
    window(h).await.0
}

async fn a_lane_shows_the_tokens_of_the_last_minute_by_the_second_of_each_settle(backend: Backend) {
    let h = Harness::new(backend, config());
    let settle = |tokens: i64| {
        let ledger = h.ledger.clone();
        async move {
            let permit = ledger.try_admit(embedding()).await.unwrap();
            permit
                .settle_with(Settlement::new(Outcome::Success).usage(usage(Some(tokens), Some(1))))
                .await
                .unwrap()
        }
    };
    // T0 is a whole second: the first settle counts in the second from T0,
    // the next one in the second after it.
    h.clock.advance(Duration::from_millis(500));
    settle(99).await;
    h.clock.advance(Duration::from_secs(1));
    settle(199).await;
    assert_eq!(last_minute(&h).await, 300);
    // Another lane's tokens are its own.
    let other = h
        .ledger
        .try_admit(inflight::ActivitySpec::new("chat", "openai").class("chat"))
        .await
        .unwrap();
    other
        .settle_with(Settlement::new(Outcome::Success).usage(usage(None, Some(5))))
        .await
        .unwrap();
    assert_eq!(
        snapshot(&h.ledger)
            .await
            .lane("chat::openai")
            .unwrap()
            .tokens_last_minute,
        5
    );
    assert_eq!(last_minute(&h).await, 300);
    // A second counts while any of it is within the last minute: the first
    // one (T0 .. T0 + 1 s) until T0 + 61 s, the next until T0 + 62 s.
    h.clock.advance(Duration::from_millis(59_499));
    assert_eq!(
        last_minute(&h).await,
        300,
        "at T0 + 60.999 s the first second still counts"
    );
    h.clock.advance(Duration::from_millis(1));
    assert_eq!(last_minute(&h).await, 200);
    h.clock.advance(Duration::from_secs(1));
    assert_eq!(last_minute(&h).await, 0);
    // A prune forgets the seconds out of the window and nothing else.
    h.ledger.prune().await.unwrap();
    assert_eq!(last_minute(&h).await, 0);
    assert_eq!(summed(&h).await, (298, 7));
}

async fn a_late_settle_charges_its_tokens_at_its_reap(backend: Backend) {
    let h = Harness::new(backend, config());
    let id = reaped_unsettled(&h, embedding()).await;
    h.clock.advance(Duration::from_secs(30));
    settle_reporting(&h, id, usage(Some(40), Some(2))).await;
    assert_eq!(last_minute(&h).await, 42, "charged at the reap, 30 s ago");
    h.clock.advance(Duration::from_secs(31));
    assert_eq!(last_minute(&h).await, 0, "the reap's second left the window");
    // A late settle long after its reap charges nothing to the window.
    let id = reaped_unsettled(&h, embedding()).await;
    h.clock.advance(2 * MIN);
    settle_reporting(&h, id, usage(Some(7), None)).await;
    assert_eq!(last_minute(&h).await, 0);
    assert_eq!(summed(&h).await, (47, 2), "the aggregates count both");
}

against_every_store!(
    a_lane_shows_the_tokens_of_the_last_minute_by_the_second_of_each_settle,
    a_late_settle_charges_its_tokens_at_its_reap,
    a_settle_keeps_its_usage_and_the_aggregate_sums_it,
    a_count_out_of_range_refuses_the_settle_and_changes_nothing,
    a_late_settle_counts_its_usage_once,
);

/// The lane's `tokensReserved`.
async fn reserved(h: &Harness) -> i64 {
    window(h).await.1
}

async fn an_executing_call_reserves_its_estimate_and_charges_it_when_it_reports_none(backend: Backend) {
    let h = Harness::new(backend, config());
    // Begun started, and started later: both reserve while they run.
    let now = h.ledger.now();
    let started = h
        .ledger
        .begin_record(embedding().max_tokens(400).started_at(now))
        .await
        .unwrap();
    assert_eq!(started.max_tokens, Some(400));
    let waiting = h.ledger.begin_record(embedding().max_tokens(100)).await.unwrap();
    assert_eq!(
        (reserved(&h).await, last_minute(&h).await),
        (400, 0),
        "a waiting call reserves nothing"
    );
    h.ledger.start(waiting.activity_id, None).await.unwrap();
    assert_eq!(reserved(&h).await, 500);
    // Reported usage replaces the estimate; none reported charges it.
    settle_reporting(&h, started.activity_id, usage(Some(30), Some(20))).await;
    assert_eq!((reserved(&h).await, last_minute(&h).await), (100, 50));
    h.ledger
        .settle(waiting.activity_id, Settlement::new(Outcome::Success))
        .await
        .unwrap();
    assert_eq!((reserved(&h).await, last_minute(&h).await), (0, 150));
    // A call cancelled before it started charges nothing.
    let cancelled = h.ledger.begin_record(embedding().max_tokens(900)).await.unwrap();
    h.ledger.cancel(cancelled.activity_id, None).await.unwrap();
    assert_eq!((reserved(&h).await, last_minute(&h).await), (0, 150));
}

async fn a_reaped_unsettled_call_charges_its_estimate_at_its_reap_until_a_late_settle_replaces_it(
    backend: Backend,
) {
    let h = Harness::new(backend, config());
    let id = reaped_unsettled(&h, embedding().max_tokens(400)).await;
    assert_eq!((reserved(&h).await, last_minute(&h).await), (0, 400));
    h.clock.advance(Duration::from_secs(10));
    settle_reporting(&h, id, usage(Some(40), Some(2))).await;
    assert_eq!(
        last_minute(&h).await,
        42,
        "the late settle's usage replaces the estimate"
    );
}

async fn a_class_estimate_applies_when_a_begin_declares_none_and_a_bad_one_is_refused(backend: Backend) {
    let classes = std::collections::BTreeMap::from([(
        "embedding".to_owned(),
        inflight::domain::ClassBounds::new(5 * MIN, None)
            .unwrap()
            .with_tokens(250)
            .unwrap(),
    )]);
    let config = inflight::LedgerConfig::new(inflight::domain::ReapPolicy::new(classes, 4.0).unwrap());
    let h = Harness::new(backend, config);
    let record = h.ledger.begin_record(embedding()).await.unwrap();
    assert_eq!(record.max_tokens, Some(250));
    let own = h.ledger.begin_record(embedding().max_tokens(7)).await.unwrap();
    assert_eq!(own.max_tokens, Some(7), "a declared estimate wins");
    for bad in [-1, 1_000_000_001] {
        let err = h
            .ledger
            .begin_record(embedding().max_tokens(bad))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(err.to_string().contains("maxTokens"), "{err}");
    }
    assert_eq!(
        snapshot(&h.ledger).await.total_activities,
        2,
        "a refused begin writes nothing"
    );
}

mod estimates {
    use super::*;

    against_every_store!(
        an_executing_call_reserves_its_estimate_and_charges_it_when_it_reports_none,
        a_reaped_unsettled_call_charges_its_estimate_at_its_reap_until_a_late_settle_replaces_it,
        a_class_estimate_applies_when_a_begin_declares_none_and_a_bad_one_is_refused,
    );
}
