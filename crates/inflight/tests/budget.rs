//! Token budgets (`docs/semantics.md` §8, "Budgets"): a lane's
//! `tokens_per_minute`, and its provider's, admit a start only while the
//! last minute's tokens, the reservations of the calls executing, the
//! estimates waiting ahead of it and its own estimate fit; on every store,
//! with a fake clock.

mod common;

use std::time::Duration;

use common::{config, embedding, snapshot, succeed_at_once, Backend, Harness, LANE, MIN};
use inflight::{
    ActivityId, ActivitySpec, Admission, ErrorKind, Ledger, LedgerConfig, Outcome, Settlement, State, Usage,
};

fn budgeted(tokens_per_minute: i64) -> LedgerConfig {
    config().with_lane_budget(LANE, tokens_per_minute).unwrap()
}

/// A call on `LANE` estimated at `tokens`.
fn estimated(tokens: i64) -> ActivitySpec {
    embedding().max_tokens(tokens)
}

/// Begins a call of `spec`, waiting in line.
async fn waiting(ledger: &Ledger, spec: ActivitySpec) -> ActivityId {
    ledger.begin_record(spec).await.unwrap().activity_id
}

/// Asks once to start `id`: whether it started, else the refusal.
async fn ask(ledger: &Ledger, id: ActivityId) -> Result<(), inflight::LedgerError> {
    ledger.start(id, None).await.map(drop)
}

fn spent(total: i64) -> Settlement {
    Settlement::new(Outcome::Success).usage(Usage {
        input_tokens: Some(total),
        output_tokens: None,
    })
}

/// The lane's `(tokensLastMinute, tokensReserved)`.
async fn window(ledger: &Ledger) -> (i64, i64) {
    let snap = snapshot(ledger).await;
    let lane = snap.lane(LANE).unwrap();
    (lane.tokens_last_minute, lane.tokens_reserved)
}

/// The scenario: `tokens_per_minute = 1000`, three calls of 400;
/// the third is refused with when the window makes room, and starts once
/// a settle reconciles an estimate with less.
async fn a_third_call_of_400_waits_for_room_in_a_budget_of_1000(backend: Backend) {
    let h = Harness::new(backend, budgeted(1_000));
    let first = waiting(&h.ledger, estimated(400)).await;
    let second = waiting(&h.ledger, estimated(400)).await;
    let third = waiting(&h.ledger, estimated(400)).await;
    ask(&h.ledger, first).await.unwrap();
    ask(&h.ledger, second).await.unwrap();
    let err = ask(&h.ledger, third).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    assert!(err.to_string().contains("tokens_per_minute 1000"), "{err}");
    assert!(err.to_string().contains("keeps its place in line"), "{err}");
    // Only reservations hold it: no roll-off makes room, a settle must.
    assert_eq!(err.retry_after(), Some(MIN));
    assert_eq!(h.ledger.get(third).await.unwrap().state, State::Waiting);
    // A begin already started has no place to keep: nothing is recorded.
    let now = h.ledger.now();
    let err = h
        .ledger
        .begin_record(estimated(400).started_at(now))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    assert!(err.to_string().ends_with("nothing was recorded"), "{err}");
    assert_eq!(snapshot(&h.ledger).await.total_activities, 3);
    let snap = snapshot(&h.ledger).await;
    let lane = snap.lane(LANE).unwrap();
    assert_eq!(
        (lane.tokens_reserved, lane.tokens_per_minute, lane.cap),
        (800, Some(1_000), None)
    );
    // The first spent 150: its estimate is replaced, and room is made.
    h.clock.advance(Duration::from_millis(1_500));
    h.ledger.settle(first, spent(150)).await.unwrap();
    assert_eq!(window(&h.ledger).await, (150, 400));
    ask(&h.ledger, third).await.expect("150 + 400 + 400 fits in 1000");
    assert_eq!(window(&h.ledger).await, (150, 800));
    // A fourth is refused until the 150 rolls off: a second after the one
    // it was charged in leaves the last minute.
    let fourth = waiting(&h.ledger, estimated(200)).await;
    let err = ask(&h.ledger, fourth).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    // Charged at 1.5 s, in the second from 1 s: it leaves at 62 s.
    let left = err.retry_after().unwrap();
    assert_eq!(left, Duration::from_millis(60_500));
    h.clock.advance(left - Duration::from_millis(1));
    assert_eq!(
        ask(&h.ledger, fourth).await.unwrap_err().kind(),
        ErrorKind::BudgetExhausted
    );
    h.clock.advance(Duration::from_millis(1));
    ask(&h.ledger, fourth).await.expect("the 150 rolled off");
}

