//! A `tower` layer that puts the ledger in front of any service: each call is
//! begun, waits in line for a slot of its lane, runs, and is settled as a
//! classifier says.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use inflight::layer::LedgerLayer;
//! use inflight::{ActivitySpec, Ledger, LedgerConfig};
//! use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
//!
//! let config = LedgerConfig::default().with_lane_cap("knowledge-base::ollama", 4)?;
//! let ledger = Ledger::builder(config).build()?;
//! let embed = service_fn(|text: String| async move { Ok::<_, std::io::Error>(text.len()) });
//! let spec = ActivitySpec::new("knowledge-base", "ollama").class("embedding");
//! let mut client = ServiceBuilder::new()
//!     .layer(LedgerLayer::new(ledger.clone(), spec)) // the one line
//!     .service(embed);
//! let len = client.ready().await?.call("hello".to_owned()).await?;
//! assert_eq!(len, 5);
//! # Ok::<(), tower::BoxError>(())
//! # }).unwrap();
//! ```
//!
//! The layer holds settings ([`LedgerLayer`]), the service holds the inner
//! service ([`LedgerService`]), and each call's [`ResponseFuture`] holds the
//! call: it waits in line, then holds the [`Permit`] while the inner service
//! runs, then settles it.
//!
//! # Admission happens in the response future, not in `poll_ready`
//!
//! tower's `ConcurrencyLimit` takes its semaphore permit in `poll_ready` and
//! hands it to the call: a full limit makes `poll_ready` pending, which is
//! how backpressure reaches the caller. [`LedgerService`] keeps the other
//! half of that design: its `poll_ready` is the inner service's (its
//! backpressure and its errors pass through), and the response future holds
//! the permit and frees the slot when dropped. But it does not wait for a
//! slot in `poll_ready`. A call waits in line as the first step of its
//! response future, by [`Ledger::admit`], and the inner service is called
//! only once the call is admitted. Why:
//!
//! - **The lane comes from the request.** [`LedgerLayer::describe_with`]
//!   derives the spec, so the lane, from each request; `poll_ready` has no
//!   request, so it does not know which lane to wait on. A layer built with
//!   a fixed spec could, but then one layer would behave two ways depending
//!   on its constructor.
//! - **A slot is a record, shared by every process, not a local permit.** To
//!   hold a slot the ledger records a call and starts it. Taken in
//!   `poll_ready`, it would be an `executing` call with no request yet. A
//!   caller that polls ready and never calls (a balancer that polls several
//!   services and picks one, a request that fails to build, a service kept
//!   ready in a cache) would hold that slot for as long as the service
//!   lives, against every process sharing the store, and operators would see
//!   a call that is not happening: the phantom saturation the ledger exists
//!   to remove. Here readiness reserves nothing in the ledger; only a call
//!   records anything.
//! - **First come, first served.** The line is ordered by `enqueuedAt`,
//!   which a call gets when it is recorded, so calls are admitted in the
//!   order they were made, across processes. A slot reserved at readiness
//!   would go by the order of readiness, and idle while its holder builds
//!   the request.
//! - **Cancel safety.** The waiting is [`Ledger::admit`]'s, inside the
//!   response future: dropping the future leaves the line and records the
//!   call `cancelled`. Nothing is left behind in the service.
//!
//! What this costs: `poll_ready` says ready while the lane is full, and a
//! call on a full lane waits in its response future instead, counted in the
//! lane's `waiting` like any call in line. A caller that must not wait long
//! puts a timeout above the layer (`tower::timeout`): the future it drops
//! leaves the line. And since the inner service is called only once the
//! call is admitted, the instance that was polled ready moves into the
//! response future to be called then (hence `S: Clone`: the pattern tower's
//! `Service` documentation gives for calling an inner service from a
//! future). Whatever that instance reserved when it said ready stays
//! reserved while the call waits in line.
//!
//! # Classifying results
//!
//! Once the inner service answers, a [`Classify`] turns its result into a
//! [`Verdict`]: the call succeeded, failed at a [`FailureStage`], or was
//! cancelled. The default, [`ErrorsAsFailures`], counts `Ok` as a success
//! and `Err` as a provider failure. Pass your own with
//! [`LedgerLayer::classify_with`]: a closure over `&Result<Response, Error>`
//! or any type that implements [`Classify`].
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use std::io;
//!
//! use inflight::layer::{LedgerLayer, Verdict};
//! use inflight::{ActivitySpec, FailureStage, Ledger, LedgerConfig, SnapshotOptions};
//! use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
//!
//! let ledger = Ledger::builder(LedgerConfig::default()).build()?;
//! // A client that answers with the provider's HTTP status, and fails with
//! // `Interrupted` when the user gave up.
//! let chat = service_fn(|prompt: &'static str| async move {
//!     match prompt {
//!         "" => Err(io::Error::from(io::ErrorKind::Interrupted)),
//!         "too much" => Ok(429_u16),
//!         _ => Ok(200),
//!     }
//! });
//! let classify = |result: &Result<u16, io::Error>| match result {
//!     Ok(200) => Verdict::Success,
//!     Ok(_) => Verdict::Failure(FailureStage::Provider), // rate limited
//!     Err(err) if err.kind() == io::ErrorKind::Interrupted => Verdict::Cancelled,
//!     Err(_) => Verdict::Failure(FailureStage::Provider),
//! };
//! let spec = ActivitySpec::new("assistant", "openai").class("chat");
//! let mut client = ServiceBuilder::new()
//!     .layer(LedgerLayer::new(ledger.clone(), spec).classify_with(classify))
//!     .service(chat);
//! for prompt in ["hello", "too much", ""] {
//!     let _ = client.ready().await?.call(prompt).await;
//! }
//! let snapshot = ledger.snapshot(SnapshotOptions::default()).await?;
//! let chats = &snapshot.aggregates[0];
//! assert_eq!((chats.successes, chats.failures, chats.cancelled), (1, 1, 1));
//! # Ok::<(), tower::BoxError>(())
//! # }).unwrap();
//! ```
//!
//! The verdict settles the call, and the result goes back to the caller as it
//! was: a response classified as a failure is still the caller's response. A
//! settle that fails is logged and does not change the result.
//!
//! # Errors
//!
//! The service's error is [`LayerError`]: [`LayerError::Ledger`] when the
//! ledger could not record or admit the call (the inner service is then not
//! called), [`LayerError::Inner`] with the inner service's own error,
//! unchanged, from `poll_ready` or from its response.

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;
use tower::{BoxError, Layer, Service};

