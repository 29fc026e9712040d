//! The store for several hosts: one PostgreSQL database that every
//! instance shares, with the same guarantees as one process.
//!
//! # Driver
//! `tokio-postgres`. The engine is one sync implementation of every command
//! over a `Txn` (`store::engine`); this store runs that same engine,
//! unchanged, on a writer thread per connection, exactly as the SQLite store
//! does, instead of a second, async engine. A writer's connection is a
//! `session::Session`: the async client, driven by a small runtime that
//! the writer thread blocks on, so that requests known in advance (`BEGIN`
//! and the lock of the group's records; the group's writes and its
//! `COMMIT`) leave in one flush. Migrations and the `LISTEN` connection use
//! the blocking `postgres` client, the same driver's synchronous face.
//! Statements are prepared once per connection and cached; every
//! transaction groups the commands that waited for the writer (group
//! commit), so one round trip to commit serves them all.
//!
//! # Guarantees across instances
//! - **Caps, first come first served**: before an admission decision the
//!   engine locks the lane's row (`SELECT ... FROM lanes ... FOR UPDATE`,
//!   `LOCK_LANE` in `sql.rs`), then reaps, counts and decides in separate
//!   READ COMMITTED statements that each see every decision committed
//!   before the lock was granted. No `SKIP LOCKED`, no SERIALIZABLE.
//! - **Exactly-once reaps**: every read that leads to a write locks its
//!   rows; a second reaper waits, re-reads, and no longer finds a record
//!   the first one reaped.
//! - **One clock**: each transaction reads its "now" from the SQL function
//!   `inflight_now()`, the database's `clock_timestamp()`; hosts' clocks
//!   never decide a reap. A ledger built on another clock than the system's
//!   (a test's `FakeClock`) overrides it per transaction with
//!   `SET LOCAL inflight.now_ms`.
//! - **Waking waiters elsewhere**: a transaction that grants or frees a slot
//!   sends `pg_notify` before it commits; each instance keeps one `LISTEN`
//!   connection (reconnected when lost) and wakes its waiters, who also
//!   poll. `listen=false` turns the listener off (PgBouncer in transaction
//!   mode).
//! - **Migrations** are versioned (`inflight_schema`), run under
//!   `pg_advisory_lock`, and an instance refuses a schema newer than it.
//!
//! # URL
//! `postgres://user@host:port/db` (or `postgresql://`), with any parameter
//! the `postgres` client takes (`connect_timeout`, `application_name`, ...)
//! and these of the store's own:
//! - `schema=NAME`: the schema the tables live in (created if missing);
//!   the connection's default otherwise;
//! - `pool=N`: writer connections, 1 to 64. Each group commit shares one
//!   commit between every command waiting. With several writers, a group
//!   takes at most 32 commands and runs while the one before writes and
//!   commits, on another backend (`order::Order`), each writer
//!   counting into counter rows of its own, and the commands of this
//!   process still land in the order they were submitted, as the SQLite
//!   store lands them (a dropped handle's cancel lands before the snapshot
//!   asked for next);
//! - `listen=false`: no `LISTEN` connection; waiters poll.
//!
//! - `sslmode=require` (or `verify-ca`, `verify-full`): TLS, with the
//!   server's certificate verified, chain and host name, against the
//!   system's roots or the PEM file `sslrootcert=PATH` names. This is
//!   stricter than libpq's `require`, which does not verify: a ledger's
//!   connection is not one to give to whoever answers. `disable` and
//!   `prefer` (the default) connect without TLS.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::thread;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::error::LedgerError;
use crate::stats::CallSnapshot;
use crate::store::sql::group::Published;

use super::sql::counts::PendingCounts;
use super::{Command, Reply, Store, StoreFuture, Wake};
use session::Session;

mod listen;
mod order;
mod schema;
mod session;
mod sql;
#[doc(hidden)]
pub mod testing;
mod txn;
mod writer;

use txn::{Conn, Fault};
use writer::{write_loop, Job, Writer};

/// How long opening a connection may take before the command that needed
/// it fails as `unavailable`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Writer connections when the URL names none: two, so that a group's
/// writes and commit run beside the next group's on another backend.
pub const DEFAULT_POOL: usize = 2;

