//! The human-readable snapshot: lanes, outcomes, the oldest in-flight
//! records and the reaped evidence, as operators read it. It is the
//! snapshot's `Display`: `inflight snapshot` prints it, and so does
//! `println!("{snapshot}")` on the library's own snapshot, which converts to
//! this one first.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use crate::{ActivityRecord, OwnerState, Snapshot, Timestamp};

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&render_snapshot(self))
    }
}

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

/// The fewest characters a short id has.
pub const SHORT_ID_MIN_LEN: usize = 8;

/// The short ids of a table: for each id, its shortest suffix of at least
/// [`SHORT_ID_MIN_LEN`] characters that no other id of `ids` ends with (the
/// whole id when it is that short, or when another id ends with all of it).
///
/// Suffixes, because a UUIDv7's first characters are its timestamp: ids
/// begun in the same few seconds share them, and their ends are random.
/// The `inflight` commands take such a suffix wherever they take an id.
pub fn short_ids<'a>(ids: impl IntoIterator<Item = &'a str>) -> BTreeMap<&'a str, &'a str> {
    // Sorted by their reversed characters, ids that share a suffix are
    // neighbours: each needs one character more than it shares with either.
    let mut reversed: Vec<(Vec<char>, &str)> = ids
        .into_iter()
        .map(|id| (id.chars().rev().collect(), id))
        .collect();
    reversed.sort_unstable();
    reversed.dedup();
    let shared = |a: &[char], b: &[char]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let mut short = BTreeMap::new();
    for (index, (chars, id)) in reversed.iter().enumerate() {
        let before = index.checked_sub(1).map_or(0, |i| shared(chars, &reversed[i].0));
        let after = reversed.get(index + 1).map_or(0, |next| shared(chars, &next.0));
        let len = (before.max(after) + 1).max(SHORT_ID_MIN_LEN).min(chars.len());
        let start = id.char_indices().rev().nth(len - 1).map_or(0, |(at, _)| at);
        short.insert(*id, &id[start..]);
    }
    short
}

/// `id`'s short form in `short`, or the whole id.
fn short_id<'a>(short: &BTreeMap<&str, &'a str>, id: &'a str) -> &'a str {
    short.get(id).copied().unwrap_or(id)
}

fn lane_of(record: &ActivityRecord) -> String {
    format!("{}::{}", record.service, record.provider)
}

fn time_or_dash(at: Option<Timestamp>) -> String {
    at.map_or_else(|| "-".to_owned(), |at| at.to_string())
}

