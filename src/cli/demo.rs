//! `inflight demo`: the seed's incident, before and after.

use std::fmt::Write as _;

use serde_json::Value;

use super::table::{human_duration, render_snapshot};
use super::CliError;
use crate::demo::{IncidentReplay, LAST_OLLAMA_TRAFFIC, SNAPSHOT_AT};
use inflight::domain::timestamp::parse_rfc3339;

/// Renders the replay: the snapshot of a ledger that never expires anything,
/// then inflight's at the same instant, then what changed lane by lane.
///
/// # Errors
/// A snapshot that cannot be serialized (never, in practice).
pub fn render(replay: &IncidentReplay) -> Result<String, CliError> {
    let to_json = |snapshot| {
        serde_json::to_value(snapshot)
            .map_err(|err| CliError::Failed(format!("cannot render the snapshot: {err}")))
    };
    let mut before = to_json(&replay.before)?;
    let after = to_json(&replay.after)?;
    // The ledger inflight replaces never expires anything: show it that way
    // rather than as a bound no clock reaches.
    if let Some(records) = before.get_mut("inFlight").and_then(Value::as_array_mut) {
        for record in records {
            record["reapableAt"] = Value::Null;
        }
    }

    let mut out = String::new();
    let quiet_for = match (parse_rfc3339(SNAPSHOT_AT), parse_rfc3339(LAST_OLLAMA_TRAFFIC)) {
        (Some(read), Some(last)) => human_duration(read - last),
        _ => "hours".to_owned(),
    };
    let _ = writeln!(
        out,
        "inflight demo: the seed's incident replayed against an in-memory ledger with a fake clock,\n\
         read at {SNAPSHOT_AT}, {quiet_for} after the last Ollama traffic ({LAST_OLLAMA_TRAFFIC}).\n"
    );
    out.push_str("=== BEFORE: a ledger with no expiry (what the seed's operators saw) ===\n\n");
    out.push_str(&render_snapshot(&before));
    out.push_str(
        "\n=== AFTER: inflight, default classes (embedding 5m, chat 10m), bound = factor 4 x deadline ===\n\n",
    );
    out.push_str(&render_snapshot(&after));

    out.push_str("\n=== WHAT CHANGED ===\n\n");
    let lanes = |snapshot: &Value| {
        snapshot
            .get("nativeAdmission")
            .and_then(Value::as_object)
            .cloned()
    };
    let (before_lanes, after_lanes) = (
        lanes(&before).unwrap_or_default(),
        lanes(&after).unwrap_or_default(),
    );
    let count = |lane: Option<&Value>, key: &str| {
        lane.and_then(|lane| lane.get(key))
            .and_then(Value::as_i64)
            .unwrap_or(0)
    };
    let mut keys: Vec<&String> = before_lanes.keys().chain(after_lanes.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let (was, now) = (before_lanes.get(key), after_lanes.get(key));
        let reaped = now.and_then(|lane| lane.get("reaped"));
        let _ = writeln!(
            out,
            "{key}: executing {} -> {}, waiting {} -> {}; reaped {} abandoned, {} unsettled",
            count(was, "executing"),
            count(now, "executing"),
            count(was, "waiting"),
            count(now, "waiting"),
            count(reaped, "abandoned"),
            count(reaped, "unsettled"),
        );
    }
    let _ = writeln!(
        out,
        "\nThe leaked records did not vanish: each is kept reaped, as evidence, with its disposition\n\
         (abandoned: never started; unsettled: started, never settled). Live work on the lane the\n\
         role moved to is untouched, because each record's bound derives from its own class."
    );
    Ok(out)
}
