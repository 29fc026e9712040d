//! Ranked lanes (`docs/semantics.md` §6): interactive work first with at
//! most `max_overtakes` grants in a row while batch work waits, and
//! `batch_cap` headroom that only interactive work may take. On every
//! store, through the decision and through the waiting line.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{config, embedding, snapshot, Backend, Harness, Waiters, LANE};
use inflight::{ActivityId, ErrorKind, Ledger, LedgerConfig, Outcome, Priority, Settlement, State};

/// `LANE` with one slot, ranked with `max_overtakes`.
fn overtaking(max_overtakes: u32) -> LedgerConfig {
    config()
        .with_lane_cap(LANE, 1)
        .unwrap()
        .with_lane_ranking(LANE, None, Some(max_overtakes))
        .unwrap()
}

/// Begins one waiting record a millisecond, so that line order is the
/// order given; returns their ids.
async fn line_up(h: &Harness, priorities: &[Priority]) -> Vec<ActivityId> {
    let mut ids = Vec::new();
    for priority in priorities {
        h.clock.advance(Duration::from_millis(1));
        let record = h
            .ledger
            .begin_record(embedding().priority(*priority))
            .await
            .unwrap();
        ids.push(record.activity_id);
    }
    ids
}

async fn settle(ledger: &Ledger, id: ActivityId) {
    ledger
        .settle(id, Settlement::new(Outcome::Success))
        .await
        .unwrap();
}

/// Lets every waiting record of `ids` ask once, last in line first, each
/// time the slot comes back; returns the order they were admitted in, as
/// places in `ids`. Exactly one is admitted each time.
async fn serve_by_asking(ledger: &Ledger, ids: &[ActivityId]) -> Vec<usize> {
    let mut order = Vec::new();
    while order.len() < ids.len() {
        let mut admitted = Vec::new();
        for (at, id) in ids.iter().enumerate().rev() {
            if order.contains(&at) {
                continue;
            }
            match ledger.start(*id, None).await {
                Ok(record) => {
                    assert_eq!(record.state, State::Executing);
                    admitted.push(at);
                }
                Err(err) => assert_eq!(err.kind(), ErrorKind::LaneFull, "{err}"),
            }
        }
        assert_eq!(admitted.len(), 1, "one slot, one admitted: {admitted:?}");
        order.push(admitted[0]);
        settle(ledger, ids[admitted[0]]).await;
    }
    order
}

/// neomjs/neo#17093's fixture: behind a blocker, one batch and two
/// interactive records; with one overtake the lane serves interactive-1,
/// the batch, interactive-2. With two batch records: I1, B1, I2, B2.
async fn one_overtake_serves_neos_order(backend: Backend) {
    use Priority::{Batch as B, Interactive as I};
    for (line, expected) in [
        (vec![B, I, I], vec![1, 0, 2]),
        (vec![B, B, I, I], vec![2, 0, 3, 1]),
    ] {
        let h = Harness::new(backend, overtaking(1));
        let blocker = h.ledger.try_admit(embedding()).await.unwrap();
        let ids = line_up(&h, &line).await;
        blocker.settle(Outcome::Success).await.unwrap();
        assert_eq!(serve_by_asking(&h.ledger, &ids).await, expected, "{line:?}");
    }
}

/// The same order when every record waits in line at once and the line
/// wakes them (`Ledger::start_waiting`), and `unknown` counts as batch.
async fn the_waiting_line_serves_the_same_order(backend: Backend) {
    use Priority::{Interactive as I, Unknown as U};
    let h = Harness::new(backend, overtaking(1));
    let blocker = h.ledger.try_admit(embedding()).await.unwrap();
    let ids = line_up(&h, &[U, U, I, I]).await;
    let waiters = Waiters::start(&h.ledger, &ids, Duration::from_millis(5));
    tokio::time::sleep(Duration::from_millis(50)).await;
    blocker.settle(Outcome::Success).await.unwrap();
    assert_eq!(waiters.finish().await, [2, 0, 3, 1]);
}

