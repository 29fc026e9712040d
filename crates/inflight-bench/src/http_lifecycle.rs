//! `http_lifecycle`: lifecycles per second through the real HTTP server over
//! loopback, reported only.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

use crate::report::{ms, percentile, round, Case, Target};
use crate::sqlite_env::{multi_thread, sqlite_ledger, TempDir};
use crate::Plan;

const HTTP_CLIENTS: usize = 16;

/// POSTs `body` to `url`; the answer and how long it took, in ms.
async fn post_json(client: &reqwest::Client, url: String, body: Value) -> Result<(Value, f64)> {
    let started = Instant::now();
    let response = client.post(url).json(&body).send().await?;
    let status = response.status();
    let body: Value = response.json().await?;
    if !status.is_success() {
        bail!("HTTP {status}: {body}");
    }
    Ok((body, ms(started.elapsed())))
}

async fn http_lifecycle_once(client: &reqwest::Client, base: &str, latencies: &mut Vec<f64>) -> Result<()> {
    let begin = json!({
        "service": "knowledge-base", "provider": "ollama", "class": "embedding", "model": "nomic-embed-text"
    });
    let (record, t) = post_json(client, format!("{base}/v1/activities"), begin).await?;
    latencies.push(t);
    let id = record["activityId"]
        .as_str()
        .ok_or_else(|| anyhow!("no activityId in {record}"))?
        .to_owned();
    let (_, t) = post_json(client, format!("{base}/v1/activities/{id}/start"), json!({})).await?;
    latencies.push(t);
    let settle = json!({"success": true});
    let (_, t) = post_json(client, format!("{base}/v1/activities/{id}/settle"), settle).await?;
    latencies.push(t);
    Ok(())
}

pub(crate) fn http_lifecycle(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let tmp = TempDir::new(dir, "http")?;
    let ledger = sqlite_ledger(&tmp.file("ours.db"), None)?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        // The real server path: the router, axum::serve, the reaper.
        let server = tokio::spawn(inflight_server::serve_on(listener, ledger, None, inflight_server::Limits::default(), async {
            let _ = stopped.await;
        }));
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(HTTP_CLIENTS)
            .timeout(Duration::from_secs(30))
            .build()?;
        let run = |window: Duration| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                let until = Instant::now() + window;
                let started = Instant::now();
                let mut tasks = Vec::new();
                for _ in 0..HTTP_CLIENTS {
                    let (client, base) = (client.clone(), base.clone());
                    tasks.push(tokio::spawn(async move {
                        let (mut latencies, mut lifecycles) = (Vec::new(), 0_u64);
                        while Instant::now() < until {
                            http_lifecycle_once(&client, &base, &mut latencies).await?;
                            lifecycles += 1;
                        }
                        Ok::<_, anyhow::Error>((latencies, lifecycles))
                    }));
                }
                let (mut latencies, mut lifecycles) = (Vec::new(), 0_u64);
                for task in tasks {
                    let (l, n) = task.await??;
                    latencies.extend(l);
                    lifecycles += n;
                }
                Ok::<_, anyhow::Error>((latencies, lifecycles, started.elapsed()))
            }
        };
        run(plan.http_window / 5).await?; // warm-up: connections, caches
        let (mut latencies, lifecycles, elapsed) = run(plan.http_window).await?;
        let _ = stop.send(());
        server.await??;
        latencies.sort_by(f64::total_cmp);
        let (p50, p99) = (percentile(&latencies, 50.0), percentile(&latencies, 99.0));
        let rate = lifecycles as f64 / elapsed.as_secs_f64();
        Ok(vec![Case {
            name: "http_lifecycle".into(),
            ours: rate,
            baseline: None,
            unit: "lifecycles/s",
            target: Target::Report,
            paired_ratio: None,
            note: format!(
                "{HTTP_CLIENTS} concurrent clients over loopback, SQLite store, {:.0}s; per request p50 {p50:.2} ms, \
                 p99 {p99:.2} ms ({} requests); client and server share the machine",
                plan.http_window.as_secs_f64(),
                latencies.len()
            ),
            extra: serde_json::Map::from_iter([
                ("p50_ms".to_owned(), json!(round(p50))),
                ("p99_ms".to_owned(), json!(round(p99))),
                ("clients".to_owned(), json!(HTTP_CLIENTS)),
            ]),
        }])
    })
}
