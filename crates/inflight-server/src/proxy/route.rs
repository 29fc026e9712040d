//! A `[proxy.NAME]` table: where its calls go, whose they are, and how
//! long they may wait; read and checked once, at start-up.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::uri::{Authority, Scheme};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use inflight::config::{parse_count, parse_duration, parse_string, ConfigError, ConfigWarning};
use inflight::domain::labels::Label;

use crate::settings::HttpUrl;

/// The longest a proxied call may wait in line, from its route's
/// `max_wait` or its `X-Inflight-Max-Wait`: a client holds its connection
/// that long.
pub(crate) const MAX_WAIT_LIMIT: Duration = Duration::from_secs(600);
/// A route's `max_wait` when it sets none.
pub(crate) const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(30);
/// A route's `max_body_bytes` when it sets none: 16 MiB, room for a large
/// prompt or a batch of texts to embed.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// The largest `max_body_bytes` a route may set: bodies are held whole.
const MAX_BODY_LIMIT: usize = 1024 * 1024 * 1024;

/// The client a route forwards with: a pool of connections to its
/// upstream, HTTP/1.1, over TLS for `https://`.
pub(super) type UpstreamClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// One `[proxy.NAME]` route.
pub struct Route {
    pub(super) name: String,
    pub(super) scheme: Scheme,
    pub(super) authority: Authority,
    /// The upstream URL's path, without a trailing `/` (empty for `/`).
    pub(super) base_path: String,
    pub(super) provider: Label,
    pub(super) service: Label,
    pub(super) max_wait: Duration,
    pub(super) max_body: usize,
    ca_file: Option<PathBuf>,
    pub(super) client: UpstreamClient,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("name", &self.name)
            .field("upstream", &self.upstream())
            .field("provider", &self.provider.as_str())
            .field("service", &self.service.as_str())
            .field("max_wait", &self.max_wait)
            .field("max_body", &self.max_body)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

/// The same configuration (the clients are not compared).
impl PartialEq for Route {
    fn eq(&self, other: &Self) -> bool {
        (&self.name, self.upstream(), &self.provider, &self.service)
            == (&other.name, other.upstream(), &other.provider, &other.service)
            && (self.max_wait, self.max_body, &self.ca_file)
                == (other.max_wait, other.max_body, &other.ca_file)
    }
}

impl Route {
    /// The route's name: it is served under `/proxy/NAME/`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The upstream URL, as configured (without a trailing `/`).
    pub fn upstream(&self) -> String {
        format!("{}://{}{}", self.scheme, self.authority, self.base_path)
    }

    /// The provider label of its calls.
    pub fn provider(&self) -> &str {
        self.provider.as_str()
    }

    /// The service label of a call that names none.
    pub fn service(&self) -> &str {
        self.service.as_str()
    }

    /// How long a call waits in line unless it says otherwise.
    pub fn max_wait(&self) -> Duration {
        self.max_wait
    }

    /// The largest request body it forwards.
    pub fn max_body(&self) -> usize {
        self.max_body
    }