/// With `max_overtakes = 0` (the default) the line stays first come,
/// first served, whatever the priority.
async fn without_overtakes_the_line_is_first_come_first_served(backend: Backend) {
    use Priority::{Batch as B, Interactive as I};
    let h = Harness::new(backend, config().with_lane_cap(LANE, 1).unwrap());
    let blocker = h.ledger.try_admit(embedding()).await.unwrap();
    let ids = line_up(&h, &[B, I, B, I]).await;
    blocker.settle(Outcome::Success).await.unwrap();
    assert_eq!(serve_by_asking(&h.ledger, &ids).await, [0, 1, 2, 3]);
}

/// The run of overtakes is the store's, not one ledger's: a second ledger
/// on the same store (a restart, another instance) serves the batch
/// record next after one overtake made by the first.
async fn the_run_of_overtakes_outlives_the_ledger_that_counted_it(backend: Backend) {
    use Priority::{Batch as B, Interactive as I};
    if matches!(backend, Backend::Memory) {
        return; // nothing outlives a memory store's ledger
    }
    let h = Harness::new(backend, overtaking(1));
    let ids = line_up(&h, &[B, I, I]).await;
    let first = h.ledger.start(ids[1], None).await.unwrap();
    let other = Ledger::builder(overtaking(1))
        .store_url(h.url.clone())
        .clock(h.clock.clone())
        .build()
        .unwrap();
    settle(&other, first.activity_id).await;
    let err = other.start(ids[2], None).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LaneFull, "interactive-2 must wait: {err}");
    other.start(ids[0], None).await.unwrap();
}

/// `batch_cap` under 64 batch calls waiting at once: batch work never
/// holds more than its share, and an interactive call is admitted at once
/// into the headroom.
async fn batch_cap_keeps_headroom_under_64_waiting_batch_calls(backend: Backend) {
    let config = config()
        .with_lane_cap(LANE, 4)
        .unwrap()
        .with_lane_ranking(LANE, Some(3), None)
        .unwrap();
    let h = Harness::new(backend, config);
    let executing_batch = Arc::new(Mutex::new((0usize, 0usize)));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let batch: Vec<_> = (0..64)
        .map(|_| {
            let (ledger, counts, release) = (
                h.ledger.clone(),
                Arc::clone(&executing_batch),
                Arc::clone(&release),
            );
            tokio::spawn(async move {
                let permit = ledger.admit(embedding().priority(Priority::Batch)).await.unwrap();
                {
                    let mut counts = counts.lock().unwrap();
                    counts.0 += 1;
                    counts.1 = counts.1.max(counts.0);
                }
                release.acquire().await.unwrap().forget();
                // Counted out only once settled: the count errs high.
                permit.settle(Outcome::Success).await.unwrap();
                counts.lock().unwrap().0 -= 1;
            })
        })
        .collect();
    // Until three run and 61 wait.
    loop {
        let lane = snapshot(&h.ledger).await.lane(LANE).unwrap().clone();
        if (lane.executing, lane.waiting) == (3, 61) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let interactive = h
        .ledger
        .try_admit(embedding().priority(Priority::Interactive))
        .await
        .expect("the headroom admits interactive work at once");
    // The headroom taken, the next interactive call waits like any.
    let err = h
        .ledger
        .try_admit(embedding().priority(Priority::Interactive))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LaneFull);
    interactive.settle(Outcome::Success).await.unwrap();
    release.add_permits(64);
    for call in batch {
        call.await.unwrap();
    }
    assert_eq!(
        executing_batch.lock().unwrap().1,
        3,
        "batch work held more than batch_cap"
    );
    let lane = snapshot(&h.ledger).await.lane(LANE).unwrap().clone();
    assert_eq!((lane.executing, lane.waiting), (0, 0));
}

against_every_store!(
    one_overtake_serves_neos_order,
    the_waiting_line_serves_the_same_order,
    without_overtakes_the_line_is_first_come_first_served,
    the_run_of_overtakes_outlives_the_ledger_that_counted_it,
    batch_cap_keeps_headroom_under_64_waiting_batch_calls,
);
