//! Where the ledger's time comes from.
//!
//! Every rule of the ledger is a function of time, so time is injected: the
//! server uses [`SystemClock`], and tests advance a [`FakeClock`] instead of
//! sleeping.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::domain::Timestamp;

/// A source of wall-clock time, to the millisecond.
///
/// Persisted timestamps are wall-clock epoch milliseconds, so that several
/// processes sharing one store agree on what "now" means.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;

    /// Whether this is the operating system's wall clock. A store with a
    /// clock of its own that every host shares (PostgreSQL's) decides with
    /// that one instead; any other clock (a test's [`FakeClock`]) overrides
    /// the store's, so that tests drive time the same way on every store.
    fn is_system(&self) -> bool {
        false
    }
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(wall_millis(Precision::Exact))
    }

    fn is_system(&self) -> bool {
        true
    }
}

/// How closely a reading of the wall clock must follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Precision {
    /// To the millisecond: the timestamps a record keeps.
    Exact,
    /// To a clock tick (a few milliseconds): enough to order ids, and on
    /// Linux it costs no timer read.
    Tick,
}

/// The wall clock in epoch milliseconds. Every store command reads it, so
/// on Linux it is read with one `clock_gettime` and integer arithmetic,
/// rather than through `SystemTime` and a 128-bit `Duration::as_millis`.
///
/// Measured against `SystemTime` for both precisions (docs/performance.md,
/// "Tricks measured"): at b02b459 a lifecycle of `memory_lifecycle` ran
/// 5,163 instructions without it instead of 4,866 (6.1 % more), and 8 to
/// 11 % more wall-clock time, since `SystemTime` also reads the timer for
/// ids where the coarse clock does not. So it stays.
#[cfg(target_os = "linux")]
// `time_t` and `c_long` are 32 bits wide on some Linux targets.
#[allow(clippy::useless_conversion)]
pub(crate) fn wall_millis(precision: Precision) -> i64 {
    let clock = match precision {
        Precision::Exact => libc::CLOCK_REALTIME,
        Precision::Tick => libc::CLOCK_REALTIME_COARSE,
    };
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the call to fill.
    if unsafe { libc::clock_gettime(clock, &mut now) } != 0 {
        return std_wall_millis();
    }
    i64::from(now.tv_sec)
        .saturating_mul(1_000)
        .saturating_add(i64::from(now.tv_nsec) / 1_000_000)
}

/// The wall clock in epoch milliseconds.
#[cfg(not(target_os = "linux"))]
pub(crate) fn wall_millis(_precision: Precision) -> i64 {
    std_wall_millis()
}

fn std_wall_millis() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}

/// A clock that only moves when told to. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use inflight::clock::{Clock, FakeClock};
/// use inflight::Timestamp;
///
/// let clock = FakeClock::at(Timestamp::from_millis(1_000));
/// clock.advance(Duration::from_secs(2));
/// assert_eq!(clock.now(), Timestamp::from_millis(3_000));
/// ```
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    now: Arc<AtomicI64>,
}

impl FakeClock {
    /// A fake clock reading `now`.
    pub fn at(now: Timestamp) -> Self {
        Self {
            now: Arc::new(AtomicI64::new(now.as_millis())),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.now.fetch_add(by, Ordering::SeqCst);
    }

    /// Sets the clock to `now`.
    pub fn set(&self, now: Timestamp) {
        self.now.store(now.as_millis(), Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.now.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_reads_what_std_reads() {
        let before = std_wall_millis();
        let exact = SystemClock.now().as_millis();
        let tick = wall_millis(Precision::Tick);
        let after = std_wall_millis();
        assert!(
            (before..=after).contains(&exact),
            "{before} <= {exact} <= {after}"
        );
        // The coarse clock lags by at most a tick (a few ms), never leads.
        assert!(
            tick <= after && tick + 100 >= before,
            "{tick} vs {before}..{after}"
        );
    }
}
