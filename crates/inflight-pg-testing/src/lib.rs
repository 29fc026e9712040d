//! Test databases on a real PostgreSQL server, for inflight's tests and
//! benchmarks. Not for production use, and not part of the library: a
//! crate of its own, so that the library ships no test harness.
//!
//! The server is `INFLIGHT_TEST_POSTGRES_URL`'s; when it is not set,
//! [`DEFAULT_SERVER`] when that can be reached, and otherwise a private
//! cluster this process starts with the installed server programs and stops
//! when it ends ([`cluster`], whose documentation gives the rule);
//! `INFLIGHT_TEST_POSTGRES_URL=private` asks for the private cluster
//! whatever runs on the machine. Each test process (a run) creates its own
//! database, `inflight_test_<host>_<pid>` (`<host>` a hash of this machine's
//! name, so that machines sharing a server leave each other's alone), and
//! drops it when it exits; each test gets a fresh schema in it
//! ([`TestDatabase`]), dropped when the test ends. A run that was killed
//! leaves its database behind: the next run on the machine drops every one
//! of this machine's whose process is gone, first thing.
//!
//! When no server can be had (the one named is unreachable, or none is and
//! the server programs are missing), [`TestDatabase::new`] panics with a
//! message that says so and what to do: PostgreSQL tests never skip
//! silently.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

pub mod cluster;

/// Runs `work` on a thread of its own: the blocking client runs a runtime
/// of its own for each call, which must not be nested in an async test's.
fn off_runtime<T: Send>(work: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| match scope.spawn(work).join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

/// The server the tests use when `INFLIGHT_TEST_POSTGRES_URL` is not set.
pub const DEFAULT_SERVER: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// The variable that points the tests at another server.
pub const SERVER_VARIABLE: &str = "INFLIGHT_TEST_POSTGRES_URL";
/// `SERVER_VARIABLE`'s value that asks for a private cluster.
pub const PRIVATE: &str = "private";
/// Every test database's name starts with this.
pub const PREFIX: &str = "inflight_test_";

// Maintenance statements of the test harness (never run by the store).
// The names they take are made here, of `[a-z0-9_]` only: none is quoted.
const LIST_TEST_DATABASES: &str = "SELECT datname FROM pg_database WHERE datname LIKE 'inflight\\_test\\_%'";
const DROP_DATABASE: &str = "DROP DATABASE IF EXISTS {} WITH (FORCE)";
const CREATE_DATABASE: &str = "CREATE DATABASE {}";
const DROP_SCHEMA: &str = "DROP SCHEMA IF EXISTS {} CASCADE";

/// This run's database name.
fn run_name() -> String {
    format!("{PREFIX}{}_{}", host_tag(), std::process::id())
}

/// A short tag of this machine's name.
fn host_tag() -> String {
    use std::hash::{Hash, Hasher};
    let mut name = [0u8; 256];
    // SAFETY: the buffer is valid and writable for its whole length.
    let ok = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } == 0;
    let name = if ok { &name[..] } else { &[][..] };
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    name.split(|b| *b == 0)
        .next()
        .unwrap_or_default()
        .hash(&mut hasher);
    format!("{:08x}", hasher.finish() as u32)
}

/// The test server's URL: `SERVER_VARIABLE`'s, or [`DEFAULT_SERVER`] when
/// it can be reached, or this process's private cluster's (started now).
///
/// # Panics
/// When there is none of those, saying what to do.
pub fn server_url() -> String {
    static URL: OnceLock<Result<String, String>> = OnceLock::new();
    // Decided once: every test of the process uses the same server.
    URL.get_or_init(|| off_runtime(find_server))
        .clone()
        .unwrap_or_else(|message| panic!("{message}"))
}

fn find_server() -> Result<String, String> {
    match std::env::var(SERVER_VARIABLE) {
        Ok(url) if url == PRIVATE => cluster::private_url()
            .map_err(|err| format!("{SERVER_VARIABLE}={PRIVATE} asks for a private cluster, but {err}")),
        Ok(url) => Ok(url),
        Err(_) => {
            let mut config: postgres::Config = DEFAULT_SERVER.parse().expect("the default URL is valid");
            let reached = config
                .connect_timeout(std::time::Duration::from_secs(5))
                .connect(postgres::NoTls);
            match reached {
                Ok(_) => Ok(DEFAULT_SERVER.to_owned()),
                Err(unreached) => cluster::private_url().map_err(|err| {
                    format!(
                        "the PostgreSQL tests found no server at {DEFAULT_SERVER} ({unreached}), \
                         and cannot run a private cluster instead: {err}.\n\
                         Install PostgreSQL's server programs (initdb, pg_ctl; Debian: apt-get \
                         install postgresql-15), start a server there (user postgres, trust \
                         authentication), or set {SERVER_VARIABLE} to another server's URL."
                    )
                }),
            }
        }
    }
}

