//! Lingering close: a served connection ends with the server's FIN, then a
//! bounded read of whatever the client still sends, then the close.
//!
//! Closing a socket whose receive buffer holds bytes the server never read
//! (a body of a request answered without reading it: a GET with a body, a
//! 413 past the body limit, a 431 past the head limit) makes the kernel send
//! a TCP reset instead of a FIN, and a reset makes the client's kernel drop
//! the answer it was still reading. So, as nginx does, the server shuts its
//! write side down first (the client gets the whole answer and then EOF),
//! reads and discards what arrives until the client's EOF, [`LINGER_BYTES`]
//! or [`LINGER_TIME`], and only then closes.
//!
//! [`Lingering`] wraps the TCP stream under hyper (and under TLS): its
//! `poll_shutdown` sends the FIN at once, and dropping it (on every path by
//! which a connection ends: a clean close, an error, a timeout) hands the
//! socket to a task that lingers and then closes it. The connection's place
//! in `max_connections` is held until then, so lingering sockets are counted.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;

/// The most a closing connection reads and discards. Past it the client is
/// sending more than any request it could still want answered (a body is at
/// most 64 KiB), and a reset is its own doing. A few MiB covers a client
/// that sends a whole oversized body before reading the answer.
pub const LINGER_BYTES: usize = 4 * 1024 * 1024;

/// The longest a closing connection lingers. A client that neither sends nor
/// closes would otherwise hold its socket; 2 s is long enough for a body in
/// flight on a slow network to arrive, short enough not to matter to
/// `max_connections`.
pub const LINGER_TIME: Duration = Duration::from_secs(2);

/// A TCP stream that lingers when it closes (see the module doc).
#[derive(Debug)]
pub struct Lingering {
    /// `None` only once dropped.
    stream: Option<TcpStream>,
    /// Released when the lingering ends.
    permit: Option<OwnedSemaphorePermit>,
    /// Whether the FIN was already sent.
    shut: bool,
}

impl Lingering {
    /// Wraps `stream`, holding `permit` (its place among the open
    /// connections) until the lingering after its close ends.
    pub fn new(stream: TcpStream, permit: Option<OwnedSemaphorePermit>) -> Self {
        Self {
            stream: Some(stream),
            permit,
            shut: false,
        }
    }

    fn stream(&mut self) -> io::Result<&mut TcpStream> {
        self.stream
            .as_mut()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "the connection is closed"))
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let Some(stream) = self.stream.take() else {
            return;
        };
        let (permit, shut) = (self.permit.take(), self.shut);
        // Outside a runtime (only when the runtime itself is going away) the
        // socket closes at once.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                linger(stream, shut).await;
                drop(permit);
            });
        }
    }
}

/// Sends the FIN (unless `shut` says it was sent), then reads and discards
/// until EOF, [`LINGER_BYTES`] or [`LINGER_TIME`], whichever comes first;
/// the caller drops (closes) `stream` after.
async fn linger(mut stream: TcpStream, shut: bool) {
    if !shut && stream.shutdown().await.is_err() {
        // The peer is gone already: nothing to wait for.
        return;
    }
    let _ = tokio::time::timeout(LINGER_TIME, async {
        let mut buf = [0u8; 16 * 1024];
        let mut left = LINGER_BYTES;
        while left > 0 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

impl AsyncRead for Lingering {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.get_mut().stream()?).poll_read(cx, buf)
    }
}

impl AsyncWrite for Lingering {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(self.get_mut().stream()?).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.get_mut().stream()?).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.as_ref().is_some_and(TcpStream::is_write_vectored)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.get_mut().stream()?).poll_flush(cx)
    }

    /// The FIN, at once: the client reading to EOF gets it without waiting
    /// for the lingering, which begins when the stream is dropped.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = std::task::ready!(Pin::new(this.stream()?).poll_shutdown(cx));
        this.shut = true;
        Poll::Ready(result)
    }
}

/// Marks an answer given without reading the request's whole body (413
/// past the body limit, 408 past the body timeout) `Connection: close`.
/// Hyper closes such a connection after the answer anyway; a client not
/// told so would send its next request on it and lose that one.
pub fn close_when_body_unread(mut response: axum::response::Response) -> axum::response::Response {
    use axum::http::{header, HeaderValue, StatusCode};
    if matches!(
        response.status(),
        StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT
    ) {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}
