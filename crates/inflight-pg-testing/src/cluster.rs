//! Private PostgreSQL clusters for the tests: `initdb` and `pg_ctl` from the
//! installed server programs, in a directory of their own, on a free port
//! of 127.0.0.1 and a socket in that directory. [`Cluster`] is the part
//! every private cluster shares (the crash and TLS tests drive one of their
//! own with it); `private_url` gives the one a test process runs when no
//! server is reachable (see the parent module).
//!
//! The rule for a process's private cluster: each test process runs its
//! own, in `<temp>/inflight-test-postgres-<uid>/<pid>-<start>` (`<start>` the
//! process's start time, so that a reused pid is not mistaken for it).
//! Processes never share one, so no process waits for another's or stops
//! it under another's feet. Three things stop it:
//!
//! - the process's exit (`exit`, which ends every test harness, passed or
//!   failed): an `atexit` handler stops it and removes its directory before
//!   the process is gone;
//! - the process's death by a signal (a `kill -9`, a Ctrl-C): a watchdog
//!   started with the cluster, in a process group of its own so that the
//!   terminal's signals miss it, waits for the end of a pipe only the test
//!   process holds, then stops the cluster and removes the directory;
//! - when the watchdog died too: the next test process that looks for a
//!   server stops and removes every cluster there whose process is gone,
//!   first thing.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};

/// The directory of PostgreSQL's server programs (`initdb`, `pg_ctl`):
/// `pg_config --bindir`'s, or the newest of Debian's
/// `/usr/lib/postgresql/<version>/bin`.
///
/// # Errors
/// When neither has them, saying what to install.
pub fn server_programs() -> Result<PathBuf, String> {
    let configured = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()));
    let mut debian: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|entry| entry.path().join("bin"))
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
        .ok_or_else(|| {
            "a private PostgreSQL cluster needs PostgreSQL's server programs (initdb, pg_ctl), \
             found neither in `pg_config --bindir` nor in /usr/lib/postgresql/*/bin: install \
             them (Debian: apt-get install postgresql-15)"
                .to_owned()
        })
}

/// Whether this process runs as root, whom PostgreSQL refuses to run as.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A PostgreSQL cluster in a directory of its own (its data directory
/// `data`, its log, its socket), run with the installed server programs:
/// as the `postgres` user when this process is root. Its commands are
/// returned, not run, so that async tests may run them their own way.
#[derive(Debug)]
pub struct Cluster {
    bin: PathBuf,
    /// Its directory.
    pub dir: PathBuf,
    /// Its data directory, `data` in `dir`.
    pub data: PathBuf,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// As root, its programs run as the `postgres` user.
    pub as_postgres: bool,
}

impl Cluster {
    /// A cluster to make in `dir`, an existing directory (given to the
    /// `postgres` user when this process is root), on a free port.
    ///
    /// # Errors
    /// When the server programs are missing, or `dir` cannot be given away.
    pub fn new(dir: &Path) -> Result<Self, String> {
        let mut cluster = Self::at(dir)?;
        if cluster.as_postgres {
            let owned = Command::new("chown").arg("postgres:").arg(dir).status();
            if !owned.as_ref().is_ok_and(|status| status.success()) {
                return Err(format!(
                    "cannot give {} to the postgres user ({owned:?}): PostgreSQL refuses to run as \
                     root, and its data must be the postgres user's",
                    dir.display()
                ));
            }
        }
        cluster.port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map_err(|err| format!("cannot find a free port on 127.0.0.1: {err}"))?
            .port();
        Ok(cluster)
    }

    /// The cluster already in `dir` (no port of its own known): to stop it.
    fn at(dir: &Path) -> Result<Self, String> {
        Ok(Self {
            bin: server_programs()?,
            dir: dir.to_owned(),
            data: dir.join("data"),
            port: 0,
            as_postgres: is_root(),
        })
    }

    /// Its URL, as user `postgres` on database `postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Its log.
    pub fn log(&self) -> PathBuf {
        self.dir.join("postgres.log")
    }

