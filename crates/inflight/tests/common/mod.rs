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

/// Starts each record of `ids` waiting in line at once (`start_waiting`,
/// up to a minute), each settled `hold` after it is admitted.
pub struct Waiters {
    /// The places in `ids` admitted so far, in the order admitted.
    pub order: std::sync::Arc<std::sync::Mutex<Vec<usize>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

#[allow(dead_code)] // each test binary uses its own part of `common`
impl Waiters {
    pub fn start(ledger: &Ledger, ids: &[inflight::ActivityId], hold: Duration) -> Self {
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let tasks = ids
            .iter()
            .enumerate()
            .rev()
            .map(|(at, id)| {
                let (ledger, order, id) = (ledger.clone(), std::sync::Arc::clone(&order), *id);
                tokio::spawn(async move {
                    ledger
                        .start_waiting(id, None, Some(Duration::from_secs(60)))
                        .await
                        .unwrap();
                    order.lock().unwrap().push(at);
                    tokio::time::sleep(hold).await;
                    let success = inflight::Settlement::new(inflight::Outcome::Success);
                    ledger.settle(id, success).await.unwrap();
                })
            })
            .collect();
        Self { order, tasks }
    }

    /// The places admitted so far.
    pub fn admitted(&self) -> Vec<usize> {
        self.order.lock().unwrap().clone()
    }

    /// Every waiter's end; the order they were admitted in.
    pub async fn finish(self) -> Vec<usize> {
        let Self { order, tasks } = self;
        for task in tasks {
            task.await.unwrap();
        }
        let admitted = order.lock().unwrap().clone();
        admitted
    }
}

/// Admits `spec` at once and settles it as a success: proof that its lane
/// grants a slot now, leaving nothing held.
pub async fn succeed_at_once(ledger: &Ledger, spec: ActivitySpec) {
    let permit = ledger.try_admit(spec).await.expect("admitted at once");
    permit.settle(inflight::Outcome::Success).await.unwrap();
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
