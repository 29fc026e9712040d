//! `memory_lifecycle`: begin, start and settle on the in-memory store, against
//! a hand-written semaphore and map.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{anyhow, Result};
use inflight::{Ledger, LedgerConfig};

use crate::report::{median, Case, Target};
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
        let (mut ours, mut base) = (Vec::new(), Vec::new());
        for _ in 0..plan.reps {
            let started = Instant::now();
            for _ in 0..n {
                hand.lifecycle().await?;
            }
            base.push(started.elapsed().as_nanos() as f64 / n as f64);
            let started = Instant::now();
            for _ in 0..n {
                ledger_lifecycle(&ledger).await?;
            }
            ours.push(started.elapsed().as_nanos() as f64 / n as f64);
        }
        let (ours_ns, base_ns) = (median(ours), median(base));
        Ok(vec![Case {
            name: "memory_lifecycle".into(),
            ours: ours_ns / 1e3,
            baseline: Some(base_ns / 1e3),
            unit: "us/lifecycle",
            target: Target::AtMost(3.0),
            paired_ratio: None,
            note: format!(
                "begin+start+settle, 1 task, current-thread runtime; median of {} reps x {n}; \
                 baseline = Semaphore permit + Mutex<HashMap> insert/update/remove",
                plan.reps
            ),
            extra: serde_json::Map::new(),
        }])
    })
}
