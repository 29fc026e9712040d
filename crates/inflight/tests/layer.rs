//! `LedgerLayer`, the ledger in front of a tower service (feature `tower`).
#![cfg(feature = "tower")]

mod common;

use std::time::Duration;

use common::*;
use inflight::layer::LedgerLayer;
use inflight::{Ledger, LedgerConfig};
use tower::{Service, ServiceExt};

const LANE: &str = "knowledge-base::ollama";

fn capped(cap: u32) -> LedgerConfig {
    config().with_lane_cap(LANE, cap).unwrap()
}

async fn lane_counts(ledger: &Ledger) -> (i64, i64) {
    let snap = snapshot(ledger).await;
    let lane = snap.lane(LANE).unwrap();
    (lane.executing, lane.waiting)
}

against_every_store!(
    tower_layer_settles_each_call,
    response_future_drop_releases_capacity
);

async fn tower_layer_settles_each_call(backend: Backend) {
    let h = Harness::new(backend, capped(2));
    let embed = tower::service_fn(|text: &'static str| async move {
        if text.is_empty() {
            Err(std::io::Error::other("empty input"))
        } else {
            Ok(text.len())
        }
    });
    let mut client = tower::ServiceBuilder::new()
        .layer(LedgerLayer::new(h.ledger.clone(), embedding()))
        .service(embed);
    assert_eq!(client.ready().await.unwrap().call("hello").await.unwrap(), 5);
    assert!(client.ready().await.unwrap().call("").await.is_err());
    let snap = snapshot(&h.ledger).await;
    let aggregate = &snap.aggregates[0];
    assert_eq!(
        (aggregate.calls, aggregate.successes, aggregate.failures),
        (2, 1, 1)
    );
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
}

async fn response_future_drop_releases_capacity(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let hang = tower::service_fn(|_: ()| std::future::pending::<Result<(), std::io::Error>>());
    let mut client = tower::ServiceBuilder::new()
        .layer(LedgerLayer::new(h.ledger.clone(), embedding()))
        .service(hang);
    let call = client.ready().await.unwrap().call(());
    assert!(tokio::time::timeout(Duration::from_secs(5), call).await.is_err());
    tokio::task::yield_now().await;
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
    assert_eq!(snapshot(&h.ledger).await.aggregates[0].cancelled, 1);
}
