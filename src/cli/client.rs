//! The HTTP client behind `inflight snapshot` and `inflight reap`: it sends
//! and reads the wire types of [`inflight_api`].

use std::path::Path;
use std::time::Duration;

use inflight_api::{ActivityRecord, CancelRequest, ErrorBody, Owner, ReapCounts, Snapshot, SnapshotQuery};
use serde::de::DeserializeOwned;

use super::ids::{self, Kind};
use super::CliError;

/// How long a request may take before the client gives up.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A client of one server.
#[derive(Clone)]
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client of the server at `base` (`http://127.0.0.1:7878`,
    /// `https://...`, or `127.0.0.1:7878`: see [`server_url`]). With
    /// `ca_file`, an `https://` server's certificate is checked against the
    /// certificates in that PEM file instead of the system's roots.
    ///
    /// # Errors
    /// A `base` that is not an `http://` or `https://` URL; a CA file that
    /// cannot be read or holds no certificate.
    pub fn new(base: &str, token: Option<String>, ca_file: Option<&Path>) -> Result<Self, CliError> {
        let url = server_url(base)?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(CliError::Failed(format!(
                "the server {base:?} (--server or INFLIGHT_URL): only http:// and https:// URLs are supported"
            )));
        }
        let base = url.as_str();
        let mut builder = reqwest::Client::builder().timeout(REQUEST_TIMEOUT);
        if let Some(path) = ca_file {
            builder = builder.tls_built_in_root_certs(false);
            for certificate in read_ca_file(path)? {
                builder = builder.add_root_certificate(certificate);
            }
        }
        let http = builder
            .build()
            .map_err(|err| CliError::Failed(format!("cannot build the HTTP client: {err}")))?;
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            token: token.filter(|token| !token.is_empty()),
            http,
        })
    }

    /// `GET /v1/snapshot` with `query` (`limit`, `since`).
    ///
    /// # Errors
    /// The server cannot be reached, refuses, or answers no snapshot.
    ///
    /// # Cancel safety
    /// Not cancel safe in effect: a snapshot reaps first, on the server,
    /// whether or not its answer is awaited; nothing else changes.
    pub async fn snapshot(&self, query: &SnapshotQuery) -> Result<Snapshot, CliError> {
        let request = self.http.get(format!("{}/v1/snapshot", self.base)).query(query);
        let text = self.send(request).await?;
        self.decode(&text, "a snapshot")
    }

    /// `POST /v1/reap`: what this call reaped.
    ///
    /// # Errors
    /// The server cannot be reached, refuses, or answers no reap counts.
    ///
    /// # Cancel safety
    /// Not cancel safe: a request already sent is carried out by the
    /// server whether or not its answer is awaited.
    pub async fn reap(&self) -> Result<ReapCounts, CliError> {
        let request = self.http.post(format!("{}/v1/reap", self.base));
        let text = self.send(request).await?;
        self.decode(&text, "reap counts")
    }

    /// `GET /v1/activities/{id}`.
    ///
    /// # Errors
    /// The server cannot be reached, refuses, or answers no record.
    ///
    /// # Cancel safety
    /// Not cancel safe in effect: a read reaps the record first, on the
    /// server, if it is past its bound, whether or not the answer is awaited.
    pub async fn activity(&self, id: &str) -> Result<ActivityRecord, CliError> {
        let request = self.http.get(format!("{}/v1/activities/{id}", self.base));
        let text = self.send(request).await?;
        self.decode(&text, "a record")
    }

    /// `POST /v1/activities/{id}/cancel` with `reason`.
    ///
    /// # Errors
    /// The server cannot be reached, refuses, or answers no record.
    ///
    /// # Cancel safety
    /// Not cancel safe: a request already sent is carried out by the
    /// server whether or not its answer is awaited.
    pub async fn cancel(&self, id: &str, reason: Option<String>) -> Result<ActivityRecord, CliError> {
        let request = self
            .http
            .post(format!("{}/v1/activities/{id}/cancel", self.base))
            .json(&CancelRequest { reason });
        let text = self.send(request).await?;
        self.decode(&text, "a record")
    }

    /// `DELETE /v1/owners/{id}`.
    ///
    /// # Errors
    /// The server cannot be reached, refuses, or answers no owner.
    ///
    /// # Cancel safety
    /// Not cancel safe: a request already sent is carried out by the
    /// server whether or not its answer is awaited.
    pub async fn release_owner(&self, id: &str) -> Result<Owner, CliError> {
        let request = self.http.delete(format!("{}/v1/owners/{id}", self.base));
        let text = self.send(request).await?;
        self.decode(&text, "an owner")
    }

    /// The whole id `text` names: `text` itself when it is a whole id, else
    /// the one id of `kind` the server's snapshot lists that ends with it
    /// (the short id a table shows). Only ids the server gave go into a
    /// path, never the text typed.
    ///
    /// # Errors
    /// The server cannot be reached, or no id or several end with `text`.
    ///
    /// # Cancel safety
    /// As [`Client::snapshot`], which it may call: the server reaps first.
    pub async fn resolve(&self, text: &str, kind: Kind) -> Result<String, CliError> {
        if ids::is_full_id(text.trim()) {
            return Ok(text.trim().to_ascii_lowercase());
        }
        // Every record the snapshot can list, over the whole history.
        let query = SnapshotQuery {
            limit: Some(10_000),
            since: Some("1970-01-01T00:00:00Z".to_owned()),
        };
        let snapshot = self.snapshot(&query).await?;
        ids::resolve(text, &ids::listed(&snapshot, kind), kind).map(str::to_owned)
    }

    /// Sends `request`; the body of a success, or the server's error.
    async fn send(&self, mut request: reqwest::RequestBuilder) -> Result<String, CliError> {
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.map_err(|err| self.unreachable(&err))?;
        let status = response.status();
        let text = response.text().await.map_err(|err| self.unreachable(&err))?;
        if status.is_success() {
            return Ok(text);
        }
        Err(CliError::Failed(match serde_json::from_str::<ErrorBody>(&text) {
            Ok(_) if status == reqwest::StatusCode::UNAUTHORIZED => self.unauthorized(),
            Ok(ErrorBody { error }) if status == reqwest::StatusCode::FORBIDDEN => format!(
                "the server at {} refused this token ({status}): {}",
                self.base, error.message
            ),
            Ok(ErrorBody { error }) => format!(
                "the server at {} refused ({status}): {}: {}",
                self.base, error.code, error.message
            ),
            Err(_) => format!("the server at {} answered {status}", self.base),
        }))
    }

    /// A 401, in the CLI's terms rather than the HTTP header's: the client
    /// knows whether it sent a token, so it says which case this is.
    fn unauthorized(&self) -> String {
        if self.token.is_some() {
            format!(
                "the server at {} does not accept the token given (--token or INFLIGHT_TOKEN): \
                 it is not one of the server's tokens",
                self.base
            )
        } else {
            format!(
                "the server at {} requires a token: pass --token TOKEN or set INFLIGHT_TOKEN",
                self.base
            )
        }
    }

    /// Reads an answer as `T`, which the route answers with (`what`).
    fn decode<T: DeserializeOwned>(&self, text: &str, what: &str) -> Result<T, CliError> {
        serde_json::from_str(text).map_err(|err| {
            CliError::Failed(format!(
                "the server at {} did not answer with {what} ({err}); is it an inflight server?",
                self.base
            ))
        })
    }

    fn unreachable(&self, err: &reqwest::Error) -> CliError {
        // The innermost cause says what went wrong (refused, a certificate
        // not trusted, ...); reqwest's own text only says "error sending
        // request".
        let mut cause: &dyn std::error::Error = err;
        while let Some(source) = cause.source() {
            cause = source;
        }
        let certificate = cause.to_string().contains("certificate");
        CliError::Failed(if certificate {
            format!(
                "cannot connect to the inflight server at {}: {cause}; if it uses a private CA, \
                 pass its certificate with --ca-file FILE or INFLIGHT_CA_FILE",
                self.base
            )
        } else if err.is_connect() {
            format!(
                "cannot connect to the inflight server at {}: {cause} (is `inflight serve` running there?)",
                self.base
            )
        } else if err.is_timeout() {
            format!(
                "the server at {} did not answer within {}s",
                self.base,
                REQUEST_TIMEOUT.as_secs()
            )
        } else if self.base.starts_with("http://") {
            // What a TLS server does to a plain request: it hangs up.
            format!(
                "request to the server at {} failed: {cause}; does the server serve https? \
                 then write its URL with https://",
                self.base
            )
        } else {
            format!("request to the server at {} failed: {cause}", self.base)
        })
    }
}

