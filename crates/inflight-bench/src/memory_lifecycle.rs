//! `memory_lifecycle`: begin, start and settle on the in-memory store, against
//! a hand-written semaphore and map.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{anyhow, Result};
use inflight::{Ledger, LedgerConfig};
use serde_json::json;

use crate::report::{round, spread, Case, Target};
use crate::sqlite_env::{ledger_lifecycle, now_ms};
use crate::Plan;

/// What a user would keep by hand per call: the labels and the timestamps.
#[derive(Debug)]
#[allow(dead_code)] // read through `black_box` only
struct HandCall {
    service: String,
    provider: String,
    class: String,
    model: String,
    enqueued_at: i64,
    started_at: Option<i64>,
    completed_at: Option<i64>,
    success: Option<bool>,
}

/// The hand-written baseline: a semaphore permit plus a map insert and
/// remove per call, the map behind a mutex as it must be once shared.
pub(crate) struct HandLedger {
    permits: tokio::sync::Semaphore,
    calls: Mutex<HashMap<u64, HandCall>>,
    next_id: AtomicU64,
}

impl HandLedger {
    pub(crate) fn new() -> Self {
        Self {
            permits: tokio::sync::Semaphore::new(1024),
            calls: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        }
    }

    pub(crate) async fn lifecycle(&self) -> Result<()> {
        let permit = self.permits.acquire().await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let call = HandCall {
            service: "knowledge-base".to_owned(),
            provider: "ollama".to_owned(),
            class: "embedding".to_owned(),
            model: "nomic-embed-text".to_owned(),
            enqueued_at: now_ms(),
            started_at: None,
            completed_at: None,
            success: None,
        };
        self.calls.lock().expect("poisoned").insert(id, call);
        // start
        if let Some(call) = self.calls.lock().expect("poisoned").get_mut(&id) {
            call.started_at = Some(now_ms());
        }
        // settle
        let mut call = self
            .calls
            .lock()
            .expect("poisoned")
            .remove(&id)
            .ok_or_else(|| anyhow!("lost call"))?;
        call.completed_at = Some(now_ms());
        call.success = Some(true);
        black_box(call);
        drop(permit);
        Ok(())
    }
}

pub(crate) fn memory_lifecycle(plan: &Plan) -> Result<Vec<Case>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let ledger = Ledger::builder(LedgerConfig::default())
            .store_url("memory:")
            .build()?;
        let hand = HandLedger::new();
        let n = plan.memory_ops;
        // Warm-up: allocator, caches, the map's capacity.
        for _ in 0..n / 4 {
            ledger_lifecycle(&ledger).await?;
            hand.lifecycle().await?;
        }
        // Pairs of repetitions, baseline then ours, so that a slow spell of
        // the machine hits both sides of a pair alike; the ratio is the
        // median of the pairs' ratios.
        let (mut ours, mut base, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..plan.reps {
            let started = Instant::now();
            for _ in 0..n {
                hand.lifecycle().await?;
            }
            let b = started.elapsed().as_nanos() as f64 / n as f64;
            let started = Instant::now();
            for _ in 0..n {
                ledger_lifecycle(&ledger).await?;
            }
            let o = started.elapsed().as_nanos() as f64 / n as f64;
            base.push(b);
            ours.push(o);
            ratios.push(o / b);
        }
        let (o_min, ours_ns, o_max) = spread(&ours);
        let (b_min, base_ns, b_max) = spread(&base);
        let (r_min, ratio, r_max) = spread(&ratios);
        let pairs = ratios.len();
        eprintln!(
            "  memory_lifecycle: ours median {ours_ns:.0} ns (min {o_min:.0}, max {o_max:.0}); baseline median \
             {base_ns:.0} ns (min {b_min:.0}, max {b_max:.0}); per-pair ratio median {ratio:.2}x (min \
             {r_min:.2}, max {r_max:.2}); ratio of medians {:.2}x",
            ours_ns / base_ns
        );
        Ok(vec![Case {
            name: "memory_lifecycle".into(),
            ours: ours_ns / 1e3,
            baseline: Some(base_ns / 1e3),
            unit: "us/lifecycle",
            // Issue 28's target: twice a bare semaphore and map at most.
            target: Target::AtMost(2.0),
            paired_ratio: Some(ratio),
            note: format!(
                "begin+start+settle, 1 task, current-thread runtime; median of {} reps x {n}; \
                 baseline = Semaphore permit + Mutex<HashMap> insert/update/remove; ratio = median of \
                 {pairs} interleaved pairs' ratios (ratio of medians {:.2}x)",
                plan.reps,
                ours_ns / base_ns
            ),
            extra: serde_json::Map::from_iter([
                ("pairs".to_owned(), json!(pairs)),
                ("ratio_of_medians".to_owned(), json!(round(ours_ns / base_ns))),
                ("ratio_min".to_owned(), json!(round(r_min))),
                ("ratio_max".to_owned(), json!(round(r_max))),
            ]),
        }])
    })
}
