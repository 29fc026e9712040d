//! Cooldowns and adaptive caps (`docs/semantics.md` §6, "Cooldowns"): a
//! provider's `Retry-After` on a failure stops a capped lane from granting
//! until it passes, on every store; waiters keep their places and are
//! served in order when it ends; `direct` and `external` records are never
//! refused; an adaptive lane halves its cap and earns it back.

mod common;

use std::time::Duration;

use common::{config, embedding, snapshot, succeed_at_once, Backend, Harness, Waiters, LANE};
use inflight::{Admission, ErrorKind, FailureStage, LedgerConfig, Outcome, Settlement, State};

const PROVIDER_REFUSED: Outcome = Outcome::Failure(FailureStage::Provider);

fn capped(cap: u32) -> LedgerConfig {
    config().with_lane_cap(LANE, cap).unwrap()
}

/// A call on `LANE` that the provider refused with `Retry-After`.
async fn refused_with_retry_after(h: &Harness, retry_after: Duration) {
    let permit = h.ledger.try_admit(embedding()).await.unwrap();
    permit
        .settle_with(Settlement::new(PROVIDER_REFUSED).retry_after(retry_after))
        .await
        .unwrap();
}

async fn a_retry_after_cools_the_lane_down_until_it_passes(backend: Backend) {
    let h = Harness::new(backend, capped(4));
    let before = h.ledger.now();
    refused_with_retry_after(&h, Duration::from_millis(2_500)).await;
    let err = h.ledger.try_admit(embedding()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LaneCooling, "{err}");
    let left = err.retry_after().unwrap();
    assert!(
        left > Duration::from_secs(2) && left <= Duration::from_millis(2_500),
        "{left:?}"
    );
    let lane = snapshot(&h.ledger).await.lane(LANE).unwrap().clone();
    assert_eq!(lane.cooling_until, Some(before + 2_500));
    assert_eq!(lane.cooldowns, 1);
    // Executing calls go on; `direct` and `external` ones are never
    // refused by it.
    let direct = h
        .ledger
        .try_admit(embedding().admission(Admission::Direct))
        .await
        .unwrap();
    let now = h.ledger.now();
    let external = h
        .ledger
        .begin_record(embedding().admission(Admission::External).started_at(now))
        .await
        .unwrap();
    assert_eq!(external.state, State::Executing);
    direct.settle(Outcome::Success).await.unwrap();
    h.clock.advance(Duration::from_millis(2_499));
    assert_eq!(
        h.ledger.try_admit(embedding()).await.unwrap_err().kind(),
        ErrorKind::LaneCooling
    );
    h.clock.advance(Duration::from_millis(1));
    // The cooldown is over.
    succeed_at_once(&h.ledger, embedding()).await;
    let lane = snapshot(&h.ledger).await.lane(LANE).unwrap().clone();
    assert_eq!((lane.cooling_until, lane.cooldowns), (None, 1));
}

async fn a_cooldown_is_capped_by_max_cooldown_and_a_success_cannot_carry_one(backend: Backend) {
    let config = capped(4)
        .with_lane_cooldown(LANE, Some(Duration::from_secs(5)), false)
        .unwrap();
    let h = Harness::new(backend, config);
    let before = h.ledger.now();
    refused_with_retry_after(&h, Duration::from_secs(3_600)).await;
    let lane = snapshot(&h.ledger).await.lane(LANE).unwrap().clone();
    assert_eq!(lane.cooling_until, Some(before + 5_000));
    // Bad input changes nothing.
    let id = h.ledger.begin_record(embedding()).await.unwrap().activity_id;
    for settlement in [
        Settlement::new(Outcome::Success).retry_after_ms(1_000),
        Settlement::new(PROVIDER_REFUSED).retry_after_ms(0),
        Settlement::new(PROVIDER_REFUSED).retry_after_ms(3_600_001),
    ] {
        let err = h.ledger.settle(id, settlement).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(err.to_string().contains("retryAfterMs"), "{err}");
        assert_eq!(h.ledger.get(id).await.unwrap().state, State::Waiting);
    }
    assert_eq!(snapshot(&h.ledger).await.lane(LANE).unwrap().cooldowns, 1);
}

/// Waiters keep their places through a cooldown and are served in line
/// order when it ends, woken by its timer rather than their own polls.
async fn waiters_keep_their_places_and_are_served_in_order_when_it_ends(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    refused_with_retry_after(&h, Duration::from_secs(2)).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        h.clock.advance(Duration::from_millis(1));
        ids.push(h.ledger.begin_record(embedding()).await.unwrap().activity_id);
    }
    let waiters = Waiters::start(&h.ledger, &ids, Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(waiters.admitted().is_empty(), "admitted while cooling");
    h.clock.advance(Duration::from_secs(2));
    assert_eq!(waiters.finish().await, [0, 1, 2]);
}

