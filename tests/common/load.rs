//! Lifecycles under load, and what must hold once a crash is over: every
//! transition acknowledged is there, each record is counted once, and the
//! records in flight end reaped or settled. The same clients and checks
//! serve a `kill -9` of the server (on each store) and a restart of
//! PostgreSQL under a running server.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::task::JoinHandle;

use super::{Launch, Server, PATIENCE};

/// Reaped 500 ms past a begin or a start (factor 1), looked for every
/// 100 ms: what a crash leaves in flight ends soon.
pub const SHORT_BOUNDS: &str =
    "[reap]\nfactor = 1\ninterval = \"100ms\"\n[classes.embedding]\ndeadline = \"500ms\"\n";

/// What the clients were told, per record.
#[derive(Default, Clone, Copy, Debug)]
pub struct Acknowledged {
    pub started: bool,
    pub settled: bool,
    /// The settle was answered as a late settle: the record had been
    /// reaped past its 500 ms bound first (a stall around a crash), so it
    /// stays `reaped`, its settle kept as evidence.
    pub late: bool,
}

/// How a client takes a call that got no success.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// It stops: the server is gone.
    Stop,
    /// It notes the failure, leaves that record where it is, and goes on
    /// with a new one: the server stays, its database comes and goes.
    Continue,
}

/// A call that got no success, as a client saw it.
#[derive(Clone, Debug)]
pub struct Failure {
    pub sent: Instant,
    pub took: Duration,
    /// None: no answer at all (refused, cut, or timed out).
    pub status: Option<u16>,
    /// The answer's `error.code`.
    pub code: Option<String>,
    pub retry_after: Option<String>,
}

impl Failure {
    /// A 503 `unavailable` with `Retry-After`, answered within `within`.
    pub fn is_prompt_unavailable(&self, within: Duration) -> bool {
        self.status == Some(503)
            && self.code.as_deref() == Some("unavailable")
            && self.retry_after.is_some()
            && self.took <= within
    }
}

/// Concurrent HTTP clients, each running lifecycles on one lane as fast
/// as it can: begin, start, settle, with some records left waiting or
/// executing on purpose, as a crash would find them.
pub struct Load {
    acked: Arc<Mutex<HashMap<String, Acknowledged>>>,
    failures: Arc<Mutex<Vec<Failure>>>,
    /// When the last call answered with a success.
    last_ok: Arc<Mutex<Option<Instant>>>,
    stop: Arc<AtomicBool>,
    clients: Vec<JoinHandle<()>>,
}

