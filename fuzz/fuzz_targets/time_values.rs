//! Timestamps and durations: text parses or is refused, and what parses
//! writes back to the same instant; any instants at all, through begin and
//! every transition, are refused or applied, never a panic or an overflow.
#![no_main]

use inflight::domain::labels::{ActivityLabels, RawLabels};
use inflight::domain::transition::{self, Effects, NewActivity, Transition};
use inflight::domain::ReapPolicy;
use inflight::{ActivityId, Admission, FailureStage, LedgerConfig, Priority, Timestamp};
use libfuzzer_sys::fuzz_target;

fn words(data: &[u8]) -> impl Iterator<Item = i64> + '_ {
    data.chunks(8).map(|chunk| {
        let mut bytes = [0u8; 8];
        bytes[..chunk.len()].copy_from_slice(chunk);
        i64::from_le_bytes(bytes)
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(at) = text.parse::<Timestamp>() {
            assert_eq!(at.to_string().parse::<Timestamp>(), Ok(at), "{text:?}");
        }
        if let Ok(at) = serde_json::from_str::<Timestamp>(text) {
            let written = serde_json::to_string(&at).expect("writes");
            assert_eq!(
                serde_json::from_str::<Timestamp>(&written).ok(),
                Some(at),
                "{text:?}"
            );
        }
        let _ = inflight_api::human_duration(text.len() as i64);
    }

    let mut w = words(data);
    let (Some(now), Some(enqueued), Some(started), Some(deadline)) = (w.next(), w.next(), w.next(), w.next())
    else {
        return;
    };
    let config = LedgerConfig::default();
    let policy: &ReapPolicy = config.policy();
    let labels = ActivityLabels::validate(&RawLabels {
        service: "kb",
        provider: "ollama",
        class: Some("embedding"),
        operation_stage: None,
        model: None,
    })
    .expect("valid labels");
    let new = NewActivity {
        activity_id: ActivityId::new(),
        labels,
        priority: Priority::Batch,
        admission: if deadline & 1 == 0 {
            Admission::Queued
        } else {
            Admission::Direct
        },
        enqueued_at: (enqueued & 2 == 0).then_some(Timestamp::from_millis(enqueued)),
        started_at: (started & 2 == 0).then_some(Timestamp::from_millis(started)),
        deadline_ms: (deadline & 4 == 0).then_some(deadline),
        max_tokens: None,
        owner_id: None,
        extras: None,
    };
    let now = Timestamp::from_millis(now);
    let Ok(applied) = transition::begin(new, now, policy) else {
        return;
    };
    let mut record = applied.record;
    let _ = record.implied_durations();
    let _ = policy.reapable_at(&record);
    while let (Some(kind), Some(at), Some(later)) = (w.next(), w.next(), w.next()) {
        let at = (kind & 8 == 0).then_some(Timestamp::from_millis(at));
        let transition = match kind.rem_euclid(3) {
            0 => Transition::Start { at },
            1 => Transition::Settle {
                success: kind & 16 == 0,
                failure_stage: (kind & 32 == 0).then_some(FailureStage::Provider),
                at,
                retry_after_ms: None,
                usage: Default::default(),
            },
            _ => Transition::Cancel { reason: None, at },
        };
        let mut effects = Effects::new();
        let now = Timestamp::from_millis(later);
        let _ = transition::apply(&mut record, transition, now, policy, &mut effects);
        let _ = transition::reap_if_due(&mut record, now);
        let _ = record.implied_durations();
    }
});
