//! A `tower` layer that puts any provider client behind the ledger: begin,
//! admit, call, settle, in one line.
//!
//! The layer holds settings, the service holds logic, and the response future
//! holds the [`Permit`](crate::Permit): dropping the future (a
//! client disconnect, a timeout layer above) drops the permit, which records
//! the call `cancelled` and frees its slot.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower::{BoxError, Layer, Service};

use crate::domain::record::FailureStage;
use crate::ledger::{ActivitySpec, Ledger, Outcome};

type Describe<Req> = Arc<dyn Fn(&Req) -> ActivitySpec + Send + Sync>;

/// Wraps a service so that every call is recorded and admitted by a ledger.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use inflight::layer::LedgerLayer;
/// use inflight::{ActivitySpec, Ledger, LedgerConfig};
/// use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
///
/// let ledger = Ledger::builder(LedgerConfig::default()).build()?;
/// let embed = service_fn(|text: String| async move { Ok::<_, std::io::Error>(text.len()) });
/// let spec = ActivitySpec::new("knowledge-base", "ollama").class("embedding");
/// let mut client = ServiceBuilder::new()
///     .layer(LedgerLayer::new(ledger.clone(), spec)) // the one line
///     .service(embed);
/// let len = client.ready().await?.call("hello".to_owned()).await?;
/// assert_eq!(len, 5);
/// # Ok::<(), tower::BoxError>(())
/// # }).unwrap();
/// ```
pub struct LedgerLayer<Req> {
    ledger: Ledger,
    describe: Describe<Req>,
}

impl<Req> Clone for LedgerLayer<Req> {
    fn clone(&self) -> Self {
        Self {
            ledger: self.ledger.clone(),
            describe: Arc::clone(&self.describe),
        }
    }
}

impl<Req> fmt::Debug for LedgerLayer<Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LedgerLayer")
            .field("ledger", &self.ledger)
            .finish_non_exhaustive()
    }
}

impl<Req> LedgerLayer<Req> {
    /// Records every call with a copy of `spec`.
    pub fn new(ledger: Ledger, spec: ActivitySpec) -> Self {
        Self::describe_with(ledger, move |_| spec.clone())
    }

    /// Records every call with the spec `describe` derives from its request
    /// (to pick the model or stage per request, say).
    pub fn describe_with(
        ledger: Ledger,
        describe: impl Fn(&Req) -> ActivitySpec + Send + Sync + 'static,
    ) -> Self {
        Self {
            ledger,
            describe: Arc::new(describe),
        }
    }
}

impl<S, Req> Layer<S> for LedgerLayer<Req> {
    type Service = LedgerService<S, Req>;

    fn layer(&self, inner: S) -> Self::Service {
        LedgerService {
            inner,
            ledger: self.ledger.clone(),
            describe: Arc::clone(&self.describe),
        }
    }
}

/// The service [`LedgerLayer`] produces.
pub struct LedgerService<S, Req> {
    inner: S,
    ledger: Ledger,
    describe: Describe<Req>,
}

impl<S: Clone, Req> Clone for LedgerService<S, Req> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            ledger: self.ledger.clone(),
            describe: Arc::clone(&self.describe),
        }
    }
}

impl<S: fmt::Debug, Req> fmt::Debug for LedgerService<S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LedgerService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, Req> Service<Req> for LedgerService<S, Req>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Into<BoxError> + Send + 'static,
    Req: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let spec = (self.describe)(&request);
        let ledger = self.ledger.clone();
        // The clone is not ready; the instance that was polled ready goes
        // into the future.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let permit = ledger.admit(spec).await?;
            match inner.call(request).await {
                Ok(response) => {
                    if let Err(err) = permit.settle(Outcome::Success).await {
                        tracing::warn!(error = %err, "could not settle a successful call");
                    }
                    Ok(response)
                }
                Err(err) => {
                    if let Err(settle) = permit.settle(Outcome::Failure(FailureStage::Provider)).await {
                        tracing::warn!(error = %settle, "could not settle a failed call");
                    }
                    Err(err.into())
                }
            }
        })
    }
}
