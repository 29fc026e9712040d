//! Who may do what: the server's bearer tokens and their scopes.
//!
//! A token is `read` (the GET routes and `/metrics`, so the dashboard and a
//! Prometheus scrape) or `write` (every route). A write token may be bound
//! to `services`: it begins records only for them and acts only on their
//! records. The legacy `token` setting is a write token for every service.
//!
//! A token's secret is written in the file (`token`) or read from one
//! (`token_file`, trimmed), so that the secret need not sit in the
//! configuration; [`Tokens::reload`] re-reads the files (on SIGHUP). A
//! presented token is compared with every configured one in constant time,
//! and a rejection is logged with the matching entry's index, never a
//! secret.

use std::collections::BTreeSet;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use axum::http::{header, HeaderMap, Method};
use inflight::config::ConfigError;

use super::error::ApiError;
use subtle::ConstantTimeEq;

/// What a token opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The GET routes and `/metrics`.
    Read,
    /// Every route.
    Write,
}

/// Where a token's secret comes from.
#[derive(Clone, PartialEq, Eq)]
enum Source {
    /// Written in the configuration (`token`).
    Inline(Arc<str>),
    /// The trimmed contents of a file (`token_file`), re-read on reload.
    File(PathBuf),
}

/// One configured token, as the settings say it.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSpec {
    /// How the configuration names it: `token`, or `tokens[1]` (the
    /// entry's position among the `[[tokens]]`), for errors and logs.
    name: Arc<str>,
    source: Source,
    scope: Scope,
    /// `None`: every service.
    services: Option<Arc<BTreeSet<String>>>,
}

impl fmt::Debug for TokenSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            Source::Inline(_) => "<redacted>".to_owned(),
            Source::File(path) => format!("file {}", path.display()),
        };
        f.debug_struct("TokenSpec")
            .field("name", &self.name)
            .field("source", &source)
            .field("scope", &self.scope)
            .field("services", &self.services)
            .finish()
    }
}

impl TokenSpec {
    /// A write token for every service: the legacy `token` setting.
    pub fn write_all(token: impl Into<Arc<str>>) -> Self {
        Self {
            name: Arc::from("token"),
            source: Source::Inline(token.into()),
            scope: Scope::Write,
            services: None,
        }
    }

    /// What it opens.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// The services a write token is bound to (`None`: every one).
    pub fn services(&self) -> Option<&BTreeSet<String>> {
        self.services.as_deref()
    }

