//! Readers the server's own configuration tables share (`[proxy.NAME]`,
//! `[otel]`), beside the library's (`inflight::config::parse_*`).

use std::time::Duration;

use axum::http::uri::{Authority, Scheme};
use axum::http::Uri;
use inflight::config::ConfigError;

/// A base URL as [`http_url`] accepts it, in the parts a caller builds
/// requests from.
pub(crate) struct HttpUrl {
    pub(crate) scheme: Scheme,
    pub(crate) authority: Authority,
    /// The path, without its trailing `/`: empty for the root.
    pub(crate) base_path: String,
}

/// `text`, an `http://` or `https://` URL with a host and nothing a base
/// URL cannot keep: no credentials (`credentials` says where they go
/// instead), no query, no fragment. Errors name `key` and show `example`.
pub(crate) fn http_url(
    key: &str,
    text: &str,
    example: &str,
    credentials: &str,
) -> Result<HttpUrl, ConfigError> {
    let refuse = |why: &str| ConfigError::new(key, format!("{text:?} {why}; write e.g. \"{example}\""));
    let uri: Uri = text.parse().map_err(|_| refuse("is not a URL"))?;
    let query = uri.query().is_some() || text.contains('#');
    let base_path = uri.path().trim_end_matches('/').to_owned();
    let parts = uri.into_parts();
    let scheme = parts
        .scheme
        .filter(|scheme| matches!(scheme.as_str(), "http" | "https"))
        .ok_or_else(|| refuse("is not an http:// or https:// URL"))?;
    let authority = parts.authority.ok_or_else(|| refuse("names no host"))?;
    if authority.as_str().contains('@') {
        return Err(refuse(&format!("carries credentials: {credentials}")));
    }
    if authority.host().is_empty() {
        return Err(refuse("names no host"));
    }
    if query {
        return Err(refuse("has a query or a fragment"));
    }
    Ok(HttpUrl {
        scheme,
        authority,
        base_path,
    })
}

/// `duration`, if it is at most `most` (and, unless `zero` is allowed,
/// more than 0); else an error naming `key`.
pub(crate) fn duration_within(
    key: &str,
    duration: Duration,
    zero: bool,
    most: Duration,
) -> Result<Duration, ConfigError> {
    if (duration.is_zero() && !zero) || duration > most {
        let least = if zero { "" } else { "more than 0 and " };
        return Err(ConfigError::new(
            key,
            format!(
                "must be {least}at most {}, got {}",
                humantime::format_duration(most),
                humantime::format_duration(duration)
            ),
        ));
    }
    Ok(duration)
}
