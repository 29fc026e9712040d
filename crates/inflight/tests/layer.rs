//! `LedgerLayer`, the ledger in front of a tower service (feature `tower`),
//! against every store.
//!
//! Named, as tower names its own limit's tests, after how capacity comes
//! back. The provider is answered by hand ([`Provider`]): a test sees each
//! call the moment the inner service is called, which is the moment the
//! ledger admitted it. Time comes from a fake clock and tokio's paused
//! clock; no test sleeps.
#![cfg(feature = "tower")]

mod common;

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use common::*;
use futures_util::FutureExt;
use inflight::layer::{LayerError, LedgerLayer, LedgerService, Verdict};
use inflight::{ActivitySpec, ErrorKind, FailureStage, Ledger, Outcome, State};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tower::{Layer, Service, ServiceExt};

/// Yields until the lane shows `counts` (a spawned call has got that far).
async fn wait_for_lane(ledger: &Ledger, counts: (i64, i64)) {
    while lane_counts(ledger).await != counts {
        tokio::task::yield_now().await;
    }
}

/// Calls, successes, failures, cancelled.
async fn outcomes(ledger: &Ledger) -> (i64, i64, i64, i64) {
    let snap = snapshot(ledger).await;
    let aggregate = &snap.aggregates[0];
    (
        aggregate.calls,
        aggregate.successes,
        aggregate.failures,
        aggregate.cancelled,
    )
}

/// A newcomer is admitted at once, then settles.
async fn assert_a_slot_is_free(ledger: &Ledger) {
    let permit = ledger.try_admit(embedding()).await.unwrap();
    permit.settle(Outcome::Success).await.unwrap();
}

/// One call the provider received, and how the test answers it.
struct Call {
    text: &'static str,
    reply: oneshot::Sender<io::Result<usize>>,
}

impl Call {
    fn answer(self, result: io::Result<usize>) {
        self.reply.send(result).unwrap();
    }
}

/// A provider the test answers by hand: each call arrives on a channel the
/// moment the service is called. Always ready.
#[derive(Clone)]
struct Provider {
    calls: mpsc::UnboundedSender<Call>,
}

fn provider() -> (Provider, mpsc::UnboundedReceiver<Call>) {
    let (calls, received) = mpsc::unbounded_channel();
    (Provider { calls }, received)
}

impl Service<&'static str> for Provider {
    type Response = usize;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<usize>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, text: &'static str) -> Self::Future {
        let (reply, answer) = oneshot::channel();
        self.calls.send(Call { text, reply }).unwrap();
        Box::pin(async move {
            answer
                .await
                .unwrap_or_else(|_| Err(io::Error::other("no answer")))
        })
    }
}

fn client(h: &Harness, provider: Provider) -> LedgerService<Provider> {
    LedgerLayer::new(h.ledger.clone(), embedding()).layer(provider)
}

type Answer = Result<usize, LayerError<io::Error>>;