/// How connections are secured, from `sslmode` and `sslrootcert`.
#[derive(Clone)]
enum Tls {
    /// Plain TCP: `sslmode=disable` or `prefer`.
    Off,
    /// TLS with the server's certificate verified.
    On(tokio_postgres_rustls::MakeRustlsConnect),
}

impl Tls {
    /// The TLS `sslmode` asks for, verified against the certificates in
    /// `root_cert` (a PEM file), or the system's when `None`.
    fn new(mode: &str, root_cert: Option<&str>) -> Result<Self, String> {
        match mode {
            "disable" | "prefer" => {
                if root_cert.is_some() {
                    return Err(format!(
                        "sslrootcert is given but sslmode is {mode:?}: with no TLS it would not be used; \
                         set sslmode=require"
                    ));
                }
                return Ok(Self::Off);
            }
            "require" | "verify-ca" | "verify-full" => {}
            other => {
                return Err(format!(
                    "sslmode {other:?} is not one of disable, prefer, require, verify-ca, verify-full"
                ))
            }
        }
        let mut roots = rustls::RootCertStore::empty();
        match root_cert {
            Some(path) => {
                use rustls::pki_types::{pem::PemObject, CertificateDer};
                let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                    .and_then(Iterator::collect)
                    .map_err(|err| {
                        format!("sslrootcert {path:?} cannot be read as PEM certificates: {err}")
                    })?;
                if certs.is_empty() {
                    return Err(format!("sslrootcert {path:?} holds no certificate"));
                }
                for cert in certs {
                    roots.add(cert).map_err(|err| {
                        format!("sslrootcert {path:?} holds a certificate that cannot be used: {err}")
                    })?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(found.certs);
                if roots.is_empty() {
                    return Err(
                        "sslmode=require, and no sslrootcert is given and the system has no root \
                                certificates: name the server's CA with sslrootcert=PATH"
                            .to_owned(),
                    );
                }
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|err| format!("TLS cannot be set up: {err}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self::On(tokio_postgres_rustls::MakeRustlsConnect::new(config)))
    }
}

/// Checks `url`'s parameters as opening the store reads them, connecting
/// to nothing.
pub(super) fn check_url(url: &str) -> Result<(), LedgerError> {
    Settings::parse(url).map(drop)
}

/// Where and how to connect, from a store URL.
#[derive(Clone)]
struct Settings {
    config: tokio_postgres::Config,
    tls: Tls,
    schema: Option<String>,
    pool: usize,
    listen: bool,
    /// The notification channel: one per schema, so that ledgers sharing a
    /// database in different schemas do not wake each other.
    channel: String,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("hosts", &self.config.get_hosts())
            .field("dbname", &self.config.get_dbname())
            .field("schema", &self.schema)
            .field("pool", &self.pool)
            .field("listen", &self.listen)
            .field("tls", &matches!(self.tls, Tls::On(_)))
            .finish()
    }
}

impl Settings {
    /// Reads `url`; its store parameters are taken out, the rest is the
    /// client's.
    fn parse(url: &str) -> Result<Self, LedgerError> {
        let named = |message: String| {
            LedgerError::invalid(format!("store URL {}: {message}", super::redacted_url(url)))
        };
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut schema = None;
        let mut pool = DEFAULT_POOL;
        let mut listen = true;
        let mut ssl_mode = "prefer";
        let mut root_cert = None;
        let mut passed = Vec::new();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            match pair.split_once('=') {
                Some(("schema", value)) => {
                    let valid = !value.is_empty()
                        && value.len() <= 63
                        && value
                            .bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
                    if !valid {
                        return Err(named(format!(
                            "schema {value:?} is not 1 to 63 lowercase letters, digits or underscores"
                        )));
                    }
                    schema = Some(value.to_owned());
                }
                Some(("pool", value)) => {
                    pool = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=64).contains(n))
                        .ok_or_else(|| named(format!("pool {value:?} is not a number from 1 to 64")))?;
                }
                Some(("listen", value)) => {
                    listen = match value {
                        "true" => true,
                        "false" => false,
                        other => return Err(named(format!("listen {other:?} is not one of true, false"))),
                    };
                }
                // Read here, not by the client: it knows neither the
                // verify modes nor the root certificate file.
                Some(("sslmode", value)) => ssl_mode = value,
                Some(("sslrootcert", value)) => root_cert = Some(value),
                _ => passed.push(pair),
            }
        }
        let client_url = if passed.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", passed.join("&"))
        };
        let tls = Tls::new(ssl_mode, root_cert).map_err(named)?;
        let mut config =
            tokio_postgres::Config::from_str(&client_url).map_err(|err| named(err.to_string()))?;
        config.ssl_mode(match tls {
            Tls::Off => tokio_postgres::config::SslMode::Disable,
            Tls::On(_) => tokio_postgres::config::SslMode::Require,
        });
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("inflight");
        }
        // A peer that vanished without closing is noticed within seconds.
        config.keepalives(true).keepalives_idle(Duration::from_secs(5));
        let channel = match &schema {
            Some(schema) => format!("inflight_capacity_{schema}"),
            None => "inflight_capacity".to_owned(),
        };
        Ok(Self {
            config,
            tls,
            schema,
            pool,
            listen,
            channel,
        })
    }

    /// A new connection, set up for the store.
    fn connect(&self) -> Result<Conn, LedgerError> {
        let connected = match &self.tls {
            Tls::Off => Session::connect(&self.config, tokio_postgres::NoTls)?,
            Tls::On(tls) => Session::connect(&self.config, tls.clone())?,
        };
        let client = connected.map_err(connect_failed)?;
        let mut setup = vec![sql::SESSION.to_owned()];
        if let Some(schema) = &self.schema {
            setup.push(sql::use_schema(schema));
        }
        client
            .batch_execute(&setup.join("; "))
            .map_err(|err| Fault::of(&err).error("cannot set up a PostgreSQL connection", err))?;
        Ok(Conn::new(client, self.channel.clone()))
    }

    /// A new connection, as the server gives it.
    fn client(&self) -> Result<postgres::Client, LedgerError> {
        let config = postgres::Config::from(self.config.clone());
        let connected = match &self.tls {
            Tls::Off => config.connect(postgres::NoTls),
            Tls::On(tls) => config.connect(tls.clone()),
        };
        connected.map_err(connect_failed)
    }

    /// The key the migration lock is taken on.
    fn lock_key(&self) -> String {
        format!("inflight.migrate:{}", self.schema.as_deref().unwrap_or(""))
    }
}

