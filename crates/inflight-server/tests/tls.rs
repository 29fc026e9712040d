//! `inflight serve` over TLS, against a real listener with certificates
//! made for the test: the handshake and requests through a rustls client;
//! a reload to a new certificate, which new connections get while an open
//! one goes on; a client that trusts another CA refused; and the limits of
//! plain HTTP held the same over TLS.

mod support;

use std::num::NonZeroUsize;
use std::time::Duration;

use inflight_server::http::AppState;
use inflight_server::{Limits, Reload, Tls, TlsFiles};
use rustls::pki_types::CertificateDer;
use support::certs::{connect, files, presented, Ca};
use support::{exchange, read_answer, request, Running};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// Serves a memory ledger over `tls` within `limits`.
async fn start(tls: Tls, limits: Limits) -> Running {
    support::start(move |listener, stopped| {
        let state = AppState::new(support::ledger("")).with_limits(limits);
        inflight_server::serve_tls(listener, state, tls, async {
            let _ = stopped.await;
        })
    })
    .await
}

/// A CA, and a certificate it issued in a temporary directory.
struct Issued {
    _dir: tempfile::TempDir,
    ca: Ca,
    files: TlsFiles,
    first: CertificateDer<'static>,
}

fn issued() -> Issued {
    let dir = tempfile::tempdir().unwrap();
    let (ca, files) = (Ca::new("inflight test CA"), files(dir.path()));
    let first = ca.issue(&files);
    Issued {
        _dir: dir,
        ca,
        files,
        first,
    }
}

async fn healthz(stream: &mut TlsStream<TcpStream>) -> u16 {
    exchange(stream, &request("GET", "/healthz", "", b""))
        .await
        .expect("an answer")
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_is_served_and_a_reload_changes_only_new_connections() {
    let Issued {
        _dir,
        ca,
        files,
        first,
    } = issued();
    let tls = Tls::load(&files).unwrap();
    let reload = Reload::new();
    tls.reload_on(&reload);
    let server = start(tls, Limits::default()).await;
    let client = ca.client();

    let mut open = connect(&client, server.addr).await.expect("a handshake");
    assert_eq!(presented(&open), first);
    assert_eq!(
        open.get_ref().1.alpn_protocol(),
        None,
        "the client offered no protocol"
    );
    assert_eq!(healthz(&mut open).await, 200);

    let second = ca.issue(&files);
    assert_ne!(first, second);
    reload.trigger();
    // The reload runs in its own task: wait (bounded) for it to land.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let mut fresh = connect(&client, server.addr).await.expect("a handshake");
        if presented(&fresh) == second {
            assert_eq!(healthz(&mut fresh).await, 200);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the reload never landed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The connection opened before goes on, with its certificate.
    assert_eq!(healthz(&mut open).await, 200);
    assert_eq!(presented(&open), first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_cannot_read_the_files_keeps_the_old_pair() {
    let Issued {
        _dir: dir,
        ca,
        files,
        first,
    } = issued();
    let tls = Tls::load(&files).unwrap();
    let server = start(tls.clone(), Limits::default()).await;

    std::fs::write(&files.cert, "-----BEGIN CERTIFICATE-----\nnot base64\n").unwrap();
    let err = tls.reload().expect_err("an invalid certificate");
    assert_eq!(err.key, "server.tls.cert");
    assert!(err.problem.contains("server.crt"), "{err}");
    // A key that belongs to another certificate is refused as well.
    let other = TlsFiles {
        cert: files.cert.clone(),
        key: dir.path().join("other.key"),
    };
    ca.issue(&other);
    ca.issue(&files);
    std::fs::copy(&other.key, &files.key).unwrap();
    let err = tls.reload().expect_err("a key of another certificate");
    assert_eq!(err.key, "server.tls.key");
    assert!(err.problem.contains("is not the key of the certificate"), "{err}");

    let mut stream = connect(&ca.client(), server.addr).await.expect("a handshake");
    assert_eq!(presented(&stream), first, "the old pair is still served");
    assert_eq!(healthz(&mut stream).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_trusts_another_ca_is_refused() {
    let Issued { _dir, ca, files, .. } = issued();
    let server = start(Tls::load(&files).unwrap(), Limits::default()).await;

    let stranger = Ca::new("another CA");
    let err = connect(&stranger.client(), server.addr)
        .await
        .expect_err("a certificate from an unknown CA");
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");
    // Plain HTTP to the TLS port is no handshake either.
    let mut plain = TcpStream::connect(server.addr).await.unwrap();
    plain
        .write_all(&request("GET", "/healthz", "", b""))
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer).await;
    assert!(!answer.starts_with(b"HTTP/1.1 200"), "plain HTTP was served");
    // Neither troubled the server.
    let mut stream = connect(&ca.client(), server.addr).await.expect("a handshake");
    assert_eq!(healthz(&mut stream).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limits_of_plain_http_hold_over_tls() {
    let Issued { _dir, ca, files, .. } = issued();
    let limits = Limits::default()
        .with_max_connections(NonZeroUsize::new(2).unwrap())
        .with_header_timeout(Duration::from_millis(500))
        .unwrap();
    let server = start(Tls::load(&files).unwrap(), limits).await;
    let client = ca.client();

    // A connection that never starts its handshake is closed after the
    // header timeout.
    let mut silent = TcpStream::connect(server.addr).await.unwrap();
    let started = std::time::Instant::now();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "still open after 5 s");
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
    drop(silent);

    // An oversized request head is answered 431, as over plain HTTP.
    let mut stream = connect(&client, server.addr).await.unwrap();
    let junk = format!("x-junk: {}\r\n", "x".repeat(128 * 1024));
    let answer = exchange(&mut stream, &request("GET", "/healthz", &junk, b"")).await;
    assert_eq!(answer.expect("a 431").status, 431);
    drop(stream);

    // Past max_connections: a 503 over TLS, with Retry-After. (The places
    // of the connections above come back once their lingering sees the
    // client's close.)
    let mut held = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while held.len() < 2 {
        let mut stream = connect(&client, server.addr).await.unwrap();
        if healthz(&mut stream).await == 200 {
            held.push(stream);
        } else {
            assert!(tokio::time::Instant::now() < deadline, "no place came back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut refused = connect(&client, server.addr).await.expect("a handshake");
    refused
        .write_all(&request("GET", "/healthz", "", b""))
        .await
        .unwrap();
    let answer = read_answer(&mut refused).await.expect("a 503");
    assert_eq!(answer.status, 503);
    assert!(answer
        .headers
        .contains(&("retry-after".to_owned(), "1".to_owned())));
}