/// The certificates of the PEM file `path` (`--ca-file`, `INFLIGHT_CA_FILE`).
fn read_ca_file(path: &Path) -> Result<Vec<reqwest::Certificate>, CliError> {
    let refuse = |why: String| {
        CliError::Failed(format!(
            "the CA file {} (--ca-file or INFLIGHT_CA_FILE) {why}",
            path.display()
        ))
    };
    let pem = std::fs::read(path).map_err(|err| refuse(format!("cannot be read: {err}")))?;
    let certificates =
        reqwest::Certificate::from_pem_bundle(&pem).map_err(|err| refuse(format!("is not PEM: {err}")))?;
    if certificates.is_empty() {
        return Err(refuse("holds no PEM certificate".to_owned()));
    }
    Ok(certificates)
}

/// The server's URL from `--server` or `INFLIGHT_URL`: a URL, or
/// `host:port` without a scheme, which means `http://host:port`.
///
/// # Errors
/// Neither: says how to write it.
pub fn server_url(text: &str) -> Result<reqwest::Url, CliError> {
    let text = text.trim();
    // `localhost:7878` parses as a URL of scheme `localhost`: only text
    // with `://` names its scheme.
    let parsed = if text.contains("://") {
        reqwest::Url::parse(text)
    } else {
        reqwest::Url::parse(&format!("http://{text}"))
    };
    match parsed {
        Ok(url) if url.has_host() => Ok(url),
        Ok(_) => Err(CliError::Failed(format!(
            "the server {text:?} (--server or INFLIGHT_URL) names no host: write it as http://HOST:PORT"
        ))),
        Err(err) => Err(CliError::Failed(format!(
            "the server {text:?} (--server or INFLIGHT_URL) is neither a URL nor HOST:PORT ({err}): \
             write it as http://HOST:PORT"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_without_a_scheme_is_taken_as_http() {
        for (text, url) in [
            ("127.0.0.1:7980", "http://127.0.0.1:7980/"),
            ("localhost:7878", "http://localhost:7878/"),
            (" [::1]:7878/ ", "http://[::1]:7878/"),
            ("http://127.0.0.1:7878", "http://127.0.0.1:7878/"),
            ("inflight.internal", "http://inflight.internal/"),
        ] {
            assert_eq!(server_url(text).unwrap().as_str(), url, "{text}");
        }
        let client = Client::new("127.0.0.1:7980/", None, None).unwrap();
        assert_eq!(client.base, "http://127.0.0.1:7980");
    }

    #[test]
    fn an_unparseable_server_is_refused_saying_how_to_write_it() {
        for text in ["", "127.0.0.1:port", "http://", "two words:80", "http://[::1"] {
            let err = server_url(text).unwrap_err().to_string();
            assert!(err.contains("http://HOST:PORT"), "{text}: {err}");
        }
        let err = Client::new("ftp://127.0.0.1:21", None, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("only http:// and https:// URLs"), "{err}");
    }

    #[test]
    fn an_answer_that_is_not_the_wire_type_is_refused_plainly() {
        let client = Client::new("http://127.0.0.1:1", None, None).unwrap();
        for text in ["{}", "null", "<html>", r#"{"abandoned": "x"}"#] {
            let err = client.decode::<ReapCounts>(text, "reap counts").unwrap_err();
            assert!(
                err.to_string().contains("did not answer with reap counts"),
                "{err}"
            );
        }
        assert!(client.decode::<Snapshot>("{}", "a snapshot").is_err());
        let counts: ReapCounts = client
            .decode(
                r#"{"abandoned": 1, "unsettled": 2, "newer": true}"#,
                "reap counts",
            )
            .unwrap();
        assert_eq!(counts.total(), 3);
    }
}
