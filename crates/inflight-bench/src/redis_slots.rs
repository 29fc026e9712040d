//! `redis_slots`: lifecycles per second through the real HTTP server (the
//! two-request spelling of `http_lifecycle_two_requests`) against what a
//! fleet puts up instead of inflight: a slot registry in Redis. Its
//! acquire is one Lua script (EVALSHA) on a sorted set per lane that drops
//! the expired members, then adds the call with its deadline as the score
//! unless the set holds `cap` already; its release is one `ZREM`. The same
//! 16 clients on each side, each one lifecycle at a time, each its own
//! connection; windows of the two sides alternate.
//!
//! Two more sides are reported beside the ratio, in the same rotation: the
//! same server on the memory store, which keeps no more than Redis does;
//! and the HTTP floor, axum answering the same two requests with constant
//! bodies and keeping nothing. No HTTP service on this machine does more
//! lifecycles than the floor, so its ratio to Redis bounds what any HTTP
//! ledger could reach.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use inflight::store::Synchronous;
use inflight::{Ledger, LedgerConfig};
use redis::aio::MultiplexedConnection;
use redis::{AsyncCommands, AsyncConnectionConfig, Script};
use serde_json::json;

use crate::http_lifecycle::{clients, drive, Requests, Server, HTTP_CLIENTS};
use crate::report::{median, round, Case, Pairs, Target};
use crate::sqlite_env::{multi_thread, now_ms, sqlite_ledger_at, TempDir};
use crate::Plan;

/// The Redis server, unless `INFLIGHT_BENCH_REDIS_URL` names another.
const DEFAULT_URL: &str = "redis://127.0.0.1:6379/";
const URL_VARIABLE: &str = "INFLIGHT_BENCH_REDIS_URL";

/// A cap the clients never reach: the case measures what a slot costs, not
/// refusals (a refusal fails the run).
const CAP: u64 = 1_000_000;

/// A slot's deadline, in ms: the `embedding` class's default deadline on
/// our side (5 minutes), so nothing expires during a run.
const DEADLINE_MS: i64 = 5 * 60 * 1000;

/// The acquire. `KEYS[1]`: the lane's sorted set; `ARGV`: now (ms), the
/// deadline (ms), the cap, the call's id. 1 when the slot is taken, 0 when
/// the lane is full.
const ACQUIRE: &str = r"
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[4])
  return 1
end
return 0
";

/// How long a connection may take, and then any command.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// `count` connections to `url`, each its own TCP connection with
/// `TCP_NODELAY`, as our HTTP clients have.
async fn connections(url: &str, count: usize) -> Result<Vec<MultiplexedConnection>> {
    let unreachable = || format!("no Redis answers at {url} (set {URL_VARIABLE} to name another server)");
    let client = redis::Client::open(url).with_context(unreachable)?;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(CONNECT_TIMEOUT)
        .set_response_timeout(RESPONSE_TIMEOUT)
        .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
    let mut connections = Vec::with_capacity(count);
    for _ in 0..count {
        let connection = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .with_context(unreachable)?;
        connections.push(connection);
    }
    Ok(connections)
}

/// One slot's lifecycle the Redis way: the acquire script, then the
/// release.
async fn slot_lifecycle(connection: &mut MultiplexedConnection, script: &Script, key: &str) -> Result<()> {
    let id = uuid::Uuid::new_v4().to_string();
    let granted: i64 = script
        .key(key)
        .arg(now_ms())
        .arg(DEADLINE_MS)
        .arg(CAP)
        .arg(&id)
        .invoke_async(connection)
        .await?;
    if granted != 1 {
        bail!("the acquire script refused a slot under a cap of {CAP}: the baseline must never be refused");
    }
    let released: i64 = connection.zrem(key, &id).await?;
    if released != 1 {
        bail!("the release of {id} removed {released} members of {key}");
    }
    Ok(())
}

