//! Shared test harness: a ledger on each store, with a fake clock.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use inflight::domain::{ClassBounds, ReapPolicy};
use inflight::{ActivitySpec, FakeClock, Ledger, LedgerConfig, SnapshotOptions, Timestamp};

pub const T0: Timestamp = Timestamp::from_millis(1_786_000_000_000);
pub const MIN: Duration = Duration::from_secs(60);
pub const MS: Duration = Duration::from_millis(1);

#[derive(Clone, Copy, Debug)]
pub enum Backend {
    Memory,
    Sqlite,
    /// A fresh schema on the test PostgreSQL server
    /// (`INFLIGHT_TEST_POSTGRES_URL`).
    #[cfg(feature = "postgres")]
    Postgres,
}

/// What a store keeps outside the process, dropped after the ledger.
pub enum Scratch {
    Dir(tempfile::TempDir),
    #[cfg(feature = "postgres")]
    Database(inflight_pg_testing::TestDatabase),
}

pub struct Harness {
    pub ledger: Ledger,
    pub clock: FakeClock,
    /// The store's URL, for a second ledger on it.
    pub url: String,
    pub _dir: Option<Scratch>,
}

impl Harness {
    pub fn new(backend: Backend, config: LedgerConfig) -> Self {
        let clock = FakeClock::at(T0);
        let (url, dir) = match backend {
            Backend::Memory => ("memory:".to_owned(), None),
            Backend::Sqlite => {
                let dir = tempfile::tempdir().unwrap();
                let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
                (url, Some(Scratch::Dir(dir)))
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres => {
                let database = inflight_pg_testing::TestDatabase::new();
                (database.store_url(""), Some(Scratch::Database(database)))
            }
        };
        let ledger = Ledger::builder(config)
            .store_url(url.clone())
            .clock(clock.clone())
            .build()
            .unwrap();
        Self {
            ledger,
            clock,
            url,
            _dir: dir,
        }
    }

    pub fn default(backend: Backend) -> Self {
        Self::new(backend, LedgerConfig::default())
    }
}

/// embedding: deadline 5m (queue wait 5m); chat: deadline 10m, queue wait 2m.
pub fn config() -> LedgerConfig {
    let classes = BTreeMap::from([
        ("embedding".to_owned(), ClassBounds::new(5 * MIN, None).unwrap()),
        (
            "chat".to_owned(),
            ClassBounds::new(10 * MIN, Some(2 * MIN)).unwrap(),
        ),
    ]);
    LedgerConfig::new(ReapPolicy::new(classes, 4.0).unwrap())
}

pub fn embedding() -> ActivitySpec {
    ActivitySpec::new("knowledge-base", "ollama")
        .class("embedding")
        .operation_stage("kb-tenant-ingestion-embedding")
        .model("nomic-embed-text")
}

/// The lane `embedding()` runs on.
pub const LANE: &str = "knowledge-base::ollama";

/// `config()` with `LANE` capped at `cap`.
pub fn capped(cap: u32) -> LedgerConfig {
    config().with_lane_cap(LANE, cap).unwrap()
}

/// `LANE`'s executing and waiting counts, from a snapshot.
pub async fn lane_counts(ledger: &Ledger) -> (i64, i64) {
    let snap = snapshot(ledger).await;
    let lane = snap.lane(LANE).unwrap();
    (lane.executing, lane.waiting)
}

pub async fn snapshot(ledger: &Ledger) -> inflight::Snapshot {
    ledger.snapshot(SnapshotOptions::default()).await.unwrap()
}

#[macro_export]
macro_rules! against_every_store {
    ($($name:ident),+ $(,)?) => {
        mod memory {
            $(
                #[tokio::test(start_paused = true)]
                async fn $name() {
                    super::$name(super::Backend::Memory).await
                }
            )+
        }
        mod sqlite {
            $(
                #[tokio::test(start_paused = true)]
                async fn $name() {
                    super::$name(super::Backend::Sqlite).await
                }
            )+
        }
        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(start_paused = true)]
                async fn $name() {
                    super::$name(super::Backend::Postgres).await
                }
            )+
        }
    };
}
