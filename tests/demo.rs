//! The incident the demo replays, against every store: the leaked lanes are
//! cleared and the live lane is left alone.

// The harness's PostgreSQL backend is behind the library's `postgres`
// feature, which this package does not declare: here the demo runs on the
// memory and SQLite stores (tests/postgres_instances.rs covers PostgreSQL).
#![allow(unexpected_cfgs)]

#[path = "../crates/inflight/tests/common/mod.rs"]
mod common;

use common::*;
use inflight::State;

against_every_store!(seed_incident_replay_clears_the_leaked_lanes_and_leaves_the_live_lane);

async fn seed_incident_replay_clears_the_leaked_lanes_and_leaves_the_live_lane(backend: Backend) {
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
