//! What the cases share around the store: the spec and deadline every call
//! uses, the store's pragmas, temporary directories, ledger constructors,
//! the plain-SQLite baseline's table and lifecycle, populating through the
//! API, and writing the page cache back.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use inflight::store::Synchronous;
use inflight::{ActivitySpec, FakeClock, Ledger, LedgerConfig, Outcome};

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The spec every benchmark call uses.
pub(crate) fn spec() -> ActivitySpec {
    ActivitySpec::new("knowledge-base", "ollama")
        .class("embedding")
        .model("nomic-embed-text")
}

/// A deadline so long nothing declared with it expires during a run.
pub(crate) const LONG_DEADLINE: Duration = Duration::from_secs(365 * 24 * 3600);

// ---------------------------------------------------------------------------
// The store's pragmas
// ---------------------------------------------------------------------------

/// The SQLite settings the store applies, read from its source so the
/// baseline always runs with exactly the same ones.
#[derive(Debug, Clone)]
pub(crate) struct Pragmas {
    /// `(name, value)` in the order the store sets them.
    set: Vec<(String, String)>,
    busy_timeout: Duration,
    /// Where they were read from.
    pub(crate) source: String,
}

impl Pragmas {
    /// The store's own settings under `synchronous`, as it exports them.
    pub(crate) fn load(synchronous: Synchronous) -> Self {
        Self {
            set: inflight::store::sqlite::pragmas(synchronous)
                .iter()
                .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
                .collect(),
            busy_timeout: inflight::store::sqlite::BUSY_TIMEOUT,
            source: format!("inflight::store::sqlite::pragmas(Synchronous::{synchronous:?})"),
        }
    }

    pub(crate) fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .set
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        parts.push(format!("busy_timeout={}ms", self.busy_timeout.as_millis()));
        parts.join(", ")
    }

    /// Opens a baseline connection with the store's settings.
    pub(crate) fn connect(&self, path: &Path) -> Result<rusqlite::Connection> {
        let conn = rusqlite::Connection::open(path).context("open the baseline database")?;
        conn.busy_timeout(self.busy_timeout)?;
        for (name, value) in &self.set {
            conn.pragma_update(None, name, value)
                .with_context(|| format!("PRAGMA {name} = {value}"))?;
        }
        Ok(conn)
    }
}

// ---------------------------------------------------------------------------
// Temporary directories (no dev-dependencies in a binary)
// ---------------------------------------------------------------------------

/// A directory removed when dropped.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(parent: &Path, label: &str) -> Result<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = parent.join(format!(
            "inflight-bench-{}-{}-{label}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
        Ok(Self(path))
    }

    pub(crate) fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------
// Ledgers
// ---------------------------------------------------------------------------

/// A SQLite ledger on the system clock with the durability `synchronous`.
pub(crate) fn sqlite_ledger_at(path: &Path, synchronous: Synchronous) -> Result<Ledger> {
    Ledger::builder(LedgerConfig::default())
        .store_url(format!("sqlite://{}?synchronous={synchronous}", path.display()))
        .build()
        .context("open the SQLite ledger")
}

pub(crate) fn sqlite_ledger(path: &Path, clock: Option<FakeClock>) -> Result<Ledger> {
    sqlite_ledger_with(path, LedgerConfig::default(), clock)
}

pub(crate) fn sqlite_ledger_with(
    path: &Path,
    config: LedgerConfig,
    clock: Option<FakeClock>,
) -> Result<Ledger> {
    let builder = Ledger::builder(config).store_url(format!("sqlite://{}", path.display()));
    let builder = match clock {
        Some(clock) => builder.clock(clock),
        None => builder,
    };
    builder.build().context("open the SQLite ledger")
}

pub(crate) fn multi_thread() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("build a runtime")
}

pub(crate) async fn ledger_lifecycle(ledger: &Ledger) -> Result<()> {
    let mut call = ledger.begin(spec()).await?;
    call.start().await?;
    black_box(call.settle(Outcome::Success).await?);
    Ok(())
}

// ---------------------------------------------------------------------------
// The plain-SQLite baseline
// ---------------------------------------------------------------------------

pub(crate) const BASELINE_TABLE: &str = "CREATE TABLE IF NOT EXISTS calls (
    id           TEXT PRIMARY KEY NOT NULL,
    service      TEXT NOT NULL,
    provider     TEXT NOT NULL,
    class        TEXT NOT NULL,
    model        TEXT NOT NULL,
    state        TEXT NOT NULL,
    enqueued_at  INTEGER NOT NULL,
    started_at   INTEGER,
    completed_at INTEGER,
    success      INTEGER
) WITHOUT ROWID";

/// The baseline's transitions, each one statement binding the id and the time.
pub(crate) const BASELINE_BEGIN: &str =
    "INSERT INTO calls (id, service, provider, class, model, state, enqueued_at) \
     VALUES (?1, 'knowledge-base', 'ollama', 'embedding', 'nomic-embed-text', 'waiting', ?2)";
pub(crate) const BASELINE_START: &str = "UPDATE calls SET state = 'executing', started_at = ?2 WHERE id = ?1";
pub(crate) const BASELINE_SETTLE: &str =
    "UPDATE calls SET state = 'succeeded', completed_at = ?2, success = 1 WHERE id = ?1";

/// One lifecycle the plain way: one autocommit statement per transition.
pub(crate) fn baseline_lifecycle(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    let id = uuid::Uuid::new_v4().to_string();
    for sql in [BASELINE_BEGIN, BASELINE_START, BASELINE_SETTLE] {
        conn.prepare_cached(sql)?
            .execute(rusqlite::params![id, now_ms()])?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Populating through the API, concurrently (group commit makes it fast)
// ---------------------------------------------------------------------------

const POPULATE_TASKS: usize = 64;

/// Begins `count` records that stay in flight (no handle, so nothing
/// cancels them), made with `make`.
pub(crate) async fn populate_in_flight<F>(ledger: &Ledger, count: usize, make: F) -> Result<()>
where
    F: Fn() -> ActivitySpec + Clone + Send + 'static,
{
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..POPULATE_TASKS.min(count.max(1)) {
        let (ledger, next, make) = (ledger.clone(), Arc::clone(&next), make.clone());
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < count {
                ledger.begin_record(make()).await?;
            }
            Ok::<_, inflight::LedgerError>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(())
}

/// A record executing since `at` with a declared deadline of a year: in
/// flight for the whole run, never due.
pub(crate) fn long_lived(at: i64) -> impl Fn() -> ActivitySpec + Clone + Send + 'static {
    move || {
        spec()
            .deadline(LONG_DEADLINE)
            .started_at(inflight::Timestamp::from_millis(at))
    }
}

/// Writes every dirty page back to disk before a read-only measurement.
pub(crate) fn flush_page_cache() {
    #[cfg(unix)]
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe {
        libc::sync();
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_baseline_takes_the_store_s_own_pragmas() {
        let pragmas = Pragmas::load(Synchronous::Normal);
        assert!(pragmas
            .set
            .contains(&("synchronous".to_owned(), "normal".to_owned())));
        assert!(pragmas.set.iter().any(|(name, _)| name == "synchronous"));
        assert_eq!(pragmas.busy_timeout, inflight::store::sqlite::BUSY_TIMEOUT);
    }
}
