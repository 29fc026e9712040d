//! The upstream's answer on its way back: streamed to the client frame by
//! frame, read for usage as it passes, and settled when it ends.
//!
//! The call's [`Permit`] lives inside the answer's body, so that the one
//! `Drop` of that permit is what records a call whose client went away
//! (`client-disconnected`, the spec's reason): mid-stream, or before the
//! answer began. Every other end is a settle that lands *before* the
//! answer's last frame is handed on: once a client holds the whole answer,
//! the ledger already shows the call settled, and a server shutting down
//! (which waits for its connections) loses no settle. A streamed answer
//! that says it is complete (OpenAI's `data: [DONE]`, Anthropic's
//! `message_stop`, Ollama's `"done": true`) is settled there, before that
//! frame: a client may hang up on reading it, before the body's formal end.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::{Duration, SystemTime};

use axum::body::{Bytes, HttpBody};
use axum::http::{header, HeaderMap, StatusCode};
use axum::BoxError;
use hyper::body::{Frame, Incoming, SizeHint};
use tokio::time::{Instant, Sleep};

use inflight::domain::admission::MAX_RETRY_AFTER_MS;
use inflight::domain::record::FailureStage;
use inflight::domain::usage::{self, Usage};
use inflight::{Outcome, Permit, Settlement};

use super::usage::{Framing, Reader};

/// What the call's end needs to know besides the answer's bytes.
pub(super) struct Ending {
    pub(super) permit: Permit,
    /// The model the request asked for (its body's or its path's).
    pub(super) asked_model: Option<String>,
    pub(super) status: StatusCode,
    /// The upstream's `Retry-After`, for a 429 or a 503.
    pub(super) retry_after: Option<Duration>,
}

impl Ending {
    /// What the answer's head says: its status and, for a refusal, how
    /// long the provider asks callers to wait.
    pub(super) fn new(
        permit: Permit,
        asked_model: Option<String>,
        status: StatusCode,
        headers: &HeaderMap,
    ) -> Self {
        let refused = matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        );
        Self {
            permit,
            asked_model,
            status,
            retry_after: refused.then(|| retry_after(headers, SystemTime::now())).flatten(),
        }
    }

    /// Settles the call as its answer ended: `cut` when the upstream broke
    /// off or ran past the deadline. The model is refined first when the
    /// answer names another.
    pub(super) async fn settle(self, read: super::usage::Read, cut: bool) {
        let Self {
            mut permit,
            asked_model,
            status,
            retry_after,
        } = self;
        if let Some(model) = read.model.filter(|model| Some(model) != asked_model.as_ref()) {
            if let Err(err) = permit.refine(model).await {
                tracing::warn!(error = %err, id = %permit.id(), "cannot refine a proxied call's model");
            }
        }
        // A count the ledger cannot keep (an upstream's nonsense) is left
        // out, so that the call is still settled as it ended.
        let id = permit.id();
        let kept = |field: &str, tokens: Option<i64>| match tokens {
            Some(tokens) if !usage::is_token_count(tokens) => {
                tracing::warn!(%id, field, tokens, "a proxied answer's token count is out of range; not recorded");
                None
            }
            tokens => tokens,
        };
        let usage = Usage {
            input_tokens: kept("input_tokens", read.input_tokens),
            output_tokens: kept("output_tokens", read.output_tokens),
        };
        let failed = cut || status.is_client_error() || status.is_server_error();
        let mut settlement = Settlement::new(if failed {
            Outcome::Failure(FailureStage::Provider)
        } else {
            Outcome::Success
        })
        .usage(usage);
        // A refusal's wait holds however its body ended.
        if let Some(wait) = retry_after {
            settlement = settlement.retry_after(wait);
        }
        if let Err(err) = permit.settle_with(settlement).await {
            tracing::warn!(error = %err, %id, "cannot settle a proxied call");
        }
    }
}

/// The wait a refusing upstream asks for: `retry-after-ms` (OpenAI's), or
/// `Retry-After` in seconds or as an HTTP date; within what a cooldown
/// takes (1 ms to an hour). `None` when it says nothing usable, or zero.
pub(super) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let text = |name| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::trim)
    };
    // An unusable `retry-after-ms` (negative, not a number) leaves the
    // standard header to say it.
    let in_ms = text("retry-after-ms")
        .and_then(|ms| ms.parse::<f64>().ok())
        .and_then(|ms| Duration::try_from_secs_f64(ms / 1000.0).ok());
    let wait = match in_ms {
        Some(wait) => wait,
        None => {
            let value = text(header::RETRY_AFTER.as_str())?;
            match value.parse::<f64>() {
                Ok(secs) => Duration::try_from_secs_f64(secs).ok()?,
                Err(_) => httpdate::parse_http_date(value).ok()?.duration_since(now).ok()?,
            }
        }
    };
    let most = Duration::from_millis(u64::try_from(MAX_RETRY_AFTER_MS).unwrap_or(u64::MAX));
    (wait >= Duration::from_millis(1)).then(|| wait.min(most))
}

/// The body of a proxied answer.
pub(super) struct Answer {
    stage: Stage,
}

