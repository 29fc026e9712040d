//! `inflight check-config` and `inflight serve` read a configuration file
//! with one validation: a file one refuses, the other refuses with the same
//! key and message, and what is valid but likely a mistake is said by both.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

fn inflight(dir: &Path, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_inflight"))
        .args(args)
        .current_dir(dir)
        .env_remove("INFLIGHT_STORE")
        .env_remove("INFLIGHT_LISTEN")
        .env_remove("INFLIGHT_TOKEN")
        .env_remove("INFLIGHT_CONFIG")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary runs");
    // A file that `serve` took would serve forever: stop it.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("waits").is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().expect("kills");
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

#[test]
fn check_config_and_serve_refuse_the_same_files_with_the_same_error() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text, says) in [
        (
            "scheme.toml",
            "store = \"sqlit://x.db\"\n",
            "store: unsupported store URL",
        ),
        (
            "param.toml",
            "store = \"sqlite://x.db?journal=wal\"\n",
            "store: store URL",
        ),
        (
            "pool.toml",
            "store = \"postgres://db/x?pool=0\"\n",
            "store: store URL",
        ),
        (
            "cap.toml",
            "[lanes.\"kb::ollama\"]\ncap = \"4\"\n",
            "lanes.\"kb::ollama\".cap: invalid type",
        ),
        ("factor.toml", "[reap]\nfactor = 0.5\n", "reap.factor:"),
        (
            "deadline.toml",
            "[classes.chat]\ndeadline = \"soon\"\n",
            "classes.chat.deadline:",
        ),
        (
            "timeout.toml",
            "[server]\nbody_timeout = \"2h\"\n",
            "server.body_timeout:",
        ),
    ] {
        let file = dir.path().join(name);
        std::fs::write(&file, text).unwrap();
        let file = file.to_str().unwrap();
        let checked = inflight(dir.path(), &["check-config", file]);
        let served = inflight(
            dir.path(),
            &["serve", "--config", file, "--listen", "127.0.0.1:0"],
        );
        let checked_err = String::from_utf8_lossy(&checked.stderr);
        let served_err = String::from_utf8_lossy(&served.stderr);
        assert_eq!(
            checked.status.code(),
            Some(2),
            "check-config {text}: {checked_err}"
        );
        assert_eq!(served.status.code(), Some(2), "serve {text}: {served_err}");
        assert!(checked_err.contains(says), "{text}: {checked_err}");
        assert_eq!(checked_err, served_err, "{text}");
    }
    assert!(
        !dir.path().join("x.db").exists(),
        "nothing was opened to check a file"
    );
}

#[test]
fn check_config_warns_of_bare_milliseconds_and_dropped_classes_and_still_passes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("warned.toml");
    std::fs::write(
        &file,
        "store = \"memory:\"\n[classes.embeding]\ndeadline = 300\n[lanes.\"kb::ollama\"]\ncap = 4\n",
    )
    .unwrap();
    let checked = inflight(dir.path(), &["check-config", file.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert_eq!(checked.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("warning: classes.embeding.deadline: 300 means 300 ms; write \"300s\" for seconds"),
        "{stderr}"
    );
    assert!(
        stderr.contains("warning: classes: replaces the built-in classes, leaving out chat and embedding"),
        "{stderr}"
    );
}

/// The address in the server's `listening on http://ADDR` line; the rest
/// of its log is drained in the background, so that it never blocks on a
/// full pipe.
fn listening_address(stderr: std::process::ChildStderr) -> String {
    use std::io::{BufRead, BufReader};
    let (found, address) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut found = Some(found);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some((_, rest)) = line.split_once("listening on http://") {
                let addr = rest.split_whitespace().next().unwrap_or_default().to_owned();
                if let Some(found) = found.take() {
                    let _ = found.send(addr);
                }
            }
        }
    });
    address
        .recv_timeout(Duration::from_secs(20))
        .expect("the server logs where it listens")
}

/// Sends one HTTP/1.1 request and returns the answer's status line.
fn post(port: u16, path: &str, body: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connects");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer.lines().next().unwrap_or_default().to_owned()
}

#[test]
fn check_config_against_a_server_names_a_misspelled_lane_and_an_unknown_class() {
    let dir = tempfile::tempdir().unwrap();
    // Port 0, and the address read from the server's own log: a port picked
    // beforehand and freed could be taken by another test's server first.
    let mut server = Command::new(env!("CARGO_BIN_EXE_inflight"))
        .args(["serve", "--store", "memory:", "--listen", "127.0.0.1:0"])
        .current_dir(dir.path())
        .env_remove("INFLIGHT_CONFIG")
        .env_remove("INFLIGHT_TOKEN")
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the server starts");
    let listen = listening_address(server.stderr.take().expect("piped stderr"));
    let port: u16 = listen.rsplit_once(':').unwrap().1.parse().unwrap();
    for _ in 0..2 {
        let status = post(
            port,
            "/v1/activities",
            r#"{"service":"knowledge-base","provider":"ollama","class":"embeding"}"#,
        );
        assert!(status.contains("201"), "{status}");
    }
    let file = dir.path().join("olama.toml");
    std::fs::write(&file, "[lanes.\"knowledge-base::olama\"]\ncap = 4\n").unwrap();
    let url = format!("http://{listen}");
    let checked = inflight(
        dir.path(),
        &["check-config", file.to_str().unwrap(), "--against", &url],
    );
    server.kill().unwrap();
    let _ = server.wait();
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert_eq!(checked.status.code(), Some(0), "warnings only: {stderr}");
    assert!(
        stderr.contains(&format!(
            "warning: lane knowledge-base::olama is capped at 4 but has no calls on {url} since "
        )) && stderr.contains("while knowledge-base::ollama (one or two edits away) has")
            && stderr.contains("(lane_unused_near_miss)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("warning: class embeding (did you mean embedding?) is not configured")
            && stderr.contains("(unknown_class)"),
        "{stderr}"
    );
}
