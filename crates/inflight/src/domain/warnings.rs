//! What the configuration says and the calls do not match: a capped lane
//! no call uses next to a lane one or two edits away that calls do use (a
//! misspelled lane caps nothing), and calls of a class the configuration
//! does not know (they get the widest bound). Pure: it reads the calls as
//! counts per lane and class, so the snapshot and `check-config --against`
//! (a file against a live server's calls) apply the one rule.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::admission::LaneSettings;
use super::bounds::ReapPolicy;
use super::record::LaneKey;

/// The code of a configured lane with no calls next to a near one with
/// calls.
pub const LANE_UNUSED_NEAR_MISS: &str = "lane_unused_near_miss";
/// The code of calls of a class the configuration does not know.
pub const UNKNOWN_CLASS: &str = "unknown_class";
/// The class of a call that gave none: never warned of.
const NO_CLASS: &str = "unknown";
/// The most edits (Levenshtein distance, on the whole `service::provider`
/// key) between a configured lane and a used one for a near miss.
pub const NEAR_MISS_EDITS: usize = 2;
/// The most unknown classes named one by one; the rest are counted in
/// one more warning (and folded into `other` in `/metrics`).
pub const MAX_NAMED_CLASSES: usize = 16;

/// Something an operator most likely wants to fix: a stable `code` and a
/// human message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Warning {
    /// `lane_unused_near_miss` or `unknown_class`.
    pub code: &'static str,
    /// What, and what to check.
    pub message: String,
}

/// The calls seen, as counts: lanes with calls, and calls per class the
/// policy does not configure. Built from aggregates, one at a time.
#[derive(Debug, Default)]
pub struct Seen<'a> {
    lanes: BTreeSet<(&'a str, &'a str)>,
    unknown_classes: BTreeMap<&'a str, i64>,
}

impl<'a> Seen<'a> {
    /// Counts `calls` of `class` on the lane `service::provider`;
    /// `track_lanes` false skips the lanes (no lane is configured).
    pub fn add(
        &mut self,
        policy: &ReapPolicy,
        track_lanes: bool,
        lane: (&'a str, &'a str),
        class: &'a str,
        calls: i64,
    ) {
        if track_lanes {
            self.lanes.insert(lane);
        }
        if class != NO_CLASS && !policy.knows(class) {
            *self.unknown_classes.entry(class).or_default() += calls;
        }
    }

    /// Calls per class the policy does not know.
    pub fn unknown_classes(&self) -> &BTreeMap<&'a str, i64> {
        &self.unknown_classes
    }

    /// The warnings: near-miss lanes of `caps`, then unknown classes;
    /// `since` says the window the calls were counted in (`"since …"`).
    pub fn warnings(
        &self,
        caps: &BTreeMap<LaneKey, LaneSettings>,
        policy: &ReapPolicy,
        since: &str,
    ) -> Vec<Warning> {
        let mut warnings = Vec::new();
        for (lane, cap) in caps {
            let (service, provider) = (lane.service.as_str(), lane.provider.as_str());
            if self.lanes.contains(&(service, provider)) {
                continue;
            }
            let key = lane.to_string();
            let near: Vec<String> = self
                .lanes
                .iter()
                .map(|(service, provider)| format!("{service}::{provider}"))
                .filter(|used| within_edits(&key, used, NEAR_MISS_EDITS))
                .collect();
            if near.is_empty() {
                continue;
            }
            let cap = cap
                .cap
                .map_or_else(|| "declared".to_owned(), |cap| format!("capped at {cap}"));
            warnings.push(Warning {
                code: LANE_UNUSED_NEAR_MISS,
                message: format!(
                    "lane {key} is {cap} but has no calls {since}, while {} (one or two edits away) {}: \
                     check the lane's spelling in the configuration and in the calls",
                    near.join(", "),
                    if near.len() == 1 { "has" } else { "have" }
                ),
            });
        }
        let configured: Vec<&str> = policy.classes().keys().map(String::as_str).collect();
        for (class, calls) in self.unknown_classes.iter().take(MAX_NAMED_CLASSES) {
            let near: Vec<&str> = configured
                .iter()
                .copied()
                .filter(|known| within_edits(class, known, NEAR_MISS_EDITS))
                .collect();
            let hint = if near.is_empty() {
                String::new()
            } else {
                format!(" (did you mean {}?)", near.join(" or "))
            };
            warnings.push(Warning {
                code: UNKNOWN_CLASS,
                message: format!(
                    "class {class}{hint} is not configured, and calls use it ({calls} in all, seen {since}): \
                     they get the widest bound of any class; configured classes: {}",
                    configured.join(", ")
                ),
            });
        }
        let more = self.unknown_classes.len().saturating_sub(MAX_NAMED_CLASSES);
        if more > 0 {
            warnings.push(Warning {
                code: UNKNOWN_CLASS,
                message: format!("and {more} more classes that are not configured"),
            });
        }
        warnings
    }
}