    /// Reads `[[tokens]]` entry `index`; errors name `tokens[index].key`.
    fn from_table(index: usize, table: &toml::Table) -> Result<Self, ConfigError> {
        let key = |name: &str| format!("tokens[{index}].{name}");
        for name in table.keys() {
            if !["token", "token_file", "scope", "services"].contains(&name.as_str()) {
                return Err(ConfigError::new(
                    key(name),
                    "unknown key; a [[tokens]] entry takes token or token_file, scope and services",
                ));
            }
        }
        let text = |name: &str| -> Result<Option<&str>, ConfigError> {
            match table.get(name) {
                None => Ok(None),
                Some(toml::Value::String(text)) => Ok(Some(text.as_str())),
                Some(other) => Err(ConfigError::new(
                    key(name),
                    format!("must be a string, got {}", other.type_str()),
                )),
            }
        };
        let source = match (text("token")?, text("token_file")?) {
            (Some(token), None) => {
                if token.trim().is_empty() {
                    return Err(ConfigError::new(key("token"), "must not be empty"));
                }
                Source::Inline(Arc::from(token))
            }
            (None, Some(path)) => {
                if path.trim().is_empty() {
                    return Err(ConfigError::new(key("token_file"), "must not be empty"));
                }
                Source::File(PathBuf::from(path))
            }
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    key("token"),
                    "give token or token_file, not both",
                ))
            }
            (None, None) => {
                return Err(ConfigError::new(
                    key("token"),
                    "missing: give token = \"...\" or token_file = \"path\"",
                ))
            }
        };
        let scope = match text("scope")? {
            Some("read") => Scope::Read,
            Some("write") => Scope::Write,
            Some(other) => {
                return Err(ConfigError::new(
                    key("scope"),
                    format!("must be \"read\" or \"write\", got {other:?}"),
                ))
            }
            None => {
                return Err(ConfigError::new(
                    key("scope"),
                    "missing: say scope = \"read\" or scope = \"write\"",
                ))
            }
        };
        let services = match table.get("services") {
            None => None,
            Some(toml::Value::Array(values)) => {
                if scope == Scope::Read {
                    return Err(ConfigError::new(
                        key("services"),
                        "only a write token is bound to services; a read token reads every service",
                    ));
                }
                let mut services = BTreeSet::new();
                for (at, value) in values.iter().enumerate() {
                    let service = value.as_str().filter(|s| !s.trim().is_empty()).ok_or_else(|| {
                        ConfigError::new(
                            format!("tokens[{index}].services[{at}]"),
                            "must be a service name (a non-empty string)",
                        )
                    })?;
                    services.insert(service.to_owned());
                }
                if services.is_empty() {
                    return Err(ConfigError::new(
                        key("services"),
                        "must name at least one service; leave it out for every service",
                    ));
                }
                Some(Arc::new(services))
            }
            Some(other) => {
                return Err(ConfigError::new(
                    key("services"),
                    format!("must be a list of service names, got {}", other.type_str()),
                ))
            }
        };
        Ok(Self {
            name: Arc::from(format!("tokens[{index}]")),
            source,
            scope,
            services,
        })
    }

    /// The secret as it stands now.
    fn read_secret(&self) -> Result<Box<[u8]>, ConfigError> {
        match &self.source {
            Source::Inline(token) => Ok(token.as_bytes().into()),
            Source::File(path) => {
                let key = format!("{}.token_file", self.name);
                let text = std::fs::read_to_string(path).map_err(|err| {
                    ConfigError::new(&key, format!("cannot read {}: {err}", path.display()))
                })?;
                let secret = text.trim();
                if secret.is_empty() {
                    return Err(ConfigError::new(&key, format!("{} is empty", path.display())));
                }
                Ok(secret.as_bytes().into())
            }
        }
    }
}

/// Every token the settings configure: the legacy `token` (a write token
/// for every service, listed first) and the `[[tokens]]` entries.
///
/// # Errors
/// An invalid entry, naming its key (`tokens[1].scope`).
pub fn token_specs(legacy: Option<&str>, tables: &[toml::Table]) -> Result<Vec<TokenSpec>, ConfigError> {
    let mut specs: Vec<TokenSpec> = legacy.map(TokenSpec::write_all).into_iter().collect();
    for (index, table) in tables.iter().enumerate() {
        specs.push(TokenSpec::from_table(index, table)?);
    }
    Ok(specs)
}

/// What a request's token grants: the entry it matched, its scope and its
/// services. Without configured tokens every request is granted everything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The matching entry as the configuration names it (`token`, or
    /// `tokens[1]`), for logs.
    name: Option<Arc<str>>,
    scope: Scope,
    services: Option<Arc<BTreeSet<String>>>,
}

impl Grant {
    /// Everything: a server without tokens.
    pub(crate) fn everything() -> Self {
        Self {
            name: None,
            scope: Scope::Write,
            services: None,
        }
    }

    /// Why `method` is refused, when the scope does not cover it: a read
    /// token covers GET and HEAD only.
    pub(crate) fn refuses_method(&self, method: &Method) -> Option<String> {
        let reads = method == Method::GET || method == Method::HEAD;
        (self.scope == Scope::Read && !reads).then(|| {
            format!(
                "this token's scope is read: it opens the GET routes and /metrics; {method} needs a write token"
            )
        })
    }