use crate::domain::record::FailureStage;
use crate::error::LedgerError;
use crate::ledger::{ActivitySpec, Ledger, Outcome, Permit};

/// The reason recorded on a call its classifier judged [`Verdict::Cancelled`].
const CLASSIFIED_CANCELLED: &str = "classified cancelled";

/// How a call that ran ended, as its [`Classify`] judges its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It succeeded: settled as a success.
    Success,
    /// It failed at this stage: settled as a failure.
    Failure(FailureStage),
    /// It was called off (the user gave up, say): recorded `cancelled`, with
    /// the reason `classified cancelled`; neither a success nor a failure.
    Cancelled,
}

/// Judges the result of the inner service: which results count as failures,
/// and at which stage.
///
/// Implemented by [`ErrorsAsFailures`] (the default) and by every closure
/// `Fn(&Result<T, E>) -> Verdict`; see [the module docs](self) for an
/// example.
pub trait Classify<T, E> {
    /// The verdict on `result`, which then goes back to the caller unchanged.
    fn classify(&self, result: &Result<T, E>) -> Verdict;
}

impl<F, T, E> Classify<T, E> for F
where
    F: Fn(&Result<T, E>) -> Verdict,
{
    fn classify(&self, result: &Result<T, E>) -> Verdict {
        self(result)
    }
}

/// The default classifier: `Ok` is a success, `Err` a failure at
/// [`FailureStage::Provider`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorsAsFailures;

impl<T, E> Classify<T, E> for ErrorsAsFailures {
    fn classify(&self, result: &Result<T, E>) -> Verdict {
        match result {
            Ok(_) => Verdict::Success,
            Err(_) => Verdict::Failure(FailureStage::Provider),
        }
    }
}

/// Derives the [`ActivitySpec`] a request is recorded with (so its lane).
///
/// Implemented by [`ActivitySpec`] itself (every request gets a copy:
/// [`LedgerLayer::new`]) and by every closure `Fn(&Req) -> ActivitySpec`
/// ([`LedgerLayer::describe_with`]).
pub trait Describe<Req> {
    /// The spec `request` is recorded with.
    fn describe(&self, request: &Req) -> ActivitySpec;
}