/// A failed connection attempt as a ledger error: `unavailable` unless the
/// server itself refused (bad credentials, no such database).
fn connect_failed(err: postgres::Error) -> LedgerError {
    let fault = Fault::of(&err);
    let fault = if fault == Fault::Other && err.as_db_error().is_none() {
        Fault::Unavailable
    } else {
        fault
    };
    fault.error("cannot connect to PostgreSQL", err)
}

/// A ledger store in a PostgreSQL database, shared by every instance that
/// opens it.
pub struct PostgresStore {
    settings: Arc<Settings>,
    jobs: RwLock<Option<mpsc::Sender<Job>>>,
    writers: Mutex<Vec<thread::JoinHandle<()>>>,
    stop: Arc<AtomicBool>,
    /// The call histograms and the capacity watchers, which the writers
    /// publish to after each commit and the listener wakes.
    published: Arc<Published>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Connects to the database at `url`, migrates it (under an advisory
    /// lock, so that instances starting together take turns), recomputes
    /// the bounds of in-flight records under `config`, and starts the
    /// writers and the listener.
    ///
    /// # Errors
    /// `InvalidInput` for a bad URL; `Unavailable` when the server cannot
    /// be reached; `Storage` when the schema is newer than this build or
    /// cannot be migrated.
    pub fn open(url: &str, config: Arc<LedgerConfig>, clock: Arc<dyn Clock>) -> Result<Self, LedgerError> {
        let settings = Arc::new(Settings::parse(url)?);
        let first = off_runtime(|| schema::migrate(&settings, &config, clock.as_ref()))?;
        let (jobs, queue) = mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        let mut writers = Vec::with_capacity(settings.pool);
        let mut first = Some(first);
        let published = Arc::new(Published::default());
        let order = Arc::new(order::Order::of(settings.pool));
        for index in 0..settings.pool {
            let writer = Writer {
                settings: Arc::clone(&settings),
                conn: first.take(),
                config: Arc::clone(&config),
                clock: Arc::clone(&clock),
                published: Arc::clone(&published),
                order: Arc::clone(&order),
                // At most 64 writers (`pool`).
                shard: index as i16,
            };
            let queue = Arc::clone(&queue);
            let handle = thread::Builder::new()
                .name(format!("inflight-pg-{index}"))
                .spawn(move || write_loop(writer, &queue))
                .map_err(|err| LedgerError::storage("cannot start a PostgreSQL writer thread", err))?;
            writers.push(handle);
        }
        let stop = Arc::new(AtomicBool::new(false));
        if settings.listen {
            let (settings, published, stop) =
                (Arc::clone(&settings), Arc::clone(&published), Arc::clone(&stop));
            thread::Builder::new()
                .name("inflight-pg-listen".into())
                .spawn(move || listen::listen_loop(&settings, &published.watchers, &stop))
                .map_err(|err| LedgerError::storage("cannot start the PostgreSQL listener", err))?;
        }
        Ok(Self {
            settings,
            jobs: RwLock::new(Some(jobs)),
            writers: Mutex::new(writers),
            stop,
            published,
        })
    }

    /// How many writer connections it keeps.
    pub fn pool(&self) -> usize {
        self.settings.pool
    }

    /// Whether it keeps a `LISTEN` connection.
    pub fn listens(&self) -> bool {
        self.settings.listen
    }
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Store for PostgresStore {
    fn call_stats(&self) -> CallSnapshot {
        self.published.call_stats()
    }

    fn execute(&self, command: Command) -> StoreFuture {
        let (reply, answer) = oneshot::channel();
        let sent = match &*self
            .jobs
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(jobs) => jobs.send(Job::Run(command, reply)).is_ok(),
            None => false,
        };
        StoreFuture::pending(async move {
            if !sent {
                return Err(LedgerError::closed());
            }
            answer.await.map_err(|_| LedgerError::closed())?
        })
    }

    fn close(&self) -> StoreFuture {
        self.stop.store(true, Ordering::SeqCst);
        // The writers answer what is queued, then find the queue closed.
        drop(
            self.jobs
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(),
        );
        let writers = std::mem::take(
            &mut *self
                .writers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let (done, closed) = oneshot::channel();
        let joined = thread::Builder::new()
            .name("inflight-pg-close".into())
            .spawn(move || {
                for writer in writers {
                    let _ = writer.join();
                }
                let _ = done.send(());
            });
        StoreFuture::pending(async move {
            if joined.is_ok() {
                let _ = closed.await;
            }
            Ok(Reply::Closed)
        })
    }

    fn watch_capacity(&self, wake: Wake) {
        self.published.watchers.add(wake);
    }

    fn recheck_within(&self) -> Duration {
        // With its listener, another instance's grant or freed slot wakes
        // the waiters at once; without it (PgBouncer in transaction mode)
        // polling is all they have.
        if self.settings.listen {
            super::RECHECK_HEARD
        } else {
            super::RECHECK_UNHEARD
        }
    }
}

/// Bulk-loads `count` settled records, completed over the hour before
/// `completed_at`, with their counters, straight into the database at
/// `url` (migrated first): for benchmarks that need a large history fast.
/// Not for production use.
///
/// # Errors
/// As [`PostgresStore::open`], and `Storage` when a write fails.
#[doc(hidden)]
pub fn seed_history(
    url: &str,
    count: usize,
    completed_at: crate::domain::Timestamp,
) -> Result<(), LedgerError> {
    use crate::domain::query;
    use crate::domain::record::ActivityId;

    let settings = Settings::parse(url)?;
    let config = LedgerConfig::default();
    off_runtime(|| {
        let mut conn = schema::migrate(&settings, &config, &crate::clock::SystemClock)?;
        let failed = |err: postgres::Error| LedgerError::storage("cannot seed history", err);
        let mut counts = PendingCounts::default();
        conn.client.batch_execute(sql::BEGIN).map_err(failed)?;
        let mut done = 0;
        while done < count {
            let batch = (count - done).min(10_000);
            let (mut ids, mut enqueued, mut started, mut completed) = (
                Vec::with_capacity(batch),
                Vec::with_capacity(batch),
                Vec::with_capacity(batch),
                Vec::with_capacity(batch),
            );
            for i in done..done + batch {
                let at = completed_at.sub_millis(i as i64 % 3_600_000);
                ids.push(ActivityId::new().to_string());
                enqueued.push(at.as_millis() - 20);
                started.push(at.as_millis() - 10);
                completed.push(at.as_millis());
                counts.complete(query::completion_minute(at));
            }
            conn.client
                .execute(sql::SEED_RECORDS, &[&ids, &enqueued, &started, &completed])
                .map_err(failed)?;
            done += batch;
        }
        conn.client.batch_execute(sql::COMMIT).map_err(failed)?;
        let (aggregate, totals) = super::seeded_history_totals(count, completed_at)?;
        counts.totals.insert(aggregate, totals);
        txn::write_counts(&mut conn, &mut counts)
            .map_err(|unflushed| unflushed.into_error("cannot update counters"))?;
        conn.client.batch_execute(sql::ANALYZE).map_err(failed)
    })
}

/// Runs `work` on a thread of its own: the blocking client runs a runtime
/// of its own for each call, which must not be nested in the caller's
/// (opening a store from async code).
pub(crate) fn off_runtime<T: Send>(work: impl FnOnce() -> T + Send) -> T {
    thread::scope(|scope| match scope.spawn(work).join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_names_what_is_wrong_with_it() {
        let message = |url: &str| Settings::parse(url).unwrap_err().to_string();
        assert!(message("postgres://u@h/db?pool=0").contains("pool \"0\" is not a number from 1 to 64"));
        assert!(message("postgres://u@h/db?listen=no").contains("listen \"no\" is not one of true, false"));
        assert!(message("postgres://u@h/db?schema=Bad-Name").contains("schema \"Bad-Name\""));
        assert!(message("postgres://u:secret@h/db?bogus=1").contains("u:***@h"));
        let settings =
            Settings::parse("postgresql://u@h:5433/db?schema=a1&pool=2&listen=false&application_name=x")
                .unwrap();
        assert_eq!((settings.pool, settings.listen), (2, false));
        assert_eq!(settings.schema.as_deref(), Some("a1"));
        assert_eq!(settings.config.get_application_name(), Some("x"));
        assert_eq!(settings.config.get_connect_timeout(), Some(&CONNECT_TIMEOUT));
    }

    #[test]
    fn tls_is_asked_for_with_sslmode_and_its_roots_are_checked() {
        let message = |url: &str| Settings::parse(url).unwrap_err().to_string();
        assert!(message("postgres://u@h/db?sslmode=allow").contains("sslmode \"allow\" is not one of"));
        assert!(
            message("postgres://u@h/db?sslmode=require&sslrootcert=/nonexistent/ca.pem")
                .contains("sslrootcert \"/nonexistent/ca.pem\" cannot be read")
        );
        assert!(message("postgres://u@h/db?sslrootcert=/etc/hosts").contains("set sslmode=require"));
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no certificate here\n").unwrap();
        let url = format!(
            "postgres://u@h/db?sslmode=require&sslrootcert={}",
            empty.display()
        );
        assert!(
            message(&url).contains("holds no certificate"),
            "{}",
            message(&url)
        );

        for (url, tls) in [
            ("postgres://u@h/db", false),
            ("postgres://u@h/db?sslmode=disable", false),
            ("postgres://u@h/db?sslmode=prefer", false),
        ] {
            let settings = Settings::parse(url).unwrap();
            assert_eq!(matches!(settings.tls, Tls::On(_)), tls, "{url}");
            assert_eq!(
                settings.config.get_ssl_mode(),
                postgres::config::SslMode::Disable,
                "{url}"
            );
        }
    }
}