/// Whether `a` is within `most` single-character edits (insertions,
/// deletions, substitutions) of `b`, and not equal to it. Bounded: strings
/// whose lengths differ by more are refused at once, and each row of the
/// table stops the search once every cell is past `most`.
pub fn within_edits(a: &str, b: &str, most: usize) -> bool {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    if a == b || a.len().abs_diff(b.len()) > most {
        return false;
    }
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut next = Vec::with_capacity(row.len());
        next.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let substitute = row[j] + usize::from(ca != cb);
            next.push(substitute.min(row[j + 1] + 1).min(next[j] + 1));
        }
        if next.iter().all(|&edits| edits > most) {
            return false;
        }
        row = next;
    }
    row[b.len()] <= most
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LedgerConfig;

    #[test]
    fn edits_are_counted_and_bounded() {
        assert!(within_edits("kb::olama", "kb::ollama", 2));
        assert!(within_edits("kb::ollama", "kb::olama", 2));
        assert!(within_edits("knowledge-base::ollama", "knowledge_base::olama", 2));
        assert!(
            !within_edits("kb::ollama", "kb::ollama", 2),
            "the same lane is no near miss"
        );
        assert!(!within_edits("kb::ollama", "kb::openai", 2));
        assert!(!within_edits("kb::o", "kb::ollama", 2));
        assert!(within_edits("embeding", "embedding", 2));
        assert!(!within_edits("chat", "embedding", 2));
    }

    #[test]
    fn a_capped_lane_without_calls_next_to_a_near_one_with_calls_is_warned_of() {
        let config = LedgerConfig::default()
            .with_lane_cap("knowledge-base::olama", 4)
            .unwrap()
            .with_lane_cap("memory-core::openai", 2)
            .unwrap();
        let policy = config.policy();
        let mut seen = Seen::default();
        seen.add(policy, true, ("knowledge-base", "ollama"), "embedding", 4);
        seen.add(policy, true, ("knowledge-base", "openai"), "embeding", 3);
        seen.add(policy, true, ("chat-svc", "openai"), "unknown", 9);
        let warnings = seen.warnings(config.lanes(), policy, "since 2026-08-13T12:00:00.000Z");
        let codes: Vec<&str> = warnings.iter().map(|w| w.code).collect();
        assert_eq!(codes, [LANE_UNUSED_NEAR_MISS, UNKNOWN_CLASS], "{warnings:?}");
        assert_eq!(
            warnings[0].message,
            "lane knowledge-base::olama is capped at 4 but has no calls since 2026-08-13T12:00:00.000Z, while \
             knowledge-base::ollama (one or two edits away) has: check the lane's spelling in the configuration \
             and in the calls"
        );
        assert_eq!(
            warnings[1].message,
            "class embeding (did you mean embedding?) is not configured, and calls use it (3 in all, seen since \
             2026-08-13T12:00:00.000Z): they get the widest bound of any class; configured classes: chat, embedding"
        );
        assert_eq!(seen.unknown_classes().get("embeding"), Some(&3));
        assert_eq!(
            seen.unknown_classes().get("unknown"),
            None,
            "no class given is no mistake"
        );
    }

    #[test]
    fn unknown_classes_are_named_up_to_a_bound() {
        let config = LedgerConfig::default();
        let names: Vec<String> = (0..40).map(|i| format!("class-{i:02}")).collect();
        let mut seen = Seen::default();
        for name in &names {
            seen.add(config.policy(), false, ("kb", "o"), name, 1);
        }
        let warnings = seen.warnings(config.lanes(), config.policy(), "ever");
        assert_eq!(warnings.len(), MAX_NAMED_CLASSES + 1);
        assert_eq!(
            warnings[MAX_NAMED_CLASSES].message,
            "and 24 more classes that are not configured"
        );
    }
}
