//! Crashes under load on PostgreSQL: the server killed with SIGKILL and
//! restarted on the same database; and the database itself restarted twice
//! (a fast shutdown, then a crash) under a server that keeps running. After
//! each: every acknowledged transition is there, each record is counted
//! once, and the records in flight end reaped or settled. While the
//! database is away, calls get 503 `unavailable` with `Retry-After` within
//! 5 s, never another 5xx and never a hang, and the server recovers by
//! itself.
//!
//! The kill test runs on a fresh schema of the test server
//! (`INFLIGHT_TEST_POSTGRES_URL`, by default postgres@127.0.0.1:5432). The
//! restart test cannot restart that server, which others share: it starts
//! a private PostgreSQL cluster of its own (`initdb` into a temporary
//! directory, a free port, `fsync` and `synchronous_commit` on) and tears
//! it down at the end, also when it fails.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::load::{check_records, kill_9_under_load, Failure, Load, OnFailure, SHORT_BOUNDS};
use common::{config_file, Launch, Server};
use inflight::store::postgres::testing::TestDatabase;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_work_survives_kill_9_under_load_on_postgres() {
    let database = TestDatabase::new();
    let figures = kill_9_under_load(&database.store_url("")).await;
    eprintln!("kill -9 under load (PostgreSQL): {figures}");
}

/// The directory of PostgreSQL's server programs (`initdb`, `pg_ctl`):
/// `pg_config --bindir`'s, or the newest of Debian's
/// `/usr/lib/postgresql/<version>/bin`.
fn server_programs() -> PathBuf {
    let configured = std::process::Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()));
    let mut debian: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    // Newest first: "15" after "9.6" by number, not by text.
    debian.sort_by_key(|bin| {
        let version = bin.parent().and_then(Path::file_name).unwrap_or_default();
        std::cmp::Reverse(
            version
                .to_string_lossy()
                .split('.')
                .map(|part| part.parse::<u32>().unwrap_or(0))
                .collect::<Vec<_>>(),
        )
    });
    configured
        .into_iter()
        .chain(debian)
        .find(|bin| bin.join("initdb").is_file() && bin.join("pg_ctl").is_file())
        .unwrap_or_else(|| {
            panic!(
                "the PostgreSQL restart test runs a private PostgreSQL cluster and needs \
                 PostgreSQL's server programs (initdb, pg_ctl), found neither in `pg_config \
                 --bindir` nor in /usr/lib/postgresql/*/bin: install them (Debian: \
                 apt-get install postgresql-15)"
            )
        })
}

/// Whether this process runs as root, whom PostgreSQL refuses to run as.
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective user.
    std::fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0)
}

/// A private PostgreSQL cluster, stopped and removed when dropped.
struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    /// As root, its programs run as the `postgres` user.
    as_postgres: bool,
    // Last: removed after the cluster stopped.
    dir: tempfile::TempDir,
}