impl<Req> Describe<Req> for ActivitySpec {
    fn describe(&self, _: &Req) -> ActivitySpec {
        self.clone()
    }
}

impl<F, Req> Describe<Req> for F
where
    F: Fn(&Req) -> ActivitySpec,
{
    fn describe(&self, request: &Req) -> ActivitySpec {
        self(request)
    }
}

/// An error of [`LedgerService`]: the ledger's, or the inner service's own.
///
/// `Display` says which side failed; [`Error::source`] is the error itself
/// (print the chain to see both). It is an [`Error`] when the inner service's
/// error is one, so `?` turns it into a [`BoxError`]; for an inner service
/// whose error is already a `BoxError`, use [`LayerError::into_box_error`].
#[derive(Debug)]
pub enum LayerError<E> {
    /// The ledger could not record or admit the call (a spec it refused, a
    /// store that failed or was closed). The inner service was not called.
    Ledger(LedgerError),
    /// The inner service failed, in `poll_ready` or in its response.
    Inner(E),
}

impl<E> LayerError<E> {
    /// The error itself as a [`BoxError`], unwrapped: for an inner service
    /// whose error is a `BoxError`, which does not implement [`Error`] (so
    /// neither does its `LayerError`).
    pub fn into_box_error(self) -> BoxError
    where
        E: Into<BoxError>,
    {
        match self {
            Self::Ledger(err) => err.into(),
            Self::Inner(err) => err.into(),
        }
    }
}

impl<E> fmt::Display for LayerError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ledger(_) => f.write_str("the ledger did not admit the call"),
            Self::Inner(_) => f.write_str("the inner service failed"),
        }
    }
}

impl<E: Error + 'static> Error for LayerError<E> {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            Self::Ledger(err) => Some(err),
            Self::Inner(err) => Some(err),
        }
    }
}

/// Wraps a service so that every call is recorded, admitted and settled by a
/// ledger. See [the module docs](self).
///
/// `D` describes each request ([`Describe`]), `C` classifies each result
/// ([`Classify`]).
#[derive(Clone)]
pub struct LedgerLayer<D = ActivitySpec, C = ErrorsAsFailures> {
    ledger: Ledger,
    describe: D,
    classify: C,
}

impl<D, C> fmt::Debug for LedgerLayer<D, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LedgerLayer")
            .field("ledger", &self.ledger)
            .finish_non_exhaustive()
    }
}

impl LedgerLayer {
    /// Records every call with a copy of `spec`.
    pub fn new(ledger: Ledger, spec: ActivitySpec) -> Self {
        Self {
            ledger,
            describe: spec,
            classify: ErrorsAsFailures,
        }
    }
}

impl<D> LedgerLayer<D> {
    /// Records every call with the spec `describe` derives from its request:
    /// to pick the lane, model or stage per request.
    ///
    /// ```
    /// use inflight::layer::LedgerLayer;
    /// use inflight::{ActivitySpec, Ledger, LedgerConfig};
    ///
    /// # fn main() -> Result<(), inflight::LedgerError> {
    /// let ledger = Ledger::builder(LedgerConfig::default()).build()?;
    /// let layer = LedgerLayer::describe_with(ledger, |(provider, _text): &(&'static str, String)| {
    ///     ActivitySpec::new("knowledge-base", *provider).class("embedding")
    /// });
    /// # let _ = layer;
    /// # Ok(())
    /// # }
    /// ```
    pub fn describe_with<Req>(ledger: Ledger, describe: D) -> Self
    where
        D: Fn(&Req) -> ActivitySpec,
    {
        Self {
            ledger,
            describe,
            classify: ErrorsAsFailures,
        }
    }
}

impl<D, C> LedgerLayer<D, C> {
    /// Classifies each result with `classify` instead of the default
    /// [`ErrorsAsFailures`]: a closure `Fn(&Result<T, E>) -> Verdict`, or any
    /// [`Classify`]. See [the module docs](self) for an example.
    pub fn classify_with<C2>(self, classify: C2) -> LedgerLayer<D, C2> {
        LedgerLayer {
            ledger: self.ledger,
            describe: self.describe,
            classify,
        }
    }
}

impl<S, D: Clone, C: Clone> Layer<S> for LedgerLayer<D, C> {
    type Service = LedgerService<S, D, C>;

