//! The human-readable snapshot: lanes, the oldest in-flight records and the
//! reaped evidence. `inflight snapshot` and `inflight demo` share it.
//!
//! It renders the snapshot's JSON (as the server sends it), so the client
//! needs no type of its own and tolerates fields it does not know.

use std::fmt::Write as _;

use serde_json::Value;

use inflight::domain::timestamp::parse_rfc3339;

/// Formats milliseconds as the two most significant units: `35h 39m`,
/// `4m 12s`, `850ms`; days only from a week on (`8d 3h`).
pub fn human_duration(ms: i64) -> String {
    if ms < 0 {
        return format!("-{}", human_duration(ms.saturating_neg()));
    }
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    const DAY: i64 = 86_400_000;
    const UNITS: [(&str, i64); 5] = [
        ("y", 365 * DAY),
        ("d", DAY),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ];
    // Hours read better than days for the first week: "35h 39m".
    let units = if ms < 7 * DAY { &UNITS[2..] } else { &UNITS[..] };
    let mut parts = Vec::new();
    let mut rest = ms;
    for &(name, size) in units {
        let count = rest / size;
        if count > 0 || !parts.is_empty() {
            parts.push(format!("{count}{name}"));
            rest -= count * size;
        }
        if parts.len() == 2 {
            break;
        }
    }
    if parts.len() == 2 && parts[1].starts_with('0') {
        parts.pop();
    }
    parts.join(" ")
}

fn text<'a>(value: &'a Value, key: &str) -> &'a str {
    value.get(key).and_then(Value::as_str).unwrap_or("-")
}

fn int(value: &Value, key: &str) -> i64 {
    value.get(key).and_then(Value::as_i64).unwrap_or(0)
}

fn time(value: &Value, key: &str) -> Option<i64> {
    value.get(key).and_then(Value::as_str).and_then(parse_rfc3339)
}