    /// `program` of PostgreSQL's with `args`, as the user it must run as,
    /// in the cluster's directory.
    pub fn command(&self, program: &str, args: &[&str]) -> Command {
        let path = self.bin.join(program);
        let mut command = if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            Command::new(path)
        };
        command.args(args).current_dir(&self.dir);
        command
    }

    /// `initdb`: user `postgres`, trust authentication.
    pub fn initdb(&self) -> Command {
        let data = self.data.display().to_string();
        self.command(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                "postgres",
                "-A",
                "trust",
                "--locale=C",
                "-E",
                "UTF8",
                // initdb's own files: a test cluster never outlives a crash.
                "--no-sync",
            ],
        )
    }

    /// After `initdb`: listen on its port of 127.0.0.1 and its socket only,
    /// with `settings` (lines of `postgresql.conf`) added.
    ///
    /// # Errors
    /// When `postgresql.conf` cannot be written.
    pub fn configure(&self, settings: &str) -> Result<(), String> {
        let conf = self.data.join("postgresql.conf");
        let mut text =
            std::fs::read_to_string(&conf).map_err(|err| format!("cannot read {}: {err}", conf.display()))?;
        text.push_str(&format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n{settings}\n",
            self.port,
            self.dir.display()
        ));
        std::fs::write(&conf, text).map_err(|err| format!("cannot write {}: {err}", conf.display()))
    }

    /// `pg_ctl start`, which waits until it takes connections.
    pub fn start(&self) -> Command {
        let log = self.log().display().to_string();
        let data = self.data.display().to_string();
        self.command("pg_ctl", &["-D", &data, "-l", &log, "-w", "-t", "60", "start"])
    }

    /// `pg_ctl stop` in `mode`: `fast` (clients cut, a clean shutdown) or
    /// `immediate` (every process quits at once, a crash: the next start
    /// recovers from the WAL). Fails harmlessly when it is not running.
    pub fn stop(&self, mode: &str) -> Command {
        let data = self.data.display().to_string();
        self.command("pg_ctl", &["-D", &data, "-m", mode, "-w", "-t", "60", "stop"])
    }

    /// What running `what` gave: an error with its output and the server's
    /// log when it failed.
    ///
    /// # Errors
    /// When it could not run or failed.
    pub fn check(&self, what: &str, output: io::Result<Output>) -> Result<(), String> {
        let output = output.map_err(|err| format!("cannot run {what}: {err}"))?;
        if output.status.success() {
            return Ok(());
        }
        let log = std::fs::read_to_string(self.log()).unwrap_or_default();
        Err(format!(
            "{what} failed ({}): {}{}\nthe server's log ({}):\n{log}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            self.log().display(),
        ))
    }

    /// Runs `command` (one of this cluster's) to its end.
    ///
    /// # Errors
    /// As [`Cluster::check`].
    pub fn run(&self, mut command: Command) -> Result<(), String> {
        let what = format!("{command:?}");
        self.check(&what, command.output())
    }
}

/// This process's private cluster, and the pipe whose end stops it.
#[derive(Debug)]
pub(crate) struct Private {
    pub(crate) cluster: Cluster,
    watchdog: Mutex<Option<Child>>,
}

/// The URL of this process's private cluster, started on first use (and
/// the clusters of dead processes stopped first).
///
/// # Errors
/// When it cannot be started (the server programs missing, say), saying why.
pub(crate) fn private_url() -> Result<String, String> {
    private().map(|private| private.cluster.url())
}