/// `server` with its database replaced by `database`.
fn with_database(server: &str, database: &str) -> String {
    let (base, query) = server
        .split_once('?')
        .map_or((server, None), |(b, q)| (b, Some(q)));
    let (scheme, rest) = base.split_once("://").unwrap_or(("postgres", base));
    let authority = rest.split('/').next().unwrap_or(rest);
    match query {
        Some(query) => format!("{scheme}://{authority}/{database}?{query}"),
        None => format!("{scheme}://{authority}/{database}"),
    }
}

fn connect(url: &str) -> postgres::Client {
    postgres::Client::connect(url, postgres::NoTls).unwrap_or_else(|err| {
        panic!(
            "cannot reach the test PostgreSQL server at {url}: {err}\n\
             The PostgreSQL tests need a server: start it, set {SERVER_VARIABLE} to \
             another server's URL, or unset it (the tests then use {DEFAULT_SERVER}, \
             or a private cluster when that cannot be reached)."
        )
    })
}

/// This run's database (created on first use, with the leftovers of dead
/// runs dropped first); its URL.
fn run_database() -> &'static str {
    static DATABASE: OnceLock<String> = OnceLock::new();
    DATABASE.get_or_init(|| {
        let server = server_url();
        let mut admin = connect(&server);
        drop_leftovers(&mut admin);
        let name = run_name();
        admin
            .batch_execute(&DROP_DATABASE.replace("{}", &name))
            .and_then(|()| admin.batch_execute(&CREATE_DATABASE.replace("{}", &name)))
            .unwrap_or_else(|err| panic!("cannot create the test database {name}: {err}"));
        // Dropped when the process exits: the test harness exits through
        // `exit`, which runs this.
        extern "C" fn drop_at_exit() {
            // On a thread of its own: the exiting thread's runtime context
            // may already be torn down, and a panic must not cross `exit`.
            let dropped = std::thread::spawn(|| {
                let server = server_url();
                let name = run_name();
                if let Ok(mut admin) = postgres::Client::connect(&server, postgres::NoTls) {
                    let _ = admin.batch_execute(&DROP_DATABASE.replace("{}", &name));
                }
            });
            let _ = dropped.join();
        }
        // SAFETY: registers a plain function with no captured state.
        unsafe {
            libc::atexit(drop_at_exit);
        }
        with_database(&server, &name)
    })
}

/// Drops the databases of earlier runs whose process is gone.
fn drop_leftovers(admin: &mut postgres::Client) {
    let Ok(rows) = admin.query(LIST_TEST_DATABASES, &[]) else {
        return;
    };
    for row in rows {
        let name: String = row.get(0);
        let mine = format!("{PREFIX}{}_", host_tag());
        let Some(pid) = name.strip_prefix(&mine).and_then(|pid| pid.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: signal 0 only asks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !alive {
            let _ = admin.batch_execute(&DROP_DATABASE.replace("{}", &name));
        }
    }
}

/// A fresh schema in this run's database, dropped when this is dropped.
#[derive(Debug)]
pub struct TestDatabase {
    database: String,
    schema: String,
}

impl TestDatabase {
    /// A fresh, empty schema.
    ///
    /// # Panics
    /// When the test server cannot be reached (with a message that says so).
    pub fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        off_runtime(|| {
            let database = run_database().to_owned();
            let schema = format!("t{}", NEXT.fetch_add(1, Ordering::SeqCst));
            let mut client = connect(&database);
            client
                .batch_execute(&DROP_SCHEMA.replace("{}", &schema))
                .unwrap_or_else(|err| panic!("cannot clear the test schema {schema}: {err}"));
            Self { database, schema }
        })
    }

    /// The store URL of this schema, with `extra` parameters
    /// (`"pool=1&listen=false"`, or empty).
    pub fn store_url(&self, extra: &str) -> String {
        let separator = if self.database.contains('?') { '&' } else { '?' };
        let mut url = format!("{}{separator}schema={}", self.database, self.schema);
        if !extra.is_empty() {
            url.push('&');
            url.push_str(extra);
        }
        url
    }

    /// A plain connection to the database, its search path on the schema:
    /// for tests that look at the tables or hold a transaction open. Use it
    /// off any async runtime (a thread of its own, or `spawn_blocking`).
    pub fn client(&self) -> postgres::Client {
        // Connected on a thread of its own, so that async code may ask.
        off_runtime(|| {
            let mut client = connect(&self.database);
            client
                .batch_execute(&format!("SET search_path TO {}", self.schema))
                .unwrap_or_else(|err| panic!("cannot use the test schema {}: {err}", self.schema));
            client
        })
    }

    /// The schema's name.
    pub fn schema(&self) -> &str {
        &self.schema
    }
}

impl Default for TestDatabase {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        off_runtime(|| {
            if let Ok(mut client) = postgres::Client::connect(&self.database, postgres::NoTls) {
                let _ = client.batch_execute(&DROP_SCHEMA.replace("{}", &self.schema));
            }
        });
    }
}