/// Polls the client ready, calls it, and runs the response future as a task.
async fn spawn_call<S>(client: &mut S, text: &'static str) -> JoinHandle<Answer>
where
    S: Service<&'static str, Response = usize, Error = LayerError<io::Error>>,
    S::Future: Send + 'static,
{
    tokio::spawn(client.ready().await.unwrap().call(text))
}

against_every_store!(
    capacity_returns_when_the_response_completes,
    capacity_returns_when_the_inner_service_fails,
    capacity_returns_when_the_response_future_is_dropped,
    capacity_returns_when_the_inner_future_panics,
    a_response_future_dropped_while_waiting_leaves_the_line,
    capacity_is_never_taken_when_poll_ready_was_called_but_call_never_was,
    calls_wait_in_line_first_come_first_served_while_poll_ready_stays_ready,
    readiness_and_its_errors_are_the_inner_services,
    a_classifier_decides_success_failure_or_cancelled,
    a_request_the_ledger_refuses_never_reaches_the_inner_service,
    each_request_waits_on_the_lane_its_description_names,
);

async fn capacity_returns_when_the_response_completes(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let (provider, mut calls) = provider();
    let mut client = client(&h, provider);
    let first = spawn_call(&mut client, "hello").await;
    let running = calls.recv().await.unwrap();
    assert_eq!(lane_counts(&h.ledger).await, (1, 0));
    let second = spawn_call(&mut client, "world").await;
    wait_for_lane(&h.ledger, (1, 1)).await;

    running.answer(Ok(5));
    assert_eq!(first.await.unwrap().unwrap(), 5);
    // The slot went to the call waiting in line.
    let next = calls.recv().await.unwrap();
    assert_eq!(next.text, "world");
    next.answer(Ok(5));
    assert_eq!(second.await.unwrap().unwrap(), 5);
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
    assert_eq!(outcomes(&h.ledger).await, (2, 2, 0, 0));
}

async fn capacity_returns_when_the_inner_service_fails(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let (provider, mut calls) = provider();
    let mut client = client(&h, provider);
    let first = spawn_call(&mut client, "hello").await;
    let running = calls.recv().await.unwrap();
    let second = spawn_call(&mut client, "world").await;
    wait_for_lane(&h.ledger, (1, 1)).await;

    running.answer(Err(io::Error::from(io::ErrorKind::ConnectionReset)));
    // The inner service's own error, its type kept.
    match first.await.unwrap() {
        Err(LayerError::Inner(err)) => assert_eq!(err.kind(), io::ErrorKind::ConnectionReset),
        other => panic!("expected the provider's error, got {other:?}"),
    }
    let next = calls.recv().await.unwrap();
    assert_eq!(next.text, "world");
    next.answer(Ok(5));
    second.await.unwrap().unwrap();
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
    assert_eq!(outcomes(&h.ledger).await, (2, 1, 1, 0));
    let snap = snapshot(&h.ledger).await;
    let failed = snap
        .recent_completions
        .iter()
        .find(|record| record.state == State::Failed)
        .unwrap();
    assert_eq!(failed.failure_stage, Some(FailureStage::Provider));
}

async fn capacity_returns_when_the_response_future_is_dropped(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let (provider, mut calls) = provider();
    let mut client = client(&h, provider);
    let first = spawn_call(&mut client, "hello").await;
    let running = calls.recv().await.unwrap();
    let second = spawn_call(&mut client, "world").await;
    wait_for_lane(&h.ledger, (1, 1)).await;

    // A timeout above, a client that went away: the future is dropped
    // while the provider works.
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    assert!(running.reply.is_closed(), "the inner future was dropped with it");
    let next = calls.recv().await.unwrap();
    assert_eq!(next.text, "world");
    next.answer(Ok(5));
    second.await.unwrap().unwrap();
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
    assert_eq!(outcomes(&h.ledger).await, (2, 1, 0, 1));
}

async fn capacity_returns_when_the_inner_future_panics(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let crashing = tower::service_fn(|_: &'static str| {
        poll_fn(|_| -> Poll<io::Result<usize>> { panic!("the provider client panicked") })
    });
    let mut client = LedgerLayer::new(h.ledger.clone(), embedding()).layer(crashing);
    let crashed = tokio::spawn(client.ready().await.unwrap().call("hello")).await;
    assert!(crashed.unwrap_err().is_panic());
    tokio::task::yield_now().await;
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
    assert_eq!(outcomes(&h.ledger).await, (1, 0, 0, 1));
    assert_a_slot_is_free(&h.ledger).await;
}

async fn a_response_future_dropped_while_waiting_leaves_the_line(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let (provider, mut calls) = provider();
    let mut client = client(&h, provider);
    let first = spawn_call(&mut client, "hello").await;
    let running = calls.recv().await.unwrap();
    let waiting = spawn_call(&mut client, "world").await;
    wait_for_lane(&h.ledger, (1, 1)).await;

    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    wait_for_lane(&h.ledger, (1, 0)).await;
    assert!(
        calls.try_recv().is_err(),
        "a call that left the line is never made"
    );
    running.answer(Ok(5));
    first.await.unwrap().unwrap();
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
    assert_eq!(outcomes(&h.ledger).await, (2, 1, 0, 1));
    assert_a_slot_is_free(&h.ledger).await;
}

