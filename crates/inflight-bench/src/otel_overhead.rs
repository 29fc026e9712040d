//! `otel_overhead`: the HTTP lifecycle with `[otel]` export on, to a
//! collector that takes and drops everything, next to the same server
//! without export, in one run. Two servers on two SQLite files
//! (`synchronous=normal`), 16 clients each, windows alternating between
//! them, two-request lifecycles. The case carries the HTTP aim
//! (`http_lifecycle_two_requests`'s) with export on; the ratio to the
//! server without export is in its note and figures.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use inflight::store::Synchronous;
use inflight_server::http::AppState;
use inflight_server::otel::{OtelSettings, OtelStats};
use serde_json::json;

use crate::http_lifecycle::{
    clients, drive, Requests, Server, HTTP_CLIENTS, TARGET_P99_MS, TARGET_RATE, WINDOWS,
};
use crate::report::{percentile, round, Case, Target};
use crate::sqlite_env::{multi_thread, sqlite_ledger_at, TempDir};
use crate::Plan;

/// A collector that answers every export 200 and keeps nothing, on a free
/// loopback port: its base URL.
async fn collector() -> Result<String> {
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(|| async { "" }))
        .route("/v1/metrics", axum::routing::post(|| async { "" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(base)
}

/// One server's windows.
#[derive(Default)]
struct Tally {
    latencies: Vec<f64>,
    lifecycles: u64,
    elapsed: f64,
}

impl Tally {
    fn rate(&self) -> f64 {
        self.lifecycles as f64 / self.elapsed
    }
}

pub(crate) fn otel_overhead(plan: &Plan, dir: &Path) -> Result<Vec<Case>> {
    let runtime = multi_thread()?;
    let tmp = TempDir::new(dir, "otel")?;
    runtime.block_on(async {
        let endpoint = collector().await?;
        let table: toml::Table = format!("endpoint = \"{endpoint}\"").parse()?;
        let settings = OtelSettings::resolve(Some(&table), &|_| None, &mut Vec::new())?
            .ok_or_else(|| anyhow!("[otel] is on"))?;
        let plain = sqlite_ledger_at(&tmp.file("plain.db"), Synchronous::Normal)?;
        let exported = sqlite_ledger_at(&tmp.file("exported.db"), Synchronous::Normal)?;
        let stats = Arc::new(OtelStats::default());
        let exporting =
            inflight_server::otel::start(&settings, &exported, Arc::clone(&stats)).map_err(|e| anyhow!(e))?;
        let servers = [
            Server::start(plain).await?,
            Server::start_state(AppState::new(exported).with_otel(Arc::clone(&stats))).await?,
        ];
        let mut sides = [
            clients(&servers[0].base, HTTP_CLIENTS).await?,
            clients(&servers[1].base, HTTP_CLIENTS).await?,
        ];
        // Warm-up; every lifecycle on the exporting side is one end.
        let mut ended = 0;
        for side in &mut sides {
            ended = drive(side, Requests::Two, plan.http_window / 10, None).await?.1;
        }
        let window = plan.http_window / u32::try_from(2 * WINDOWS)?;
        let mut tallies = [Tally::default(), Tally::default()];
        for _ in 0..WINDOWS {
            for (side, tally) in sides.iter_mut().zip(&mut tallies) {
                let (latencies, lifecycles, elapsed) = drive(side, Requests::Two, window, None).await?;
                tally.latencies.extend(latencies);
                tally.lifecycles += lifecycles;
                tally.elapsed += elapsed.as_secs_f64();
            }
        }
        let [plain, exported] = servers;
        plain.stop().await?;
        exported.stop().await?;
        exporting.shutdown().await;
        let (sent, dropped) = (
            stats.exported.load(Ordering::Relaxed),
            stats.dropped.load(Ordering::Relaxed),
        );
        let ended = ended + tallies[1].lifecycles;
        if sent + dropped != ended {
            bail!("export lost ends: {sent} sent and {dropped} dropped of {ended} lifecycles");
        }
        let [mut off, mut on] = tallies;
        Ok(vec![case(&mut on, &mut off, sent, dropped)])
    })
}

fn case(on: &mut Tally, off: &mut Tally, sent: u64, dropped: u64) -> Case {
    for tally in [&mut *on, &mut *off] {
        tally.latencies.sort_by(f64::total_cmp);
    }
    let (p50, p99) = (percentile(&on.latencies, 50.0), percentile(&on.latencies, 99.0));
    let (off50, off99) = (percentile(&off.latencies, 50.0), percentile(&off.latencies, 99.0));
    let (rate, ratio) = (on.rate(), on.rate() / off.rate());
    let met = rate >= TARGET_RATE && p99 < TARGET_P99_MS;
    Case {
        name: "otel_overhead".into(),
        ours: rate,
        baseline: None,
        unit: "lifecycles/s",
        target: Target::Aim { met },
        paired_ratio: None,
        note: format!(
            "begin with ?start=now&wait=5s, settle; [otel] export on, to a collector on loopback that drops \
             everything: {rate:.0}/s, per request p50 {p50:.2} ms, p99 {p99:.2} ms; the same server without \
             export {:.0}/s, p50 {off50:.2} ms, p99 {off99:.2} ms ({ratio:.2}x); {HTTP_CLIENTS} clients each, \
             windows alternating, SQLite synchronous=normal; {sent} spans sent, {dropped} dropped; the HTTP aim \
             ({TARGET_RATE:.0}/s, p99 < {TARGET_P99_MS} ms) with export on {}",
            off.rate(),
            if met { "met" } else { "not met" },
        ),
        extra: serde_json::Map::from_iter([
            ("p50_ms".to_owned(), json!(round(p50))),
            ("p99_ms".to_owned(), json!(round(p99))),
            ("without_export".to_owned(), json!(round(off.rate()))),
            ("ratio_to_without".to_owned(), json!(round(ratio))),
            ("spans_sent".to_owned(), json!(sent)),
            ("spans_dropped".to_owned(), json!(dropped)),
            ("aim_met".to_owned(), json!(met)),
        ]),
    }
}
