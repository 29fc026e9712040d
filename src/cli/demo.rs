//! `inflight demo`: the incident that motivated inflight, before and after.

use std::fmt::Write as _;

use inflight::wire::ToApi;
use inflight_api::Lane;

use crate::demo::{IncidentReplay, LAST_OLLAMA_TRAFFIC, SNAPSHOT_AT};
use inflight::Timestamp;
use inflight_api::{human_duration, render_snapshot};

/// Renders the replay: the snapshot of a ledger that never expires anything,
/// then inflight's at the same instant, then what changed lane by lane. The
/// ledger's snapshots are shown as the server would send them.
pub fn render(replay: &IncidentReplay) -> String {
    let mut before = replay.before.to_api();
    let after = replay.after.to_api();
    // The ledger inflight replaces never expires anything: show it that way
    // rather than as a bound no clock reaches.
    for row in &mut before.in_flight {
        row.record.reapable_at = None;
    }

    let mut out = String::new();
    let quiet_for = match (
        SNAPSHOT_AT.parse::<Timestamp>(),
        LAST_OLLAMA_TRAFFIC.parse::<Timestamp>(),
    ) {
        (Ok(read), Ok(last)) => human_duration(read.millis_since(last)),
        _ => "hours".to_owned(),
    };
    let _ = writeln!(
        out,
        "inflight demo: an incident replayed against an in-memory ledger with a fake clock.\n\n\
         A service kept a ledger of its calls to AI providers (enqueued, started, settled), and its\n\
         operators read from it how many calls each service::provider lane had in flight. Some settles\n\
         were lost (client aborts, provider timeouts that stranded work), and those records stayed\n\
         \"in flight\" forever: lanes looked saturated with no work on them, `unknown` junk piled up,\n\
         and only a restart cleared it. Here the embeddings moved from Ollama to OpenAI after\n\
         {LAST_OLLAMA_TRAFFIC}; the ledger is read at {SNAPSHOT_AT}, {quiet_for} later.\n"
    );
    out.push_str("=== BEFORE: a ledger with no expiry, as its operators saw it ===\n\n");
    out.push_str(&render_snapshot(&before));
    out.push_str(
        "\n=== AFTER: inflight at the same instant: a record in flight past 4 x its class's deadline\n\
         (embedding 5m, chat 10m) is reaped ===\n\n",
    );
    out.push_str(&render_snapshot(&after));

    out.push_str("\n=== WHAT CHANGED ===\n\n");
    let (before_lanes, after_lanes) = (&before.native_admission, &after.native_admission);
    let count = |lane: Option<&Lane>, field: fn(&Lane) -> i64| lane.map_or(0, field);
    let mut keys: Vec<&String> = before_lanes.keys().chain(after_lanes.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let (was, now) = (before_lanes.get(key), after_lanes.get(key));
        let _ = writeln!(
            out,
            "{key}: executing {} -> {}, waiting {} -> {}; reaped {} abandoned, {} unsettled",
            count(was, |lane| lane.executing),
            count(now, |lane| lane.executing),
            count(was, |lane| lane.waiting),
            count(now, |lane| lane.waiting),
            count(now, |lane| lane.reaped.abandoned),
            count(now, |lane| lane.reaped.unsettled),
        );
    }
    let _ = writeln!(
        out,
        "\nNo restart was needed: the leaked records were reaped past their bound, so the Ollama lanes\n\
         show no work in flight, which is the truth. The records did not vanish: each is kept reaped,\n\
         as evidence, with its disposition (abandoned: never started; unsettled: started, never\n\
         settled). The live calls on OpenAI, where the embeddings moved, are untouched, because each\n\
         record's bound derives from its own class's deadline."
    );
    out
}