async fn capacity_is_never_taken_when_poll_ready_was_called_but_call_never_was(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let (provider, mut calls) = provider();
    let mut client = client(&h, provider);
    // Polled ready, then kept and never called (a balancer that picked
    // another service, a request that failed to build).
    let mut idle = client.clone();
    idle.ready().await.unwrap();
    let snap = snapshot(&h.ledger).await;
    assert_eq!(snap.total_activities, 0, "readiness records nothing");
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));

    // The lane's one slot is there for a call, from this process or any.
    assert_a_slot_is_free(&h.ledger).await;
    let call = spawn_call(&mut client, "hello").await;
    calls.recv().await.unwrap().answer(Ok(5));
    assert_eq!(call.await.unwrap().unwrap(), 5);
    drop(idle);
    assert_eq!(outcomes(&h.ledger).await, (2, 2, 0, 0));
}

async fn calls_wait_in_line_first_come_first_served_while_poll_ready_stays_ready(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let (provider, mut calls) = provider();
    let mut client = client(&h, provider);
    let first = spawn_call(&mut client, "first").await;
    let running = calls.recv().await.unwrap();
    let mut waiting = Vec::new();
    for (text, in_line) in [("second", 1), ("third", 2)] {
        h.clock.advance(MS);
        // The lane is full, yet the service is ready: the call waits in its
        // response future, not in poll_ready.
        let ready = poll_fn(|cx| client.poll_ready(cx)).now_or_never();
        assert!(matches!(ready, Some(Ok(()))));
        waiting.push(tokio::spawn(client.call(text)));
        wait_for_lane(&h.ledger, (1, in_line)).await;
    }
    assert!(calls.try_recv().is_err(), "no call runs before it is admitted");

    running.answer(Ok(5));
    first.await.unwrap().unwrap();
    for (expected, call) in ["second", "third"].into_iter().zip(waiting) {
        let next = calls.recv().await.unwrap();
        assert_eq!(next.text, expected, "admitted in the order called");
        assert!(calls.try_recv().is_err(), "one at a time");
        next.answer(Ok(6));
        assert_eq!(call.await.unwrap().unwrap(), 6);
    }
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
}

/// Never ready: its connection is gone.
#[derive(Clone)]
struct Disconnected;

impl Service<&'static str> for Disconnected {
    type Response = usize;
    type Error = io::Error;
    type Future = std::future::Ready<io::Result<usize>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Err(io::Error::from(io::ErrorKind::NotConnected)))
    }

    fn call(&mut self, _: &'static str) -> Self::Future {
        unreachable!("never ready, never called")
    }
}

async fn readiness_and_its_errors_are_the_inner_services(backend: Backend) {
    let h = Harness::new(backend, capped(4));
    // An inner service that admits one call at a time by itself.
    let (provider, mut calls) = provider();
    let limited = tower::limit::ConcurrencyLimit::new(provider, 1);
    let mut client = LedgerLayer::new(h.ledger.clone(), embedding()).layer(limited);
    let first = spawn_call(&mut client, "hello").await;
    let running = calls.recv().await.unwrap();
    // Its backpressure reaches the caller, with slots free in the lane.
    assert!(poll_fn(|cx| client.poll_ready(cx)).now_or_never().is_none());
    running.answer(Ok(5));
    first.await.unwrap().unwrap();
    let second = spawn_call(&mut client, "world").await;
    calls.recv().await.unwrap().answer(Ok(5));
    second.await.unwrap().unwrap();

    // Its readiness errors reach the caller as its own, and record nothing.
    let mut broken = LedgerLayer::new(h.ledger.clone(), embedding()).layer(Disconnected);
    match broken.ready().await {
        Err(LayerError::Inner(err)) => assert_eq!(err.kind(), io::ErrorKind::NotConnected),
        other => panic!("expected the inner service's error, got {:?}", other.err()),
    }
    assert_eq!(outcomes(&h.ledger).await, (2, 2, 0, 0));
}