    /// Reads `[proxy.NAME]`; every error names its key.
    pub(super) fn from_table(
        name: &str,
        table: &toml::Table,
        warnings: &mut Vec<ConfigWarning>,
        system_roots: &mut Option<rustls::ClientConfig>,
    ) -> Result<Self, ConfigError> {
        let key = |field: &str| format!("proxy.{name}.{field}");
        check_name(name)?;
        let mut upstream = None;
        let mut provider = None;
        let mut service = None;
        let mut max_wait = DEFAULT_MAX_WAIT;
        let mut max_body = DEFAULT_MAX_BODY_BYTES;
        let mut ca_file = None;
        for (field, value) in table {
            let at = key(field);
            match field.as_str() {
                "upstream" => upstream = Some(parse_string(&at, value)?),
                "provider" => provider = Some(label(&at, "provider", &parse_string(&at, value)?)?),
                "service" => service = Some(label(&at, "service", &parse_string(&at, value)?)?),
                "max_wait" => {
                    max_wait = crate::settings::duration_within(
                        &at,
                        parse_duration(&at, value, warnings)?,
                        true,
                        MAX_WAIT_LIMIT,
                    )?;
                }
                "max_body_bytes" => max_body = parse_count(&at, value, 1..=MAX_BODY_LIMIT, "bytes")?,
                "ca_file" => ca_file = Some(PathBuf::from(parse_string(&at, value)?)),
                _ => {
                    return Err(ConfigError::new(
                        at,
                        "is not a setting; [proxy.NAME] takes upstream, provider, service, max_wait, \
                         max_body_bytes, ca_file",
                    ))
                }
            }
        }
        let upstream = upstream.ok_or_else(|| {
            ConfigError::new(
                key("upstream"),
                "is required: the URL calls are forwarded to, e.g. \"http://127.0.0.1:11434\"",
            )
        })?;
        let provider = provider.ok_or_else(|| {
            ConfigError::new(
                key("provider"),
                "is required: the provider label of its calls, e.g. \"ollama\"",
            )
        })?;
        let service = match service {
            Some(service) => service,
            None => label(&key("name"), "service", name)?,
        };
        let HttpUrl {
            scheme,
            authority,
            base_path,
        } = read_upstream(&key("upstream"), &upstream)?;
        if ca_file.is_some() && scheme != Scheme::HTTPS {
            return Err(ConfigError::new(
                key("ca_file"),
                format!("is set but the upstream {upstream:?} is not https://: it would not be used"),
            ));
        }
        let tls = tls_for(&key("ca_file"), &scheme, ca_file.as_deref(), system_roots)?;
        let client = client(tls);
        Ok(Self {
            name: name.to_owned(),
            scheme,
            authority,
            base_path,
            provider,
            service,
            max_wait,
            max_body,
            ca_file,
            client,
        })
    }
}

/// A route's name is one path segment of labels' characters.
fn check_name(name: &str) -> Result<(), ConfigError> {
    Label::new("name", name).map(drop).map_err(|err| {
        ConfigError::new(
            format!("proxy.{name:?}"),
            format!("the route's name is a path segment: {}", err.problem),
        )
    })
}

fn label(key: &str, field: &'static str, value: &str) -> Result<Label, ConfigError> {
    Label::new(field, value).map_err(|err| ConfigError::new(key, format!("{value:?}: {}", err.problem)))
}

/// The scheme, host and base path of `upstream`: `http://` or `https://`
/// with a host, and nothing a forwarded request could not keep (a query, a
/// fragment, credentials).
fn read_upstream(key: &str, upstream: &str) -> Result<HttpUrl, ConfigError> {
    crate::settings::http_url(
        key,
        upstream,
        "http://127.0.0.1:11434\" or \"https://api.openai.com",
        "the client's own headers reach the upstream",
    )
}

/// The TLS settings of an upstream of `scheme`: verified against
/// `ca_file`, or the system's roots, read once for every route that uses
/// them (`system_roots`); none read for a plain `http://` upstream, which
/// never handshakes.
fn tls_for(
    key: &str,
    scheme: &Scheme,
    ca_file: Option<&std::path::Path>,
    system_roots: &mut Option<rustls::ClientConfig>,
) -> Result<rustls::ClientConfig, ConfigError> {
    let read = |ca_file| inflight::store::client_tls(key, ca_file).map_err(|err| ConfigError::new(key, err));
    if *scheme != Scheme::HTTPS {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        return rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map(|config| {
                config
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth()
            })
            .map_err(|err| ConfigError::new(key, format!("TLS cannot be set up: {err}")));
    }
    match (ca_file, system_roots.as_ref()) {
        (Some(file), _) => read(Some(file)),
        (None, Some(system)) => Ok(system.clone()),
        (None, None) => Ok(system_roots.insert(read(None)?).clone()),
    }
}

/// A pool of connections for one route, with `tls` for `https://`.
fn client(tls: rustls::ClientConfig) -> UpstreamClient {
    Client::builder(TokioExecutor::new()).build(crate::tls::client_connector(tls))
}

/// Every route of a `[proxy]` configuration, by name.
#[derive(Debug, Default, PartialEq)]
pub struct Routes {
    routes: BTreeMap<String, Arc<Route>>,
}

impl Routes {
    /// Reads every `[proxy.NAME]` table.
    ///
    /// # Errors
    /// The first invalid table, naming its key.
    pub fn from_tables(
        tables: &BTreeMap<String, toml::Table>,
        warnings: &mut Vec<ConfigWarning>,
    ) -> Result<Self, ConfigError> {
        let mut system_roots = None;
        let routes = tables
            .iter()
            .map(|(name, table)| {
                let route = Route::from_table(name, table, warnings, &mut system_roots)?;
                Ok((name.clone(), Arc::new(route)))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Self { routes })
    }

    /// The route named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<Route>> {
        self.routes.get(name)
    }

