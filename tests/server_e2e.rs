//! End to end: the real `inflight` binary on a free port and a temporary
//! SQLite file. Polling a real process is unavoidable here; every wait is a
//! bounded loop with a generous limit, so a loaded machine only makes it
//! slower.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::load::kill_9_under_load;
use common::{config_file, inflight, sqlite, Launch, Server, PATIENCE};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// The store URL of a fresh SQLite file in `dir`.
fn temp_store(dir: &tempfile::TempDir) -> String {
    sqlite(&dir.path().join("inflight.db"), None)
}

async fn run_cli(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut command = inflight();
    command.args(args);
    for (key, value) in env {
        command.env(key, value);
    }
    let output = tokio::time::timeout(PATIENCE, command.output())
        .await
        .expect("the command finishes")
        .expect("the binary runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lifecycle_over_http_with_a_token_the_cli_and_a_graceful_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let store = temp_store(&dir);
    let mut server = Server::start(Launch {
        store: Some(store.clone()),
        // flag > environment: the environment's address is not local.
        args: vec!["--listen".into(), "127.0.0.1:0".into()],
        env: vec![
            ("INFLIGHT_LISTEN", "192.0.2.1:9".into()),
            ("INFLIGHT_TOKEN", "e2e-token".into()),
        ],
        token: Some("e2e-token"),
    })
    .await;

    let (status, health) = server.get("/healthz").await;
    assert_eq!((status, health), (200, json!({"status": "ok"})));
    let unauthorized = reqwest::get(format!("{}/v1/snapshot", server.base))
        .await
        .unwrap();
    assert_eq!(unauthorized.status().as_u16(), 401);

    let id = server
        .begin(json!({"service": "knowledge-base", "provider": "ollama", "class": "embedding"}))
        .await;
    let (status, started) = server
        .post(&format!("/v1/activities/{id}/start"), json!({}))
        .await;
    assert_eq!((status, &started["state"]), (200, &json!("executing")));
    let (status, settled) = server
        .post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
        .await;
    assert_eq!((status, &settled["state"]), (200, &json!("succeeded")));
    let (status, fetched) = server.get(&format!("/v1/activities/{id}")).await;
    assert_eq!((status, fetched), (200, settled));
    let waiting = server
        .begin(json!({"service": "knowledge-base", "provider": "ollama"}))
        .await;

    let (status, snapshot) = server.get("/v1/snapshot?limit=10&since=1h").await;
    assert_eq!(status, 200);
    assert_eq!(snapshot["totalActivities"], 2);
    assert_eq!(snapshot["totalRecentCompletions"], 1);
    assert_eq!(
        snapshot["nativeAdmission"]["knowledge-base::ollama"]["waiting"],
        1
    );
    let (status, reaped) = server.post("/v1/reap", json!({})).await;
    assert_eq!((status, reaped), (200, json!({"abandoned": 0, "unsettled": 0})));

    // The CLI, as an operator runs it.
    let base = server.base.clone();
    let server_flag = ["--server", base.as_str()];
    let (code, table, _) = run_cli(
        &["snapshot", server_flag[0], server_flag[1]],
        &[("INFLIGHT_TOKEN", "e2e-token")],
    )
    .await;
    assert_eq!(code, Some(0), "{table}");
    assert!(table.contains("knowledge-base::ollama"), "{table}");
    assert!(
        table.contains(&waiting[waiting.len() - 8..]),
        "the in-flight record is listed by the end of its id: {table}"
    );
    let (code, raw, _) = run_cli(
        &[
            "snapshot",
            "--json",
            "--token",
            "e2e-token",
            server_flag[0],
            server_flag[1],
        ],
        &[],
    )
    .await;
    assert_eq!(code, Some(0));
    let raw: Value = serde_json::from_str(&raw).expect("--json prints the snapshot");
    assert_eq!(raw["totalActivities"], 2);
    let (code, out, _) = run_cli(
        &["reap", "--token", "e2e-token", server_flag[0], server_flag[1]],
        &[],
    )
    .await;
    assert_eq!(code, Some(0));
    assert!(out.contains("reaped 0 abandoned"), "{out}");
    let (code, _, err) = run_cli(&["snapshot", server_flag[0], server_flag[1]], &[]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("requires a token"), "{err}");

    // SIGTERM: a graceful shutdown, exit 0.
    let pid = server.child.id().expect("running").to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().await.unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(PATIENCE, server.child.wait())
        .await
        .expect("the server stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "graceful shutdown exits 0: {status}");

    // Nothing listens any more: a clear one-line error, exit 1.
    let (code, out, err) = run_cli(&["snapshot", server_flag[0], server_flag[1]], &[]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(err.contains("cannot connect"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line, no backtrace: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_takes_the_short_ids_its_tables_show() {
    let dir = tempfile::tempdir().unwrap();
    let store = temp_store(&dir);
    let server = Server::start(Launch {
        store: Some(store.clone()),
        args: vec!["--listen".into(), "127.0.0.1:0".into()],
        ..Launch::default()
    })
    .await;
    let base = server.base.clone();
    let at = ["--server", base.as_str()];
    // UUIDv7s begun together share their first 8 characters.
    let first = server.begin(json!({"service": "kb", "provider": "ollama"})).await;
    let second = server.begin(json!({"service": "kb", "provider": "ollama"})).await;
    let (status, owner) = server.post("/v1/owners", json!({"name": "worker-a"})).await;
    assert_eq!(status, 201, "{owner}");
    let owner = owner["ownerId"].as_str().unwrap().to_owned();
    let short = |id: &str| id[id.len() - 8..].to_owned();

    let (code, table, err) = run_cli(&["snapshot", at[0], at[1]], &[]).await;
    assert_eq!(code, Some(0), "{err}");
    for id in [&first, &second, &owner] {
        assert!(table.contains(&short(id)), "{id} by its end: {table}");
        assert!(!table.contains(id.as_str()), "{id} is shortened: {table}");
    }

    // A short id names the record; so does the whole id.
    let (code, shown, err) = run_cli(&["show", &short(&first), at[0], at[1]], &[]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(shown.starts_with("activityId: "), "{shown}");
    assert!(shown.contains(&first) && shown.contains("waiting"), "{shown}");
    let (code, shown, _) = run_cli(&["show", "--json", &first, at[0], at[1]], &[]).await;
    assert_eq!(code, Some(0));
    let shown: Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["activityId"], first.as_str());

    let (code, out, err) = run_cli(
        &["cancel", &short(&second), "--reason", "operator", at[0], at[1]],
        &[],
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), format!("activity {second}: cancelled"));
    let (_, record) = server.get(&format!("/v1/activities/{second}")).await;
    assert_eq!(record["state"], "cancelled");
    // Still found once it completed.
    let (code, _, err) = run_cli(&["show", &short(&second), at[0], at[1]], &[]).await;
    assert_eq!(code, Some(0), "{err}");

    let (code, out, err) = run_cli(&["release", &short(&owner), at[0], at[1]], &[]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&owner) && out.contains("released"), "{out}");

    // A suffix no id has, or one every id has, is a clear error.
    let (code, _, err) = run_cli(&["show", "deadbeef", at[0], at[1]], &[]).await;
    assert_eq!(code, Some(1));
    assert!(
        err.contains("no activity the server's snapshot lists ends with \"deadbeef\""),
        "{err}"
    );
    let shared = first
        .chars()
        .rev()
        .zip(second.chars().rev())
        .take_while(|(a, b)| a == b)
        .count();
    if shared > 0 {
        let suffix = &first[first.len() - shared..];
        let (code, _, err) = run_cli(&["show", suffix, at[0], at[1]], &[]).await;
        assert_eq!(code, Some(1));
        assert!(
            err.contains("ambiguous") && err.contains(&first) && err.contains(&second),
            "{err}"
        );
    }
    // (An ambiguous one is tested in `cli::ids`: ids here rarely share an end.)
}

/// A server on the memory store with one record waiting on `kb::ollama`.
async fn server_with_one_record() -> Server {
    let server = Server::start(Launch {
        args: vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--store".into(),
            "memory:".into(),
        ],
        ..Launch::default()
    })
    .await;
    server.begin(json!({"service": "kb", "provider": "ollama"})).await;
    server
}

/// Reads `stdout` until `done` says what was read is enough.
async fn read_until(stdout: &mut (impl tokio::io::AsyncRead + Unpin), done: impl Fn(&str) -> bool) -> String {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let read = async {
        let mut buffer = [0u8; 4096];
        while !done(&String::from_utf8_lossy(&seen)) {
            let read = stdout.read(&mut buffer).await.expect("stdout reads");
            assert!(read > 0, "the watch ended: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buffer[..read]);
        }
    };
    tokio::time::timeout(PATIENCE, read).await.expect("enough frames");
    String::from_utf8_lossy(&seen).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_watch_redraws_in_place_on_a_terminal_until_ctrl_c() {
    use tokio::io::AsyncWriteExt;
    let server = server_with_one_record().await;
    // A real terminal: `script` runs the watch on a pseudo-terminal of its
    // own and copies what it writes; Ctrl-C is typed into it.
    let watch = format!(
        "exec '{}' snapshot --watch --interval 500ms --server {}",
        common::BIN,
        server.base
    );
    let mut script = Command::new("script")
        .args(["-qfec", &watch, "/dev/null"])
        .env_remove("INFLIGHT_URL")
        .env_remove("INFLIGHT_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("`script` (util-linux) runs");
    let mut stdout = script.stdout.take().unwrap();
    // Three frames, each after a clear screen and home.
    let text = read_until(&mut stdout, |seen| seen.matches("\x1b[2J\x1b[H").count() >= 3).await;
    let frames: Vec<&str> = text.split("\x1b[2J\x1b[H").skip(1).collect();
    for frame in &frames[..2] {
        assert!(frame.contains("kb::ollama"), "{frame}");
        assert!(frame.contains("every 500ms; Ctrl-C to stop"), "{frame}");
    }
    // Ctrl-C: it stops cleanly (`script -e` exits with the watch's status).
    let mut stdin = script.stdin.take().unwrap();
    stdin.write_all(b"\x03").await.unwrap();
    stdin.flush().await.unwrap();
    let rest = async {
        use tokio::io::AsyncReadExt;
        let mut rest = Vec::new();
        stdout.read_to_end(&mut rest).await.map(|_| rest)
    };
    tokio::time::timeout(PATIENCE, rest)
        .await
        .expect("the watch stops on Ctrl-C")
        .unwrap();
    let status = tokio::time::timeout(PATIENCE, script.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_watch_into_a_pipe_prints_each_snapshot_after_the_last() {
    let server = server_with_one_record().await;
    for json in [false, true] {
        let mut args = vec![
            "snapshot",
            "--watch",
            "--interval",
            "500ms",
            "--server",
            &server.base,
        ];
        if json {
            args.push("--json");
        }
        let mut watch = inflight()
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("the binary starts");
        let mut stdout = watch.stdout.take().unwrap();
        let text = if json {
            read_until(&mut stdout, |seen| seen.matches('\n').count() >= 3).await
        } else {
            read_until(&mut stdout, |seen| seen.matches("snapshot at ").count() >= 3).await
        };
        assert!(!text.contains('\x1b'), "no screen codes in a pipe: {text:?}");
        assert!(!text.contains("Ctrl-C"), "no footer in a pipe: {text:?}");
        if json {
            // JSON lines: each line one whole snapshot.
            for line in text.lines().take(3) {
                let snapshot: Value = serde_json::from_str(line).expect("a JSON line");
                assert_eq!(snapshot["nativeAdmission"]["kb::ollama"]["waiting"], 1, "{line}");
            }
        } else {
            // Tables one after another, each followed by a blank line.
            let tables: Vec<&str> = text.split("\n\nsnapshot at ").collect();
            assert!(tables.len() >= 3, "{text}");
            for table in &tables[..2] {
                assert!(table.contains("kb::ollama"), "{table}");
            }
        }
        let pid = watch.id().expect("running").to_string();
        let killed = Command::new("kill").args(["-INT", &pid]).status().await.unwrap();
        assert!(killed.success());
        let status = tokio::time::timeout(PATIENCE, watch.wait())
            .await
            .expect("the watch stops on SIGINT")
            .unwrap();
        assert!(status.success(), "{status}");
    }

    // A reader that is done (`| head -1`) ends the watch quietly.
    let mut watch = inflight()
        .args([
            "snapshot",
            "--watch",
            "--json",
            "--interval",
            "500ms",
            "--server",
            &server.base,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the binary starts");
    let mut stdout = watch.stdout.take().unwrap();
    read_until(&mut stdout, |seen| seen.contains('\n')).await;
    drop(stdout);
    let output = tokio::time::timeout(PATIENCE, watch.wait_with_output())
        .await
        .expect("the watch stops when its reader is gone")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}: {stderr}", output.status);
    assert!(stderr.is_empty(), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_takes_host_port_and_inflight_url_and_says_how_to_write_an_address() {
    let server = server_with_one_record().await;
    let host_port = server.base.trim_start_matches("http://").to_owned();

    // `--server HOST:PORT` is http://HOST:PORT.
    let (code, table, err) = run_cli(&["snapshot", "--server", &host_port], &[]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(table.contains("kb::ollama"), "{table}");
    // INFLIGHT_URL, as the clients read it, when there is no --server...
    let (code, out, err) = run_cli(&["reap"], &[("INFLIGHT_URL", &server.base)]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("reaped 0 abandoned"), "{out}");
    let (code, _, err) = run_cli(&["snapshot"], &[("INFLIGHT_URL", &host_port)]).await;
    assert_eq!(code, Some(0), "{err}");
    // ...and --server over it.
    let (code, _, err) = run_cli(
        &["snapshot", "--server", &host_port],
        &[("INFLIGHT_URL", "http://127.0.0.1:1")],
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = run_cli(&["snapshot"], &[("INFLIGHT_URL", "http://127.0.0.1:1")]).await;
    assert_eq!(code, Some(1));
    assert!(
        err.contains("cannot connect") && err.contains("127.0.0.1:1"),
        "{err}"
    );

    // Anything else is refused, saying how to write it.
    for bad in ["127.0.0.1:port", "two words:7878", "ftp://127.0.0.1:21"] {
        let (code, _, err) = run_cli(&["snapshot", "--server", bad], &[]).await;
        assert_eq!(code, Some(1), "{bad}");
        assert!(
            err.contains("http://HOST:PORT") || err.contains("only http:// and https:// URLs"),
            "{bad}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_tells_a_missing_token_from_a_wrong_one_and_prints_what_a_scope_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = config_file(
        &dir,
        "[[tokens]]\ntoken = \"write-secret\"\nscope = \"write\"\n\
         [[tokens]]\ntoken = \"read-secret\"\nscope = \"read\"\n",
    );
    args.extend(["--store".into(), "memory:".into()]);
    let server = Server::start(Launch {
        args,
        token: Some("write-secret"),
        ..Launch::default()
    })
    .await;
    let at = ["--server", server.base.as_str()];

    let (code, _, err) = run_cli(&["snapshot", at[0], at[1]], &[]).await;
    assert_eq!(code, Some(1));
    assert!(
        err.contains("requires a token: pass --token TOKEN or set INFLIGHT_TOKEN"),
        "{err}"
    );
    for wrong in [
        vec!["snapshot", "--token", "guess", at[0], at[1]],
        vec!["snapshot", at[0], at[1]],
    ] {
        let (code, _, err) = run_cli(&wrong, &[("INFLIGHT_TOKEN", "guess")]).await;
        assert_eq!(code, Some(1));
        assert!(
            err.contains("does not accept the token given (--token or INFLIGHT_TOKEN)"),
            "{err}"
        );
        assert!(!err.contains("Authorization"), "no HTTP header to set: {err}");
    }
    // A read token reads, and a write is refused with what it lacks.
    let (code, _, err) = run_cli(&["snapshot", "--token", "read-secret", at[0], at[1]], &[]).await;
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = run_cli(&["reap", "--token", "read-secret", at[0], at[1]], &[]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("refused this token (403 Forbidden)"), "{err}");
    assert!(err.contains("needs a write token"), "the server's reason: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn help_names_every_command_and_shows_the_logging_flags_once() {
    let (code, top, _) = run_cli(&["--help"], &[]).await;
    assert_eq!(code, Some(0));
    let description = top.lines().next().unwrap();
    for command in [
        "serve",
        "snapshot",
        "show",
        "cancel",
        "release",
        "reap",
        "check-config",
        "demo",
    ] {
        assert!(description.contains(command), "{command}: {description}");
        let (code, help, _) = run_cli(&[command, "--help"], &[]).await;
        assert_eq!(code, Some(0));
        assert!(!help.contains("--log-format"), "{command}: {help}");
    }
    assert_eq!(top.matches("--log-format").count(), 1, "{top}");
    // Still taken after the command.
    let (code, _, err) = run_cli(&["demo", "--log-format", "json"], &[]).await;
    assert_eq!(code, Some(0), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_survive_kill_9_and_the_restarted_server_reaps_those_in_flight() {
    records_survive_kill_9(None).await;
}

/// `synchronous = normal` loses nothing on a process crash either: only a
/// power loss may cost it the last acknowledged transitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_survive_kill_9_under_synchronous_normal() {
    records_survive_kill_9(Some("normal")).await;
}

async fn records_survive_kill_9(synchronous: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir.path().join("inflight.db"), synchronous);
    let first = Server::start(Launch {
        store: Some(store.clone()),
        args: vec!["--listen".into(), "127.0.0.1:0".into()],
        ..Launch::default()
    })
    .await;
    let kb = json!({"service": "knowledge-base", "provider": "ollama", "class": "embedding"});
    let settled = first.begin(kb.clone()).await;
    first
        .post(
            &format!("/v1/activities/{settled}/settle"),
            json!({"success": true}),
        )
        .await;
    let executing = first.begin(kb.clone()).await;
    first
        .post(&format!("/v1/activities/{executing}/start"), json!({}))
        .await;
    let waiting = first.begin(kb).await;
    first.crash().await;

    // A short class deadline; the file is named by the environment, whose
    // address wins over the file's (not local, so it could not bind).
    let config = dir.path().join("short.toml");
    std::fs::write(
        &config,
        "listen = \"192.0.2.1:9\"\n[reap]\nfactor = 1\ninterval = \"100ms\"\n\
         [classes.embedding]\ndeadline = \"200ms\"\n",
    )
    .unwrap();
    let mut second = Server::start(Launch {
        store: Some(store.clone()),
        env: vec![
            ("INFLIGHT_CONFIG", config.display().to_string()),
            ("INFLIGHT_LISTEN", "127.0.0.1:0".into()),
        ],
        ..Launch::default()
    })
    .await;
    // The timer reaps them, with no reader at all.
    // Nothing reads meanwhile: the reaper reaps them, one event each.
    let mut reaped = (0, 0);
    while reaped != (1, 1) {
        let line = second
            .wait_for_log("the reaper to reap the records in flight at the crash", |line| {
                line["target"] == "inflight::reap" && line["fields"]["disposition"].is_string()
            })
            .await;
        match line["fields"]["disposition"].as_str() {
            Some("abandoned") => reaped.0 += 1,
            _ => reaped.1 += 1,
        }
    }

    let (status, record) = second.get(&format!("/v1/activities/{settled}")).await;
    assert_eq!((status, &record["state"]), (200, &json!("succeeded")), "{record}");
    let (_, record) = second.get(&format!("/v1/activities/{executing}")).await;
    assert_eq!(record["state"], "reaped");
    assert_eq!(record["disposition"], "unsettled");
    let (_, record) = second.get(&format!("/v1/activities/{waiting}")).await;
    assert_eq!(record["state"], "reaped");
    assert_eq!(record["disposition"], "abandoned");
    let (_, snapshot) = second.get("/v1/snapshot").await;
    assert_eq!(snapshot["totalActivities"], 3);
    assert_eq!(snapshot["totalReaped"], 2);
    assert_eq!(
        snapshot["reapedThisRead"],
        json!({"abandoned": 0, "unsettled": 0})
    );
    let lane = &snapshot["nativeAdmission"]["knowledge-base::ollama"];
    assert_eq!(
        (lane["executing"].as_i64(), lane["waiting"].as_i64()),
        (Some(0), Some(0))
    );

    // A late settle for a record reaped across the crash is absorbed.
    let (status, late) = second
        .post(
            &format!("/v1/activities/{executing}/settle"),
            json!({"success": true}),
        )
        .await;
    assert_eq!((status, &late["lateSettle"]), (200, &json!(true)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_clients_leave_every_lane_at_zero_and_count_each_lifecycle_once() {
    const CLIENTS: usize = 8;
    const LIFECYCLES: usize = 12;
    let dir = tempfile::tempdir().unwrap();
    let store = temp_store(&dir);
    let server = std::sync::Arc::new(
        Server::start(Launch {
            store: Some(store.clone()),
            args: vec!["--listen".into(), "127.0.0.1:0".into()],
            ..Launch::default()
        })
        .await,
    );
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let server = std::sync::Arc::clone(&server);
        clients.push(tokio::spawn(async move {
            for n in 0..LIFECYCLES {
                let service = format!("svc-{}", (client + n) % 3);
                let id = server
                    .begin(json!({"service": service, "provider": "ollama", "class": "chat"}))
                    .await;
                let path = format!("/v1/activities/{id}");
                let (status, _) = server.post(&format!("{path}/start"), json!({})).await;
                assert_eq!(status, 200);
                let ending = match n % 3 {
                    0 => ("settle", json!({"success": true})),
                    1 => ("settle", json!({"success": false, "failureStage": "provider"})),
                    _ => ("cancel", json!({"reason": "client went away"})),
                };
                let (status, record) = server
                    .post(&format!("{path}/{}", ending.0), ending.1.clone())
                    .await;
                assert_eq!(status, 200, "{record}");
                // A retried settle lands once.
                let (status, again) = server.post(&format!("{path}/{}", ending.0), ending.1).await;
                assert_eq!((status, again), (200, record));
            }
        }));
    }
    for client in clients {
        client.await.expect("a client ran its lifecycles");
    }
    let (status, snapshot) = server.get("/v1/snapshot?limit=1").await;
    assert_eq!(status, 200);
    let total = (CLIENTS * LIFECYCLES) as i64;
    assert_eq!(snapshot["totalActivities"], total);
    assert_eq!(snapshot["totalRecentCompletions"], total);
    assert_eq!(snapshot["totalInFlight"], 0);
    assert_eq!(snapshot["totalReaped"], 0);
    let lanes = snapshot["nativeAdmission"].as_object().unwrap();
    assert_eq!(lanes.len(), 3);
    for (key, lane) in lanes {
        assert_eq!(lane["executing"], 0, "{key}");
        assert_eq!(lane["waiting"], 0, "{key}");
    }
    let sum = |key: &str| -> i64 {
        snapshot["aggregates"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|aggregate| aggregate[key].as_i64())
            .sum()
    };
    let third = total / 3;
    assert_eq!(
        (sum("calls"), sum("successes"), sum("failures"), sum("cancelled")),
        (total, third, third, third),
        "every lifecycle counted once: {}",
        snapshot["aggregates"]
    );
    let settled = sum("successes") + sum("failures") + sum("cancelled");
    assert_eq!(
        settled, total,
        "every lifecycle counted once: {}",
        snapshot["aggregates"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_exits_0_when_valid_and_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let valid = dir.path().join("valid.toml");
    std::fs::write(
        &valid,
        "listen = \"127.0.0.1:7878\"\nstore = \"sqlite://inflight.db\"\n[reap]\nfactor = 4\ninterval = \"10s\"\n\
         [classes.embedding]\ndeadline = \"5m\"\n[classes.chat]\ndeadline = \"10m\"\nmax_queue_wait = \"2m\"\n\
         [lanes.\"knowledge-base::ollama\"]\ncap = 4\n",
    )
    .unwrap();
    let (code, out, err) = run_cli(&["check-config", valid.to_str().unwrap()], &[]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("valid"), "{out}");

    for (text, key) in [
        ("[reap]\nfactor = 0.5\n", "reap.factor"),
        ("[classes.chat]\ndeadline = 0\n", "classes.chat.deadline"),
        ("[lanes.\"no-separator\"]\ncap = 1\n", "lanes.\"no-separator\""),
        ("bogus = 1\n", "bogus"),
        ("listen = \"7878\"\n", "listen"),
    ] {
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, text).unwrap();
        let (code, _, err) = run_cli(&["check-config", file.to_str().unwrap()], &[]).await;
        assert_eq!(code, Some(2), "{text}: {err}");
        assert!(err.contains(key), "{text}: the message names {key}: {err}");
        // `serve` refuses the same file the same way, before binding.
        let (code, _, err) = run_cli(&["serve", "--config", file.to_str().unwrap()], &[]).await;
        assert_eq!(code, Some(2), "serve {text}: {err}");
        assert!(err.contains(key), "serve {text}: {err}");
    }
    let missing = dir.path().join("missing.toml");
    let (code, _, err) = run_cli(&["check-config", missing.to_str().unwrap()], &[]).await;
    assert_eq!(code, Some(2), "{err}");
}

/// Opens a connection to `server` that sends half a request header and
/// never the rest.
async fn slow_client(server: &Server) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let addr = server.base.strip_prefix("http://").unwrap();
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connects");
    stream
        .write_all(b"POST /v1/activities HTTP/1.1\r\nHost: inflight\r\nContent-Type: appl")
        .await
        .expect("writes half a header");
    stream
}

/// Waits (bounded by `until`) for the server to close `stream`.
async fn closed_by(mut stream: tokio::net::TcpStream, until: tokio::time::Instant) -> bool {
    use tokio::io::AsyncReadExt;
    let mut sink = Vec::new();
    // EOF or a reset both mean the server let go of it.
    tokio::time::timeout_at(until, stream.read_to_end(&mut sink))
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_slow_clients_neither_starve_the_others_nor_stay_open() {
    const SLOW: usize = 5_000;
    const HEADER_TIMEOUT: Duration = Duration::from_secs(3);
    let dir = tempfile::tempdir().unwrap();
    let store = temp_store(&dir);
    let server = Server::start(Launch {
        store: Some(store.clone()),
        args: config_file(&dir, "[server]\nheader_timeout = \"3s\"\n"),
        ..Launch::default()
    })
    .await;

    let mut slow = Vec::with_capacity(SLOW);
    for _ in 0..SLOW {
        slow.push((tokio::time::Instant::now(), slow_client(&server).await));
    }

    // A well-behaved client, meanwhile: full lifecycles, each call timed.
    let mut latencies = Vec::new();
    for _ in 0..10 {
        for step in 0..3 {
            let started = std::time::Instant::now();
            match step {
                0 => {
                    let id = server
                        .begin(json!({"service": "kb", "provider": "ollama", "class": "embedding"}))
                        .await;
                    latencies.push(started.elapsed());
                    let started = std::time::Instant::now();
                    let (status, _) = server
                        .post(&format!("/v1/activities/{id}/start"), json!({}))
                        .await;
                    assert_eq!(status, 200);
                    latencies.push(started.elapsed());
                    let started = std::time::Instant::now();
                    let (status, _) = server
                        .post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
                        .await;
                    assert_eq!(status, 200);
                    latencies.push(started.elapsed());
                }
                _ => {
                    let (status, _) = server.get("/healthz").await;
                    assert_eq!(status, 200);
                    latencies.push(started.elapsed());
                }
            }
        }
    }
    latencies.sort();
    let median = latencies[latencies.len() / 2];
    let worst = *latencies.last().unwrap();
    eprintln!(
        "with {SLOW} slow connections open: {} calls, median {median:?}, worst {worst:?}",
        latencies.len()
    );
    // No call waited as long as it takes the server to cut a slow
    // connection (the header timeout): none was kept waiting for them.
    assert!(
        worst < HEADER_TIMEOUT,
        "a call took {worst:?}, as long as the header timeout that cuts the slow connections"
    );

    // Each slow connection is closed within the header timeout (plus slack
    // for a loaded machine), counted from when it was opened.
    let mut still_open = 0;
    for (opened, stream) in slow {
        if !closed_by(stream, opened + HEADER_TIMEOUT + Duration::from_secs(2)).await {
            still_open += 1;
        }
    }
    assert_eq!(
        still_open, 0,
        "slow connections left open past the header timeout"
    );
    let (status, snapshot) = server.get("/v1/snapshot").await;
    assert_eq!(status, 200);
    assert_eq!(snapshot["totalActivities"], 10, "half a header records nothing");
}

#[tokio::test]
async fn a_connection_past_max_connections_is_answered_503_with_retry_after() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let store = temp_store(&dir);
    let server = Server::start(Launch {
        store: Some(store.clone()),
        args: config_file(&dir, "[server]\nmax_connections = 20\nheader_timeout = \"30s\"\n"),
        ..Launch::default()
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..20 {
        held.push(slow_client(&server).await);
    }
    // Accepted after the twenty (the backlog is first in, first out), so
    // every permit is taken by then.
    let addr = server.base.strip_prefix("http://").unwrap();
    let mut extra = tokio::net::TcpStream::connect(addr).await.unwrap();
    extra
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: inflight\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(PATIENCE, extra.read_to_string(&mut answer))
        .await
        .expect("answered")
        .expect("readable");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("retry-after: 1"), "{answer}");
    assert!(answer.contains(r#""code":"unavailable""#), "{answer}");

    // A connection that goes away hands its place back.
    held.pop();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        // Until the server has seen the connection go, a new one is still
        // past the limit: its 503 may even come before the request is sent,
        // which the client reports as an unexpected message, not an answer.
        let answer = server.request(reqwest::Method::GET, "/healthz").send().await;
        if answer.as_ref().is_ok_and(|response| response.status() == 200) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the place never came back: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Eight clients run lifecycles until the server is killed; a server
/// restarted on the same file finds every acknowledged transition, counts
/// each record once, and reaps what was in flight.
async fn acknowledged_work_survives_kill_9_under_load(synchronous: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir.path().join("inflight.db"), synchronous);
    let figures = kill_9_under_load(&store).await;
    eprintln!(
        "kill -9 under load (SQLite, synchronous = {}): {figures}",
        synchronous.unwrap_or("full")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_work_survives_kill_9_under_load_synchronous_full() {
    acknowledged_work_survives_kill_9_under_load(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_work_survives_kill_9_under_load_synchronous_normal() {
    acknowledged_work_survives_kill_9_under_load(Some("normal")).await;
}

/// The server's resident memory, in KiB, from /proc.
fn resident_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches(" kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Floods of 404s, malformed JSON, oversized headers and bodies, and
/// bodies that trickle: every one answered its 4xx, never 5xx nor a reset,
/// while a well-behaved client keeps being served and memory stays put.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_of_bad_requests_get_4xx_while_good_clients_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const FLOODERS: usize = 6;
    const REQUESTS: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let store = temp_store(&dir);
    let server = Server::start(Launch {
        store: Some(store.clone()),
        args: config_file(&dir, "[server]\nbody_timeout = \"1s\"\nheader_timeout = \"2s\"\n"),
        ..Launch::default()
    })
    .await;
    let pid = server.child.id().expect("running");
    let before = resident_kib(pid);
    let addr = server.base.strip_prefix("http://").unwrap().to_owned();

    let mut flooders = Vec::new();
    for kind in 0..FLOODERS {
        let (base, addr) = (server.base.clone(), addr.clone());
        flooders.push(tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap();
            let mut statuses = Vec::new();
            for i in 0..REQUESTS {
                let status = match kind {
                    0 => http.get(format!("{base}/nowhere/{i}")).send().await.map(|r| r.status().as_u16()),
                    1 => http
                        .post(format!("{base}/v1/activities"))
                        .header("content-type", "application/json")
                        .body(format!("{{\"service\": \"kb\", \"provider\": [{i}"))
                        .send()
                        .await
                        .map(|r| r.status().as_u16()),
                    2 => http
                        .post(format!("{base}/v1/activities"))
                        .header("content-type", "application/json")
                        .body(vec![b' '; 200 * 1024])
                        .send()
                        .await
                        .map(|r| r.status().as_u16()),
                    3 => http
                        .get(format!("{base}/v1/snapshot"))
                        .header("x-junk", "x".repeat(128 * 1024))
                        .send()
                        .await
                        .map(|r| r.status().as_u16()),
                    4 => http
                        .post(format!("{base}/v1/activities/{i}/settle"))
                        .body("{\"success\": \"maybe\"}")
                        .send()
                        .await
                        .map(|r| r.status().as_u16()),
                    _ => {
                        // A body that trickles: one byte, then nothing.
                        if i % 30 != 0 {
                            continue;
                        }
                        let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
                        stream
                            .write_all(
                                b"POST /v1/activities HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                                  Content-Length: 100\r\n\r\n{",
                            )
                            .await
                            .unwrap();
                        let mut answer = String::new();
                        let _ = tokio::time::timeout(PATIENCE, stream.read_to_string(&mut answer)).await;
                        let status = answer.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
                        Ok(status)
                    }
                };
                // A connection the server cut is no answer at all (0).
                statuses.push(status.unwrap_or(0));
            }
            (kind, statuses)
        }));
    }

    // Meanwhile, a well-behaved client.
    let mut latencies = Vec::new();
    for _ in 0..30 {
        let started = std::time::Instant::now();
        let id = server
            .begin(json!({"service": "kb", "provider": "ollama", "class": "embedding"}))
            .await;
        let (status, _) = server
            .post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
            .await;
        assert_eq!(status, 200);
        latencies.push(started.elapsed());
    }
    let mut by_kind = Vec::new();
    for flooder in flooders {
        by_kind.push(flooder.await.unwrap());
    }
    latencies.sort();
    let median = latencies[latencies.len() / 2];
    eprintln!(
        "under the flood: a begin and a settle took median {median:?}, worst {:?}",
        latencies.last().unwrap()
    );
    for (kind, statuses) in &by_kind {
        let server_errors: Vec<_> = statuses.iter().filter(|s| **s >= 500).collect();
        assert!(
            server_errors.is_empty(),
            "flood {kind} got 5xx: {server_errors:?}"
        );
        let expected: &[u16] = match kind {
            0 => &[404],
            1 | 4 => &[400],
            // The answer comes before the whole body (or head) was sent,
            // and the connection closes after it: the server lingers,
            // discarding the rest, so the client still sending gets it.
            2 => &[413],
            3 => &[431],
            _ => &[408],
        };
        assert!(
            statuses.iter().all(|s| expected.contains(s)),
            "flood {kind}: expected {expected:?}, got {:?}",
            statuses.iter().collect::<std::collections::BTreeSet<_>>()
        );
    }
    let after = resident_kib(pid);
    eprintln!(
        "server memory: {before} KiB before, {after} KiB after {} bad requests",
        FLOODERS * REQUESTS
    );
    assert!(
        after < before + 64 * 1024,
        "memory grew from {before} KiB to {after} KiB"
    );
    let (_, snapshot) = server.get("/v1/snapshot").await;
    assert_eq!(snapshot["totalActivities"], 30, "bad requests record nothing");
}

/// The environment a slot-holding child process reads: the server's base URL.
const HOLDER_BASE: &str = "INFLIGHT_TEST_HOLDER_BASE";

/// Child process: registers an owner with a one-second lease, takes a slot
/// on the capped lane, says so, and renews until it is killed. Run by hand
/// (without the environment), it does nothing.
#[tokio::test]
#[ignore = "a child process of killed_client_processes_give_their_slots_back_through_their_leases"]
async fn child_holds_a_slot_over_http() {
    let Ok(base) = std::env::var(HOLDER_BASE) else {
        return;
    };
    let http = reqwest::Client::new();
    let post = |path: String, body: Value| {
        let request = http.post(format!("{base}{path}")).json(&body);
        async move {
            let response = request.send().await.expect("the server answers");
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (status, owner) = post("/v1/owners".to_owned(), json!({"name": "holder", "ttlMs": 1000})).await;
    assert_eq!(status, 201, "{owner}");
    let owner = owner["ownerId"].as_str().unwrap().to_owned();
    let (status, record) = post(
        "/v1/activities".to_owned(),
        json!({"service": "kb", "provider": "ollama", "class": "embedding", "ownerId": owner}),
    )
    .await;
    assert_eq!(status, 201, "{record}");
    let id = record["activityId"].as_str().unwrap();
    let (status, _) = post(format!("/v1/activities/{id}/start?wait=30s"), json!({})).await;
    assert_eq!(status, 200);
    println!("HOLDING {id}");
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        post(format!("/v1/owners/{owner}/renew"), json!({})).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_client_processes_give_their_slots_back_through_their_leases() {
    let dir = tempfile::tempdir().unwrap();
    killed_client_processes(&dir, temp_store(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_client_processes_give_their_slots_back_through_their_leases_on_postgres() {
    let dir = tempfile::tempdir().unwrap();
    let database = inflight_pg_testing::TestDatabase::new();
    killed_client_processes(&dir, database.store_url("")).await;
}

/// Two client processes hold both slots of a cap-2 lane under 1 s leases
/// and are killed while four calls wait: the slots come back to the first
/// two in line within seconds, and the lane never shows more than two
/// executing.
async fn killed_client_processes(dir: &tempfile::TempDir, store: String) {
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
    use std::sync::Arc;

    let server = Server::start(Launch {
        store: Some(store.clone()),
        args: config_file(
            dir,
            "[reap]\ninterval = \"100ms\"\n[lanes.\"kb::ollama\"]\ncap = 2\n",
        ),
        ..Launch::default()
    })
    .await;

    // Two client processes take both slots.
    let mut holders = Vec::new();
    for _ in 0..2 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_holds_a_slot_over_http",
                "--ignored",
                "--nocapture",
            ])
            .env(HOLDER_BASE, &server.base)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let held = tokio::time::timeout(PATIENCE, async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.starts_with("HOLDING ") {
                    return true;
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        assert!(held, "a holder did not get its slot");
        holders.push(child);
    }

    // Meanwhile, the cap is watched, and four calls wait in line.
    let stop = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicI64::new(0));
    let watcher = {
        let (base, stop, most) = (server.base.clone(), Arc::clone(&stop), Arc::clone(&most));
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            while !stop.load(Ordering::Relaxed) {
                let snapshot: Value = http
                    .get(format!("{base}/v1/snapshot?limit=1"))
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                // A snapshot without the count fails: it would watch nothing.
                let executing = snapshot["nativeAdmission"]["kb::ollama"]["executing"]
                    .as_i64()
                    .unwrap_or_else(|| panic!("no executing count for kb::ollama in {snapshot}"));
                most.fetch_max(executing, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let mut waiters = Vec::new();
    for _ in 0..4 {
        let id = server
            .begin(json!({"service": "kb", "provider": "ollama", "class": "embedding"}))
            .await;
        waiters.push(id);
    }
    let killed_at = std::time::Instant::now();
    for mut holder in holders {
        holder.kill().await.unwrap();
    }
    // Their leases run out (1 s), their records are reaped owner-lost, and
    // the first two in line get the slots.
    for id in &waiters[..2] {
        let (status, record) = server
            .post(&format!("/v1/activities/{id}/start?wait=10s"), json!({}))
            .await;
        assert_eq!(status, 200, "{record}");
    }
    let reclaimed_in = killed_at.elapsed();
    let (status, _) = server
        .post(&format!("/v1/activities/{}/start", waiters[2]), json!({}))
        .await;
    assert_eq!(status, 429, "the lane is full again with the two admitted");
    stop.store(true, Ordering::Relaxed);
    watcher.await.unwrap();
    assert!(
        most.load(Ordering::Relaxed) <= 2,
        "{} executing on a cap-2 lane",
        most.load(Ordering::Relaxed)
    );
    let (_, snapshot) = server.get("/v1/snapshot").await;
    assert_eq!(snapshot["totalReapedOwnerLost"], 2, "{snapshot}");
    eprintln!("two killed client processes' slots came back in {reclaimed_in:?} (lease 1 s) on {store}");
    assert!(reclaimed_in < Duration::from_secs(5), "{reclaimed_in:?}");
}

/// Sends the server SIGHUP and waits for its log line starting `logged`.
async fn hang_up(server: &mut Server, logged: &str) {
    let pid = server.child.id().expect("running").to_string();
    let hup = Command::new("kill").args(["-HUP", &pid]).status().await.unwrap();
    assert!(hup.success());
    server
        .wait_for_log(logged, |line| {
            line["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(logged))
        })
        .await;
}

/// A scope-refusal log line: it names the token's index, never its value.
fn is_scope_refusal(line: &Value) -> bool {
    line["fields"]["message"]
        .as_str()
        .is_some_and(|m| m.starts_with("refused a request beyond its token's scope"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoped_tokens_from_files_hold_their_scopes_and_are_reread_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let read_file = dir.path().join("read-token");
    std::fs::write(&read_file, "reader-one\n").unwrap();
    let config = format!(
        "[[tokens]]\ntoken_file = {:?}\nscope = \"read\"\n\
         [[tokens]]\ntoken = \"kb-writer\"\nscope = \"write\"\nservices = [\"knowledge-base\"]\n",
        read_file.display().to_string()
    );
    let mut server = Server::start(Launch {
        store: Some(temp_store(&dir)),
        args: config_file(&dir, &config),
        // The single token beside the entries: they keep their names.
        env: vec![("INFLIGHT_TOKEN", "legacy-admin".into())],
        token: Some("kb-writer"),
    })
    .await;
    let kb = json!({"service": "knowledge-base", "provider": "ollama"});
    server.begin(kb.clone()).await;
    let status = |reply: reqwest::Response| reply.status().as_u16();
    let (http, base) = (server.http.clone(), server.base.clone());
    let as_reader = |token: &str, method: reqwest::Method, path: &str| {
        http.request(method, format!("{base}{path}")).bearer_auth(token)
    };

    // The read token reads, and is refused on a write, logged by index.
    let read = as_reader("reader-one", reqwest::Method::GET, "/v1/snapshot");
    assert_eq!(status(read.send().await.unwrap()), 200);
    let metrics = as_reader("reader-one", reqwest::Method::GET, "/metrics");
    assert_eq!(status(metrics.send().await.unwrap()), 200);
    let write = as_reader("reader-one", reqwest::Method::POST, "/v1/activities").json(&kb);
    let refused = write.send().await.unwrap();
    assert_eq!(refused.status().as_u16(), 403);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "forbidden", "{body}");
    let line = server
        .wait_for_log("the refusal's log line", is_scope_refusal)
        .await;
    assert_eq!(line["fields"]["token"], "tokens[0]", "{line}");
    assert!(
        !line.to_string().contains("reader-one"),
        "a secret in the log: {line}"
    );

    // The bound write token cannot begin for another service.
    let (code, body) = server
        .post(
            "/v1/activities",
            json!({"service": "billing", "provider": "ollama"}),
        )
        .await;
    assert_eq!(
        (code, &body["error"]["code"]),
        (403, &json!("forbidden")),
        "{body}"
    );

    // A new secret in the file, then SIGHUP: the new one opens, the old no
    // longer does, and the server goes on serving.
    std::fs::write(&read_file, "reader-two\n").unwrap();
    hang_up(&mut server, "re-read the token files").await;
    let new = as_reader("reader-two", reqwest::Method::GET, "/v1/snapshot");
    assert_eq!(status(new.send().await.unwrap()), 200);
    let old = as_reader("reader-one", reqwest::Method::GET, "/v1/snapshot");
    assert_eq!(status(old.send().await.unwrap()), 401);

    // An emptied file at the next SIGHUP keeps the secret in force.
    std::fs::write(&read_file, "").unwrap();
    hang_up(&mut server, "keeping the token's previous secret").await;
    let kept = as_reader("reader-two", reqwest::Method::GET, "/v1/snapshot");
    assert_eq!(status(kept.send().await.unwrap()), 200);
}

/// A CA made for the test, and a server certificate for 127.0.0.1 it
/// signed, written as `ca.pem`, `server.crt` and `server.key` in `dir`.
fn make_certificates(dir: &std::path::Path) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("server.crt"), leaf.pem()).unwrap();
    std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_reads_an_https_server_trusting_the_ca_it_is_given() {
    let dir = tempfile::tempdir().unwrap();
    make_certificates(dir.path());
    let path = |name: &str| dir.path().join(name).display().to_string();
    let server = Server::start(Launch {
        store: Some(temp_store(&dir)),
        args: vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--tls-cert".into(),
            path("server.crt"),
            "--tls-key".into(),
            path("server.key"),
        ],
        ..Launch::default()
    })
    .await;
    assert!(server.base.starts_with("https://"), "{}", server.base);
    let base = server.base.clone();

    let (code, out, err) = run_cli(
        &[
            "snapshot",
            "--json",
            "--server",
            &base,
            "--ca-file",
            &path("ca.pem"),
        ],
        &[],
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    let snapshot: Value = serde_json::from_str(&out).expect("a JSON snapshot");
    assert_eq!(snapshot["totalActivities"], 0);
    let (code, _, err) = run_cli(
        &["reap", "--server", &base],
        &[("INFLIGHT_CA_FILE", &path("ca.pem"))],
    )
    .await;
    assert_eq!(code, Some(0), "INFLIGHT_CA_FILE: {err}");

    // Without the CA, the system's roots do not know it: a clear refusal
    // that says how to trust it.
    let (code, _, err) = run_cli(&["snapshot", "--server", &base], &[]).await;
    assert_ne!(code, Some(0));
    assert!(err.contains("certificate") && err.contains("--ca-file"), "{err}");
    // Plain http:// to it: the server hangs up, and the CLI says why that
    // may be.
    let plain = base.replacen("https://", "http://", 1);
    let (code, _, err) = run_cli(&["snapshot", "--server", &plain], &[]).await;
    assert_ne!(code, Some(0));
    assert!(err.contains("does the server serve https?"), "{err}");
    // A CA file that is not one is named.
    let (code, _, err) = run_cli(
        &["snapshot", "--server", &base, "--ca-file", &path("server.key")],
        &[],
    )
    .await;
    assert_ne!(code, Some(0));
    assert!(err.contains("server.key") && err.contains("--ca-file"), "{err}");
    // An exported token or CA file does not trouble a plain check-config.
    let config = dir.path().join("plain.toml");
    std::fs::write(&config, "listen = \"127.0.0.1:7878\"\n").unwrap();
    let (code, _, err) = run_cli(
        &["check-config", &config.display().to_string()],
        &[("INFLIGHT_TOKEN", "x"), ("INFLIGHT_CA_FILE", "/nonexistent")],
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
}