/// This process's private cluster, started on first use.
pub(crate) fn private() -> Result<&'static Private, String> {
    static PRIVATE: OnceLock<Result<Private, String>> = OnceLock::new();
    PRIVATE
        .get_or_init(|| {
            let private = start_private(&runs_dir()?)?;
            extern "C" fn stop_at_exit() {
                if let Some(Ok(private)) = PRIVATE.get() {
                    private.stop();
                }
            }
            // SAFETY: registers a plain function with no captured state.
            unsafe {
                libc::atexit(stop_at_exit);
            }
            Ok(private)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Where this user's test processes keep their clusters.
fn runs_dir() -> Result<PathBuf, String> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let runs = std::env::temp_dir().join(format!("inflight-test-postgres-{uid}"));
    std::fs::create_dir_all(&runs).map_err(|err| format!("cannot create {}: {err}", runs.display()))?;
    // In a shared temporary directory: someone else's is not to be trusted.
    match std::fs::metadata(&runs) {
        Ok(meta) if meta.uid() == uid => Ok(runs),
        _ => Err(format!(
            "{} is not this user's: remove it, or set TMPDIR elsewhere",
            runs.display()
        )),
    }
}

/// Starts a cluster for this process in `runs`, after stopping those of
/// dead processes there.
fn start_private(runs: &Path) -> Result<Private, String> {
    remove_leftovers(runs);
    let pid = std::process::id();
    let start = started(pid).ok_or("cannot read this process's start time in /proc")?;
    let dir = runs.join(format!("{pid}-{start}"));
    std::fs::create_dir(&dir).map_err(|err| format!("cannot create {}: {err}", dir.display()))?;
    let cluster = match Cluster::new(&dir) {
        Ok(cluster) => cluster,
        Err(err) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(err);
        }
    };
    // Before initdb: a process killed while it runs leaves nothing either.
    let private = Private {
        watchdog: Mutex::new(Some(watchdog(&cluster)?)),
        cluster,
    };
    let started = private
        .cluster
        .run(private.cluster.initdb())
        .and_then(|()| private.cluster.configure(""))
        .and_then(|()| private.cluster.run(private.cluster.start()));
    if let Err(err) = started {
        private.stop();
        return Err(format!("cannot start a private PostgreSQL cluster: {err}"));
    }
    Ok(private)
}