    /// Every route, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.routes.values().map(AsRef::as_ref)
    }

    /// The names, for a message about a route that does not exist.
    pub(super) fn names(&self) -> String {
        let names: Vec<&str> = self.routes.keys().map(String::as_str).collect();
        if names.is_empty() {
            "none is configured ([proxy.NAME] in the configuration file)".to_owned()
        } else {
            format!("the routes are {}", names.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Routes, ConfigError> {
        let file: toml::Table = toml::from_str(text).unwrap();
        let tables = match file.get("proxy") {
            Some(toml::Value::Table(proxy)) => proxy
                .iter()
                .map(|(name, table)| (name.clone(), table.as_table().unwrap().clone()))
                .collect(),
            _ => BTreeMap::new(),
        };
        Routes::from_tables(&tables, &mut Vec::new())
    }

    #[test]
    fn a_route_takes_its_defaults() {
        let routes =
            read("[proxy.ollama]\nupstream = \"http://127.0.0.1:11434/\"\nprovider = \"ollama\"\n").unwrap();
        let route = routes.get("ollama").unwrap();
        assert_eq!(route.upstream(), "http://127.0.0.1:11434");
        assert_eq!((route.provider(), route.service()), ("ollama", "ollama"));
        assert_eq!(route.max_wait(), DEFAULT_MAX_WAIT);
        assert_eq!(route.max_body(), DEFAULT_MAX_BODY_BYTES);
        let routes = read(
            "[proxy.oa]\nupstream = \"https://api.openai.com/v1\"\nprovider = \"openai\"\nservice = \"kb\"\n\
             max_wait = \"2m\"\nmax_body_bytes = 1024\n",
        )
        .unwrap();
        let route = routes.get("oa").unwrap();
        assert_eq!(route.upstream(), "https://api.openai.com/v1");
        assert_eq!(route.base_path, "/v1");
        assert_eq!(
            (route.service(), route.max_wait(), route.max_body()),
            ("kb", Duration::from_secs(120), 1024)
        );
    }

    #[test]
    fn every_bad_setting_is_named() {
        let base = "upstream = \"http://h:1\"\nprovider = \"p\"\n";
        for (text, key, says) in [
            ("provider = \"p\"\n", "proxy.r.upstream", "is required"),
            ("upstream = \"http://h:1\"\n", "proxy.r.provider", "is required"),
            (
                "upstream = \"ftp://h\"\nprovider = \"p\"\n",
                "proxy.r.upstream",
                "http:// or https://",
            ),
            (
                "upstream = \"h:1\"\nprovider = \"p\"\n",
                "proxy.r.upstream",
                "http:// or https://",
            ),
            (
                "upstream = \"http://u:pw@h\"\nprovider = \"p\"\n",
                "proxy.r.upstream",
                "credentials",
            ),
            (
                "upstream = \"http://h/?a=1\"\nprovider = \"p\"\n",
                "proxy.r.upstream",
                "query",
            ),
            (
                &format!("{base}service = \"a b\"\n"),
                "proxy.r.service",
                "not allowed",
            ),
            (
                &format!("{base}max_wait = \"11m\"\n"),
                "proxy.r.max_wait",
                "at most 10m",
            ),
            (
                &format!("{base}max_wait = \"soon\"\n"),
                "proxy.r.max_wait",
                "not a duration",
            ),
            (
                &format!("{base}max_body_bytes = 0\n"),
                "proxy.r.max_body_bytes",
                "from 1",
            ),
            (
                &format!("{base}ca_file = \"/x.pem\"\n"),
                "proxy.r.ca_file",
                "not https://",
            ),
            (
                &format!("{base}timeout = 3\n"),
                "proxy.r.timeout",
                "is not a setting",
            ),
        ] {
            let err = read(&format!("[proxy.r]\n{text}")).unwrap_err();
            assert_eq!(err.key, key, "{text}: {err}");
            assert!(err.problem.contains(says), "{text}: {err}");
        }
        let err = read("[proxy.\"a/b\"]\nupstream = \"http://h\"\nprovider = \"p\"\n").unwrap_err();
        assert!(err.problem.contains("path segment"), "{err}");
        let err = read(
            "[proxy.r]\nupstream = \"https://h\"\nprovider = \"p\"\nca_file = \"/nonexistent/ca.pem\"\n",
        )
        .unwrap_err();
        assert_eq!(err.key, "proxy.r.ca_file");
        assert!(err.problem.contains("cannot be read"), "{err}");
    }
}