    /// Why acting for `service` is refused, when the token is bound to
    /// other services.
    pub(crate) fn refuses_service(&self, service: &str) -> Option<String> {
        let services = self.services.as_ref()?;
        (!services.contains(service)).then(|| {
            let names: Vec<&str> = services.iter().map(String::as_str).collect();
            format!(
                "this token is bound to the services {}; it cannot act for service {service:?}",
                names.join(", ")
            )
        })
    }

    /// Whether it is bound to some services, so that an action on a record
    /// must check the record's service first.
    pub(crate) fn is_bound(&self) -> bool {
        self.services.is_some()
    }

    /// The matching entry as the configuration names it, for logs (`None`
    /// without tokens).
    pub(crate) fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
}

/// Who a request's `Authorization` header says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Identity {
    /// No bearer token at all.
    Missing,
    /// A bearer token that matches none configured.
    Unknown,
    /// A configured token.
    Known(Grant),
}

/// One token in force: its secret as last read, and its grant.
struct Loaded {
    secret: Box<[u8]>,
    grant: Grant,
}

/// The tokens in force. Built once from the settings; [`Tokens::reload`]
/// re-reads the `token_file`s.
pub struct Tokens {
    specs: Vec<TokenSpec>,
    loaded: RwLock<Arc<[Loaded]>>,
}

/// The same configuration: the secrets read from files are not compared.
impl PartialEq for Tokens {
    fn eq(&self, other: &Self) -> bool {
        self.specs == other.specs
    }
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens").field("specs", &self.specs).finish()
    }
}

impl Tokens {
    /// Reads every secret `specs` name.
    ///
    /// # Errors
    /// An unreadable or empty `token_file`, naming its key and path.
    pub fn load(specs: Vec<TokenSpec>) -> Result<Self, ConfigError> {
        let loaded = specs
            .iter()
            .map(|spec| {
                Ok(Loaded {
                    secret: spec.read_secret()?,
                    grant: Grant {
                        name: Some(spec.name.clone()),
                        scope: spec.scope,
                        services: spec.services.clone(),
                    },
                })
            })
            .collect::<Result<Arc<[Loaded]>, ConfigError>>()?;
        Ok(Self {
            specs,
            loaded: RwLock::new(loaded),
        })
    }

    /// The tokens configured, in order.
    pub fn specs(&self) -> &[TokenSpec] {
        &self.specs
    }

    /// Re-reads each `token_file`. A file that cannot be read, or is empty,
    /// keeps its previous secret (a half-written file must not lock every
    /// client out) and is logged; returns how many secrets changed.
    pub fn reload(&self) -> usize {
        let current = Arc::clone(&self.loaded.read().unwrap_or_else(|e| e.into_inner()));
        let mut changed = 0;
        let next: Arc<[Loaded]> = self
            .specs
            .iter()
            .zip(current.iter())
            .map(|(spec, was)| {
                let secret = match spec.read_secret() {
                    Ok(secret) => secret,
                    Err(err) => {
                        tracing::error!(error = %err, "keeping the token's previous secret");
                        was.secret.clone()
                    }
                };
                if secret != was.secret {
                    changed += 1;
                }
                Loaded {
                    secret,
                    grant: was.grant.clone(),
                }
            })
            .collect();
        *self.loaded.write().unwrap_or_else(|e| e.into_inner()) = next;
        if changed > 0 {
            tracing::info!(changed, "re-read the token files");
        }
        changed
    }

    /// Who `headers` say the request is. Every configured secret is
    /// compared, in constant time, whatever matched first, so that the
    /// answer's timing does not tell which entry, if any, came close.
    pub(crate) fn identify(&self, headers: &HeaderMap) -> Identity {
        self.identify_presented(bearer(headers))
    }

    /// Who the token in the header `name` (`X-Inflight-Token`, sent
    /// bare) says the request is, as [`Tokens::identify`] does.
    pub(crate) fn identify_by(&self, headers: &HeaderMap, name: &str) -> Identity {
        let presented = headers
            .get(name)
            .map(|value| value.as_bytes().trim_ascii())
            .filter(|token| !token.is_empty());
        self.identify_presented(presented)
    }

