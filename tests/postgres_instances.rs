//! Several `inflight serve` processes on one PostgreSQL database behave as
//! one ledger: caps hold across them (also against a transaction held
//! open mid-decision), first come first served, each leaked record is
//! reaped once however many reapers run, concurrent begins with one
//! idempotency key make one record, a waiter on one is admitted once
//! a settle on the other frees its slot, an owner's lease works across
//! them, a ranked lane serves interactive and batch work in one order
//! whichever server asks, a provider's Retry-After settled on one holds
//! the other's waiters until it ends, a lane's cap holds for calls proxied
//! through both servers to one provider, and a server whose database goes
//! away answers 503 `unavailable` within seconds and recovers by itself.
//!
//! The database is a fresh schema on the test server
//! (`INFLIGHT_TEST_POSTGRES_URL`, by default postgres@127.0.0.1:5432).
//! Polling real processes is unavoidable here; every wait is bounded.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{Launch, Server};
use inflight_pg_testing::TestDatabase;
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// Short classes and a reaper that never runs on its own, so that the
/// tests' own reap calls are the only reapers.
const CONFIG: &str = r#"
[reap]
factor = 1
interval = "1h"
[classes.fast]
deadline = 100
[classes.embedding]
deadline = "5m"
[lanes."capped::ollama"]
cap = 2
[lanes."single::ollama"]
cap = 1
[lanes."held::ollama"]
cap = 2
[lanes."ranked::ollama"]
cap = 1
max_overtakes = 1
[lanes."cooling::ollama"]
cap = 1
[lanes."metered::openai"]
tokens_per_minute = 1000
[providers.gemini]
tokens_per_minute = 1500
"#;

/// A server on `store`, configured by `config`, on a free port.
async fn start(store: &str, config: &std::path::Path) -> Server {
    Server::start(Launch {
        store: Some(store.to_owned()),
        args: vec![
            "--listen".to_owned(),
            "127.0.0.1:0".to_owned(),
            "--config".to_owned(),
            config.display().to_string(),
        ],
        ..Launch::default()
    })
    .await
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

fn config_file() -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), CONFIG).unwrap();
    file
}

/// Two servers on one fresh database.
async fn two_servers(database: &TestDatabase, config: &tempfile::NamedTempFile) -> Arc<[Server; 2]> {
    let url = database.store_url("");
    let a = start(&url, config.path()).await;
    let b = start(&url, config.path()).await;
    Arc::new([a, b])
}

