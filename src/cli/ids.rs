//! The ids commands take: a full id, or the short id a table shows (the
//! end of one, [`inflight_api::short_ids`]), resolved against the ids the
//! server's snapshot lists.

use inflight_api::Snapshot;

use super::CliError;

/// What an id names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An activity: the snapshot's in-flight, completed and reaped records.
    Activity,
    /// An owner: the snapshot's owners.
    Owner,
}

impl Kind {
    fn noun(self) -> &'static str {
        match self {
            Self::Activity => "activity",
            Self::Owner => "owner",
        }
    }

    fn nouns(self) -> &'static str {
        match self {
            Self::Activity => "activities",
            Self::Owner => "owners",
        }
    }
}

/// Whether `text` is a whole id (a UUID, hyphenated), used as it is.
pub fn is_full_id(text: &str) -> bool {
    text.len() == 36
        && text.char_indices().all(|(at, c)| match at {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// The ids of `kind` that `snapshot` lists.
pub fn listed(snapshot: &Snapshot, kind: Kind) -> Vec<&str> {
    match kind {
        Kind::Activity => snapshot
            .in_flight
            .iter()
            .map(|row| row.record.activity_id.as_str())
            .chain(
                snapshot
                    .recent_completions
                    .iter()
                    .map(|record| record.activity_id.as_str()),
            )
            .chain(snapshot.reaped.iter().map(|row| row.record.activity_id.as_str()))
            .collect(),
        Kind::Owner => snapshot
            .owners
            .iter()
            .map(|owner| owner.owner_id.as_str())
            .collect(),
    }
}

/// The one id of `known` that `short` names: an id equal to it, else the
/// one id that ends with it (case aside).
///
/// # Errors
/// None ends with it, or several do (they are named, so that the operator
/// can type more of the one they mean).
pub fn resolve<'a>(short: &str, known: &[&'a str], kind: Kind) -> Result<&'a str, CliError> {
    let wanted = short.trim().to_ascii_lowercase();
    if wanted.is_empty() {
        return Err(CliError::Failed(format!("an empty {} id", kind.noun())));
    }
    if let Some(exact) = known.iter().find(|id| id.eq_ignore_ascii_case(&wanted)) {
        return Ok(exact);
    }
    let mut matching: Vec<&str> = known
        .iter()
        .copied()
        .filter(|id| id.to_ascii_lowercase().ends_with(&wanted))
        .collect();
    matching.sort_unstable();
    matching.dedup();
    match matching.as_slice() {
        [one] => Ok(one),
        [] => Err(CliError::Failed(format!(
            "no {} the server's snapshot lists ends with {short:?}; pass the whole id",
            kind.noun()
        ))),
        several => Err(CliError::Failed(format!(
            "{short:?} is ambiguous: {} {} end with it: {}; type more of its end",
            several.len(),
            kind.nouns(),
            several.join(", "),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "01939b1c-7a00-7000-8000-1111a1b2c3d4";
    const B: &str = "01939b1c-7a00-7000-8000-2222a1b2c3d4";
    const C: &str = "01939b1c-7a00-7000-8000-0000000fc3d5";

    #[test]
    fn full_ids_are_uuids() {
        assert!(is_full_id(A));
        assert!(is_full_id(&A.to_uppercase()));
        for not in [
            "",
            "a1b2c3d4",
            "01939b1c7a00700080001111a1b2c3d4",
            &A[1..],
            &A.replace('-', "_"),
        ] {
            assert!(!is_full_id(not), "{not}");
        }
    }

    #[test]
    fn a_unique_suffix_names_its_id() {
        let known = [A, B, C];
        assert_eq!(resolve("1a1b2c3d4", &known, Kind::Activity).unwrap(), A);
        assert_eq!(resolve("2A1B2C3D4", &known, Kind::Activity).unwrap(), B);
        assert_eq!(resolve("0fc3d5", &known, Kind::Activity).unwrap(), C);
        assert_eq!(resolve(A, &known, Kind::Activity).unwrap(), A);
    }

    #[test]
    fn an_exact_id_wins_over_the_ids_that_end_with_it() {
        assert_eq!(
            resolve("short", &["x-short", "short"], Kind::Owner).unwrap(),
            "short"
        );
    }

    #[test]
    fn an_ambiguous_suffix_names_every_candidate() {
        let err = resolve("a1b2c3d4", &[A, B, C], Kind::Activity)
            .unwrap_err()
            .to_string();
        assert!(err.contains("ambiguous: 2 activities end with it"), "{err}");
        assert!(err.contains(A) && err.contains(B) && !err.contains(C), "{err}");
    }

    #[test]
    fn an_unknown_suffix_says_none_matches() {
        let err = resolve("deadbeef", &[A, B], Kind::Owner).unwrap_err().to_string();
        assert!(
            err.starts_with("no owner the server's snapshot lists ends with \"deadbeef\""),
            "{err}"
        );
        let err = resolve(" ", &[A], Kind::Activity).unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
    }
}