    fn layer(&self, inner: S) -> Self::Service {
        LedgerService {
            inner,
            ledger: self.ledger.clone(),
            describe: self.describe.clone(),
            classify: self.classify.clone(),
        }
    }
}

/// The service [`LedgerLayer`] produces.
#[derive(Clone)]
pub struct LedgerService<S, D = ActivitySpec, C = ErrorsAsFailures> {
    inner: S,
    ledger: Ledger,
    describe: D,
    classify: C,
}

impl<S: fmt::Debug, D, C> fmt::Debug for LedgerService<S, D, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LedgerService")
            .field("inner", &self.inner)
            .field("ledger", &self.ledger)
            .finish_non_exhaustive()
    }
}

impl<S, D, C> LedgerService<S, D, C> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, consuming this one.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The ledger it records calls in.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }
}

impl<S, Req, D, C> Service<Req> for LedgerService<S, D, C>
where
    S: Service<Req> + Clone,
    D: Describe<Req>,
    C: Classify<S::Response, S::Error> + Clone,
{
    type Response = S::Response;
    type Error = LayerError<S::Error>;
    type Future = ResponseFuture<S, Req, C>;

    /// Ready when the inner service is. Nothing is reserved in the ledger:
    /// a call waits for its slot in its [`ResponseFuture`] (see [the module
    /// docs](self) for why).
    ///
    /// # Errors
    /// [`LayerError::Inner`] with the inner service's error.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(LayerError::Inner)
    }

    /// Describes the request and returns the future that records it, waits
    /// in line, calls the inner service once admitted, and settles the call.
    /// Nothing is recorded until the future is polled.
    ///
    /// # Errors
    /// As [`ResponseFuture`].
    ///
    /// # Cancel safety
    /// As [`ResponseFuture`]: dropping it never leaves a slot held.
    fn call(&mut self, request: Req) -> Self::Future {
        let spec = self.describe.describe(&request);
        // The instance that was polled ready goes into the future; the clone
        // left here is polled ready before the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture {
            stage: Stage::Admitting {
                admission: Box::pin(admit(self.ledger.clone(), spec)),
                inner,
                request,
            },
            classify: self.classify.clone(),
        }
    }
}

/// Waiting in line, or settling: the ledger's own async steps, boxed because
/// their futures have no name.
type LedgerStep<T> = Pin<Box<dyn Future<Output = T> + Send>>;

async fn admit(ledger: Ledger, spec: ActivitySpec) -> Result<Permit, LedgerError> {
    ledger.admit(spec).await
}

async fn settle(permit: Permit, verdict: Verdict) {
    let id = permit.id();
    let settled = match verdict {
        Verdict::Success => permit.settle(Outcome::Success).await,
        Verdict::Failure(stage) => permit.settle(Outcome::Failure(stage)).await,
        Verdict::Cancelled => permit.cancel(Some(CLASSIFIED_CANCELLED.to_owned())).await,
    };
    if let Err(err) = settled {
        tracing::warn!(activity_id = %id, ?verdict, error = %err, "could not settle a call");
    }
}

pin_project! {
    /// The future of one call through a [`LedgerService`]: it records the
    /// call and waits in line for a slot, then calls the inner service and
    /// holds the [`Permit`] while the inner future runs, then settles the
    /// call as its [`Classify`] judges the result and returns that result.
    ///
    /// The inner service's future is held as it is; only the ledger's own
    /// two steps (waiting in line, settling) are boxed.
    ///
    /// # Errors
    /// [`LayerError::Ledger`] when the ledger could not record or admit the
    /// call, as [`Ledger::admit`] (never `LaneFull`: it waits instead); the
    /// inner service is then not called. [`LayerError::Inner`] with the inner
    /// service's error, after the call is settled. A settle that fails is
    /// logged, not returned.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future never leaves a slot held. Dropped
    /// while waiting in line, the call leaves the line and is recorded
    /// `cancelled` (as [`Ledger::admit`]). Dropped while the inner future
    /// runs, the inner future is dropped with the permit, which records the
    /// call `cancelled` and frees its slot. Dropped while settling, the settle
    /// has been submitted and lands ([`Permit::settle`]); only the response
    /// is lost.
    #[must_use = "futures do nothing unless polled"]
    pub struct ResponseFuture<S, Req, C>
    where
        S: Service<Req>,
    {
        #[pin]
        stage: Stage<S, Req, S::Future, Result<S::Response, S::Error>>,
        classify: C,
    }
}