/// The executing and waiting counts of `lane`, from a snapshot.
async fn lane_counts(server: &Server, lane: &str) -> (i64, i64) {
    let (status, snapshot) = server.get("/v1/snapshot").await;
    assert_eq!(status, 200, "{snapshot}");
    let row = &snapshot["nativeAdmission"][lane];
    assert!(row.is_object(), "no lane {lane} in {snapshot}");
    (
        row["executing"].as_i64().unwrap(),
        row["waiting"].as_i64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cap_holds_across_two_servers_under_concurrent_starts() {
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    for round in 0..3 {
        let mut starts = JoinSet::new();
        for i in 0..6 {
            let servers = Arc::clone(&servers);
            starts.spawn(async move {
                let now = now_ms();
                let body = json!({"service": "capped", "provider": "ollama", "class": "embedding",
                                  "enqueuedAt": now, "startedAt": now});
                servers[i % 2].post("/v1/activities", body).await
            });
        }
        let mut admitted = Vec::new();
        let mut refused = 0;
        while let Some(answer) = starts.join_next().await {
            let (status, body) = answer.unwrap();
            match status {
                201 => admitted.push(body["activityId"].as_str().unwrap().to_owned()),
                429 => refused += 1,
                other => panic!("unexpected {other}: {body}"),
            }
        }
        assert_eq!((admitted.len(), refused), (2, 4), "round {round}");
        assert_eq!(lane_counts(&servers[1], "capped::ollama").await, (2, 0));
        // Settled on the other server than the one that began it, maybe.
        for (i, id) in admitted.iter().enumerate() {
            let (status, body) = servers[i % 2]
                .post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
                .await;
            assert_eq!(status, 200, "{body}");
        }
    }
}

/// Two servers on one database never exceed a lane's token budget, nor a
/// provider's shared by two lanes, under concurrent starts of calls
/// estimated at 100 tokens: exactly as many are admitted as fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn token_budgets_hold_across_two_servers_under_concurrent_starts() {
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    let mut starts = JoinSet::new();
    for i in 0..48 {
        let servers = Arc::clone(&servers);
        starts.spawn(async move {
            let now = now_ms();
            let (service, provider) = match i % 3 {
                0 => ("metered", "openai"),
                1 => ("chat", "gemini"),
                _ => ("search", "gemini"),
            };
            let body = json!({"service": service, "provider": provider, "class": "embedding",
                              "maxTokens": 100, "enqueuedAt": now, "startedAt": now});
            (provider, servers[i % 2].post("/v1/activities", body).await)
        });
    }
    let (mut openai, mut gemini) = (0, 0);
    while let Some(answer) = starts.join_next().await {
        let (provider, (status, body)) = answer.unwrap();
        match (status, body["error"]["code"].as_str()) {
            (201, _) if provider == "openai" => openai += 1,
            (201, _) => gemini += 1,
            (429, Some("budget_exhausted")) => {}
            other => panic!("unexpected {other:?}: {body}"),
        }
    }
    assert_eq!((openai, gemini), (10, 15), "1000 / 100 and 1500 / 100");
    let (status, snapshot) = servers[1].get("/v1/snapshot").await;
    assert_eq!(status, 200);
    let reserved = |lane: &str| {
        snapshot["nativeAdmission"][lane]["tokensReserved"]
            .as_i64()
            .unwrap_or(0)
    };
    assert_eq!(reserved("metered::openai"), 1_000, "{snapshot}");
    assert_eq!(
        reserved("chat::gemini") + reserved("search::gemini"),
        1_500,
        "{snapshot}"
    );
}

/// A provider that answers every POST after 40 ms, counting how many it
/// answers at once (now, most): its address and the counts.
async fn slow_provider() -> (String, Arc<[std::sync::atomic::AtomicUsize; 2]>) {
    use std::sync::atomic::Ordering::SeqCst;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counts: Arc<[std::sync::atomic::AtomicUsize; 2]> = Arc::default();
    let shared = Arc::clone(&counts);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let counts = Arc::clone(&shared);
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                // One request after another on the kept-alive connection.
                loop {
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = value.trim().parse().unwrap();
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    stream.read_exact(&mut body).await.unwrap();
                    let now = counts[0].fetch_add(1, SeqCst) + 1;
                    counts[1].fetch_max(now, SeqCst);
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    counts[0].fetch_sub(1, SeqCst);
                    let answer = r#"{"model":"nomic-embed-text","embeddings":[[0.1]],"prompt_eval_count":3}"#;
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        answer.len()
                    );
                    let reply = format!("{head}{answer}");
                    if stream.get_mut().write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), counts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lanes_cap_holds_for_calls_proxied_through_two_servers() {
    let database = TestDatabase::new();
    let (upstream, counts) = slow_provider().await;
    let config = tempfile::NamedTempFile::new().unwrap();
    let proxy =
        format!("[proxy.ollama]\nupstream = \"{upstream}\"\nprovider = \"ollama\"\nservice = \"capped\"\n");
    std::fs::write(config.path(), format!("{CONFIG}{proxy}")).unwrap();
    let servers = two_servers(&database, &config).await;
    let mut calls = JoinSet::new();
    for i in 0..20 {
        let servers = Arc::clone(&servers);
        calls.spawn(async move {
            let answer = servers[i % 2]
                .request(reqwest::Method::POST, "/proxy/ollama/api/embed")
                .json(&json!({"model": "nomic-embed-text", "input": "hello"}))
                .send()
                .await
                .unwrap();
            (answer.status().as_u16(), answer.text().await.unwrap())
        });
    }
    while let Some(answer) = calls.join_next().await {
        let (status, body) = answer.unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("prompt_eval_count"), "{body}");
    }
    let most = counts[1].load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        most, 2,
        "the provider never saw more than the lane's cap of 2, across both servers"
    );
    let (status, snapshot) = servers[0].get("/v1/snapshot").await;
    assert_eq!(status, 200);
    assert_eq!(snapshot["totalSucceeded"], 20, "{snapshot}");
    assert_eq!(lane_counts(&servers[1], "capped::ollama").await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_begins_with_one_idempotency_key_on_two_servers_make_one_record() {
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    for round in 0..3 {
        let key = format!("retry-{round}");
        let body = json!({"service": "keyed", "provider": "ollama", "class": "embedding"});
        let mut begins = JoinSet::new();
        for i in 0..8 {
            let (servers, key, body) = (Arc::clone(&servers), key.clone(), body.clone());
            begins.spawn(async move {
                let answer = servers[i % 2]
                    .request(reqwest::Method::POST, "/v1/activities")
                    .header("Idempotency-Key", key)
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = answer.status().as_u16();
                let replayed = answer.headers().contains_key("idempotent-replayed");
                let record: serde_json::Value = answer.json().await.unwrap();
                (
                    status,
                    replayed,
                    record["activityId"].as_str().unwrap().to_owned(),
                )
            });
        }
        let mut answers = Vec::new();
        while let Some(answer) = begins.join_next().await {
            answers.push(answer.unwrap());
        }
        let created: Vec<_> = answers.iter().filter(|(status, ..)| *status == 201).collect();
        assert_eq!(created.len(), 1, "round {round}: {answers:?}");
        assert!(
            answers.iter().all(|(status, replayed, id)| *id == created[0].2
                && (*status == 201 || (*status == 200 && *replayed))),
            "round {round}: {answers:?}"
        );
    }
    let (_, snapshot) = servers[1].get("/v1/snapshot").await;
    assert_eq!(snapshot["totalActivities"], 3, "one record a key: {snapshot}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_starts_are_admitted_first_come_first_served_across_servers() {
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    let body = json!({"service": "capped", "provider": "ollama", "class": "embedding"});
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(servers[i % 2].begin(body.clone()).await);
    }
    let mut starts = JoinSet::new();
    for (i, id) in ids.iter().enumerate() {
        let (servers, id) = (Arc::clone(&servers), id.clone());
        starts.spawn(async move {
            let (status, _) = servers[(i + 1) % 2]
                .post(&format!("/v1/activities/{id}/start"), json!({}))
                .await;
            (id, status)
        });
    }
    let mut admitted = Vec::new();
    while let Some(answer) = starts.join_next().await {
        let (id, status) = answer.unwrap();
        assert!(status == 200 || status == 429, "{status}");
        if status == 200 {
            admitted.push(id);
        }
    }
    admitted.sort();
    let mut first_two = ids[..2].to_vec();
    first_two.sort();
    assert_eq!(admitted, first_two, "the two enqueued first, and only they");
}

/// neomjs/neo#17093's order with one overtake, its records begun and
/// started through both servers: whichever server asks, the lane's run of
/// overtakes is the database's, so the order is interactive-1, batch-1,
/// interactive-2, batch-2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ranked_lane_serves_one_order_across_servers() {
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    let now = now_ms();
    let blocker = servers[0]
        .begin(
            json!({"service": "ranked", "provider": "ollama", "class": "embedding",
                      "enqueuedAt": now, "startedAt": now}),
        )
        .await;
    let mut ids = Vec::new();
    for (i, priority) in ["batch", "batch", "interactive", "interactive"]
        .into_iter()
        .enumerate()
    {
        let body = json!({"service": "ranked", "provider": "ollama", "class": "embedding",
                          "priority": priority, "enqueuedAt": now + 1 + i as i64});
        ids.push(servers[i % 2].begin(body).await);
    }
    servers[1]
        .post(
            &format!("/v1/activities/{blocker}/settle"),
            json!({"success": true}),
        )
        .await;
    let mut order = Vec::new();
    for round in 0..ids.len() {
        let mut admitted = Vec::new();
        for (at, id) in ids.iter().enumerate().rev() {
            if order.contains(&at) {
                continue;
            }
            let (status, answer) = servers[(round + at) % 2]
                .post(&format!("/v1/activities/{id}/start"), json!({}))
                .await;
            match status {
                200 => admitted.push(at),
                429 => assert_eq!(answer["error"]["code"], "lane_full", "{answer}"),
                _ => panic!("{status}: {answer}"),
            }
        }
        assert_eq!(admitted.len(), 1, "one slot, one admitted: {admitted:?}");
        order.push(admitted[0]);
        servers[round % 2]
            .post(
                &format!("/v1/activities/{}/settle", ids[admitted[0]]),
                json!({"success": true}),
            )
            .await;
    }
    assert_eq!(order, [2, 0, 3, 1], "I1, B1, I2, B2");
}

