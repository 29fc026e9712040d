//! The incident the demo replays, against every store: the leaked lanes are
//! cleared and the live lane is left alone; and what `inflight demo` says.

// The harness's PostgreSQL backend is behind the library's `postgres`
// feature, which this package does not declare: here the demo runs on the
// memory and SQLite stores (tests/postgres_instances.rs covers PostgreSQL).
#![allow(unexpected_cfgs)]

#[path = "../crates/inflight/tests/common/mod.rs"]
mod common;

use common::*;
use inflight::State;

against_every_store!(incident_replay_clears_the_leaked_lanes_and_leaves_the_live_lane);

async fn incident_replay_clears_the_leaked_lanes_and_leaves_the_live_lane(backend: Backend) {
    let h = Harness::default(backend);
    let replayed = inflight_cli::demo::replay_into(&h.ledger, &h.clock)
        .await
        .unwrap();
    assert_eq!(replayed.leaked.len(), 1 + 13 + 5);
    assert_eq!(
        (replayed.live_executing.len(), replayed.live_waiting.len()),
        (3, 1)
    );

    let snap = snapshot(&h.ledger).await;
    for lane in inflight_cli::demo::LEAKED_LANES {
        let view = snap.lane(lane).unwrap();
        assert_eq!((view.executing, view.waiting), (0, 0), "{lane}");
    }
    assert_eq!(snap.lane("knowledge-base::ollama").unwrap().reaped.unsettled, 13);
    let unknown = snap.lane("unknown::ollama").unwrap();
    assert_eq!((unknown.reaped.unsettled, unknown.reaped.abandoned), (1, 4));
    for (id, disposition) in &replayed.leaked {
        let record = h.ledger.get(*id).await.unwrap();
        assert_eq!(record.state, State::Reaped);
        assert_eq!(record.disposition, Some(*disposition));
    }
    let live = snap.lane(inflight_cli::demo::LIVE_LANE).unwrap();
    assert_eq!((live.executing, live.waiting), (3, 1));
    assert_eq!(live.reaped.total(), 0);
    for id in replayed.live_executing {
        assert_eq!(h.ledger.get(id).await.unwrap().state, State::Executing);
    }
    assert_eq!(snap.total_in_flight, 4);
}

/// The demo speaks of the incident itself, in words a new user knows.
#[tokio::test]
async fn the_demo_tells_the_incident_before_and_after() {
    let replay = inflight_cli::demo::replay_incident().await.unwrap();
    let text = inflight_cli::cli::demo::render(&replay);
    for said in [
        "stayed\n\"in flight\" forever: lanes looked saturated with no work on them, `unknown` junk piled up,\n\
         and only a restart cleared it",
        "the embeddings moved from Ollama to OpenAI after\n2026-08-13T07:21:55.000Z",
        "the ledger is read at 2026-08-13T19:59:00.000Z, 12h 37m later",
        "=== BEFORE: a ledger with no expiry, as its operators saw it ===",
        "=== AFTER: inflight at the same instant",
        "knowledge-base::ollama: executing 13 -> 0, waiting 0 -> 0; reaped 0 abandoned, 13 unsettled",
        "unknown::ollama: executing 1 -> 0, waiting 4 -> 0; reaped 4 abandoned, 1 unsettled",
        "No restart was needed",
        "The live calls on OpenAI, where the embeddings moved, are untouched",
    ] {
        assert!(text.contains(said), "{said:?} in:\n{text}");
    }
    // Words of the project's history, not of what a user sees.
    for unsaid in ["seed", "role"] {
        assert!(!text.contains(unsaid), "{unsaid:?} in:\n{text}");
    }
}