/// A process that, once the pipe to its input closes (this process ended,
/// however), stops `cluster` and removes its directory.
fn watchdog(cluster: &Cluster) -> Result<Child, String> {
    use std::os::unix::process::CommandExt;
    let stop = cluster.stop("immediate");
    Command::new("sh")
        .arg("-c")
        .arg(r#"cat >/dev/null; "$@" >/dev/null 2>&1; rm -rf "$INFLIGHT_CLUSTER_DIR""#)
        .arg("sh")
        .arg(stop.get_program())
        .args(stop.get_args())
        .env("INFLIGHT_CLUSTER_DIR", &cluster.dir)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Out of the terminal's process group: a Ctrl-C that kills the
        // tests must leave it to clean up after them.
        .process_group(0)
        .spawn()
        .map_err(|err| format!("cannot start sh, which stops the private cluster when the tests end: {err}"))
}

impl Private {
    /// Stops the cluster and removes its directory, through the watchdog,
    /// and waits until that is done.
    fn stop(&self) {
        let watchdog = self
            .watchdog
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(mut watchdog) = watchdog {
            drop(watchdog.stdin.take());
            let _ = watchdog.wait();
        }
    }

    /// The server's process id, from its `postmaster.pid`.
    #[cfg(test)]
    pub(crate) fn server_pid(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.cluster.data.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }
}

/// When process `pid` started (clock ticks after boot), if it is running.
pub(crate) fn started(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22; the fields are counted after the command's name, which is
    // in parentheses and may hold anything, spaces and parentheses too.
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

/// Stops and removes the clusters in `runs` whose process is gone; leaves
/// anything else there alone.
pub(crate) fn remove_leftovers(runs: &Path) {
    let Ok(entries) = std::fs::read_dir(runs) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some((pid, start)) = name.to_str().and_then(|name| name.split_once('-')) else {
            continue;
        };
        let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
            continue;
        };
        if started(pid) == Some(start) {
            continue;
        }
        let dir = entry.path();
        if dir.join("data").join("postmaster.pid").exists() {
            if let Ok(cluster) = Cluster::at(&dir) {
                let _ = cluster.stop("immediate").output();
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::{TestDatabase, PRIVATE, SERVER_VARIABLE};

    /// Asks the child test to stay until it is killed.
    const STAY: &str = "INFLIGHT_TEST_CHILD_STAY";

    #[test]
    fn only_the_clusters_of_dead_processes_are_removed() {
        let runs = tempfile::tempdir().unwrap();
        let me = std::process::id();
        let start = started(me).unwrap();
        let mut child = Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let keep = [format!("{me}-{start}"), "notes".to_owned(), "12-x".to_owned()];
        let remove = [format!("{me}-{}", start + 1), format!("{dead}-{start}")];
        for name in keep.iter().chain(&remove) {
            std::fs::create_dir_all(runs.path().join(name).join("data")).unwrap();
        }
        remove_leftovers(runs.path());
        for name in &keep {
            assert!(runs.path().join(name).exists(), "{name} was removed");
        }
        for name in &remove {
            assert!(!runs.path().join(name).exists(), "{name} was kept");
        }
    }

    /// Run by the tests below in a process of its own: uses a private
    /// cluster, says where it is, and ends (or stays a while, to be killed).
    #[test]
    #[ignore = "a child of the tests below, with INFLIGHT_TEST_POSTGRES_URL=private"]
    fn private_cluster_child() {
        let database = TestDatabase::new();
        let one: i32 = database.client().query_one("SELECT 1", &[]).unwrap().get(0);
        assert_eq!(one, 1);
        let private = private().unwrap();
        assert_eq!(crate::server_url(), private.cluster.url());
        println!(
            "CLUSTER {} {}",
            private.server_pid().unwrap(),
            private.cluster.dir.display()
        );
        drop(database);
        if std::env::var_os(STAY).is_some() {
            // Long enough to be killed; bounded, so that a parent that
            // missed the line above is not left waiting for ever.
            std::thread::sleep(Duration::from_secs(120));
        }
    }

    /// This test binary running `private_cluster_child` alone.
    fn child(stay: bool) -> Command {
        // The test's path inside its crate: the module path less the crate.
        let module = module_path!().split_once("::").unwrap().1;
        let name = format!("{module}::private_cluster_child");
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args([
                "--exact",
                &name,
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(SERVER_VARIABLE, PRIVATE)
            .stdout(Stdio::piped());
        if stay {
            command.env(STAY, "1");
        }
        command
    }

    /// The server's pid and the cluster's directory, from the child's line.
    fn cluster_line(line: &str) -> Option<(i32, PathBuf)> {
        // After the harness's "test <name> ... " when it runs one test.
        let (pid, dir) = line.split_once("CLUSTER ")?.1.split_once(' ')?;
        Some((pid.parse().ok()?, PathBuf::from(dir)))
    }

    /// Waits at most `patience` for the server `server` to end and `dir` to
    /// go.
    fn assert_gone(server: i32, dir: &Path, patience: Duration) {
        // SAFETY: signal 0 only asks whether the process exists.
        let running = || unsafe { libc::kill(server, 0) == 0 };
        let deadline = Instant::now() + patience;
        while (running() || dir.exists()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!running(), "its server {server} still runs");
        assert!(!dir.exists(), "{} is left", dir.display());
    }

    #[test]
    fn a_run_on_a_private_cluster_leaves_nothing_running() {
        let output = child(false).output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "the child failed: {stdout}");
        let (server, dir) = stdout
            .lines()
            .find_map(cluster_line)
            .unwrap_or_else(|| panic!("the child did not say where its cluster was: {stdout}"));
        // Removed before the process ended; its server stopped (`pg_ctl -w`
        // returns once the server removed its pid file, a moment before
        // its last process is gone).
        assert!(!dir.exists(), "{} is left", dir.display());
        assert_gone(server, &dir, Duration::from_secs(10));
    }

    #[test]
    fn a_killed_run_s_private_cluster_is_stopped_and_removed() {
        let mut child = child(true).spawn().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let found = lines.map_while(Result::ok).find_map(|line| cluster_line(&line));
        child.kill().unwrap();
        child.wait().unwrap();
        let (server, dir) = found.expect("the child said where its cluster was");
        // The watchdog's work: it takes a moment after the kill.
        assert_gone(server, &dir, Duration::from_secs(60));
    }
}
