//! Lingering close, against a real listener: a client whose request body the
//! server never reads still gets its whole answer, never a reset, when the
//! connection closes after it.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{read_answer, request, Answer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Requests per route.
const PER_ROUTE: usize = 200;

/// Sends `head`, then (a moment later, so that it arrives after the server
/// read the head) `body`, over a `Connection: close` connection; reads the
/// answer whole, then to EOF. Any reset on the way is the error.
async fn close_after(addr: std::net::SocketAddr, head: &[u8], body: &[u8]) -> std::io::Result<Answer> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    stream.write_all(head).await?;
    if !body.is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
        stream.write_all(body).await?;
    }
    let answer = read_answer(&mut stream).await?;
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await?;
    Ok(answer)
}

/// Splits a request into its head and its body.
fn split(request: &[u8]) -> (&[u8], &[u8]) {
    let at = request.windows(4).position(|w| w == b"\r\n\r\n").expect("a head") + 4;
    request.split_at(at)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_to_requests_whose_body_is_not_read_arrive_whole() {
    let server = support::start_plain(support::ledger("[labels]\nmax_lanes = 1000\n")).await;
    let addr = server.addr;
    let mut id = String::new();
    for lane in 0..600 {
        let body = json!({"service": format!("svc-{lane}"), "provider": "ollama", "class": "embedding"});
        let begin = request(
            "POST",
            "/v1/activities",
            "connection: close\r\n",
            body.to_string().as_bytes(),
        );
        let answer = close_after(addr, &begin, &[]).await.expect("a begin");
        assert_eq!(answer.status, 201, "{}", String::from_utf8_lossy(&answer.body));
        id = answer.json()["activityId"].as_str().unwrap().to_owned();
    }

    let small = br#"{"a": "small body the route does not read"}"#;
    let activity = format!("/v1/activities/{id}");
    let routes = [
        ("GET", "/v1/snapshot"),
        ("GET", "/metrics"),
        ("GET", activity.as_str()),
        ("GET", "/healthz"),
        ("POST", "/v1/reap"),
    ];
    let mut tasks = Vec::new();
    for (method, path) in routes {
        let whole = request(method, path, "connection: close\r\n", small);
        let label = format!("{method} {path}");
        tasks.push(tokio::spawn(async move {
            let (head, body) = split(&whole);
            let mut failures = Vec::new();
            for _ in 0..PER_ROUTE {
                match close_after(addr, head, body).await {
                    Ok(answer) if answer.status == 200 => {}
                    Ok(answer) => failures.push(format!("status {}", answer.status)),
                    Err(err) => failures.push(err.to_string()),
                }
            }
            (label, failures)
        }));
    }
    let mut failed = Vec::new();
    for task in tasks {
        let (label, failures) = task.await.unwrap();
        if !failures.is_empty() {
            failed.push(format!(
                "{label}: {} of {PER_ROUTE} failed, e.g. {}",
                failures.len(),
                failures[0]
            ));
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_past_the_body_limit_gets_its_413_whole() {
    let server = support::start_plain(support::ledger("")).await;
    let body = vec![b' '; 2 * 1024 * 1024];
    let mut failures = Vec::new();
    for _ in 0..50 {
        let head = format!(
            "POST /v1/activities HTTP/1.1\r\nhost: inflight\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            body.len()
        );
        // The client sends its whole request, in pieces as a network
        // delivers them, then reads: as a client that does not look for an
        // early answer does. Without lingering, the server's close resets
        // the connection while it still sends, and the answer is lost.
        let answer = tokio::time::timeout(Duration::from_secs(10), async {
            let mut stream = TcpStream::connect(server.addr).await?;
            stream.write_all(head.as_bytes()).await?;
            for piece in body.chunks(64 * 1024) {
                stream.write_all(piece).await?;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let answer = read_answer(&mut stream).await?;
            let mut rest = Vec::new();
            stream.read_to_end(&mut rest).await?;
            Ok::<_, std::io::Error>(answer)
        })
        .await
        .expect("an answer within 10 s");
        match answer {
            Ok(answer) if answer.status == 413 => {
                assert_eq!(answer.json()["error"]["code"], "payload_too_large");
                // So that a client does not send another request on it.
                assert!(answer
                    .headers
                    .contains(&("connection".to_owned(), "close".to_owned())));
            }
            Ok(answer) => failures.push(format!("status {}", answer.status)),
            Err(err) => failures.push(err.to_string()),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 50 failed, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
}

/// How long the server lingers at most (`linger::LINGER_TIME`).
const LINGER_TIME: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lingering_adds_no_wait_to_a_clean_close() {
    let server = support::start_plain(support::ledger("")).await;
    for _ in 0..20 {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let asked = std::time::Instant::now();
        // The client reads to EOF without closing its side first: the EOF
        // is the server's FIN, sent before it lingers.
        stream
            .write_all(&request("GET", "/healthz", "connection: close\r\n", b""))
            .await
            .unwrap();
        let answer = read_answer(&mut stream).await.unwrap();
        assert_eq!(answer.status, 200);
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await.unwrap();
        // A FIN sent after lingering would come only once the linger bound
        // ran out (the client sends nothing more), counted from after the
        // request arrived.
        let took = asked.elapsed();
        assert!(
            took < LINGER_TIME,
            "EOF {took:?} after the request: the FIN waited for the linger"
        );
    }
}