impl Cluster {
    /// `initdb`, then a start on a free port.
    async fn start() -> Self {
        let bin = server_programs();
        let dir = tempfile::tempdir().unwrap();
        let as_postgres = is_root();
        if as_postgres {
            let owned = std::process::Command::new("chown")
                .arg("postgres:")
                .arg(dir.path())
                .status()
                .expect("chown runs");
            assert!(
                owned.success(),
                "cannot give {} to the postgres user",
                dir.path().display()
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cluster = Self {
            bin,
            data: dir.path().join("data"),
            port,
            as_postgres,
            dir,
        };
        cluster
            .run(
                "initdb",
                &[
                    "-D",
                    &cluster.data.display().to_string(),
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "--locale=C",
                    "-E",
                    "UTF8",
                    // initdb's own files: a process crash never costs them.
                    "--no-sync",
                ],
            )
            .await;
        let settings = format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
             fsync = on\nsynchronous_commit = on\nfull_page_writes = on\n\
             max_connections = 50\nshared_buffers = 16MB\n",
            cluster.port,
            cluster.dir.path().display()
        );
        let conf = cluster.data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).unwrap();
        text.push_str(&settings);
        std::fs::write(&conf, text).unwrap();
        cluster.up().await;
        cluster
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// `program` of PostgreSQL's, as the user it must run as.
    fn command(&self, program: &str, args: &[&str]) -> std::process::Command {
        let path = self.bin.join(program);
        let mut command = if self.as_postgres {
            let mut command = std::process::Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            std::process::Command::new(path)
        };
        command.args(args).current_dir(self.dir.path());
        command
    }

    async fn run(&self, program: &str, args: &[&str]) {
        let output = tokio::process::Command::from(self.command(program, args))
            .output()
            .await
            .unwrap_or_else(|err| panic!("cannot run {program}: {err}"));
        let log = std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default();
        assert!(
            output.status.success(),
            "{program} {args:?} failed: {}{}\nthe server's log:\n{log}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
    }

    /// Starts it, and waits until it takes connections.
    async fn up(&self) {
        let log = self.dir.path().join("postgres.log").display().to_string();
        let data = self.data.display().to_string();
        self.run("pg_ctl", &["-D", &data, "-l", &log, "-w", "-t", "60", "start"])
            .await;
    }

    /// Stops it: `fast` (clients cut, a clean shutdown) or `immediate`
    /// (every process quits at once, a crash: the next start recovers
    /// from the WAL).
    async fn down(&self, mode: &str) {
        let data = self.data.display().to_string();
        self.run("pg_ctl", &["-D", &data, "-m", mode, "-w", "-t", "60", "stop"])
            .await;
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.data.display().to_string();
        // Fails harmlessly when it is not running.
        let _ = self
            .command("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
            .output();
    }
}

/// One restart of the database: how long it was away, and what the calls
/// meanwhile got.
struct Gap {
    how: &'static str,
    /// From the stop to the database taking connections again.
    down: Duration,
    /// From then to the first call that succeeded.
    recovered_after: Duration,
    /// Calls that failed, from the stop until the next restart (or the end).
    failures: Vec<Failure>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_under_load_loses_nothing_and_the_gap_gets_503() {
    const PROMPT: Duration = Duration::from_secs(5);
    let cluster = Cluster::start().await;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(Launch {
        store: Some(cluster.url()),
        args: config_file(&dir, SHORT_BOUNDS),
        ..Launch::default()
    })
    .await;
    let load = Load::start(&server.base, 8, OnFailure::Continue);
    load.until_settled(100).await;
    let early = load.failures();
    assert!(early.is_empty(), "calls failed before any restart: {early:#?}");

    let mut gaps = Vec::new();
    for (how, mode) in [("fast shutdown", "fast"), ("crash", "immediate")] {
        let before = load.failures().len();
        let stopped = Instant::now();
        cluster.down(mode).await;
        // Away long enough that every client meets the gap.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        cluster.up().await;
        let back = Instant::now();
        let recovered = load.first_success_after(back, Duration::from_secs(20)).await;
        // More load on the recovered database before the next restart.
        load.until_settled(load.settled() + 100).await;
        let failures = load.failures()[before..].to_vec();
        gaps.push(Gap {
            how,
            down: back - stopped,
            recovered_after: recovered - back,
            failures,
        });
    }
    let (acked, failures) = load.finish().await;

    for gap in &gaps {
        let slowest = gap.failures.iter().map(|f| f.took).max().unwrap_or_default();
        eprintln!(
            "PostgreSQL {} under load: away {:?}, first success {:?} after it was back; \
             {} calls answered 503 unavailable meanwhile, the slowest in {slowest:?}",
            gap.how,
            gap.down,
            gap.recovered_after,
            gap.failures.len(),
        );
        assert!(
            !gap.failures.is_empty(),
            "no call met the {}: the test saw no gap",
            gap.how
        );
    }
    let wrong: Vec<&Failure> = failures
        .iter()
        .filter(|failure| !failure.is_prompt_unavailable(PROMPT))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} failed calls were not a 503 `unavailable` with Retry-After within {PROMPT:?} \
         (status None: no answer): {:#?}",
        wrong.len(),
        failures.len(),
        &wrong[..wrong.len().min(10)]
    );

    let figures = check_records(&server, &acked).await;
    eprintln!("PostgreSQL restarted twice under load: {figures}");
}