async fn a_classifier_decides_success_failure_or_cancelled(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    // The provider's HTTP status, or `Interrupted` when the user gave up.
    let chat = tower::service_fn(|prompt: &'static str| async move {
        match prompt {
            "" => Err(io::Error::from(io::ErrorKind::Interrupted)),
            "too much" => Ok(429_u16),
            _ => Ok(200),
        }
    });
    let classify = |result: &Result<u16, io::Error>| match result {
        Ok(200) => Verdict::Success,
        Ok(_) => Verdict::Failure(FailureStage::Provider),
        Err(err) if err.kind() == io::ErrorKind::Interrupted => Verdict::Cancelled,
        Err(_) => Verdict::Failure(FailureStage::Provider),
    };
    let mut client = LedgerLayer::new(h.ledger.clone(), embedding())
        .classify_with(classify)
        .layer(chat);
    assert_eq!(client.ready().await.unwrap().call("hello").await.unwrap(), 200);
    // A response judged a failure is still the caller's response.
    assert_eq!(client.ready().await.unwrap().call("too much").await.unwrap(), 429);
    let interrupted = client.ready().await.unwrap().call("").await.unwrap_err();
    assert!(matches!(interrupted, LayerError::Inner(err) if err.kind() == io::ErrorKind::Interrupted));

    assert_eq!(outcomes(&h.ledger).await, (3, 1, 1, 1));
    assert_eq!(lane_counts(&h.ledger).await, (0, 0));
    let snap = snapshot(&h.ledger).await;
    let ended = |state| {
        snap.recent_completions
            .iter()
            .find(|record| record.state == state)
            .unwrap()
    };
    assert_eq!(ended(State::Failed).failure_stage, Some(FailureStage::Provider));
    assert_eq!(
        ended(State::Cancelled).cancel_reason.as_deref(),
        Some("classified cancelled")
    );
}

async fn a_request_the_ledger_refuses_never_reaches_the_inner_service(backend: Backend) {
    let h = Harness::new(backend, capped(1));
    let (provider, mut calls) = provider();
    let mut client = LedgerLayer::describe_with(h.ledger.clone(), |_: &&'static str| {
        ActivitySpec::new("bad service!", "ollama") // not a label
    })
    .layer(provider);
    let refused = client.ready().await.unwrap().call("hello").await;
    match refused {
        Err(LayerError::Ledger(err)) => assert_eq!(err.kind(), ErrorKind::InvalidInput),
        other => panic!("expected the ledger's refusal, got {other:?}"),
    }
    assert!(calls.try_recv().is_err(), "the inner service was not called");
    assert_eq!(snapshot(&h.ledger).await.total_activities, 0);
}

async fn each_request_waits_on_the_lane_its_description_names(backend: Backend) {
    let config = config()
        .with_lane_cap("knowledge-base::ollama", 1)
        .unwrap()
        .with_lane_cap("knowledge-base::openai", 1)
        .unwrap();
    let h = Harness::new(backend, config);
    let (provider, mut calls) = provider();
    // The request names its provider, so its lane.
    let mut client = LedgerLayer::describe_with(h.ledger.clone(), |provider: &&'static str| {
        ActivitySpec::new("knowledge-base", *provider).class("embedding")
    })
    .layer(provider);
    let ollama = spawn_call(&mut client, "ollama").await;
    let busy = calls.recv().await.unwrap();
    // The ollama lane is full; the openai lane is not, and its call runs.
    let openai = spawn_call(&mut client, "openai").await;
    let other = calls.recv().await.unwrap();
    assert_eq!((busy.text, other.text), ("ollama", "openai"));
    other.answer(Ok(1));
    busy.answer(Ok(2));
    assert_eq!(openai.await.unwrap().unwrap(), 1);
    assert_eq!(ollama.await.unwrap().unwrap(), 2);
    let snap = snapshot(&h.ledger).await;
    for lane in ["knowledge-base::ollama", "knowledge-base::openai"] {
        let lane = snap.lane(lane).unwrap();
        assert_eq!((lane.executing, lane.waiting), (0, 0));
    }
}
