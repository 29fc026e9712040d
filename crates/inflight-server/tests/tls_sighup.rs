//! The real SIGHUP path: `serve` re-reads its certificate and key when the
//! process gets SIGHUP. Alone in its test binary, since the signal goes to
//! the whole process.

mod support;

use std::time::Duration;

use inflight::Settings;
use inflight_server::{Overrides, ServerSettings};
use support::certs::{connect, files, presented, Ca};
use support::{exchange, request};

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_makes_serve_re_read_its_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, files) = (Ca::new("inflight test CA"), files(dir.path()));
    let first = ca.issue(&files);
    // A free port, for `serve` binds its own listener.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let overrides = Overrides {
        listen: Some(addr.to_string()),
        store: Some("memory:".to_owned()),
        tls_cert: Some(files.cert.clone()),
        tls_key: Some(files.key.clone()),
        ..Overrides::default()
    };
    let settings = ServerSettings::merge(&overrides, Settings::default()).unwrap();
    tokio::spawn(inflight_server::serve(settings));
    let client = ca.client();

    // Once a handshake succeeds, `serve` is past installing its SIGHUP
    // handler (it does so first), and the signal no longer ends the process.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut open = loop {
        match connect(&client, addr).await {
            Ok(stream) => break stream,
            Err(err) => {
                assert!(tokio::time::Instant::now() < deadline, "never served: {err}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(presented(&open), first);

    let second = ca.issue(&files);
    let status = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .expect("the kill program");
    assert!(status.success());
    loop {
        let fresh = connect(&client, addr).await.expect("a handshake");
        if presented(&fresh) == second {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "SIGHUP did not reload");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let answer = exchange(&mut open, &request("GET", "/healthz", "", b"")).await;
    assert_eq!(
        answer.expect("an answer").status,
        200,
        "the open connection goes on"
    );
}