/// A plain text table: a header and rows, columns padded to fit. Columns
/// listed in `right` are right-aligned.
struct Table {
    header: Vec<&'static str>,
    right: Vec<usize>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: Vec<&'static str>, right: Vec<usize>) -> Self {
        Self {
            header,
            right,
            rows: Vec::new(),
        }
    }

    fn render(&self, out: &mut String) {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let header: Vec<String> = self.header.iter().map(|h| (*h).to_owned()).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (index, (cell, width)) in row.iter().zip(&widths).enumerate() {
                if index > 0 {
                    line.push_str("  ");
                }
                if self.right.contains(&index) {
                    let _ = write!(line, "{cell:>width$}");
                } else {
                    let _ = write!(line, "{cell:<width$}");
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
    }
}

fn short_id(record: &Value) -> String {
    text(record, "activityId").chars().take(8).collect()
}

fn lane_of(record: &Value) -> String {
    format!("{}::{}", text(record, "service"), text(record, "provider"))
}

/// Renders a snapshot (its JSON) as the operator's table.
pub fn render_snapshot(snapshot: &Value) -> String {
    let mut out = String::new();
    let at = time(snapshot, "at").unwrap_or(0);
    let _ = writeln!(
        out,
        "snapshot at {} (status: {}; history since {})",
        text(snapshot, "at"),
        text(snapshot, "status"),
        text(snapshot, "since")
    );
    let _ = writeln!(
        out,
        "{} activities, {} in flight, {} completed in the window, {} reaped, {} late settles, {} resurrections",
        int(snapshot, "totalActivities"),
        int(snapshot, "totalInFlight"),
        int(snapshot, "totalRecentCompletions"),
        int(snapshot, "totalReaped"),
        int(snapshot, "totalLateSettles"),
        int(snapshot, "totalResurrections"),
    );
    if let Some(this_read) = snapshot.get("reapedThisRead") {
        let (abandoned, unsettled) = (int(this_read, "abandoned"), int(this_read, "unsettled"));
        if abandoned + unsettled > 0 {
            let _ = writeln!(
                out,
                "this read reaped {abandoned} abandoned and {unsettled} unsettled records"
            );
        }
    }

    out.push('\n');
    let lanes = snapshot.get("nativeAdmission").and_then(Value::as_object);
    match lanes {
        Some(lanes) if !lanes.is_empty() => {
            let mut table = Table::new(
                vec![
                    "LANE",
                    "CAP",
                    "EXECUTING",
                    "WAITING",
                    "REAPED ABANDONED",
                    "REAPED UNSETTLED",
                    "OWNER LOST",
                    "LONGEST WAIT",
                ],
                vec![1, 2, 3, 4, 5, 6, 7],
            );
            for (key, lane) in lanes {
                let reaped = lane.get("reaped").cloned().unwrap_or(Value::Null);
                let cap = lane
                    .get("cap")
                    .and_then(Value::as_i64)
                    .map_or_else(|| "-".to_owned(), |cap| cap.to_string());
                let longest = int(lane, "longestWaitMs");
                table.rows.push(vec![
                    key.clone(),
                    cap,
                    int(lane, "executing").to_string(),
                    int(lane, "waiting").to_string(),
                    int(&reaped, "abandoned").to_string(),
                    int(&reaped, "unsettled").to_string(),
                    int(lane, "reapedOwnerLost").to_string(),
                    if longest > 0 {
                        human_duration(longest)
                    } else {
                        "-".to_owned()
                    },
                ]);
            }
            table.render(&mut out);
        }
        _ => out.push_str("no lanes yet\n"),
    }

    let in_flight = snapshot.get("inFlight").and_then(Value::as_array);
    let truncated = snapshot
        .get("inFlightTruncated")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    out.push('\n');
    match in_flight {
        Some(records) if !records.is_empty() => {
            let _ = writeln!(
                out,
                "in flight, oldest first ({} of {}{}):",
                records.len(),
                int(snapshot, "totalInFlight"),
                if truncated { ", truncated" } else { "" }
            );
            let mut table = Table::new(
                vec![
                    "ACTIVITY",
                    "LANE",
                    "CLASS",
                    "STATE",
                    "AGE",
                    "REAPABLE IN",
                    "REAPABLE AT",
                ],
                vec![4, 5],
            );
            for record in records {
                let age = record
                    .get("elapsedMs")
                    .and_then(Value::as_i64)
                    .or_else(|| time(record, "enqueuedAt").map(|enqueued| at - enqueued))
                    .unwrap_or(0);
                let (reapable_in, reapable_at) = match time(record, "reapableAt") {
                    Some(reapable) => (
                        human_duration((reapable - at).max(0)),
                        text(record, "reapableAt").to_owned(),
                    ),
                    None => ("never".to_owned(), "-".to_owned()),
                };
                table.rows.push(vec![
                    short_id(record),
                    lane_of(record),
                    text(record, "class").to_owned(),
                    text(record, "state").to_owned(),
                    human_duration(age),
                    reapable_in,
                    reapable_at,
                ]);
            }
            table.render(&mut out);
        }
        _ => out.push_str("nothing in flight\n"),
    }

    let reaped = snapshot.get("reaped").and_then(Value::as_array);
    if let Some(records) = reaped.filter(|records| !records.is_empty()) {
        let truncated = snapshot
            .get("reapedTruncated")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let _ = writeln!(
            out,
            "\nreaped in the window, newest first ({}{}), kept as evidence:",
            records.len(),
            if truncated { ", truncated" } else { "" }
        );
        let mut table = Table::new(
            vec![
                "ACTIVITY",
                "LANE",
                "CLASS",
                "DISPOSITION",
                "REASON",
                "AGE",
                "REAPED AT",
                "LATE SETTLE",
            ],
            vec![5],
        );
        for record in records {
            table.rows.push(vec![
                short_id(record),
                lane_of(record),
                text(record, "class").to_owned(),
                text(record, "disposition").to_owned(),
                text(record, "reapReason").to_owned(),
                human_duration(int(record, "ageMs")),
                text(record, "reapedAt").to_owned(),
                if record.get("lateSettle").and_then(Value::as_bool).unwrap_or(false) {
                    "yes".to_owned()
                } else {
                    "no".to_owned()
                },
            ]);
        }
        table.render(&mut out);
    }

    let owners = snapshot.get("owners").and_then(Value::as_array);
    if let Some(owners) = owners.filter(|owners| !owners.is_empty()) {
        let _ = writeln!(out, "\nowners (live, and lost or released in the window):");
        let mut table = Table::new(
            vec![
                "OWNER",
                "NAME",
                "STATE",
                "EXPIRES IN",
                "RECORDS REAPED",
                "RECORDS CANCELLED",
            ],
            vec![3, 4, 5],
        );
        for owner in owners {
            let expires_in = match (text(owner, "state"), time(owner, "expiresAt")) {
                ("live", Some(expires)) => human_duration((expires - at).max(0)),
                _ => "-".to_owned(),
            };
            table.rows.push(vec![
                text(owner, "ownerId").chars().take(8).collect(),
                text(owner, "name").to_owned(),
                text(owner, "state").to_owned(),
                expires_in,
                int(owner, "reapedRecords").to_string(),
                int(owner, "cancelledRecords").to_string(),
            ]);
        }
        table.render(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn durations_read_like_people_write_them() {
        assert_eq!(human_duration(0), "0ms");
        assert_eq!(human_duration(850), "850ms");
        assert_eq!(human_duration(4_000), "4s");
        assert_eq!(human_duration(252_000), "4m 12s");
        assert_eq!(human_duration(3_600_000), "1h");
        assert_eq!(human_duration((35 * 60 + 39) * 60_000 + 5_000), "35h 39m");
        assert_eq!(human_duration(2 * 86_400_000 + 3 * 3_600_000), "51h");
        assert_eq!(human_duration(8 * 86_400_000 + 3 * 3_600_000), "8d 3h");
        assert_eq!(human_duration(-1_500), "-1s");
    }

    #[test]
    fn the_table_shows_lanes_in_flight_and_reaped() {
        let snapshot = json!({
            "status": "degraded",
            "at": "2026-08-13T19:59:00.000Z",
            "since": "2026-08-12T19:59:00.000Z",
            "totalActivities": 3,
            "totalInFlight": 1,
            "nativeAdmission": {
                "knowledge-base::ollama": {
                    "cap": 4, "executing": 1, "waiting": 0,
                    "reaped": {"abandoned": 1, "unsettled": 2}, "longestWaitMs": 0
                }
            },
            "inFlight": [{
                "activityId": "0123456789abcdef", "service": "knowledge-base", "provider": "ollama",
                "class": "embedding", "state": "executing", "elapsedMs": 120_000,
                "reapableAt": "2026-08-13T20:17:00.000Z"
            }],
            "reaped": [{
                "activityId": "fedcba9876543210", "service": "knowledge-base", "provider": "ollama",
                "class": "embedding", "disposition": "unsettled", "ageMs": 128_340_000,
                "reapedAt": "2026-08-13T19:59:00.000Z", "lateSettle": false, "reapReason": "owner-lost"
            }],
            "owners": [{
                "ownerId": "aaaabbbb-cccc", "name": "worker-a", "state": "lost",
                "expiresAt": "2026-08-13T19:58:00.000Z", "reapedRecords": 1, "cancelledRecords": 0
            }, {
                "ownerId": "ddddeeee-ffff", "name": "worker-b", "state": "live",
                "expiresAt": "2026-08-13T19:59:20.000Z", "reapedRecords": 0, "cancelledRecords": 0
            }]
        });
        let table = render_snapshot(&snapshot);
        assert!(
            table.contains("knowledge-base::ollama    4          1        0"),
            "{table}"
        );
        assert!(table.contains("01234567"), "{table}");
        assert!(table.contains("2m"), "{table}");
        assert!(table.contains("18m"), "{table}");
        assert!(table.contains("unsettled"), "{table}");
        assert!(table.contains("35h 39m"), "{table}");
        assert!(table.contains("owner-lost"), "{table}");
        assert!(table.contains("worker-a  lost"), "{table}");
        assert!(table.contains("20s"), "{table}");
    }

    #[test]
    fn an_empty_or_foreign_snapshot_does_not_panic() {
        assert!(render_snapshot(&json!({})).contains("nothing in flight"));
        assert!(render_snapshot(&json!(null)).contains("no lanes"));
    }
}
