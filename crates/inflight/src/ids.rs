//! Fresh activity ids, from the clock: the domain builds an id from its
//! parts ([`ActivityId::from_parts`]) and reads no clock itself.

use uuid::Uuid;

use crate::domain::record::ActivityId;

impl ActivityId {
    /// A fresh identity: a UUIDv7, random but ordered by creation time, so
    /// that records begun together sit together in a store's B-trees and a
    /// group commit writes a few pages rather than one page per record.
    ///
    /// Within this process ids are strictly increasing, so records begun in
    /// the same millisecond keep their order: a 12-bit counter follows the
    /// millisecond, and 62 random bits follow the counter.
    pub fn new() -> Self {
        let (millis, counter) = id_clock::next();
        let random = *Uuid::new_v4().as_bytes();
        let mut tail = [0_u8; 8];
        tail.copy_from_slice(&random[8..]);
        Self::from_parts(millis, counter, tail)
    }
}

/// The millisecond and counter of the next identity.
///
/// `uuid`'s own `Uuid::now_v7` would keep ids ordered within the process
/// too (a counter in one process-wide context), but it reads the precise
/// clock, takes a mutex and does 128-bit arithmetic for every id: measured
/// at b02b459, a lifecycle of `memory_lifecycle` ran 5,244 instructions with
/// it instead of 4,866 (7.8 % more), and 7 to 12 % more wall-clock time. So
/// this counter stays (docs/performance.md, "Tricks measured").
mod id_clock {
    use std::sync::atomic::{AtomicU64, Ordering};

    /// The last `(millisecond << 12) | counter` handed out.
    static LAST: AtomicU64 = AtomicU64::new(0);

    const COUNTER_BITS: u32 = 12;

    /// A millisecond no earlier than the last one handed out, and a counter
    /// that orders ids within it. 4,096 ids in one millisecond run the
    /// millisecond ahead by one rather than break the order.
    pub(super) fn next() -> (u64, u16) {
        let floor = wall_millis() << COUNTER_BITS;
        let previous = LAST
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                Some(floor.max(last + 1))
            })
            .unwrap_or_else(|last| last);
        let stamp = floor.max(previous + 1);
        (stamp >> COUNTER_BITS, (stamp & ((1 << COUNTER_BITS) - 1)) as u16)
    }

    /// The wall clock to a clock tick, which is all an id's order needs.
    fn wall_millis() -> u64 {
        let millis = crate::clock::wall_millis(crate::clock::Precision::Tick);
        u64::try_from(millis).unwrap_or(0)
    }
}

impl Default for ActivityId {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_increase_strictly_even_past_4096_in_one_millisecond() {
        let ids: Vec<ActivityId> = (0..20_000).map(|_| ActivityId::new()).collect();
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]));
    }

    #[test]
    fn ids_are_uuidv7_stamped_with_the_wall_clock() {
        let before = wall_millis();
        let id = ActivityId::new();
        let after = wall_millis();
        assert_eq!(id.as_uuid().get_version_num(), 7);
        assert_eq!(id.as_uuid().get_variant(), uuid::Variant::RFC4122);
        let (secs, nanos) = id.as_uuid().get_timestamp().expect("a v7 timestamp").to_unix();
        let millis = secs * 1_000 + u64::from(nanos) / 1_000_000;
        // The coarse clock may lag by a tick; a burst may run ahead by a few.
        assert!(
            millis + 100 >= before && millis <= after + 100,
            "{millis} vs {before}..{after}"
        );
    }

    fn wall_millis() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }
}
