//! The incident that motivated inflight, replayed with a fake clock.
//!
//! A ledger of provider calls lost some settles, and kept those records in
//! flight forever. The embeddings moved from Ollama to OpenAI after
//! 2026-08-13T07:21:55Z; at 19:59Z that ledger still reported thirteen
//! embeddings executing on `knowledge-base::ollama` and one executing plus
//! four waiting on `unknown::ollama`, some of them 35 hours old.
//! [`replay_into`] feeds that history into a ledger event by event, next to
//! live work on OpenAI, and leaves the clock at 19:59Z.

use std::collections::BTreeMap;

use inflight::clock::FakeClock;
use inflight::config::LedgerConfig;
use inflight::domain::bounds::ReapPolicy;
use inflight::domain::record::{ActivityId, Disposition, FailureStage, Priority};
use inflight::domain::snapshot::{Snapshot, SnapshotOptions};
use inflight::error::LedgerError;
use inflight::Timestamp;
use inflight::{ActivitySpec, Ledger, Outcome, Settlement};

/// When the incident's snapshot was taken.
pub const SNAPSHOT_AT: &str = "2026-08-13T19:59:00.000Z";
/// The last Ollama embedding traffic: the embeddings moved to OpenAI.
pub const LAST_OLLAMA_TRAFFIC: &str = "2026-08-13T07:21:55.000Z";
/// The lane the embeddings moved to, where live work continues.
pub const LIVE_LANE: &str = "knowledge-base::openai";
/// The lanes whose records leaked.
pub const LEAKED_LANES: [&str; 3] = ["memory-core::ollama", "knowledge-base::ollama", "unknown::ollama"];

/// What [`replay_into`] fed the ledger.
#[derive(Debug, Clone, Default)]
pub struct Replayed {
    /// Leaked records, with the disposition each must be reaped with.
    pub leaked: Vec<(ActivityId, Disposition)>,
    /// Records live on [`LIVE_LANE`] at the snapshot: executing and waiting.
    pub live_executing: Vec<ActivityId>,
    /// Records waiting on [`LIVE_LANE`] at the snapshot.
    pub live_waiting: Vec<ActivityId>,
}

fn at(text: &str) -> Timestamp {
    text.parse().expect("valid built-in timestamp")
}

/// One event of the incident's history.
enum Event {
    Begin {
        key: usize,
        spec: Box<ActivitySpec>,
        started: bool,
        leaked: Option<Disposition>,
    },
    Settle {
        key: usize,
    },
}

fn spec(
    service: &'static str,
    stage: &'static str,
    provider: &'static str,
    class: &'static str,
    model: &'static str,
) -> ActivitySpec {
    let mut spec = ActivitySpec::new(service, provider)
        .operation_stage(stage)
        .model(model)
        .priority(Priority::Batch);
    if class != "unknown" {
        spec = spec.class(class);
    }
    spec
}

/// The stranded ingestion embeddings' lane.
fn kb_ollama() -> ActivitySpec {
    spec(
        "knowledge-base",
        "kb-tenant-ingestion-embedding",
        "ollama",
        "embedding",
        "nomic-embed-text",
    )
}

/// The lane the embeddings moved to.
fn kb_openai() -> ActivitySpec {
    spec(
        "knowledge-base",
        "kb-tenant-ingestion-embedding",
        "openai",
        "embedding",
        "text-embedding-3-small",
    )
}

/// The `unknown` junk: no service, stage, class or model said.
fn unknown_ollama() -> ActivitySpec {
    spec("unknown", "unknown", "ollama", "unknown", "")
}

