//! [`LedgerBuilder`]: a ledger's configuration, store and clock.

use std::fmt;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::config::LedgerConfig;
use crate::domain::labels::{Label, LabelInterner};
use crate::error::LedgerError;
use crate::stats::LedgerStats;
use crate::store;

use super::line::Line;
use super::{AutoOwner, Inner, Ledger};

/// Builds a [`Ledger`]: its configuration, store and clock.
#[must_use = "a builder does nothing until `build` is called"]
pub struct LedgerBuilder {
    config: LedgerConfig,
    store_url: String,
    clock: Arc<dyn Clock>,
    owner: Option<(String, Duration)>,
}

impl fmt::Debug for LedgerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LedgerBuilder")
            .field("store_url", &self.store_url)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl LedgerBuilder {
    pub(super) fn new(config: LedgerConfig) -> Self {
        Self {
            config,
            store_url: "memory:".to_owned(),
            clock: Arc::new(SystemClock),
            owner: None,
        }
    }

    /// Keeps records in the store at `url` (`memory:`, `sqlite://PATH`,
    /// `postgres://user@host:port/db`).
    /// The default is `memory:`.
    pub fn store_url(mut self, url: impl Into<String>) -> Self {
        self.store_url = url.into();
        self
    }

    /// Reads time from `clock` instead of the system clock.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Makes the ledger register this process as an owner named `name` with
    /// a lease of `ttl` on its first record, renew it in the background, tag
    /// every record with it, and release it when the last clone of the
    /// ledger is dropped. If the process dies, its in-flight records are
    /// reaped as `owner-lost` within `ttl` plus one reap interval.
    pub fn owner(mut self, name: impl Into<String>, ttl: Duration) -> Self {
        self.owner = Some((name.into(), ttl));
        self
    }

    /// Opens the store and returns the ledger.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::error::ErrorKind::InvalidInput) for an
    /// unsupported store URL, [`ErrorKind::Storage`](crate::error::ErrorKind::Storage)
    /// when the store cannot be opened or migrated.
    pub fn build(self) -> Result<Ledger, LedgerError> {
        let auto_owner = match self.owner {
            None => None,
            Some((name, ttl)) => {
                let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
                crate::domain::owner::check_ttl(ttl_ms)?;
                Some(AutoOwner {
                    name: Label::new("owner name", &name)?,
                    ttl,
                    current: tokio::sync::Mutex::new(None),
                })
            }
        };
        let config = Arc::new(self.config);
        let store = store::open(&self.store_url, Arc::clone(&config), Arc::clone(&self.clock))?;
        let ledger = Ledger {
            inner: Arc::new(Inner {
                store,
                config,
                clock: self.clock,
                capacity_changed: Line::default(),
                default_owner: RwLock::new(None),
                auto_owner,
                labels: Mutex::new(LabelInterner::default()),
                undeclared_lanes: Mutex::default(),
                stats: LedgerStats::default(),
                labels_folded: std::sync::atomic::AtomicU64::new(0),
            }),
        };
        // Capacity freed by a command the store committed, or (PostgreSQL)
        // by another instance, wakes this ledger's waiters; held weakly, so
        // that the store does not keep the ledger alive.
        let weak = Arc::downgrade(&ledger.inner);
        ledger.inner.store.watch_capacity(Arc::new(move |lane| {
            if let Some(inner) = weak.upgrade() {
                // Room in a provider's token budget is room for every lane
                // of it.
                let shared =
                    lane.is_some_and(|lane| inner.config.provider_budget(lane.provider.as_str()).is_some());
                inner
                    .capacity_changed
                    .capacity_freed(if shared { None } else { lane });
            }
        }));
        Ok(ledger)
    }
}
