//! `inflight snapshot --watch`: the table redrawn in place, like `top`,
//! until interrupted; or, when standard output is not a terminal (a pipe,
//! a file), each snapshot printed after the last.

use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use inflight_api::{Snapshot, SnapshotQuery};

use super::client::Client;
use super::CliError;

/// The shortest interval `--interval` takes: faster helps no one reading a
/// table, and every redraw is a snapshot (and a reap) on the server.
pub const MIN_INTERVAL: Duration = Duration::from_millis(500);

/// Clears the screen and moves the cursor home (ANSI), before each frame.
pub const CLEAR: &str = "\x1b[2J\x1b[H";

/// How each snapshot is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// A terminal: the table redrawn in place, with a footer.
    Screen,
    /// Anything else: each table after the last, each followed by a blank
    /// line; no screen codes, which a file or a pipe would keep as junk.
    Stream,
    /// `--json`: one snapshot a line (JSON lines), terminal or not.
    JsonLines,
}

impl Output {
    /// The output for standard output as it is now.
    pub fn for_stdout(json: bool) -> Self {
        if json {
            Self::JsonLines
        } else if std::io::stdout().is_terminal() {
            Self::Screen
        } else {
            Self::Stream
        }
    }
}

/// Reads `--interval`: a duration (`2s`, `500ms`) of at least
/// [`MIN_INTERVAL`].
///
/// # Errors
/// Says what was wrong, for clap to print.
pub fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = humantime::parse_duration(text.trim())
        .map_err(|err| format!("{text:?} is not a duration such as \"2s\" or \"500ms\": {err}"))?;
    if interval < MIN_INTERVAL {
        return Err(format!(
            "must be at least {}, got {text:?}",
            humantime::format_duration(MIN_INTERVAL)
        ));
    }
    Ok(interval)
}

/// What one read writes to standard output. On the screen a failed read is
/// shown in the frame (the server may come back); in a stream it goes to
/// standard error instead (`None` here), so that standard output holds
/// snapshots only.
pub fn frame(read: Result<&Snapshot, &CliError>, interval: Duration, output: Output) -> Option<String> {
    match (output, read) {
        (Output::Screen, read) => {
            let body = read.map_or_else(|err| format!("inflight: {err}\n"), Snapshot::to_string);
            Some(format!(
                "{CLEAR}{body}\nevery {}; Ctrl-C to stop\n",
                humantime::format_duration(interval)
            ))
        }
        (Output::Stream, Ok(snapshot)) => Some(format!("{snapshot}\n")),
        (Output::JsonLines, Ok(snapshot)) => Some(match serde_json::to_string(snapshot) {
            Ok(line) => format!("{line}\n"),
            // A snapshot always serializes; were it not to, say so in band.
            Err(err) => format!("{{\"error\":{:?}}}\n", err.to_string()),
        }),
        (Output::Stream | Output::JsonLines, Err(_)) => None,
    }
}

/// Writes `client`'s snapshot every `interval` until Ctrl-C (or SIGTERM),
/// as `output` says. A failed read is reported and retried at the next one.
///
/// A closed pipe (the reader is done) ends it quietly.
///
/// # Errors
/// Standard output cannot be written for another reason.
///
/// # Cancel safety
/// Cancel safe: each snapshot is written whole, without an await, so a
/// drop leaves standard output at the end of one; the read under way (which
/// reaps on the server first, as every snapshot does) is abandoned.
pub async fn watch(
    client: &Client,
    query: &SnapshotQuery,
    interval: Duration,
    output: Output,
) -> Result<(), CliError> {
    let stop = stop_signal();
    tokio::pin!(stop);
    loop {
        let read = tokio::select! {
            () = &mut stop => return Ok(()),
            snapshot = client.snapshot(query) => snapshot,
        };
        match frame(read.as_ref(), interval, output) {
            Some(text) => {
                let mut out = std::io::stdout().lock();
                match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                    Ok(()) => {}
                    // The reader is done (`| head`): stop quietly, as
                    // command-line filters do.
                    Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                    Err(err) => return Err(CliError::Failed(format!("cannot write the snapshot: {err}"))),
                }
            }
            None => {
                if let Err(err) = &read {
                    eprintln!(
                        "inflight: {err} (retrying every {})",
                        humantime::format_duration(interval)
                    );
                }
            }
        }
        tokio::select! {
            () = &mut stop => return Ok(()),
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_is_a_duration_of_at_least_500ms() {
        assert_eq!(parse_interval("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_interval("500ms").unwrap(), MIN_INTERVAL);
        assert_eq!(parse_interval(" 1m ").unwrap(), Duration::from_secs(60));
        assert!(parse_interval("100ms").unwrap_err().contains("at least 500ms"));
        assert!(parse_interval("soon").unwrap_err().contains("not a duration"));
        assert!(parse_interval("0s").is_err());
    }

    /// An empty ledger's snapshot, as the server would send it.
    fn snapshot() -> Snapshot {
        use inflight::wire::ToApi;

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let ledger = inflight::Ledger::builder(inflight::LedgerConfig::default())
                .store_url("memory:")
                .build()
                .unwrap();
            ledger
                .snapshot(inflight::SnapshotOptions::default())
                .await
                .unwrap()
                .to_api()
        })
    }

    #[test]
    fn on_a_screen_each_frame_clears_the_screen_first_and_shows_a_failure_in_place() {
        let snapshot = snapshot();
        let table = frame(Ok(&snapshot), Duration::from_secs(2), Output::Screen).unwrap();
        assert!(table.starts_with("\x1b[2J\x1b[H"), "{table:?}");
        assert!(table.contains(&snapshot.to_string()), "{table:?}");
        assert!(table.ends_with("every 2s; Ctrl-C to stop\n"), "{table:?}");
        let err = CliError::Failed("cannot connect".to_owned());
        let failed = frame(Err(&err), MIN_INTERVAL, Output::Screen).unwrap();
        assert!(failed.contains("inflight: cannot connect\n"), "{failed:?}");
        assert!(failed.contains("every 500ms"), "{failed:?}");
    }

    #[test]
    fn in_a_stream_each_snapshot_follows_the_last_with_no_screen_codes() {
        let snapshot = snapshot();
        let text = frame(Ok(&snapshot), MIN_INTERVAL, Output::Stream).unwrap();
        assert_eq!(text, format!("{snapshot}\n"));
        assert!(!text.contains('\x1b'), "{text:?}");
        let line = frame(Ok(&snapshot), MIN_INTERVAL, Output::JsonLines).unwrap();
        assert_eq!(line.matches('\n').count(), 1, "{line:?}");
        assert_eq!(serde_json::from_str::<Snapshot>(&line).unwrap(), snapshot);
        // A failure goes to standard error, not between the snapshots.
        let err = CliError::Failed("cannot connect".to_owned());
        assert_eq!(frame(Err(&err), MIN_INTERVAL, Output::Stream), None);
        assert_eq!(frame(Err(&err), MIN_INTERVAL, Output::JsonLines), None);
    }
}
