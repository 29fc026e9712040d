//! What the tests against a real listener share: a server in process and a
//! raw HTTP/1.1 client that reads one answer by its `content-length`.

#![allow(dead_code)] // Each test file uses its own part.

pub mod certs;

use std::io;
use std::net::SocketAddr;

use inflight::{Ledger, Settings};
use inflight_server::Limits;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A memory ledger configured by `toml`.
pub fn ledger(toml: &str) -> Ledger {
    let settings = Settings::from_toml(toml).expect("valid settings");
    Ledger::builder(settings.ledger)
        .store_url("memory:")
        .build()
        .expect("memory ledger")
}

/// A server running in this process until dropped.
pub struct Running {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Serves `ledger` on a free loopback port, with `serve`: [`serve_on`] or
/// another function of the same shape.
///
/// [`serve_on`]: inflight_server::serve_on
pub async fn start<F, Fut>(serve: F) -> Running
where
    F: FnOnce(TcpListener, oneshot::Receiver<()>) -> Fut,
    Fut: std::future::Future<Output = Result<(), inflight_server::ServeError>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel();
    tokio::spawn(serve(listener, stopped));
    Running {
        addr,
        stop: Some(stop),
    }
}

/// Serves `ledger` over plain HTTP with the default limits.
pub async fn start_plain(ledger: Ledger) -> Running {
    start(|listener, stopped| {
        inflight_server::serve_on(listener, ledger, None, Limits::default(), async {
            let _ = stopped.await;
        })
    })
    .await
}

/// One answer: its status, headers (lowercase names) and body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

/// A request: `method path`, its extra header lines, and a body.
pub fn request(method: &str, path: &str, headers: &str, body: &[u8]) -> Vec<u8> {
    let mut bytes = format!(
        "{method} {path} HTTP/1.1\r\nhost: inflight\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n{headers}\r\n",
        body.len()
    )
    .into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// Sends `request` on `stream` (already written in part or not at all:
/// the caller decides), then reads one answer whole: the head, then as many
/// body bytes as its `content-length` says. A reset or an early EOF is an
/// error.
pub async fn read_answer<S: AsyncRead + Unpin>(stream: &mut S) -> io::Result<Answer> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(early_eof(&buf, "head"));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.get(9..12))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no status line: {head:?}")))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(name, _)| name == "content-length")
        .and_then(|(_, value)| value.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no content-length: {head:?}")))?;
    let mut body = buf.split_off(head_end + 4);
    while body.len() < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(early_eof(&body, "body"));
        }
        body.extend_from_slice(&chunk[..n]);
    }
    if body.len() > length {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more bytes than content-length",
        ));
    }
    Ok(Answer {
        status,
        headers,
        body,
    })
}

fn early_eof(read: &[u8], part: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("EOF in the {part} after {} bytes", read.len()),
    )
}

/// Writes `request` and reads its answer on a keep-alive connection.
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    request: &[u8],
) -> io::Result<Answer> {
    stream.write_all(request).await?;
    stream.flush().await?;
    read_answer(stream).await
}