/// The cooldown is the store's: a second ledger on it (another instance,
/// on PostgreSQL) is refused too, and its waiters are served in order once
/// it ends.
async fn a_cooldown_holds_for_a_second_ledger_on_the_store(backend: Backend) {
    if matches!(backend, Backend::Memory) {
        return; // a memory store has one ledger
    }
    let h = Harness::new(backend, capped(1));
    let other = inflight::Ledger::builder(capped(1))
        .store_url(h.url.clone())
        .clock(h.clock.clone())
        .build()
        .unwrap();
    refused_with_retry_after(&h, Duration::from_secs(2)).await;
    let err = other.try_admit(embedding()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LaneCooling, "{err}");
    let mut ids = Vec::new();
    for _ in 0..2 {
        h.clock.advance(Duration::from_millis(1));
        ids.push(other.begin_record(embedding()).await.unwrap().activity_id);
    }
    let waiters = Waiters::start(&other, &ids, Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(waiters.admitted().is_empty(), "admitted while cooling");
    h.clock.advance(Duration::from_secs(2));
    assert_eq!(waiters.finish().await, [0, 1]);
}

/// `?wait=` that runs out during a cooldown answers the cooldown.
async fn a_wait_that_runs_out_while_cooling_names_the_cooldown(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    refused_with_retry_after(&h, Duration::from_secs(30)).await;
    let err = h
        .ledger
        .begin_started(embedding(), Duration::from_millis(200))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LaneCooling, "{err}");
    let stats = h.ledger.stats();
    let reasons: Vec<&str> = stats.rejected.keys().map(|(_, why)| why.as_str()).collect();
    assert_eq!(reasons, ["wait_timeout"]);
}

/// `[providers.NAME] shared_cooldown`: a refusal on one lane of the
/// provider cools every capped lane of it, and no other provider's.
async fn a_shared_cooldown_holds_for_every_lane_of_the_provider(backend: Backend) {
    let config = capped(2)
        .with_lane_cap("chat::ollama", 1)
        .unwrap()
        .with_lane_cap("knowledge-base::openai", 1)
        .unwrap()
        .with_shared_cooldown("ollama")
        .unwrap();
    let h = Harness::new(backend, config);
    refused_with_retry_after(&h, Duration::from_secs(10)).await;
    let chat = inflight::ActivitySpec::new("chat", "ollama").class("chat");
    assert_eq!(
        h.ledger.try_admit(chat).await.unwrap_err().kind(),
        ErrorKind::LaneCooling
    );
    let other = inflight::ActivitySpec::new("knowledge-base", "openai").class("embedding");
    succeed_at_once(&h.ledger, other).await;
    let snap = snapshot(&h.ledger).await;
    assert!(snap.lane("chat::ollama").unwrap().cooling_until.is_some());
    assert!(snap
        .lane("knowledge-base::openai")
        .unwrap()
        .cooling_until
        .is_none());
}

/// `n` calls on `LANE`, each admitted at once and settled a success.
async fn succeed(ledger: &inflight::Ledger, n: usize) {
    for _ in 0..n {
        let permit = ledger.try_admit(embedding()).await.unwrap();
        permit.settle(Outcome::Success).await.unwrap();
    }
}

/// `adaptive = true`: each refusal halves the cap in force (floor 1); each
/// run of `cap` successes gives one slot back.
async fn an_adaptive_lane_halves_its_cap_and_earns_it_back(backend: Backend) {
    let config = capped(4).with_lane_cooldown(LANE, None, true).unwrap();
    let h = Harness::new(backend, config);
    refused_with_retry_after(&h, Duration::from_millis(1)).await;
    h.clock.advance(Duration::from_millis(1));
    let effective = |h: &Harness| {
        let ledger = h.ledger.clone();
        async move { snapshot(&ledger).await.lane(LANE).unwrap().effective_cap }
    };
    assert_eq!(effective(&h).await, Some(2));
    let first = h.ledger.try_admit(embedding()).await.unwrap();
    let second = h.ledger.try_admit(embedding()).await.unwrap();
    assert_eq!(
        h.ledger.try_admit(embedding()).await.unwrap_err().kind(),
        ErrorKind::LaneFull
    );
    first.settle(Outcome::Success).await.unwrap();
    second.settle(Outcome::Success).await.unwrap();
    succeed(&h.ledger, 2).await;
    assert_eq!(
        effective(&h).await,
        Some(3),
        "a run of 4 successes gives a slot back"
    );
    succeed(&h.ledger, 4).await;
    assert_eq!(effective(&h).await, Some(4));
}

against_every_store!(
    a_retry_after_cools_the_lane_down_until_it_passes,
    a_cooldown_is_capped_by_max_cooldown_and_a_success_cannot_carry_one,
    waiters_keep_their_places_and_are_served_in_order_when_it_ends,
    a_cooldown_holds_for_a_second_ledger_on_the_store,
    a_wait_that_runs_out_while_cooling_names_the_cooldown,
    a_shared_cooldown_holds_for_every_lane_of_the_provider,
    an_adaptive_lane_halves_its_cap_and_earns_it_back,
);
