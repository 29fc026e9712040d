//! `inflight snapshot --watch`: the table redrawn in place, like `top`,
//! until interrupted.

use std::io::Write as _;
use std::time::Duration;

use inflight_api::SnapshotQuery;

use super::client::Client;
use super::CliError;

/// The shortest interval `--interval` takes: faster helps no one reading a
/// table, and every redraw is a snapshot (and a reap) on the server.
pub const MIN_INTERVAL: Duration = Duration::from_millis(500);

/// Clears the screen and moves the cursor home (ANSI), before each frame.
pub const CLEAR: &str = "\x1b[2J\x1b[H";

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

/// One frame: the snapshot's table, or why there is none this time (the
/// server may come back), and the footer.
pub fn frame(body: Result<String, CliError>, interval: Duration) -> String {
    let body = body.unwrap_or_else(|err| format!("inflight: {err}\n"));
    format!(
        "{CLEAR}{body}\nevery {}; Ctrl-C to stop\n",
        humantime::format_duration(interval)
    )
}

/// Redraws `client`'s snapshot every `interval` until Ctrl-C (or SIGTERM).
/// A failed read is shown in the frame and retried at the next one.
///
/// # Errors
/// Standard output cannot be written (a closed pipe).
pub async fn watch(client: &Client, query: &SnapshotQuery, interval: Duration) -> Result<(), CliError> {
    let stop = stop_signal();
    tokio::pin!(stop);
    loop {
        let body = tokio::select! {
            () = &mut stop => return Ok(()),
            snapshot = client.snapshot(query) => snapshot.map(|snapshot| snapshot.to_string()),
        };
        let mut out = std::io::stdout().lock();
        out.write_all(frame(body, interval).as_bytes())
            .and_then(|()| out.flush())
            .map_err(|err| CliError::Failed(format!("cannot write the table: {err}")))?;
        drop(out);
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

    #[test]
    fn each_frame_clears_the_screen_first_and_shows_a_failure_in_place() {
        let table = frame(Ok("LANE  CAP\n".to_owned()), Duration::from_secs(2));
        assert!(table.starts_with("\x1b[2J\x1b[H"), "{table:?}");
        assert!(table.contains("LANE  CAP\n"), "{table:?}");
        assert!(table.ends_with("every 2s; Ctrl-C to stop\n"), "{table:?}");
        let failed = frame(Err(CliError::Failed("cannot connect".to_owned())), MIN_INTERVAL);
        assert!(failed.contains("inflight: cannot connect\n"), "{failed:?}");
        assert!(failed.contains("every 500ms"), "{failed:?}");
    }
}