/// `connections` doing slot lifecycles at once for `window`: lifecycles a
/// second. The connections come back for the next call.
async fn baseline_rate(
    connections: &mut Vec<MultiplexedConnection>,
    script: &Arc<Script>,
    key: &Arc<str>,
    window: Duration,
) -> Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let until = started + window;
    let mut tasks = Vec::new();
    for mut connection in connections.drain(..) {
        let (script, key, done) = (Arc::clone(script), Arc::clone(key), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                slot_lifecycle(&mut connection, &script, &key).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(connection)
        }));
    }
    for task in tasks {
        connections.push(task.await??);
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// The HTTP floor's server: the begin's and the settle's paths, each
/// answered with a constant body once the request's body is read.
struct Floor {
    base: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Floor {
    async fn start() -> Result<Self> {
        use axum::routing::post;
        const BEGUN: &str = r#"{"activityId":"01900000-0000-7000-8000-000000000000","state":"executing"}"#;
        const SETTLED: &str = r#"{"state":"succeeded"}"#;
        let json = |body: &'static str| ([(axum::http::header::CONTENT_TYPE, "application/json")], body);
        let app = axum::Router::new()
            .route(
                "/v1/activities",
                post(move |_: axum::body::Bytes| async move { json(BEGUN) }),
            )
            .route(
                "/v1/activities/{id}/settle",
                post(move |_: axum::body::Bytes| async move { json(SETTLED) }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        Ok(Self { base, stop, task })
    }

    async fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        self.task.await??;
        Ok(())
    }
}

pub(crate) fn redis_slots(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let url = std::env::var(URL_VARIABLE).unwrap_or_else(|_| DEFAULT_URL.to_owned());
    let runtime = multi_thread()?;
    let tmp = TempDir::new(dir, "redis-slots")?;
    let ledger = sqlite_ledger_at(&tmp.file("ours.db"), Synchronous::Normal)?;
    // A key of this run's own, deleted at the end.
    let key: Arc<str> = format!(
        "inflight-bench:{}:{}:slots:knowledge-base::ollama",
        std::process::id(),
        now_ms()
    )
    .into();
    let script = Arc::new(Script::new(ACQUIRE));
    let memory = Ledger::builder(LedgerConfig::default())
        .store_url("memory:")
        .build()?;
    let (pairs, references) = runtime.block_on(async {
        let mut connections = connections(&url, HTTP_CLIENTS + 1).await?;
        // One more, for the clean-up: the clients' may be lost with a
        // failed task.
        let mut admin = connections.pop().expect("a connection");
        let measured = async {
            let server = Server::start(ledger).await?;
            let mut ours = clients(&server.base, HTTP_CLIENTS).await?;
            // Reported beside the ratio, in the same rotation: the same
            // server on the memory store, and the HTTP floor.
            let memory_server = Server::start(memory).await?;
            let floor = Floor::start().await?;
            let mut references = [
                (clients(&memory_server.base, HTTP_CLIENTS).await?, Vec::new()),
                (clients(&floor.base, HTTP_CLIENTS).await?, Vec::new()),
            ];
            // Warm-up: the script's load, the servers' caches.
            let warm = plan.redis_window / 2;
            baseline_rate(&mut connections, &script, &key, warm).await?;
            for clients in std::iter::once(&mut ours).chain(references.iter_mut().map(|(c, _)| c)) {
                drive(clients, Requests::Two, warm, None).await?;
            }
            let rate = |(_, lifecycles, elapsed): (Vec<f64>, u64, Duration)| {
                lifecycles as f64 / elapsed.as_secs_f64()
            };
            let mut pairs = Pairs::default();
            for _ in 0..plan.redis_pairs {
                let b = baseline_rate(&mut connections, &script, &key, plan.redis_window).await?;
                let o = rate(drive(&mut ours, Requests::Two, plan.redis_window, None).await?);
                pairs.push(b, o);
                for (clients, rates) in &mut references {
                    let r = rate(drive(clients, Requests::Two, plan.redis_window, None).await?);
                    rates.push((b, o, r));
                }
            }
            let [(memory_clients, memory_rates), (floor_clients, floor_rates)] = references;
            drop((ours, memory_clients, floor_clients));
            server.stop().await?;
            memory_server.stop().await?;
            floor.stop().await?;
            Ok::<_, anyhow::Error>((pairs, [memory_rates, floor_rates]))
        }
        .await;
        // The key goes whether or not the measurement went through.
        let deleted: redis::RedisResult<()> = admin.del(&*key).await;
        let measured = measured?;
        deleted.with_context(|| format!("delete {key} on {url}"))?;
        Ok::<_, anyhow::Error>(measured)
    })?;
    // Each reference beside each pair: its rate, its ratio to Redis, and
    // ours to it.
    let [memory, floor] = references.map(|rates| {
        let rate = median(rates.iter().map(|&(_, _, r)| r).collect());
        let of_redis = median(rates.iter().map(|&(b, _, r)| r / b).collect());
        let ours_of = median(rates.iter().map(|&(_, o, r)| o / r).collect());
        (rate, of_redis, ours_of)
    });
    let (memory_rate, memory_ratio, _) = memory;
    let (floor_rate, floor_ratio, ours_of_floor) = floor;
    eprintln!(
        "  redis_slots: the same server on the memory store median {memory_rate:.0}/s, {memory_ratio:.2}x Redis; \
         the HTTP floor (axum, constant answers) median {floor_rate:.0}/s, {floor_ratio:.2}x Redis; ours \
         {ours_of_floor:.2}x the floor"
    );
    Ok(vec![pairs.case(
        "redis_slots".to_owned(),
        "lifecycles/s",
        Target::AtLeast(0.5),
        plan.redis_window,
        &format!(
            "{HTTP_CLIENTS} clients, each one lifecycle at a time on a connection of its own, over loopback, \
             sharing the machine with the server and Redis; ours: the HTTP server, SQLite synchronous=normal, \
             begin with ?start=now&wait=5s then settle; baseline: Redis at {url}, EVALSHA of a script pruning \
             expired members (ZREMRANGEBYSCORE), then ZCARD < cap and ZADD with the deadline as score, then \
             ZREM (cap {CAP}, never reached; the slot lives in memory, nothing is recorded); beside it, the same \
             server on the memory store {memory_rate:.0}/s ({memory_ratio:.2}x Redis) and the HTTP floor (axum \
             answering both requests with constant bodies) {floor_rate:.0}/s ({floor_ratio:.2}x Redis; ours \
             {ours_of_floor:.2}x it)"
        ),
        serde_json::Map::from_iter([
            ("clients".to_owned(), json!(HTTP_CLIENTS)),
            ("synchronous".to_owned(), json!("normal")),
            ("memory_store".to_owned(), json!(round(memory_rate))),
            ("memory_store_ratio".to_owned(), json!(round(memory_ratio))),
            ("http_floor".to_owned(), json!(round(floor_rate))),
            ("http_floor_ratio".to_owned(), json!(round(floor_ratio))),
            ("ours_of_http_floor".to_owned(), json!(round(ours_of_floor))),
        ]),
    )])
}