fn history() -> Vec<(Timestamp, Event)> {
    let mut events = Vec::new();
    let mut key = 0;
    let mut begin =
        |events: &mut Vec<(Timestamp, Event)>, t: Timestamp, spec: ActivitySpec, started: bool, leaked| {
            key += 1;
            events.push((
                t,
                Event::Begin {
                    key,
                    spec: Box::new(spec),
                    started,
                    leaked,
                },
            ));
            key
        };
    // The three oldest entries, as given in the incident report.
    begin(
        &mut events,
        at("2026-08-12T08:20:48.562Z"),
        spec(
            "memory-core",
            "embedding-canary",
            "ollama",
            "embedding",
            "nomic-embed-text",
        ),
        true,
        Some(Disposition::Unsettled),
    );
    begin(
        &mut events,
        at("2026-08-12T09:30:04.928Z"),
        kb_ollama(),
        true,
        Some(Disposition::Unsettled),
    );
    begin(
        &mut events,
        at("2026-08-12T20:01:44.263Z"),
        unknown_ollama(),
        false,
        Some(Disposition::Abandoned),
    );
    // Twelve more stranded ingestion embeddings, up to the last traffic.
    let first = at("2026-08-12T10:00:00.000Z");
    let last = at(LAST_OLLAMA_TRAFFIC);
    for i in 0..12 {
        let t = first + last.millis_since(first) * i / 11;
        begin(&mut events, t, kb_ollama(), true, Some(Disposition::Unsettled));
    }
    // The rest of the `unknown` junk: one executing, three more waiting.
    begin(
        &mut events,
        at("2026-08-13T01:12:09.000Z"),
        unknown_ollama(),
        true,
        Some(Disposition::Unsettled),
    );
    for t in [
        "2026-08-13T02:40:00.000Z",
        "2026-08-13T05:05:05.000Z",
        "2026-08-13T07:20:00.000Z",
    ] {
        begin(
            &mut events,
            at(t),
            unknown_ollama(),
            false,
            Some(Disposition::Abandoned),
        );
    }
    // Healthy Ollama traffic that settled, before the switch.
    for i in 0..5 {
        let t = at("2026-08-13T06:00:00.000Z") + i * 60_000;
        let key = begin(&mut events, t, kb_ollama(), true, None);
        events.push((t + 1_500, Event::Settle { key }));
    }
    // After the switch: steady traffic on OpenAI that settles...
    for i in 0..20 {
        let t = last + 60_000 + i * 30 * 60_000;
        let key = begin(&mut events, t, kb_openai(), true, None);
        events.push((t + 800, Event::Settle { key }));
    }
    // ...and live work at the snapshot: three executing, one waiting.
    let snapshot = at(SNAPSHOT_AT);
    for offset in [90_000, 60_000, 30_000] {
        begin(&mut events, snapshot - offset, kb_openai(), true, None);
    }
    begin(&mut events, snapshot - 5_000, kb_openai(), false, None);
    events.sort_by_key(|(t, _)| *t);
    events
}

/// Feeds the incident's history into `ledger`, moving `clock` to each event
/// as it happens, and leaves the clock at [`SNAPSHOT_AT`]. Nothing is read
/// along the way, so nothing is reaped on read before the snapshot.
///
/// # Errors
/// Whatever the ledger returns.
///
/// # Cancel safety
/// Not cancel safe: dropped part way, `ledger` holds part of the history
/// and `clock` stands at the last event fed.
pub async fn replay_into(ledger: &Ledger, clock: &FakeClock) -> Result<Replayed, LedgerError> {
    let mut replayed = Replayed::default();
    let mut ids: BTreeMap<usize, ActivityId> = BTreeMap::new();
    for (t, event) in history() {
        clock.set(t);
        match event {
            Event::Begin {
                key,
                spec,
                started,
                leaked,
            } => {
                let spec = if started { spec.started_at(t) } else { *spec };
                let record = ledger.begin_record(spec.enqueued_at(t)).await?;
                let id = record.activity_id;
                ids.insert(key, id);
                match leaked {
                    Some(disposition) => replayed.leaked.push((id, disposition)),
                    None if record.labels.provider.as_str() == "openai" && started => {
                        replayed.live_executing.push(id)
                    }
                    None if record.labels.provider.as_str() == "openai" => replayed.live_waiting.push(id),
                    None => {}
                }
            }
            Event::Settle { key } => {
                let settlement = Settlement::new(if key % 7 == 0 {
                    Outcome::Failure(FailureStage::Provider)
                } else {
                    Outcome::Success
                });
                let id = ids[&key];
                ledger.settle(id, settlement).await?;
                replayed.live_executing.retain(|live| *live != id);
            }
        }
    }
    clock.set(at(SNAPSHOT_AT));
    Ok(replayed)
}

/// The incident twice: once on a ledger that never expires anything (the
/// system inflight replaces), once on inflight with its default classes.
#[derive(Debug, Clone)]
pub struct IncidentReplay {
    /// What a ledger without expiry reports at the incident's snapshot.
    pub before: Snapshot,
    /// What inflight reports at the same instant.
    pub after: Snapshot,
}

/// Replays the incident on two in-memory ledgers with fake clocks.
///
/// # Errors
/// Whatever the ledger returns (nothing, on the in-memory store).
///
/// # Cancel safety
/// Cancel safe: the two ledgers are its own, and go with it.
pub async fn replay_incident() -> Result<IncidentReplay, LedgerError> {
    let defaults = LedgerConfig::default();
    // The replaced system: records never expire (a factor no clock reaches).
    let never = ReapPolicy::new(defaults.policy().classes().clone(), 1e9)
        .map_err(|err| LedgerError::new(inflight::ErrorKind::InvalidInput, err.to_string()))?;
    let mut snapshots = Vec::new();
    for config in [LedgerConfig::new(never), defaults] {
        let clock = FakeClock::at(Timestamp::MIN);
        let ledger = Ledger::builder(config)
            .store_url("memory:")
            .clock(clock.clone())
            .build()?;
        replay_into(&ledger, &clock).await?;
        snapshots.push(ledger.snapshot(SnapshotOptions::default()).await?);
    }
    let after = snapshots.pop().expect("two snapshots");
    let before = snapshots.pop().expect("two snapshots");
    Ok(IncidentReplay { before, after })
}
