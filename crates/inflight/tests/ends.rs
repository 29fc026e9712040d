//! `Ledger::watch_ends`: each committed end (settle, cancel, reap) and each
//! resurrection is shown once, after its command, with the record as the
//! command left it; a refused command shows nothing. On every store.

mod common;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use common::{config, embedding, Backend, Harness};
use inflight::domain::effect::Effect;
use inflight::domain::TraceParent;
use inflight::{ActivityId, Disposition, ErrorKind, FailureStage, Outcome, Settlement, State};

/// What the watcher saw: each end as (id, state after, what ended it).
type Seen = Arc<Mutex<Vec<(ActivityId, State, &'static str)>>>;

fn watch(h: &Harness) -> Seen {
    let seen = Seen::default();
    let into = Arc::clone(&seen);
    h.ledger.watch_ends(move |record, effect| {
        let what = match effect {
            Effect::Settled { state, .. } => state.as_str(),
            Effect::Reaped {
                disposition: Disposition::Abandoned,
                ..
            } => "reaped abandoned",
            Effect::Reaped { .. } => "reaped unsettled",
            Effect::Resurrected => "resurrected",
            other => panic!("not an end: {other:?}"),
        };
        into.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((record.activity_id, record.state, what));
    });
    seen
}

fn drain(seen: &Seen) -> Vec<(ActivityId, State, &'static str)> {
    std::mem::take(&mut *seen.lock().unwrap_or_else(PoisonError::into_inner))
}

async fn each_end_is_shown_once_after_its_command(backend: Backend) {
    let h = Harness::new(backend, config());
    let seen = watch(&h);
    let ledger = &h.ledger;
    let parent = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();

    // Begins, starts and refusals are not ends.
    let ok = ledger
        .begin_record(embedding().trace_parent(parent))
        .await
        .unwrap()
        .activity_id;
    ledger.start(ok, None).await.unwrap();
    assert!(drain(&seen).is_empty());
    let watched = Arc::new(Mutex::new(None));
    let into = Arc::clone(&watched);
    ledger.watch_ends(move |record, _| {
        *into.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(record));
    });
    ledger
        .settle(ok, Settlement::new(Outcome::Success))
        .await
        .unwrap();
    assert_eq!(drain(&seen), [(ok, State::Succeeded, "succeeded")]);
    let record = watched
        .lock()
        .unwrap()
        .take()
        .expect("a second watcher is shown it too");
    assert_eq!(record.trace_parent.as_deref(), Some(&parent), "the whole record");
    assert!(record.execution_ms.is_some());

    let failed = ledger.begin_record(embedding()).await.unwrap().activity_id;
    ledger.start(failed, None).await.unwrap();
    ledger
        .settle(failed, Settlement::new(Outcome::Failure(FailureStage::Provider)))
        .await
        .unwrap();
    let cancelled = ledger.begin_record(embedding()).await.unwrap().activity_id;
    ledger.cancel(cancelled, Some("gone".to_owned())).await.unwrap();
    assert_eq!(
        drain(&seen),
        [
            (failed, State::Failed, "failed"),
            (cancelled, State::Cancelled, "cancelled")
        ]
    );

    // A refused command shows nothing: the record had ended already.
    let again = ledger.start(ok, None).await;
    assert_eq!(again.unwrap_err().kind(), ErrorKind::Conflict);
    // A repeated settle changes nothing, so ends nothing again.
    ledger
        .settle(ok, Settlement::new(Outcome::Success))
        .await
        .unwrap();
    assert!(drain(&seen).is_empty());

    // A reap, then a resurrection by a late start; then the real end.
    let waiting = ledger.begin_record(embedding()).await.unwrap().activity_id;
    let running = ledger.begin_record(embedding()).await.unwrap().activity_id;
    ledger.start(running, None).await.unwrap();
    h.clock.advance(Duration::from_secs(2 * 3600));
    ledger.reap().await.unwrap();
    let mut reaped = drain(&seen);
    reaped.sort_by_key(|(_, _, what)| *what);
    assert_eq!(
        reaped,
        [
            (waiting, State::Reaped, "reaped abandoned"),
            (running, State::Reaped, "reaped unsettled")
        ]
    );
    ledger.start(waiting, None).await.unwrap();
    assert_eq!(drain(&seen), [(waiting, State::Executing, "resurrected")]);
    ledger
        .settle(waiting, Settlement::new(Outcome::Success))
        .await
        .unwrap();
    assert_eq!(drain(&seen), [(waiting, State::Succeeded, "succeeded")]);
    // A late settle of a reaped record ends nothing.
    ledger
        .settle(running, Settlement::new(Outcome::Success))
        .await
        .unwrap();
    assert!(drain(&seen).is_empty());
}

against_every_store!(each_end_is_shown_once_after_its_command);
