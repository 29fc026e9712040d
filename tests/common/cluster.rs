//! A private PostgreSQL cluster for the tests that must stop, crash or
//! reconfigure the database, which the machine's shared server must never
//! be: `initdb` into a temporary directory, a free port, stopped and removed
//! when dropped (also when the test fails).

use std::path::{Path, PathBuf};

/// The directory of PostgreSQL's server programs (`initdb`, `pg_ctl`):
/// `pg_config --bindir`'s, or the newest of Debian's
/// `/usr/lib/postgresql/<version>/bin`.
pub fn server_programs() -> PathBuf {
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
pub fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective user.
    std::fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0)
}

/// A private PostgreSQL cluster, stopped and removed when dropped.
pub struct Cluster {
    bin: PathBuf,
    pub data: PathBuf,
    pub port: u16,
    /// As root, its programs run as the `postgres` user.
    pub as_postgres: bool,
    // Last: removed after the cluster stopped.
    pub dir: tempfile::TempDir,
}

impl Cluster {
    /// `initdb`, then a start on a free port.
    pub async fn start() -> Self {
        let cluster = Self::init("").await;
        cluster.up().await;
        cluster
    }

    /// `initdb` on a free port with `settings` added to its
    /// `postgresql.conf`; not started.
    pub async fn init(settings: &str) -> Self {
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
             max_connections = 50\nshared_buffers = 16MB\n{settings}\n",
            cluster.port,
            cluster.dir.path().display()
        );
        let conf = cluster.data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).unwrap();
        text.push_str(&settings);
        std::fs::write(&conf, text).unwrap();
        cluster
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// `program` of PostgreSQL's, as the user it must run as.
    pub fn command(&self, program: &str, args: &[&str]) -> std::process::Command {
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

    pub async fn run(&self, program: &str, args: &[&str]) {
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
    pub async fn up(&self) {
        let log = self.dir.path().join("postgres.log").display().to_string();
        let data = self.data.display().to_string();
        self.run("pg_ctl", &["-D", &data, "-l", &log, "-w", "-t", "60", "start"])
            .await;
    }

    /// Stops it: `fast` (clients cut, a clean shutdown) or `immediate`
    /// (every process quits at once, a crash: the next start recovers
    /// from the WAL).
    pub async fn down(&self, mode: &str) {
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