enum Stage {
    /// Frames pass from the upstream to the client.
    Streaming(Box<Streaming>),
    /// The upstream's answer ended, or said it is complete; the settle
    /// runs, then `then` is handed on: the last frame, the end (`None`), or
    /// the upstream's error. What is left of a complete answer (`rest`)
    /// then streams on.
    Settling {
        settle: Pin<Box<dyn Future<Output = ()> + Send>>,
        then: Option<Result<Frame<Bytes>, BoxError>>,
        rest: Option<Box<Streaming>>,
    },
    Done,
}

struct Streaming {
    upstream: Incoming,
    /// The call, until it is settled.
    ending: Option<Ending>,
    reader: Reader,
    /// The class's deadline: past it the answer is cut.
    deadline: Pin<Box<Sleep>>,
}

impl Answer {
    /// `upstream`'s body, ending `ending`'s call, cut at `deadline`.
    pub(super) fn new(upstream: Incoming, ending: Ending, framing: Framing, deadline: Instant) -> Self {
        Self {
            stage: Stage::Streaming(Box::new(Streaming {
                upstream,
                ending: Some(ending),
                reader: Reader::new(framing),
                deadline: Box::pin(tokio::time::sleep_until(deadline)),
            })),
        }
    }

    /// Moves from streaming to settling the call (when it is not settled
    /// yet), with what to hand on after; an answer that is not over
    /// (`more`) streams on after that.
    fn settle(&mut self, cut: bool, then: Option<Result<Frame<Bytes>, BoxError>>, more: bool) {
        let Stage::Streaming(mut streaming) = std::mem::replace(&mut self.stage, Stage::Done) else {
            return;
        };
        let Some(ending) = streaming.ending.take() else {
            // Settled already (the answer said it was complete): what is
            // left of it passes, nothing to settle.
            self.stage = Stage::Settling {
                settle: Box::pin(std::future::ready(())),
                then,
                rest: more.then_some(streaming),
            };
            return;
        };
        let settle = Box::pin(ending.settle(streaming.reader.read(), cut));
        self.stage = Stage::Settling {
            settle,
            then,
            rest: more.then_some(streaming),
        };
    }
}

impl HttpBody for Answer {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            match &mut this.stage {
                Stage::Streaming(streaming) => {
                    if streaming.deadline.as_mut().poll(cx).is_ready() {
                        let cut: BoxError = "the upstream's answer ran past its class's deadline".into();
                        this.settle(true, Some(Err(cut)), false);
                        continue;
                    }
                    match ready!(Pin::new(&mut streaming.upstream).poll_frame(cx)) {
                        Some(Ok(frame)) => {
                            if let Some(data) = frame.data_ref() {
                                streaming.reader.feed(data);
                            }
                            // Trailers end a body: hyper writes them, then
                            // drops the body without polling it again.
                            let last = streaming.upstream.is_end_stream() || frame.is_trailers();
                            let complete = streaming.ending.is_some() && streaming.reader.finished();
                            if !last && !complete {
                                return Poll::Ready(Some(Ok(frame)));
                            }
                            // The answer's last frame, or the one that says
                            // it is complete: the settle lands first.
                            this.settle(false, Some(Ok(frame)), !last);
                        }
                        Some(Err(err)) => this.settle(true, Some(Err(err.into())), false),
                        None => this.settle(false, None, false),
                    }
                }
                Stage::Settling { settle, then, rest } => {
                    ready!(settle.as_mut().poll(cx));
                    let then = then.take();
                    this.stage = match rest.take() {
                        Some(rest) => Stage::Streaming(rest),
                        None => Stage::Done,
                    };
                    return Poll::Ready(then);
                }
                Stage::Done => return Poll::Ready(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // Never the upstream's: the body must be polled to its end for
        // the settle to run.
        matches!(self.stage, Stage::Done)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    header::HeaderName::from_static(name),
                    HeaderValue::from_str(value).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn retry_after_reads_every_spelling_within_a_cooldowns_range() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let read = |pairs: &[(&'static str, &str)]| retry_after(&headers(pairs), now);
        assert_eq!(read(&[("retry-after", "7")]), Some(Duration::from_secs(7)));
        assert_eq!(read(&[("retry-after", "0.5")]), Some(Duration::from_millis(500)));
        assert_eq!(
            read(&[("retry-after-ms", "250"), ("retry-after", "9")]),
            Some(Duration::from_millis(250))
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(read(&[("retry-after", &later)]), Some(Duration::from_secs(30)));
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(read(&[("retry-after", &earlier)]), None);
        assert_eq!(read(&[("retry-after", "86400")]), Some(Duration::from_secs(3600)));
        for nothing in ["0", "-1", "soon", "NaN", "inf"] {
            assert_eq!(read(&[("retry-after", nothing)]), None, "{nothing}");
            assert_eq!(
                read(&[("retry-after-ms", nothing), ("retry-after", "9")]),
                Some(Duration::from_secs(9)).filter(|_| nothing != "0"),
                "retry-after-ms {nothing}"
            );
        }
        assert_eq!(read(&[]), None);
    }
}