    fn identify_presented(&self, presented: Option<&[u8]>) -> Identity {
        let Some(presented) = presented else {
            return Identity::Missing;
        };
        let loaded = Arc::clone(&self.loaded.read().unwrap_or_else(|e| e.into_inner()));
        let mut found = None;
        for token in loaded.iter() {
            let matches = bool::from(presented.ct_eq(&token.secret));
            if matches && found.is_none() {
                found = Some(token.grant.clone());
            }
        }
        found.map_or(Identity::Unknown, Identity::Known)
    }
}

/// The token of an `Authorization: Bearer <token>` header.
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, presented) = value.trim().split_once(' ')?;
    let presented = presented.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !presented.is_empty()).then_some(presented.as_bytes())
}

/// Logs a request refused for its token's scope, naming the token as the
/// configuration does (`token`, `tokens[1]`), never by its value.
pub(crate) fn log_refusal(grant: &Grant, route: &str, why: &str) {
    tracing::info!(
        token = grant.name(),
        route,
        reason = why,
        "refused a request beyond its token's scope"
    );
}

/// Refuses acting for `service` when the request's token is bound to
/// other services, and logs it.
pub(crate) fn check_service(grant: &Grant, service: &str, route: &str) -> Result<(), ApiError> {
    match grant.refuses_service(service) {
        None => Ok(()),
        Some(why) => {
            log_refusal(grant, route, &why);
            Err(ApiError::forbidden(why))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(text: &str) -> Vec<toml::Table> {
        let file: toml::Table = toml::from_str(text).unwrap();
        match file.get("tokens") {
            Some(toml::Value::Array(entries)) => entries
                .iter()
                .map(|entry| entry.as_table().unwrap().clone())
                .collect(),
            _ => Vec::new(),
        }
    }

    fn with(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, value.parse().unwrap());
        headers
    }

    #[test]
    fn bearer_tokens_must_match_exactly() {
        let tokens = Tokens::load(token_specs(Some("s3cret"), &[]).unwrap()).unwrap();
        let known = |headers: &HeaderMap| matches!(tokens.identify(headers), Identity::Known(_));
        assert!(known(&with("Bearer s3cret")));
        assert!(known(&with("bearer s3cret")));
        for wrong in [
            "Bearer s3cre",
            "Bearer s3cretx",
            "Basic s3cret",
            "s3cret",
            "Bearer ",
        ] {
            assert!(!known(&with(wrong)), "{wrong}");
        }
        assert_eq!(tokens.identify(&with("Bearer s3cre")), Identity::Unknown);
        assert_eq!(tokens.identify(&HeaderMap::new()), Identity::Missing);
    }

    #[test]
    fn each_token_grants_its_own_scope_and_services() {
        let specs = token_specs(
            Some("legacy"),
            &tables(
                "[[tokens]]\ntoken = \"reader\"\nscope = \"read\"\n\
                 [[tokens]]\ntoken = \"kb\"\nscope = \"write\"\nservices = [\"kb\", \"search\"]\n",
            ),
        )
        .unwrap();
        let tokens = Tokens::load(specs).unwrap();
        let grant = |token: &str| match tokens.identify(&with(&format!("Bearer {token}"))) {
            Identity::Known(grant) => grant,
            other => panic!("{token}: {other:?}"),
        };
        let legacy = grant("legacy");
        assert_eq!(legacy.name(), Some("token"));
        assert!(legacy.refuses_method(&Method::POST).is_none());
        assert!(legacy.refuses_service("anything").is_none());
        assert!(!legacy.is_bound());

        let reader = grant("reader");
        assert_eq!(
            reader.name(),
            Some("tokens[0]"),
            "named as in the file, whatever comes first"
        );
        assert!(reader.refuses_method(&Method::GET).is_none());
        assert!(reader.refuses_method(&Method::HEAD).is_none());
        for method in [Method::POST, Method::DELETE, Method::PUT] {
            let why = reader.refuses_method(&method).expect("a read token cannot write");
            assert!(why.contains("write token"), "{why}");
        }

        let kb = grant("kb");
        assert!(kb.is_bound());
        assert!(kb.refuses_method(&Method::POST).is_none());
        assert!(kb.refuses_service("kb").is_none());
        assert!(kb.refuses_service("search").is_none());
        let why = kb.refuses_service("billing").expect("bound to kb and search");
        assert!(why.contains("kb, search") && why.contains("billing"), "{why}");
    }

    #[test]
    fn bad_entries_name_their_key() {
        for (text, key) in [
            ("[[tokens]]\nscope = \"read\"\n", "tokens[0].token"),
            ("[[tokens]]\ntoken = \"\"\nscope = \"read\"\n", "tokens[0].token"),
            (
                "[[tokens]]\ntoken = \"a\"\ntoken_file = \"f\"\nscope = \"read\"\n",
                "tokens[0].token",
            ),
            ("[[tokens]]\ntoken = \"a\"\n", "tokens[0].scope"),
            (
                "[[tokens]]\ntoken = \"a\"\nscope = \"admin\"\n",
                "tokens[0].scope",
            ),
            (
                "[[tokens]]\ntoken = \"a\"\nscope = \"read\"\nservices = [\"kb\"]\n",
                "tokens[0].services",
            ),
            (
                "[[tokens]]\ntoken = \"a\"\nscope = \"write\"\nservices = []\n",
                "tokens[0].services",
            ),
            (
                "[[tokens]]\ntoken = \"a\"\nscope = \"write\"\nservices = \"kb\"\n",
                "tokens[0].services",
            ),
            (
                "[[tokens]]\ntoken = \"a\"\nscope = \"write\"\nservices = [\"kb\", 3]\n",
                "tokens[0].services[1]",
            ),
            ("[[tokens]]\ntoken = 3\nscope = \"write\"\n", "tokens[0].token"),
            (
                "[[tokens]]\ntoken = \"a\"\nscope = \"write\"\nservice = [\"kb\"]\n",
                "tokens[0].service",
            ),
            (
                "[[tokens]]\ntoken = \"a\"\nscope = \"write\"\n[[tokens]]\ntoken = \"b\"\n",
                "tokens[1].scope",
            ),
        ] {
            let err = token_specs(None, &tables(text)).expect_err(text);
            assert_eq!(err.key, key, "{text}: {err}");
        }
    }

    #[test]
    fn a_token_file_is_read_trimmed_and_reread_on_reload() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first\n").unwrap();
        let text = format!(
            "[[tokens]]\ntoken_file = {:?}\nscope = \"read\"\n",
            path.display().to_string()
        );
        let tokens = Tokens::load(token_specs(None, &tables(&text)).unwrap()).unwrap();
        assert!(matches!(
            tokens.identify(&with("Bearer first")),
            Identity::Known(_)
        ));

        std::fs::write(&path, "  second  \n").unwrap();
        assert_eq!(tokens.reload(), 1);
        assert_eq!(tokens.identify(&with("Bearer first")), Identity::Unknown);
        assert!(matches!(
            tokens.identify(&with("Bearer second")),
            Identity::Known(_)
        ));

        // A file gone or emptied keeps the secret in force.
        std::fs::write(&path, "\n").unwrap();
        assert_eq!(tokens.reload(), 0);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(tokens.reload(), 0);
        assert!(matches!(
            tokens.identify(&with("Bearer second")),
            Identity::Known(_)
        ));

        // At start-up, the same is an error naming the key and the file,
        // as the file names it whether or not a single `token` comes first.
        let err = Tokens::load(token_specs(None, &tables(&text)).unwrap()).expect_err("no file");
        assert_eq!(err.key, "tokens[0].token_file");
        let err = Tokens::load(token_specs(Some("legacy"), &tables(&text)).unwrap()).expect_err("no file");
        assert_eq!(err.key, "tokens[0].token_file");
        assert!(err.problem.contains("cannot read"), "{err}");
    }
}