pin_project! {
    #[project = StageProj]
    #[project_replace = StageOwned]
    enum Stage<S, Req, F, R> {
        Admitting {
            admission: LedgerStep<Result<Permit, LedgerError>>,
            inner: S,
            request: Req,
        },
        Calling {
            #[pin]
            future: F,
            permit: Permit,
        },
        Settling {
            settle: LedgerStep<()>,
            result: R,
        },
        Done,
    }
}

impl<S, Req, C> fmt::Debug for ResponseFuture<S, Req, C>
where
    S: Service<Req>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stage = match &self.stage {
            Stage::Admitting { .. } => "waiting in line",
            Stage::Calling { .. } => "calling",
            Stage::Settling { .. } => "settling",
            Stage::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("stage", &stage)
            .finish_non_exhaustive()
    }
}

impl<S, Req, C> Future for ResponseFuture<S, Req, C>
where
    S: Service<Req>,
    C: Classify<S::Response, S::Error>,
{
    type Output = Result<S::Response, LayerError<S::Error>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.stage.as_mut().project() {
                StageProj::Admitting { admission, .. } => {
                    let admitted = ready!(admission.as_mut().poll(cx));
                    let StageOwned::Admitting {
                        mut inner, request, ..
                    } = this.stage.as_mut().project_replace(Stage::Done)
                    else {
                        unreachable!("the stage was Admitting")
                    };
                    let permit = admitted.map_err(LayerError::Ledger)?;
                    let future = inner.call(request);
                    this.stage.set(Stage::Calling { future, permit });
                }
                StageProj::Calling { future, .. } => {
                    let result = ready!(future.poll(cx));
                    let verdict = this.classify.classify(&result);
                    let StageOwned::Calling { permit, .. } = this.stage.as_mut().project_replace(Stage::Done)
                    else {
                        unreachable!("the stage was Calling")
                    };
                    this.stage.set(Stage::Settling {
                        settle: Box::pin(settle(permit, verdict)),
                        result,
                    });
                }
                StageProj::Settling { settle, .. } => {
                    ready!(settle.as_mut().poll(cx));
                    let StageOwned::Settling { result, .. } =
                        this.stage.as_mut().project_replace(Stage::Done)
                    else {
                        unreachable!("the stage was Settling")
                    };
                    return Poll::Ready(result.map_err(LayerError::Inner));
                }
                StageProj::Done => panic!("a ResponseFuture was polled after it completed"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[test]
    fn the_default_classifier_counts_errors_as_provider_failures() {
        let ok: Result<(), io::Error> = Ok(());
        let err: Result<(), io::Error> = Err(io::Error::other("boom"));
        assert_eq!(ErrorsAsFailures.classify(&ok), Verdict::Success);
        assert_eq!(
            ErrorsAsFailures.classify(&err),
            Verdict::Failure(FailureStage::Provider)
        );
    }

    #[test]
    fn a_layer_error_names_its_side_and_keeps_the_error_as_its_source() {
        let inner: LayerError<io::Error> = LayerError::Inner(io::Error::other("provider down"));
        assert_eq!(inner.to_string(), "the inner service failed");
        assert_eq!(inner.source().unwrap().to_string(), "provider down");
        let source = inner.source().unwrap().downcast_ref::<io::Error>().unwrap();
        assert_eq!(source.kind(), io::ErrorKind::Other);

        let ledger: LayerError<io::Error> =
            LayerError::Ledger(LedgerError::new(crate::ErrorKind::Closed, "shut down"));
        assert_eq!(ledger.to_string(), "the ledger did not admit the call");
        let source = ledger.source().unwrap().downcast_ref::<LedgerError>().unwrap();
        assert_eq!(source.kind(), crate::ErrorKind::Closed);
    }

    #[test]
    fn a_layer_error_over_a_box_error_unwraps_into_one() {
        let inner: LayerError<BoxError> = LayerError::Inner("provider down".into());
        assert_eq!(inner.into_box_error().to_string(), "provider down");
        let ledger: LayerError<BoxError> =
            LayerError::Ledger(LedgerError::new(crate::ErrorKind::Closed, "shut down"));
        let boxed = ledger.into_box_error();
        assert!(boxed.downcast_ref::<LedgerError>().is_some());
    }
}
