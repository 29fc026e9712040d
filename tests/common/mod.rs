//! What the tests of the real binary share: a launcher for `inflight
//! serve`, and lifecycles under load with the checks after a crash
//! ([`load`]). Polling a real process is unavoidable here; every wait is a
//! bounded loop with a generous limit, so a loaded machine only makes it
//! slower.
#![allow(dead_code)]

pub mod cluster;
pub mod load;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

pub const BIN: &str = env!("CARGO_BIN_EXE_inflight");
/// How long anything may take before the test gives up.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// A running `inflight serve`.
pub struct Server {
    pub child: Child,
    pub base: String,
    logs: mpsc::UnboundedReceiver<Value>,
    token: Option<String>,
    pub http: reqwest::Client,
}

/// How to start one.
#[derive(Default)]
pub struct Launch<'a> {
    /// The store's URL (`--store`), when not the default.
    pub store: Option<String>,
    pub args: Vec<String>,
    pub env: Vec<(&'static str, String)>,
    pub token: Option<&'a str>,
}

/// The store URL of the SQLite file `path`, with its durability
/// (`?synchronous=`) when not the default.
pub fn sqlite(path: &Path, synchronous: Option<&str>) -> String {
    let mut url = format!("sqlite://{}", path.display());
    if let Some(synchronous) = synchronous {
        url.push_str(&format!("?synchronous={synchronous}"));
    }
    url
}

/// The binary, with none of its settings taken from the environment.
pub fn inflight() -> Command {
    let mut command = Command::new(BIN);
    for var in [
        "INFLIGHT_CONFIG",
        "INFLIGHT_LISTEN",
        "INFLIGHT_STORE",
        "INFLIGHT_TOKEN",
        "INFLIGHT_URL",
        "INFLIGHT_CA_FILE",
        "INFLIGHT_TLS_CERT",
        "INFLIGHT_TLS_KEY",
        "RUST_LOG",
    ] {
        command.env_remove(var);
    }
    // Nor does it export to a collector the environment names.
    for (var, _) in std::env::vars_os() {
        if var.to_string_lossy().starts_with("OTEL_") {
            command.env_remove(var);
        }
    }
    command
}

impl Server {
    pub async fn start(launch: Launch<'_>) -> Self {
        let mut command = inflight();
        command.args(["--log-format", "json", "serve"]);
        if let Some(store) = &launch.store {
            command.args(["--store", store]);
        }
        command.args(&launch.args);
        command.env("RUST_LOG", "info");
        for (key, value) in &launch.env {
            command.env(key, value);
        }
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().expect("piped stderr");
        // Unbounded: the server never blocks on a full pipe, read or not.
        let (sender, logs) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let value = serde_json::from_str(&line).unwrap_or(json!({ "raw": line }));
                if sender.send(value).is_err() {
                    break;
                }
            }
        });
        let mut server = Self {
            child,
            base: String::new(),
            logs,
            token: launch.token.map(str::to_owned),
            http: reqwest::Client::builder().timeout(PATIENCE).build().unwrap(),
        };
        let line = server
            .wait_for_log("the server to listen", |line| {
                line["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("listening on http"))
            })
            .await;
        let addr = line["fields"]["addr"].as_str().expect("addr field");
        let message = line["fields"]["message"].as_str().unwrap_or_default();
        let scheme = if message.starts_with("listening on https://") {
            "https"
        } else {
            "http"
        };
        server.base = format!("{scheme}://{addr}");
        server
    }

    /// Waits (bounded) for a log line matching `pred`.
    pub async fn wait_for_log(&mut self, what: &str, mut pred: impl FnMut(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        let mut seen = Vec::new();
        loop {
            match tokio::time::timeout_at(deadline, self.logs.recv()).await {
                Ok(Some(line)) if pred(&line) => return line,
                Ok(Some(line)) => seen.push(line),
                Ok(None) => panic!("the server exited while waiting for {what}; its log: {seen:#?}"),
                Err(_) => panic!("timed out waiting for {what}; its log: {seen:#?}"),
            }
        }
    }

    /// The next line of its log; `None` once it exited.
    pub async fn next_log(&mut self) -> Option<Value> {
        self.logs.recv().await
    }

    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self.request(method, path);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("the server answers");
        let status = response.status().as_u16();
        (status, response.json().await.expect("a JSON answer"))
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }

    /// Begins a record; returns its id.
    pub async fn begin(&self, body: Value) -> String {
        let (status, record) = self.post("/v1/activities", body).await;
        assert_eq!(status, 201, "{record}");
        record["activityId"].as_str().unwrap().to_owned()
    }

    /// `kill -9`.
    pub async fn crash(mut self) {
        self.child.kill().await.expect("SIGKILL");
    }
}

/// Writes `text` as a configuration file in `dir`; the `--config` arguments,
/// with a free port to listen on.
pub fn config_file(dir: &tempfile::TempDir, text: &str) -> Vec<String> {
    let path = dir.path().join("inflight.toml");
    std::fs::write(&path, text).unwrap();
    vec![
        "--config".to_owned(),
        path.display().to_string(),
        "--listen".to_owned(),
        "127.0.0.1:0".to_owned(),
    ]
}