/// Renders a snapshot as the operator's table.
pub fn render_snapshot(snapshot: &Snapshot) -> String {
    let mut out = String::new();
    // One set of short ids for every table, so that a suffix names one
    // record or owner of the whole snapshot.
    let short = short_ids(
        snapshot
            .in_flight
            .iter()
            .map(|row| row.record.activity_id.as_str())
            .chain(snapshot.reaped.iter().map(|row| row.record.activity_id.as_str()))
            .chain(snapshot.owners.iter().map(|owner| owner.owner_id.as_str())),
    );
    let at = snapshot.at;
    let _ = writeln!(
        out,
        "snapshot at {at} (status: {}; history since {})",
        snapshot.status, snapshot.since
    );
    let _ = writeln!(
        out,
        "{} activities, {} in flight, {} completed in the window, {} reaped, {} late settles, {} resurrections",
        snapshot.total_activities,
        snapshot.total_in_flight,
        snapshot.total_recent_completions,
        snapshot.total_reaped,
        snapshot.total_late_settles,
        snapshot.total_resurrections,
    );
    let _ = writeln!(
        out,
        "ever: {} succeeded, {} failed, {} cancelled, {} reaped ({} of them for a lost owner)",
        snapshot.total_succeeded,
        snapshot.total_failed,
        snapshot.total_cancelled,
        snapshot.total_reaped,
        snapshot.total_reaped_owner_lost,
    );
    let this_read = snapshot.reaped_this_read;
    if this_read.total() > 0 {
        let _ = writeln!(
            out,
            "this read reaped {} abandoned and {} unsettled records",
            this_read.abandoned, this_read.unsettled
        );
    }
    for warning in &snapshot.warnings {
        let _ = writeln!(out, "warning ({}): {}", warning.code, warning.message);
    }

    out.push('\n');
    if snapshot.native_admission.is_empty() {
        out.push_str("no lanes yet\n");
    } else {
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
                "COOLING",
                "TOKENS/MIN",
            ],
            vec![1, 2, 3, 4, 5, 6, 7, 8, 9],
        );
        for (key, lane) in &snapshot.native_admission {
            table.rows.push(vec![
                key.clone(),
                match (lane.cap, lane.effective_cap) {
                    (None, _) => "-".to_owned(),
                    // An adaptive lane lowered by a provider's refusals.
                    (Some(cap), Some(effective)) if effective != cap => format!("{effective}/{cap}"),
                    (Some(cap), _) => cap.to_string(),
                },
                lane.executing.to_string(),
                lane.waiting.to_string(),
                lane.reaped.abandoned.to_string(),
                lane.reaped.unsettled.to_string(),
                lane.reaped_owner_lost.to_string(),
                if lane.longest_wait_ms > 0 {
                    human_duration(lane.longest_wait_ms)
                } else {
                    "-".to_owned()
                },
                lane.cooling_until.map_or_else(
                    || "-".to_owned(),
                    |until| human_duration(until.millis_since(snapshot.at).max(0)),
                ),
                // Charged in the last minute, what running calls reserve,
                // and the lane's own budget.
                {
                    let used = match (lane.tokens_last_minute, lane.tokens_reserved) {
                        (0, 0) if lane.tokens_per_minute.is_none() => "-".to_owned(),
                        (charged, 0) => charged.to_string(),
                        (charged, reserved) => format!("{charged} +{reserved} reserved"),
                    };
                    match lane.tokens_per_minute {
                        Some(budget) => format!("{used} of {budget}"),
                        None => used,
                    }
                },
            ]);
        }
        table.render(&mut out);
    }

    out.push('\n');
    if snapshot.in_flight.is_empty() {
        out.push_str("nothing in flight\n");
    } else {
        let _ = writeln!(
            out,
            "in flight, oldest first ({} of {}{}):",
            snapshot.in_flight.len(),
            snapshot.total_in_flight,
            if snapshot.in_flight_truncated {
                ", truncated"
            } else {
                ""
            }
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
        for row in &snapshot.in_flight {
            let record = &row.record;
            let reapable_in = record.reapable_at.map_or_else(
                || "never".to_owned(),
                |reapable| human_duration(reapable.millis_since(at).max(0)),
            );
            table.rows.push(vec![
                short_id(&short, &record.activity_id).to_owned(),
                lane_of(record),
                record.class.clone(),
                record.state.to_string(),
                human_duration(row.elapsed_ms),
                reapable_in,
                time_or_dash(record.reapable_at),
            ]);
        }
        table.render(&mut out);
    }

    if !snapshot.reaped.is_empty() {
        let _ = writeln!(
            out,
            "\nreaped in the window, newest first ({}{}), kept as evidence:",
            snapshot.reaped.len(),
            if snapshot.reaped_truncated {
                ", truncated"
            } else {
                ""
            }
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
        for row in &snapshot.reaped {
            let record = &row.record;
            table.rows.push(vec![
                short_id(&short, &record.activity_id).to_owned(),
                lane_of(record),
                record.class.clone(),
                record
                    .disposition
                    .map_or_else(|| "-".to_owned(), |d| d.to_string()),
                record
                    .reap_reason
                    .map_or_else(|| "-".to_owned(), |r| r.to_string()),
                human_duration(row.age_ms),
                time_or_dash(record.reaped_at),
                if record.late_settle { "yes" } else { "no" }.to_owned(),
            ]);
        }
        table.render(&mut out);
    }

    if !snapshot.owners.is_empty() {
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
        for owner in &snapshot.owners {
            let expires_in = if owner.state == OwnerState::Live {
                human_duration(owner.expires_at.millis_since(at).max(0))
            } else {
                "-".to_owned()
            };
            table.rows.push(vec![
                short_id(&short, &owner.owner_id).to_owned(),
                owner.name.clone(),
                owner.state.to_string(),
                expires_in,
                owner.reaped_records.to_string(),
                owner.cancelled_records.to_string(),
            ]);
        }
        table.render(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        Admission, ByPriority, Disposition, InFlightRecord, Lane, Owner, Priority, ReapCounts, ReapReason,
        ReapedRecord, SnapshotStatus, State,
    };

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

    /// An instant on 2026-08-13 (UTC), from its time of day.
    fn at(time: &str) -> Timestamp {
        format!("2026-08-13T{time}Z").parse().unwrap()
    }

    fn record(id: &str, state: State) -> ActivityRecord {
        ActivityRecord {
            activity_id: id.to_owned(),
            service: "knowledge-base".to_owned(),
            provider: "ollama".to_owned(),
            class: "embedding".to_owned(),
            operation_stage: "unknown".to_owned(),
            model: "unknown".to_owned(),
            priority: Priority::Unknown,
            admission: Admission::Queued,
            state,
            disposition: None,
            reap_reason: None,
            owner_id: None,
            enqueued_at: at("19:57:00.000"),
            started_at: None,
            completed_at: None,
            reaped_at: None,
            deadline_ms: 300_000,
            reapable_at: None,
            queue_wait_ms: None,
            execution_ms: None,
            success: None,
            failure_stage: None,
            late_settle: false,
            unstarted_success: false,
            refined: false,
            input_tokens: None,
            output_tokens: None,
            max_tokens: None,
            cancel_reason: None,
            traceparent: None,
            ignored_fields: Vec::new(),
        }
    }

    fn owner(id: &str, name: &str, state: OwnerState, expires: &str, reaped: i64) -> Owner {
        Owner {
            owner_id: id.to_owned(),
            name: name.to_owned(),
            ttl_ms: 30_000,
            registered_at: at("19:00:00.000"),
            renewed_at: at("19:00:00.000"),
            expires_at: at(expires),
            state,
            ended_at: None,
            reaped_records: reaped,
            cancelled_records: 0,
        }
    }

    fn empty() -> Snapshot {
        Snapshot {
            status: SnapshotStatus::Ok,
            at: at("19:59:00.000"),
            since: Timestamp::from_millis(at("19:59:00.000").as_millis() - 86_400_000),
            native_admission: BTreeMap::new(),
            total_activities: 0,
            total_succeeded: 0,
            total_succeeded_unstarted: 0,
            total_failed: 0,
            total_cancelled: 0,
            total_in_flight: 0,
            total_recent_completions: 0,
            total_reaped: 0,
            total_reaped_owner_lost: 0,
            total_late_settles: 0,
            total_resurrections: 0,
            reaped_this_read: ReapCounts::default(),
            in_flight: Vec::new(),
            recent_completions: Vec::new(),
            reaped: Vec::new(),
            in_flight_truncated: false,
            recent_completions_truncated: false,
            reaped_truncated: false,
            aggregates: Vec::new(),
            owners: Vec::new(),
            warnings: Vec::new(),
        }
    }

    #[test]
    fn the_table_shows_lanes_in_flight_and_reaped() {
        let lane = Lane {
            service: "knowledge-base".to_owned(),
            provider: "ollama".to_owned(),
            cap: Some(4),
            executing: 1,
            waiting: 0,
            reaped: ReapCounts {
                abandoned: 1,
                unsettled: 2,
            },
            reaped_owner_lost: 1,
            late_settles: 0,
            resurrections: 0,
            longest_wait_ms: 0,
            effective_cap: Some(4),
            cooling_until: None,
            cooldowns: 0,
            by_priority: ByPriority::default(),
            tokens_last_minute: 1_176,
            tokens_reserved: 2_000,
            tokens_per_minute: Some(10_000),
            provider_tokens_per_minute: None,
        };
        let executing = ActivityRecord {
            started_at: Some(at("19:57:00.000")),
            reapable_at: Some(at("20:17:00.000")),
            ..record("0123456789abcdef", State::Executing)
        };
        let reaped = ActivityRecord {
            disposition: Some(Disposition::Unsettled),
            reap_reason: Some(ReapReason::OwnerLost),
            reaped_at: Some(at("19:59:00.000")),
            ..record("fedcba9876543210", State::Reaped)
        };
        let snapshot = Snapshot {
            status: SnapshotStatus::Degraded,
            total_activities: 3,
            total_in_flight: 1,
            native_admission: BTreeMap::from([("knowledge-base::ollama".to_owned(), lane)]),
            in_flight: vec![InFlightRecord {
                record: executing,
                elapsed_ms: 120_000,
            }],
            reaped: vec![ReapedRecord {
                record: reaped,
                age_ms: 128_340_000,
            }],
            owners: vec![
                owner("aaaabbbb-cccc", "worker-a", OwnerState::Lost, "19:58:00.000", 1),
                owner("ddddeeee-ffff", "worker-b", OwnerState::Live, "19:59:20.000", 0),
            ],
            ..empty()
        };
        let table = render_snapshot(&snapshot);
        assert!(
            table.contains("knowledge-base::ollama    4          1        0"),
            "{table}"
        );
        assert!(table.contains("status: degraded"), "{table}");
        assert!(table.contains("TOKENS/MIN"), "{table}");
        assert!(table.contains("1176 +2000 reserved"), "{table}");
        assert!(table.contains("89abcdef  knowledge-base"), "{table}");
        assert!(table.contains("2m"), "{table}");
        assert!(table.contains("18m"), "{table}");
        assert!(table.contains("2026-08-13T20:17:00.000Z"), "{table}");
        assert!(table.contains("unsettled"), "{table}");
        assert!(table.contains("35h 39m"), "{table}");
        assert!(table.contains("owner-lost"), "{table}");
        assert!(table.contains("worker-a  lost"), "{table}");
        assert!(table.contains("20s"), "{table}");
    }

    #[test]
    fn short_ids_are_the_shortest_unique_suffixes_of_at_least_8() {
        // UUIDv7s begun in the same millisecond share their first 8 and more.
        let ids = [
            "01939b1c-7a00-7000-8000-1111a1b2c3d4",
            "01939b1c-7a00-7000-8000-2222a1b2c3d4",
            "01939b1c-7a00-7000-8000-0000000fc3d4",
            "01939b1c-7a00-7000-8000-0000000fc3d4",
            "short",
            "x-short",
        ];
        let short = short_ids(ids);
        assert_eq!(short.len(), 5, "{short:?}");
        // They share their last 8 too: one more tells them apart.
        assert_eq!(short[ids[0]], "1a1b2c3d4");
        assert_eq!(short[ids[1]], "2a1b2c3d4");
        assert_eq!(short[ids[2]], "000fc3d4");
        // An id shorter than the minimum, or the end of another, is whole.
        assert_eq!(short["short"], "short");
        assert_eq!(short["x-short"], "x-short");
        // Unique: no id but its own ends with a short id (a whole id names
        // itself exactly).
        for (id, suffix) in short.iter().filter(|(id, suffix)| id != suffix) {
            let matching: Vec<_> = short.keys().filter(|other| other.ends_with(suffix)).collect();
            assert_eq!(matching, [id], "{suffix}");
        }
        assert!(short_ids([]).is_empty());
    }

    #[test]
    fn the_tables_show_unique_short_ids_where_prefixes_collide() {
        let in_flight = |id: &str| InFlightRecord {
            record: record(id, State::Waiting),
            elapsed_ms: 1_000,
        };
        let snapshot = Snapshot {
            total_in_flight: 2,
            in_flight: vec![
                in_flight("01939b1c-7a00-7000-8000-0000aaaa1111"),
                in_flight("01939b1c-7a00-7000-8000-0000bbbb1111"),
            ],
            owners: vec![owner(
                "01939b1c-7a00-7000-8000-00000000cafe",
                "worker-a",
                OwnerState::Live,
                "19:59:20.000",
                0,
            )],
            ..empty()
        };
        let table = render_snapshot(&snapshot);
        assert!(table.contains("aaaa1111  knowledge-base::ollama"), "{table}");
        assert!(table.contains("bbbb1111  knowledge-base::ollama"), "{table}");
        assert!(table.contains("0000cafe  worker-a"), "{table}");
        assert!(!table.contains("01939b1c"), "{table}");
    }

    #[test]
    fn an_empty_snapshot_says_so() {
        let table = render_snapshot(&empty());
        assert!(table.contains("nothing in flight"), "{table}");
        assert!(table.contains("no lanes"), "{table}");
        assert!(
            table.starts_with("snapshot at 2026-08-13T19:59:00.000Z (status: ok;"),
            "{table}"
        );
    }
}