/// A provider's Retry-After settled through one server cools the lane for
/// the other: its starts are refused `lane_cooling` with the seconds left,
/// and its waiters, held through the cooldown, are admitted in line order
/// once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cooldown_on_one_server_holds_the_others_waiters_then_serves_them_in_order() {
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    let body = json!({"service": "cooling", "provider": "ollama", "class": "embedding"});
    let refused = servers[0].begin(body.clone()).await;
    let (status, answer) = servers[0]
        .post(&format!("/v1/activities/{refused}/start"), json!({}))
        .await;
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = servers[0]
        .post(
            &format!("/v1/activities/{refused}/settle"),
            json!({"success": false, "failureStage": "provider", "retryAfterMs": 2000}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let settled_at = Instant::now();
    let (status, snapshot) = servers[1].get("/v1/snapshot").await;
    assert_eq!(status, 200);
    assert!(
        snapshot["nativeAdmission"]["cooling::ollama"]["coolingUntil"].is_string(),
        "{snapshot}"
    );
    // Two waiters on the other server, in line order.
    let mut ids = Vec::new();
    for _ in 0..2 {
        ids.push(servers[1].begin(body.clone()).await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, answer) = servers[1]
        .post(&format!("/v1/activities/{}/start", ids[0]), json!({}))
        .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (429, Some("lane_cooling")),
        "{answer}"
    );
    let waiters: Vec<_> = ids
        .iter()
        .rev()
        .map(|id| {
            let (servers, id) = (Arc::clone(&servers), id.clone());
            tokio::spawn(async move {
                let (status, answer) = servers[1]
                    .post(&format!("/v1/activities/{id}/start?wait=20s"), json!({}))
                    .await;
                assert_eq!(status, 200, "{answer}");
                let admitted_at = Instant::now();
                servers[1]
                    .post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
                    .await;
                (id, admitted_at)
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for waiter in waiters {
        admitted.push(waiter.await.unwrap());
    }
    admitted.sort_by_key(|(_, at)| *at);
    let first = admitted[0].1.saturating_duration_since(settled_at);
    assert!(
        first >= Duration::from_millis(1_500),
        "admitted {first:?} after the refusal, inside its cooldown"
    );
    let order: Vec<_> = admitted.into_iter().map(|(id, _)| id).collect();
    assert_eq!(order, ids, "line order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forty_leaked_records_are_reaped_once_by_four_concurrent_reapers() {
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    for i in 0..40 {
        let now = now_ms();
        let body = json!({"service": "leaky", "provider": "ollama", "class": "fast",
                          "enqueuedAt": now, "startedAt": now});
        servers[i % 2].begin(body).await;
    }
    // Past their bound (100 ms, factor 1) by the database's clock.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut reapers = JoinSet::new();
    for i in 0..4 {
        let servers = Arc::clone(&servers);
        reapers.spawn(async move { servers[i % 2].post("/v1/reap", json!({})).await });
    }
    let mut reaped = 0;
    while let Some(answer) = reapers.join_next().await {
        let (status, counts) = answer.unwrap();
        assert_eq!(status, 200, "{counts}");
        reaped += counts["unsettled"].as_i64().unwrap() + counts["abandoned"].as_i64().unwrap();
    }
    assert_eq!(reaped, 40, "each record reaped exactly once");
    let (_, again) = servers[0].post("/v1/reap", json!({})).await;
    assert_eq!(again, json!({"abandoned": 0, "unsettled": 0}));
    let (_, snapshot) = servers[1].get("/v1/snapshot").await;
    let counted: i64 = snapshot["aggregates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row["reaped"]["unsettled"].as_i64().unwrap_or(0))
        .sum();
    assert_eq!(counted, 40, "the counters agree: {snapshot}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_on_one_server_is_admitted_after_a_settle_on_the_other() {
    // Admitted within its wait, once the slot is freed elsewhere. That the
    // notification, not the re-check, wakes it is shown without a clock in
    // crates/inflight/tests/postgres.rs
    // (a_slot_freed_by_one_instance_wakes_the_watchers_of_another).
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    let mut latencies = Vec::new();
    for _ in 0..5 {
        let now = now_ms();
        let holder = servers[0]
            .begin(
                json!({"service": "single", "provider": "ollama", "class": "embedding",
                          "enqueuedAt": now, "startedAt": now}),
            )
            .await;
        let waiter = servers[1]
            .begin(json!({"service": "single", "provider": "ollama", "class": "embedding"}))
            .await;
        let waiting = {
            let servers = Arc::clone(&servers);
            tokio::spawn(async move {
                let answer = servers[1]
                    .post(&format!("/v1/activities/{waiter}/start?wait=20s"), json!({}))
                    .await;
                (answer, Instant::now())
            })
        };
        // Let it wait in line first.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "admitted while the slot was held");
        let settled = servers[0]
            .post(
                &format!("/v1/activities/{holder}/settle"),
                json!({"success": true}),
            )
            .await;
        let settled_at = Instant::now();
        assert_eq!(settled.0, 200, "{}", settled.1);
        let ((status, record), admitted_at) = waiting.await.unwrap();
        assert_eq!(status, 200, "{record}");
        latencies.push(admitted_at.saturating_duration_since(settled_at));
        let id = record["activityId"].as_str().unwrap();
        servers[1]
            .post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
            .await;
    }
    eprintln!("wake-up latencies after the settle: {latencies:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_held_open_mid_decision_cannot_push_a_lane_over_its_cap() {
    // The pgqueuer reproduction: an instance has granted a slot and not yet
    // committed when others decide. Counting alone would see a free slot
    // twice; the lane lock makes them wait, then count it.
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    // The lane's row exists once a decision has been taken on it.
    let now = now_ms();
    let first = servers[0]
        .begin(
            json!({"service": "held", "provider": "ollama", "class": "embedding",
                      "enqueuedAt": now, "startedAt": now}),
        )
        .await;
    let (locked, lock_taken) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let held = {
        let mut client = database.client();
        std::thread::spawn(move || {
            let now = now_ms();
            let pid: i32 = client.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
            let mut tx = client.transaction().unwrap();
            tx.batch_execute("SELECT 1 FROM lanes WHERE service = 'held' AND provider = 'ollama' FOR UPDATE")
                .unwrap();
            tx.batch_execute(&format!(
                "INSERT INTO activities (activity_id, service, provider, class, operation_stage, model, \
                 priority, admission, state, enqueued_at, started_at, deadline_ms, reapable_at) \
                 VALUES ('00000000-0000-4000-8000-000000000001', 'held', 'ollama', 'embedding', \
                 'unknown', 'unknown', 'unknown', 'queued', 'executing', {now}, {now}, 300000, {})",
                now + 300_000
            ))
            .unwrap();
            locked.send(pid).unwrap();
            released.recv().unwrap();
            tx.commit().unwrap();
        })
    };
    let holder = lock_taken.recv().unwrap();
    let mut starts = JoinSet::new();
    for i in 0..3 {
        let servers = Arc::clone(&servers);
        starts.spawn(async move {
            let now = now_ms();
            let body = json!({"service": "held", "provider": "ollama", "class": "embedding",
                              "enqueuedAt": now, "startedAt": now});
            servers[i % 2].post("/v1/activities", body).await
        });
    }
    // They wait on the lane lock, not on a count: the starts' backends come
    // to wait for the holder, and no start is answered meanwhile.
    let mut watcher = database.client();
    tokio::task::spawn_blocking(move || {
        // Blocked by the holder, or queued behind one that is.
        let blocked = "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) \
                       OR EXISTS (SELECT 1 FROM unnest(pg_blocking_pids(pid)) AS ahead \
                       WHERE $1 = ANY(pg_blocking_pids(ahead)))";
        let give_up = Instant::now() + Duration::from_secs(30);
        while watcher.query_one(blocked, &[&holder]).unwrap().get::<_, i64>(0) < 2 {
            assert!(
                Instant::now() < give_up,
                "the starts never waited for the lane lock"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    })
    .await
    .unwrap();
    assert!(
        starts.try_join_next().is_none(),
        "a start was answered while the lane lock was held"
    );
    release.send(()).unwrap();
    tokio::task::spawn_blocking(move || held.join().unwrap())
        .await
        .unwrap();
    let mut statuses = Vec::new();
    while let Some(answer) = starts.join_next().await {
        statuses.push(answer.unwrap().0);
    }
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        [429, 429, 429],
        "the held slot and {first} fill the cap of 2"
    );
    assert_eq!(lane_counts(&servers[0], "held::ollama").await, (2, 0));
}

/// A TCP proxy in front of the database that can be cut and restored.
struct Proxy {
    port: u16,
    upstream: String,
    running: Option<tokio::task::JoinHandle<()>>,
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut proxy = Self {
            port,
            upstream,
            running: None,
        };
        proxy.serve(listener);
        proxy
    }

    fn serve(&mut self, listener: TcpListener) {
        let upstream = self.upstream.clone();
        self.running = Some(tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                let upstream = upstream.clone();
                connections.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        }));
    }

    /// Closes every connection and refuses new ones.
    fn cut(&mut self) {
        if let Some(running) = self.running.take() {
            running.abort();
        }
    }

    async fn restore(&mut self) {
        let listener = TcpListener::bind(("127.0.0.1", self.port)).await.unwrap();
        self.serve(listener);
    }
}

/// `url` with its host and port replaced by `authority`.
fn via(url: &str, authority: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (server, path) = rest.split_once('/').unwrap();
    let user = server
        .rsplit_once('@')
        .map(|(user, _)| format!("{user}@"))
        .unwrap_or_default();
    format!("{scheme}://{user}{authority}/{path}")
}

/// The database's host and port.
fn upstream_of(url: &str) -> String {
    let rest = url.split_once("://").unwrap().1;
    let server = rest.split('/').next().unwrap();
    let host = server.rsplit_once('@').map_or(server, |(_, host)| host);
    if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:5432")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_whose_database_goes_away_answers_503_and_recovers_by_itself() {
    let database = TestDatabase::new();
    let config = config_file();
    let url = database.store_url("");
    let mut proxy = Proxy::start(upstream_of(&url)).await;
    let server = start(&via(&url, &format!("127.0.0.1:{}", proxy.port)), config.path()).await;
    let body = json!({"service": "restart", "provider": "ollama", "class": "embedding"});
    let mut acknowledged = Vec::new();
    for _ in 0..5 {
        acknowledged.push(server.begin(body.clone()).await);
    }

    proxy.cut();
    for _ in 0..3 {
        let asked = Instant::now();
        let (status, answer) = server.post("/v1/activities", body.clone()).await;
        let took = asked.elapsed();
        assert_eq!(status, 503, "{answer}");
        assert_eq!(answer["error"]["code"], "unavailable", "{answer}");
        assert!(took <= Duration::from_secs(5), "answered after {took:?}");
    }

    proxy.restore().await;
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, answer) = server.post("/v1/activities", body.clone()).await;
        if status == 201 {
            acknowledged.push(answer["activityId"].as_str().unwrap().to_owned());
            break;
        }
        assert_eq!(status, 503, "{answer}");
        assert!(Instant::now() < give_up, "not recovered within 20 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for id in &acknowledged {
        let (status, record) = server.get(&format!("/v1/activities/{id}")).await;
        assert_eq!(status, 200, "acknowledged {id} is kept: {record}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_owner_registered_on_one_server_is_renewed_and_lost_on_the_other() {
    let database = TestDatabase::new();
    let config = config_file();
    let servers = two_servers(&database, &config).await;
    let (status, owner) = servers[0]
        .post("/v1/owners", json!({"name": "worker-a", "ttlMs": 1500}))
        .await;
    assert_eq!(status, 201, "{owner}");
    let owner_id = owner["ownerId"].as_str().unwrap().to_owned();
    let body = json!({"service": "owned", "provider": "ollama", "class": "embedding", "ownerId": owner_id});
    let record = servers[1].begin(body).await;
    // Renewed on the other server than the one it registered on: alive.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (status, renewed) = servers[1]
            .post(&format!("/v1/owners/{owner_id}/renew"), json!({}))
            .await;
        assert_eq!(status, 200, "{renewed}");
    }
    let (_, seen) = servers[0].get(&format!("/v1/activities/{record}")).await;
    assert_eq!(seen["state"], "waiting", "a renewed owner's record lives: {seen}");
    // No more renewals: lost past its lease, by the database's clock, and
    // its record reaped as owner-lost on whichever server looks.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let (_, seen) = servers[0].get(&format!("/v1/activities/{record}")).await;
    assert_eq!(seen["state"], "reaped", "{seen}");
    assert_eq!(seen["reapReason"], "owner-lost", "{seen}");
    let (status, refused) = servers[1]
        .post(&format!("/v1/owners/{owner_id}/renew"), json!({}))
        .await;
    assert_eq!(status, 409, "a lost owner cannot renew: {refused}");
}
