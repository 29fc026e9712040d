//! Crashes under load on PostgreSQL: the server killed with SIGKILL and
//! restarted on the same database. After it: every acknowledged transition
//! is there, each record is counted once, and the records in flight end
//! reaped.
//!
//! The test runs on a fresh schema of the test server
//! (`INFLIGHT_TEST_POSTGRES_URL`, by default postgres@127.0.0.1:5432).

mod common;

use common::load::kill_9_under_load;
use inflight::store::postgres::testing::TestDatabase;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_work_survives_kill_9_under_load_on_postgres() {
    let database = TestDatabase::new();
    let figures = kill_9_under_load(&database.store_url("")).await;
    eprintln!("kill -9 under load (PostgreSQL): {figures}");
}