impl Load {
    pub fn start(base: &str, clients: usize, on_failure: OnFailure) -> Self {
        let load = Self {
            acked: Arc::default(),
            failures: Arc::default(),
            last_ok: Arc::default(),
            stop: Arc::default(),
            clients: Vec::new(),
        };
        let clients = (0..clients)
            .map(|client| {
                let base = base.to_owned();
                let (acked, failures, last_ok, stop) = (
                    Arc::clone(&load.acked),
                    Arc::clone(&load.failures),
                    Arc::clone(&load.last_ok),
                    Arc::clone(&load.stop),
                );
                tokio::spawn(async move {
                    // Longer than any answer may take: one that comes later
                    // is a hang, and counted as no answer.
                    let http = reqwest::Client::builder()
                        .timeout(Duration::from_secs(10))
                        .build()
                        .unwrap();
                    let post = |path: String, body: Value| {
                        let request = http.post(format!("{base}{path}")).json(&body);
                        let (failures, last_ok) = (Arc::clone(&failures), Arc::clone(&last_ok));
                        async move {
                            let sent = Instant::now();
                            let mut failure = Failure {
                                sent,
                                took: Duration::ZERO,
                                status: None,
                                code: None,
                                retry_after: None,
                            };
                            match request.send().await {
                                Ok(response) if response.status().is_success() => {
                                    if let Ok(answer) = response.json::<Value>().await {
                                        *last_ok.lock().unwrap() = Some(Instant::now());
                                        return Some(answer);
                                    }
                                }
                                Ok(response) => {
                                    failure.status = Some(response.status().as_u16());
                                    failure.retry_after = response
                                        .headers()
                                        .get("retry-after")
                                        .and_then(|value| value.to_str().ok())
                                        .map(str::to_owned);
                                    let answer = response.json::<Value>().await.unwrap_or(Value::Null);
                                    failure.code = answer["error"]["code"].as_str().map(str::to_owned);
                                }
                                Err(_) => {}
                            }
                            failure.took = sent.elapsed();
                            failures.lock().unwrap().push(failure);
                            None
                        }
                    };
                    let mut round = 0;
                    while !stop.load(Ordering::Relaxed) {
                        round += 1;
                        let ended = 'lifecycle: {
                            let kb = json!({"service": "knowledge-base", "provider": "ollama",
                                            "class": "embedding", "operationStage": format!("client-{client}")});
                            let Some(record) = post("/v1/activities".to_owned(), kb).await else {
                                break 'lifecycle false;
                            };
                            let id = record["activityId"].as_str().unwrap().to_owned();
                            acked.lock().unwrap().insert(id.clone(), Acknowledged::default());
                            if round % 5 == 4 {
                                break 'lifecycle true;
                            }
                            if post(format!("/v1/activities/{id}/start"), json!({})).await.is_none() {
                                break 'lifecycle false;
                            }
                            acked.lock().unwrap().get_mut(&id).unwrap().started = true;
                            if round % 7 == 6 {
                                break 'lifecycle true;
                            }
                            let Some(settled) =
                                post(format!("/v1/activities/{id}/settle"), json!({"success": true})).await
                            else {
                                break 'lifecycle false;
                            };
                            let mut acked = acked.lock().unwrap();
                            let ack = acked.get_mut(&id).unwrap();
                            ack.settled = true;
                            ack.late = settled["state"] == "reaped";
                            true
                        };
                        if !ended {
                            match on_failure {
                                OnFailure::Stop => return,
                                // Not the `Retry-After` of a real client:
                                // the gap is sampled densely.
                                OnFailure::Continue => tokio::time::sleep(Duration::from_millis(50)).await,
                            }
                        }
                    }
                })
            })
            .collect();
        Self { clients, ..load }
    }

    /// How many settles were acknowledged so far.
    pub fn settled(&self) -> usize {
        self.acked.lock().unwrap().values().filter(|a| a.settled).count()
    }

    /// Waits (bounded) until `settles` settles were acknowledged.
    pub async fn until_settled(&self, settles: usize) {
        let deadline = Instant::now() + PATIENCE;
        while self.settled() < settles {
            assert!(
                Instant::now() < deadline,
                "the load stalled at {} settles",
                self.settled()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The failures so far.
    pub fn failures(&self) -> Vec<Failure> {
        self.failures.lock().unwrap().clone()
    }

    /// Waits (bounded by `within`) for a call to succeed after `since`;
    /// when it answered.
    pub async fn first_success_after(&self, since: Instant, within: Duration) -> Instant {
        loop {
            if let Some(at) = *self.last_ok.lock().unwrap() {
                if at > since {
                    return at;
                }
            }
            assert!(since.elapsed() < within, "no call succeeded within {within:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops the clients (each after its call in progress, or at once when
    /// they stop by themselves); what they were told, and their failures.
    pub async fn finish(self) -> (HashMap<String, Acknowledged>, Vec<Failure>) {
        self.stop.store(true, Ordering::Relaxed);
        for client in self.clients {
            client.await.expect("a client ran");
        }
        let acked = self.acked.lock().unwrap().clone();
        let failures = self.failures.lock().unwrap().clone();
        (acked, failures)
    }
}

/// What the checks after a crash counted.
#[derive(Clone, Copy, Debug)]
pub struct Figures {
    /// Records whose begin was acknowledged.
    pub acknowledged: usize,
    /// Records the store holds.
    pub stored: i64,
    pub succeeded: i64,
    /// Reaped: left in flight on purpose, at the crash, or by a call that
    /// failed.
    pub reaped: i64,
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} records acknowledged, {} stored, {} succeeded, {} reaped",
            self.acknowledged, self.stored, self.succeeded, self.reaped
        )
    }
}

/// Once nothing is in flight any more (waited for, bounded: the reaper
/// alone must get there): every acknowledged begin, start and settle is
/// there, each record is listed once, and the totals equal the records.
pub async fn check_records(server: &Server, acked: &HashMap<String, Acknowledged>) -> Figures {
    let deadline = Instant::now() + PATIENCE;
    let snapshot = loop {
        let (status, snapshot) = server.get("/v1/snapshot?limit=10000&since=1h").await;
        assert_eq!(status, 200, "{snapshot}");
        if snapshot["totalInFlight"] == 0 {
            break snapshot;
        }
        assert!(Instant::now() < deadline, "records stuck in flight: {snapshot}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    let mut states: HashMap<String, String> = HashMap::new();
    for section in ["recentCompletions", "reaped"] {
        for record in snapshot[section].as_array().unwrap() {
            let id = record["activityId"].as_str().unwrap().to_owned();
            assert!(
                states
                    .insert(id.clone(), record["state"].as_str().unwrap().to_owned())
                    .is_none(),
                "{id} listed twice"
            );
        }
    }
    assert!(!snapshot["recentCompletionsTruncated"].as_bool().unwrap());
    assert!(!snapshot["reapedTruncated"].as_bool().unwrap());
    for (id, ack) in acked {
        let state = states
            .get(id)
            .unwrap_or_else(|| panic!("acknowledged begin {id} was lost"));
        if ack.settled {
            // As answered: a settle that came after the reap stays a late
            // settle of a reaped record.
            let answered = if ack.late { "reaped" } else { "succeeded" };
            assert_eq!(state, answered, "acknowledged settle of {id} was lost");
        } else if ack.started {
            assert!(state == "reaped" || state == "succeeded", "{id}: {state}");
            let (_, record) = server.get(&format!("/v1/activities/{id}")).await;
            assert!(
                !record["startedAt"].is_null(),
                "acknowledged start of {id} was lost: {record}"
            );
        }
    }
    // Each record counted once: the counters match the records.
    let stored = i64::try_from(states.len()).unwrap();
    let succeeded = i64::try_from(states.values().filter(|s| *s == "succeeded").count()).unwrap();
    let reaped = i64::try_from(states.values().filter(|s| *s == "reaped").count()).unwrap();
    assert_eq!(snapshot["totalActivities"], stored, "{snapshot}");
    assert_eq!(snapshot["totalSucceeded"], succeeded);
    assert_eq!(snapshot["totalReaped"], reaped);
    let lane = &snapshot["nativeAdmission"]["knowledge-base::ollama"];
    assert_eq!(
        (lane["executing"].as_i64(), lane["waiting"].as_i64()),
        (Some(0), Some(0))
    );
    Figures {
        acknowledged: acked.len(),
        stored,
        succeeded,
        reaped,
    }
}

/// Eight clients run lifecycles as fast as they can until the server on
/// `store` is killed with SIGKILL. After a restart on the same store: every
/// transition acknowledged before the kill is there, every record is
/// counted once, and the records in flight at the crash end reaped by the
/// reaper alone.
pub async fn kill_9_under_load(store: &str) -> Figures {
    let dir = tempfile::tempdir().unwrap();
    let args = super::config_file(&dir, SHORT_BOUNDS);
    let server = Server::start(Launch {
        store: Some(store.to_owned()),
        args: args.clone(),
        ..Launch::default()
    })
    .await;
    let load = Load::start(&server.base, 8, OnFailure::Stop);
    // Load for a while, then the kill, mid-flight.
    load.until_settled(200).await;
    server.crash().await;
    let (acked, _) = load.finish().await;

    let server = Server::start(Launch {
        store: Some(store.to_owned()),
        args,
        ..Launch::default()
    })
    .await;
    check_records(&server, &acked).await
}
