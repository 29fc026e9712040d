//! The HTTP client behind `inflight snapshot` and `inflight reap`.

use std::time::Duration;

use serde_json::Value;

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
    /// A client of the server at `base` (`http://127.0.0.1:7878`).
    ///
    /// # Errors
    /// A `base` that is not an `http://` URL.
    pub fn new(base: &str, token: Option<String>) -> Result<Self, CliError> {
        let url = reqwest::Url::parse(base)
            .map_err(|err| CliError::Failed(format!("--server {base:?} is not a URL: {err}")))?;
        if url.scheme() != "http" {
            return Err(CliError::Failed(format!(
                "--server {base:?}: only http:// URLs are supported"
            )));
        }
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
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
    /// The server cannot be reached or refuses.
    pub async fn snapshot(&self, query: &[(&str, String)]) -> Result<Value, CliError> {
        let request = self.http.get(format!("{}/v1/snapshot", self.base)).query(query);
        self.send(request).await
    }

    /// `POST /v1/reap`.
    ///
    /// # Errors
    /// The server cannot be reached or refuses.
    pub async fn reap(&self) -> Result<Value, CliError> {
        let request = self.http.post(format!("{}/v1/reap", self.base));
        self.send(request).await
    }

    async fn send(&self, mut request: reqwest::RequestBuilder) -> Result<Value, CliError> {
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.map_err(|err| self.unreachable(&err))?;
        let status = response.status();
        let text = response.text().await.map_err(|err| self.unreachable(&err))?;
        let body: Option<Value> = serde_json::from_str(&text).ok();
        if !status.is_success() {
            let error = body.as_ref().and_then(|body| body.get("error"));
            let field = |key: &str| error.and_then(|e| e.get(key)).and_then(Value::as_str);
            return Err(CliError::Failed(match (field("code"), field("message")) {
                (Some(code), Some(message)) => {
                    format!(
                        "the server at {} refused ({status}): {code}: {message}",
                        self.base
                    )
                }
                _ => format!("the server at {} answered {status}", self.base),
            }));
        }
        body.ok_or_else(|| {
            CliError::Failed(format!(
                "the server at {} did not answer JSON; is it an inflight server?",
                self.base
            ))
        })
    }

    fn unreachable(&self, err: &reqwest::Error) -> CliError {
        CliError::Failed(if err.is_connect() {
            format!(
                "cannot connect to the inflight server at {} (is `inflight serve` running there?)",
                self.base
            )
        } else if err.is_timeout() {
            format!(
                "the server at {} did not answer within {}s",
                self.base,
                REQUEST_TIMEOUT.as_secs()
            )
        } else {
            format!("request to the server at {} failed: {err}", self.base)
        })
    }
}
