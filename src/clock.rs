//! Where the ledger's time comes from.
//!
//! Every rule of the ledger is a function of time, so time is injected: the
//! server uses [`SystemClock`], and tests advance a [`FakeClock`] instead of
//! sleeping.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::domain::Millis;

/// A source of wall-clock time, in epoch milliseconds.
///
/// Persisted timestamps are wall-clock epoch milliseconds, so that several
/// processes sharing one store agree on what "now" means.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time in milliseconds since the Unix epoch.
    fn now(&self) -> Millis;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
    }
}

/// A clock that only moves when told to. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use inflight::clock::{Clock, FakeClock};
///
/// let clock = FakeClock::at(1_000);
/// clock.advance(Duration::from_secs(2));
/// assert_eq!(clock.now(), 3_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    now: Arc<AtomicI64>,
}

impl FakeClock {
    /// A fake clock reading `now` epoch milliseconds.
    pub fn at(now: Millis) -> Self {
        Self {
            now: Arc::new(AtomicI64::new(now)),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.now.fetch_add(by, Ordering::SeqCst);
    }

    /// Sets the clock to `now` epoch milliseconds.
    pub fn set(&self, now: Millis) {
        self.now.store(now, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Millis {
        self.now.load(Ordering::SeqCst)
    }
}