/// 64 starts at once never exceed the budget: exactly as many as fit are
/// admitted, and the rest keep their places.
async fn a_budget_is_never_exceeded_by_64_concurrent_starts(backend: Backend) {
    let h = Harness::new(backend, budgeted(1_000));
    let mut ids = Vec::new();
    for _ in 0..64 {
        ids.push(waiting(&h.ledger, estimated(90)).await);
    }
    let asks = ids.iter().map(|id| {
        let (ledger, id) = (h.ledger.clone(), *id);
        tokio::spawn(async move { ask(&ledger, id).await })
    });
    let mut admitted = 0;
    for answer in futures_util::future::join_all(asks).await {
        match answer.unwrap() {
            Ok(()) => admitted += 1,
            Err(err) => assert!(matches!(err.kind(), ErrorKind::BudgetExhausted), "{err}"),
        }
    }
    assert_eq!(admitted, 11, "11 x 90 fits in 1000, 12 x 90 does not");
    assert_eq!(window(&h.ledger).await, (0, 990));
}

/// When the window rolls off, the waiters are served in line order: one
/// later in line is refused while the estimates ahead of it do not fit.
async fn the_window_rolls_off_and_releases_waiters_in_order(backend: Backend) {
    let h = Harness::new(backend, budgeted(1_000));
    let spender = h.ledger.try_admit(estimated(600)).await.unwrap();
    spender.settle_with(spent(600)).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..3 {
        h.clock.advance(Duration::from_millis(1));
        ids.push(waiting(&h.ledger, estimated(600)).await);
    }
    // The last in line asks first: the two ahead hold the room it wants.
    let err = ask(&h.ledger, ids[2]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    // Each waits for as long as it takes, and settles at once, charging
    // its 600: the next waits for that to roll off in turn.
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks: Vec<_> = ids
        .iter()
        .enumerate()
        .rev()
        .map(|(at, id)| {
            let (ledger, order, id) = (h.ledger.clone(), std::sync::Arc::clone(&order), *id);
            tokio::spawn(async move {
                ledger.start_waiting(id, None, None).await.unwrap();
                order.lock().unwrap().push(at);
                ledger.settle(id, spent(600)).await.unwrap();
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        order.lock().unwrap().is_empty(),
        "admitted before the window rolled off"
    );
    for served in 1..=3 {
        h.clock.advance(MIN + Duration::from_secs(1));
        // The waiters' own timers wake them when the window rolls off.
        // Paused, tokio's clock runs ahead while a store works on another
        // thread: the wait is bounded in real time.
        let give_up = std::time::Instant::now() + Duration::from_secs(30);
        while order.lock().unwrap().len() < served && std::time::Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let lane = snapshot(&h.ledger).await.lane(LANE).cloned();
        assert_eq!(order.lock().unwrap().len(), served, "one a window: {lane:?}");
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), [0, 1, 2]);
}

/// The estimates waiting ahead follow the lane's order: on a plain lane
/// a later interactive call waits for a batch call's estimate ahead of
/// it; on a lane whose interactive work overtakes (`max_overtakes`), it
/// counts only the interactive estimates ahead.
async fn the_estimates_ahead_follow_the_lanes_order(backend: Backend) {
    use inflight::Priority;
    for (overtakes, interactive_first) in [(None, false), (Some(1), true)] {
        let mut config = budgeted(1_000).with_lane_cap(LANE, 10).unwrap();
        if let Some(max) = overtakes {
            config = config.with_lane_ranking(LANE, None, Some(max)).unwrap();
        }
        let h = Harness::new(backend, config);
        let batch = waiting(&h.ledger, estimated(600).priority(Priority::Batch)).await;
        h.clock.advance(Duration::from_millis(1));
        let interactive = waiting(&h.ledger, estimated(600).priority(Priority::Interactive)).await;
        let asked = ask(&h.ledger, interactive).await;
        assert_eq!(
            asked.is_ok(),
            interactive_first,
            "max_overtakes {overtakes:?}: {asked:?}"
        );
        let other = if interactive_first { batch } else { interactive };
        let first = if interactive_first { interactive } else { batch };
        if !interactive_first {
            ask(&h.ledger, first)
                .await
                .expect("the batch call is first in line");
        }
        let err = ask(&h.ledger, other).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    }
}

/// A reaped `unsettled` record counts its estimate at its `reapedAt`; a
/// late settle's usage then replaces it there.
async fn a_reaped_record_counts_its_estimate_until_a_late_settle_says_otherwise(backend: Backend) {
    let h = Harness::new(backend, budgeted(1_000));
    let id = waiting(&h.ledger, estimated(700)).await;
    ask(&h.ledger, id).await.unwrap();
    h.clock.advance(30 * MIN);
    assert_eq!(h.ledger.reap().await.unwrap().unsettled, 1);
    assert_eq!(window(&h.ledger).await, (700, 0));
    let next = waiting(&h.ledger, estimated(400)).await;
    assert_eq!(
        ask(&h.ledger, next).await.unwrap_err().kind(),
        ErrorKind::BudgetExhausted
    );
    let late = h.ledger.settle(id, spent(100)).await.unwrap();
    assert!(late.late_settle);
    assert_eq!(window(&h.ledger).await, (100, 0));
    ask(&h.ledger, next).await.expect("100 + 400 fits");
}

/// An estimate over the whole budget could never start: refused at begin,
/// naming the budget, with nothing stored. `direct` calls are never
/// refused.
async fn an_estimate_over_the_whole_budget_is_refused_at_begin(backend: Backend) {
    let classes = std::collections::BTreeMap::from([
        (
            "embedding".to_owned(),
            inflight::domain::ClassBounds::new(5 * MIN, None).unwrap(),
        ),
        (
            "chat".to_owned(),
            inflight::domain::ClassBounds::new(10 * MIN, None)
                .unwrap()
                .with_tokens(5_000)
                .unwrap(),
        ),
    ]);
    let config = LedgerConfig::new(inflight::domain::ReapPolicy::new(classes, 4.0).unwrap())
        .with_lane_budget(LANE, 1_000)
        .unwrap();
    let h = Harness::new(backend, config);
    let err = h.ledger.begin_record(estimated(1_001)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("maxTokens 1001"), "{err}");
    assert!(
        err.to_string()
            .contains("lanes.\"knowledge-base::ollama\".tokens_per_minute = 1000"),
        "{err}"
    );
    let chat = ActivitySpec::new("knowledge-base", "ollama").class("chat");
    let err = h.ledger.begin_record(chat).await.unwrap_err();
    assert!(err.to_string().contains("class chat's tokens 5000"), "{err}");
    assert_eq!(snapshot(&h.ledger).await.in_flight.len(), 0);
    h.ledger
        .begin_record(estimated(1_000))
        .await
        .expect("the whole budget fits");
    let direct = h
        .ledger
        .try_admit(estimated(5_000).admission(Admission::Direct))
        .await
        .expect("direct calls are never refused");
    direct.settle(Outcome::Success).await.unwrap();
}

/// `direct` and `external` calls spend the budget but are never refused.
async fn direct_and_external_calls_count_but_are_never_refused(backend: Backend) {
    let h = Harness::new(backend, budgeted(1_000));
    let direct = h
        .ledger
        .try_admit(estimated(600).admission(Admission::Direct))
        .await
        .unwrap();
    let now = h.ledger.now();
    let external = h
        .ledger
        .begin_record(estimated(300).admission(Admission::External).started_at(now))
        .await
        .unwrap();
    assert_eq!(external.state, State::Executing);
    let another = h
        .ledger
        .try_admit(estimated(300).admission(Admission::Direct))
        .await
        .expect("over the budget, but direct");
    assert_eq!(window(&h.ledger).await, (0, 1_200));
    let queued = waiting(&h.ledger, estimated(1)).await;
    assert_eq!(
        ask(&h.ledger, queued).await.unwrap_err().kind(),
        ErrorKind::BudgetExhausted
    );
    direct.settle(Outcome::Success).await.unwrap();
    another.settle(Outcome::Success).await.unwrap();
}

/// `[providers.NAME] tokens_per_minute` is shared by every lane of the
/// provider, declared or not; a lane's own budget holds as well.
async fn a_provider_budget_is_shared_by_its_lanes(backend: Backend) {
    let config = budgeted(500).with_provider_budget("ollama", 1_000).unwrap();
    let h = Harness::new(backend, config);
    let chat = |tokens| {
        ActivitySpec::new("chat", "ollama")
            .class("chat")
            .max_tokens(tokens)
    };
    let held = h
        .ledger
        .try_admit(chat(700))
        .await
        .expect("an undeclared lane, within 1000");
    let err = h.ledger.try_admit(estimated(400)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    assert!(err.to_string().contains("provider ollama"), "{err}");
    // Another provider's lanes are not held.
    let other = ActivitySpec::new("knowledge-base", "openai")
        .class("embedding")
        .max_tokens(900);
    succeed_at_once(&h.ledger, other).await;
    held.settle_with(spent(100)).await.unwrap();
    let lane_call = h
        .ledger
        .try_admit(estimated(400))
        .await
        .expect("100 + 400 fits both budgets");
    // The lane's own budget of 500 holds too.
    let err = h.ledger.try_admit(estimated(200)).await.unwrap_err();
    assert!(err.to_string().contains("tokens_per_minute 500"), "{err}");
    lane_call.settle(Outcome::Success).await.unwrap();
    let snap = snapshot(&h.ledger).await;
    let lane = snap.lane("chat::ollama").unwrap();
    assert_eq!(
        (lane.tokens_per_minute, lane.provider_tokens_per_minute),
        (None, Some(1_000))
    );
}

/// The budget is the store's: two ledgers on it (two instances, on
/// PostgreSQL) starting at once never exceed it together.
async fn two_ledgers_on_the_store_never_exceed_one_budget_together(backend: Backend) {
    if matches!(backend, Backend::Memory) {
        return; // a memory store has one ledger
    }
    let config = budgeted(1_000).with_provider_budget("ollama", 2_000).unwrap();
    let h = Harness::new(backend, config.clone());
    let other = Ledger::builder(config)
        .store_url(h.url.clone())
        .clock(h.clock.clone())
        .build()
        .unwrap();
    let asks = (0..32).map(|n| {
        let ledger = if n % 2 == 0 {
            h.ledger.clone()
        } else {
            other.clone()
        };
        let spec = if n % 4 < 2 {
            estimated(100)
        } else {
            ActivitySpec::new("chat", "ollama").class("chat").max_tokens(100)
        };
        tokio::spawn(async move { ledger.try_admit(spec).await })
    });
    let mut permits = Vec::new();
    for answer in futures_util::future::join_all(asks).await {
        match answer.unwrap() {
            Ok(permit) => permits.push(permit),
            Err(err) => assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}"),
        }
    }
    let admitted = permits.len() as i64;
    let snap = snapshot(&h.ledger).await;
    let reserved = |lane: &str| snap.lane(lane).map_or(0, |lane| lane.tokens_reserved);
    assert!(reserved(LANE) <= 1_000, "{}", reserved(LANE));
    assert_eq!(reserved(LANE) + reserved("chat::ollama"), admitted * 100);
    assert!(admitted * 100 <= 2_000);
    assert_eq!(reserved(LANE), 1_000, "the lane's budget filled");
}

/// `?wait=` that runs out on a budget answers the budget.
async fn a_wait_that_runs_out_on_a_budget_names_it(backend: Backend) {
    let h = Harness::new(backend, budgeted(1_000));
    let _held = h.ledger.try_admit(estimated(800)).await.unwrap();
    let err = h
        .ledger
        .begin_started(estimated(400), Duration::from_millis(200))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    assert!(err.retry_after().is_some());
    let err = h.ledger.try_admit(estimated(400)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted);
    let stats = h.ledger.stats();
    let reasons: Vec<&str> = stats.rejected.keys().map(|(_, why)| why.as_str()).collect();
    assert_eq!(reasons, ["wait_timeout", "budget_exhausted"]);
}

against_every_store!(
    a_third_call_of_400_waits_for_room_in_a_budget_of_1000,
    a_budget_is_never_exceeded_by_64_concurrent_starts,
    the_window_rolls_off_and_releases_waiters_in_order,
    the_estimates_ahead_follow_the_lanes_order,
    a_reaped_record_counts_its_estimate_until_a_late_settle_says_otherwise,
    an_estimate_over_the_whole_budget_is_refused_at_begin,
    direct_and_external_calls_count_but_are_never_refused,
    a_provider_budget_is_shared_by_its_lanes,
    two_ledgers_on_the_store_never_exceed_one_budget_together,
    a_wait_that_runs_out_on_a_budget_names_it,
);
