//! A private PostgreSQL cluster for the tests that must stop, crash or
//! reconfigure the database, which the machine's shared server must never
//! be: `inflight-pg-testing`'s cluster ([`testing::cluster::Cluster`]) in a
//! temporary directory, with durable settings, its programs run without
//! blocking the runtime; stopped and removed when dropped (also when the
//! test fails).

use std::ops::Deref;

use inflight_pg_testing as testing;

/// A private PostgreSQL cluster, stopped and removed when dropped.
pub struct Cluster {
    cluster: testing::cluster::Cluster,
    // Last: removed after the cluster stopped.
    pub dir: tempfile::TempDir,
}

impl Deref for Cluster {
    type Target = testing::cluster::Cluster;

    fn deref(&self) -> &Self::Target {
        &self.cluster
    }
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
        let dir = tempfile::tempdir().unwrap();
        let cluster = testing::cluster::Cluster::new(dir.path()).unwrap_or_else(|err| panic!("{err}"));
        let cluster = Self { cluster, dir };
        cluster.run(cluster.initdb()).await;
        // What the crash tests check needs every commit on disk.
        let durable = format!(
            "fsync = on\nsynchronous_commit = on\nfull_page_writes = on\n\
             max_connections = 50\nshared_buffers = 16MB\n{settings}"
        );
        cluster.configure(&durable).unwrap_or_else(|err| panic!("{err}"));
        cluster
    }

    /// Runs `command`, one of the cluster's, to its end.
    pub async fn run(&self, command: std::process::Command) {
        let what = format!("{command:?}");
        let output = tokio::process::Command::from(command).output().await;
        self.check(&what, output).unwrap_or_else(|err| panic!("{err}"));
    }

    /// Starts it, and waits until it takes connections.
    pub async fn up(&self) {
        self.run(self.start()).await;
    }

    /// Stops it: `fast` (clients cut, a clean shutdown) or `immediate`
    /// (every process quits at once, a crash: the next start recovers
    /// from the WAL).
    pub async fn down(&self, mode: &str) {
        self.run(self.stop(mode)).await;
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Fails harmlessly when it is not running.
        let _ = self.stop("immediate").output();
    }
}
