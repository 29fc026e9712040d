//! What the server lets one client, or all of them, hold: connections,
//! requests in flight, and how long a request may take to arrive.
//!
//! A server that sets none of these is held open by anyone who connects and
//! sends half a header. Every limit has a default that serves a busy
//! deployment, can be changed in the `[server]` table of the configuration
//! file, and is documented in `docs/api.md`.

use std::num::NonZeroUsize;
use std::time::Duration;

use inflight::config::{parse_duration, ConfigError, ConfigWarning};

/// The server's limits. Built with [`Limits::default`] and the `with_`
/// methods, or read from a `[server]` table by [`Limits::from_table`];
/// a limit of zero cannot be expressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    max_connections: NonZeroUsize,
    max_requests: NonZeroUsize,
    header_timeout: Duration,
    body_timeout: Duration,
}

/// The default of `max_connections`: open connections at once.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// The default of `max_requests`: requests being handled at once (a
/// `?wait=` start counts while it waits).
pub const DEFAULT_MAX_REQUESTS: usize = 4_096;
/// The default of `header_timeout`: how long a request's header may take to
/// arrive, and how long an idle keep-alive connection stays open.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The default of `body_timeout`: how long a request's body may take to
/// arrive once its header has.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// The shortest timeout accepted: below it, clients on a slow network would
/// be cut off mid-request.
const MIN_TIMEOUT: Duration = Duration::from_millis(100);
/// The longest timeout accepted.
const MAX_TIMEOUT: Duration = Duration::from_secs(3_600);

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: NonZeroUsize::new(DEFAULT_MAX_CONNECTIONS).expect("non-zero"),
            max_requests: NonZeroUsize::new(DEFAULT_MAX_REQUESTS).expect("non-zero"),
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
        }
    }
}

impl Limits {
    /// Open connections at once; one more is answered 503 and closed.
    pub fn max_connections(&self) -> usize {
        self.max_connections.get()
    }

    /// Requests handled at once; one more is answered 503.
    pub fn max_requests(&self) -> usize {
        self.max_requests.get()
    }

    /// How long a request's header may take, and an idle connection stay.
    pub fn header_timeout(&self) -> Duration {
        self.header_timeout
    }

    /// How long a request's body may take once its header has arrived.
    pub fn body_timeout(&self) -> Duration {
        self.body_timeout
    }

    /// With at most `max` open connections.
    pub fn with_max_connections(mut self, max: NonZeroUsize) -> Self {
        self.max_connections = max;
        self
    }

    /// With at most `max` requests handled at once.
    pub fn with_max_requests(mut self, max: NonZeroUsize) -> Self {
        self.max_requests = max;
        self
    }

    /// With this header timeout.
    ///
    /// # Errors
    /// A timeout outside 100 ms to 1 h, naming `server.header_timeout`.
    pub fn with_header_timeout(mut self, timeout: Duration) -> Result<Self, ConfigError> {
        self.header_timeout = check_timeout("server.header_timeout", timeout)?;
        Ok(self)
    }

    /// With this body timeout.
    ///
    /// # Errors
    /// A timeout outside 100 ms to 1 h, naming `server.body_timeout`.
    pub fn with_body_timeout(mut self, timeout: Duration) -> Result<Self, ConfigError> {
        self.body_timeout = check_timeout("server.body_timeout", timeout)?;
        Ok(self)
    }

    /// Reads a `[server]` table: `max_connections`, `max_requests`,
    /// `header_timeout`, `body_timeout`; what it leaves out keeps its
    /// default. What is valid but likely not meant goes to `warnings`.
    ///
    /// # Errors
    /// An unknown key, a count that is not a positive integer, or a bad
    /// duration, naming the key.
    pub fn from_table(table: &toml::Table, warnings: &mut Vec<ConfigWarning>) -> Result<Self, ConfigError> {
        let mut limits = Self::default();
        for (key, value) in table {
            let name = format!("server.{key}");
            match key.as_str() {
                "max_connections" => limits.max_connections = positive(&name, value)?,
                "max_requests" => limits.max_requests = positive(&name, value)?,
                // `[server.tls]`: read by `crate::tls`.
                "tls" => {}
                "header_timeout" => limits = limits.with_header_timeout(parse_duration(&name, value, warnings)?)?,
                "body_timeout" => limits = limits.with_body_timeout(parse_duration(&name, value, warnings)?)?,
                _ => {
                    return Err(ConfigError::new(
                        name,
                        "is not a setting; [server] takes max_connections, max_requests, header_timeout, body_timeout, tls",
                    ))
                }
            }
        }
        Ok(limits)
    }
}

fn positive(key: &str, value: &toml::Value) -> Result<NonZeroUsize, ConfigError> {
    value
        .as_integer()
        .and_then(|n| usize::try_from(n).ok())
        .and_then(NonZeroUsize::new)
        .ok_or_else(|| ConfigError::new(key, format!("must be a positive integer, got {value}")))
}

fn check_timeout(key: &str, timeout: Duration) -> Result<Duration, ConfigError> {
    if (MIN_TIMEOUT..=MAX_TIMEOUT).contains(&timeout) {
        Ok(timeout)
    } else {
        Err(ConfigError::new(
            key,
            format!(
                "must be between 100ms and 1h, got {}",
                humantime::format_duration(timeout)
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        text.parse().expect("valid TOML")
    }

    #[test]
    fn an_empty_table_keeps_every_default() {
        assert_eq!(
            Limits::from_table(&table(""), &mut Vec::new()).unwrap(),
            Limits::default()
        );
        let limits = Limits::default();
        assert_eq!(limits.max_connections(), DEFAULT_MAX_CONNECTIONS);
        assert_eq!(limits.header_timeout(), DEFAULT_HEADER_TIMEOUT);
    }

    #[test]
    fn each_key_is_read() {
        let mut warnings = Vec::new();
        let limits = Limits::from_table(
            &table("max_connections = 100\nmax_requests = 10\nheader_timeout = \"2s\"\nbody_timeout = 500"),
            &mut warnings,
        )
        .unwrap();
        assert_eq!(warnings.len(), 1, "500 means 500 ms: {warnings:?}");
        assert_eq!(warnings[0].key, "server.body_timeout");
        assert_eq!(limits.max_connections(), 100);
        assert_eq!(limits.max_requests(), 10);
        assert_eq!(limits.header_timeout(), Duration::from_secs(2));
        assert_eq!(limits.body_timeout(), Duration::from_millis(500));
    }

    #[test]
    fn bad_values_name_their_key() {
        for (text, key) in [
            ("max_connections = 0", "server.max_connections"),
            ("max_requests = -3", "server.max_requests"),
            ("max_requests = \"many\"", "server.max_requests"),
            ("header_timeout = \"1ms\"", "server.header_timeout"),
            ("body_timeout = \"2h\"", "server.body_timeout"),
            ("body_timeout = \"soon\"", "server.body_timeout"),
            ("max_conections = 5", "server.max_conections"),
        ] {
            let err = Limits::from_table(&table(text), &mut Vec::new()).unwrap_err();
            assert_eq!(err.key, key, "{text}: {err}");
        }
    }
}
