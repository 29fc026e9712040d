//! What a store URL says, read without opening anything: which store it
//! names, SQLite's durability, and the PostgreSQL store's connection
//! settings; and the URL with its password hidden.
//!
//! A module of its own, not part of `store`, because `config` checks a URL
//! (`check-config` refuses what `serve` would) while every store takes a
//! `LedgerConfig`: both depend on this module, so `config` depends on no
//! store. `store` re-exports what is public here, under its old paths.

use std::fmt;
#[cfg(feature = "postgres")]
use std::str::FromStr;
#[cfg(feature = "postgres")]
use std::sync::Arc;
#[cfg(feature = "postgres")]
use std::time::Duration;

use crate::domain::ParseError;
use crate::error::LedgerError;

/// How durable an acknowledged command is, for a store that syncs to disk:
/// SQLite's `synchronous` in WAL mode. `Full` is the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// Every commit syncs the log: nothing acknowledged is lost, even on a
    /// power loss. Group commit shares one sync between every command of a
    /// transaction.
    #[default]
    Full,
    /// The log is synced at checkpoints only: nothing acknowledged is lost
    /// when the process crashes (`kill -9`), but a power loss or an
    /// operating-system crash may lose the last transitions acknowledged
    /// before it.
    Normal,
}

impl Synchronous {
    /// Its name in a store URL (`?synchronous=normal`), a configuration
    /// file and the `synchronous` pragma.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Normal => "normal",
        }
    }
}

impl std::str::FromStr for Synchronous {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "full" => Ok(Self::Full),
            "normal" => Ok(Self::Normal),
            other => Err(ParseError::new(other, "one of full, normal")),
        }
    }
}

impl fmt::Display for Synchronous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The store a server uses when none is named: the embedded SQLite file
/// `inflight.db` in the working directory.
pub const DEFAULT_URL: &str = "sqlite://inflight.db";

/// `url` with its password, if any, replaced by `***`: the user-info
/// password (`postgres://user:PASSWORD@host/db`) and a `password=` query
/// parameter. A store URL may carry the database's credentials, and it
/// appears in logs and error messages.
pub fn redacted_url(url: &str) -> String {
    let (head, query) = url
        .split_once('?')
        .map_or((url, None), |(head, query)| (head, Some(query)));
    let head = match head.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_once('/').map_or((rest, None), |(a, p)| (a, Some(p)));
            let authority = match authority.rsplit_once('@') {
                Some((user, host)) if user.contains(':') => {
                    let name = user.split(':').next().unwrap_or("");
                    format!("{name}:***@{host}")
                }
                _ => authority.to_owned(),
            };
            match path {
                Some(path) => format!("{scheme}://{authority}/{path}"),
                None => format!("{scheme}://{authority}"),
            }
        }
        None => head.to_owned(),
    };
    match query {
        Some(query) => {
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{head}?{}", pairs.join("&"))
        }
        None => head,
    }
}

/// What a store URL names, read without opening anything.
pub(crate) enum StoreUrl<'a> {
    Memory,
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Sqlite {
        path: &'a str,
        synchronous: Synchronous,
    },
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Postgres,
}

/// Reads `url`'s scheme and the SQLite store's parameters; a PostgreSQL
/// URL's parameters are its store's to read.
pub(crate) fn read_url(url: &str) -> Result<StoreUrl<'_>, LedgerError> {
    if url == "memory:" || url == "memory://" {
        return Ok(StoreUrl::Memory);
    }
    if let Some(rest) = url.strip_prefix("sqlite://") {
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        if path.is_empty() {
            return Err(LedgerError::invalid(
                "sqlite:// needs a file path, e.g. sqlite://inflight.db",
            ));
        }
        let mut synchronous = Synchronous::default();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            match pair.split_once('=') {
                Some(("synchronous", value)) => {
                    synchronous = value
                        .parse()
                        .map_err(|err| LedgerError::invalid(format!("store URL {url:?}: synchronous: {err}")))?;
                }
                _ => {
                    return Err(LedgerError::invalid(format!(
                        "store URL {url:?}: unknown parameter {pair:?}; the SQLite store takes synchronous=full|normal"
                    )))
                }
            }
        }
        if cfg!(not(feature = "sqlite")) {
            return Err(LedgerError::invalid(format!(
                "store URL {url:?} needs the SQLite store: build inflight with its `sqlite` feature (on by default)"
            )));
        }
        return Ok(StoreUrl::Sqlite { path, synchronous });
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        if cfg!(not(feature = "postgres")) {
            return Err(LedgerError::invalid(
                "a postgres:// store URL needs the PostgreSQL store: build inflight with its `postgres` feature",
            ));
        }
        return Ok(StoreUrl::Postgres);
    }
    Err(LedgerError::invalid(format!(
        "unsupported store URL {:?}: use \"memory:\", \"sqlite://PATH\" or \"postgres://user@host:port/db\"",
        redacted_url(url)
    )))
}

/// Checks the store URL `url` as [`open`](crate::store::open) reads it (its
/// scheme, and the parameters of its store), without opening or connecting
/// to anything: what `check-config` and `serve` both refuse, with the same
/// message.
///
/// # Errors
/// As [`open`](crate::store::open)'s
/// [`ErrorKind::InvalidInput`](crate::error::ErrorKind::InvalidInput).
pub fn check_url(url: &str) -> Result<(), LedgerError> {
    match read_url(url)? {
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres => PostgresUrl::parse(url).map(drop),
        _ => Ok(()),
    }
}

/// How long opening a connection may take before the command that needed
/// it fails as `unavailable`.
#[cfg(feature = "postgres")]
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long data sent to PostgreSQL may go unacknowledged before the
/// connection is dropped (`TCP_USER_TIMEOUT`), when the URL names none: a
/// server that vanished mid-request (a host gone, a network cut) fails the
/// group as `unavailable` then, where TCP alone would retry for about a
/// quarter of an hour while every writer waits for the turn it holds.
#[cfg(feature = "postgres")]
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);
/// Writer connections when the URL names none: two, so that a group's
/// writes and commit run beside the next group's on another backend.
#[cfg(feature = "postgres")]
pub const DEFAULT_POOL: usize = 2;

/// How connections are secured, from `sslmode` and `sslrootcert`.
#[cfg(feature = "postgres")]
#[derive(Clone)]
pub(crate) enum Tls {
    /// Plain TCP: `sslmode=disable` or `prefer`.
    Off,
    /// TLS with the server's certificate verified.
    On(tokio_postgres_rustls::MakeRustlsConnect),
}

#[cfg(feature = "postgres")]
impl Tls {
    /// The TLS `sslmode` asks for, verified against the certificates in
    /// `root_cert` (a PEM file), or the system's when `None`.
    fn new(mode: &str, root_cert: Option<&str>) -> Result<Self, String> {
        match mode {
            "disable" | "prefer" => {
                if root_cert.is_some() {
                    return Err(format!(
                        "sslrootcert is given but sslmode is {mode:?}: with no TLS it would not be used; \
                         set sslmode=require"
                    ));
                }
                return Ok(Self::Off);
            }
            "require" | "verify-ca" | "verify-full" => {}
            other => {
                return Err(format!(
                    "sslmode {other:?} is not one of disable, prefer, require, verify-ca, verify-full"
                ))
            }
        }
        let config = client_tls("sslrootcert", root_cert.map(std::path::Path::new)).map_err(|err| {
            if root_cert.is_none() {
                format!("sslmode=require, and {err}")
            } else {
                err
            }
        })?;
        Ok(Self::On(tokio_postgres_rustls::MakeRustlsConnect::new(config)))
    }
}

/// A TLS client's settings over ring: servers verified against the PEM
/// certificates in `root_cert`, or the system's roots when `None`. `key` names
/// the setting in errors (`sslrootcert`, `proxy.NAME.ca_file`). The
/// PostgreSQL store and the server's proxy both connect with it.
///
/// # Errors
/// A file that cannot be read or holds no usable certificate, or a system
/// with no root certificates, naming `key`.
#[cfg(feature = "postgres")]
pub fn client_tls(key: &str, root_cert: Option<&std::path::Path>) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    match root_cert {
        Some(path) => {
            use rustls::pki_types::{pem::PemObject, CertificateDer};
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                .and_then(Iterator::collect)
                .map_err(|err| format!("{key} {path:?} cannot be read as PEM certificates: {err}"))?;
            if certs.is_empty() {
                return Err(format!("{key} {path:?} holds no certificate"));
            }
            for cert in certs {
                roots.add(cert).map_err(|err| {
                    format!("{key} {path:?} holds a certificate that cannot be used: {err}")
                })?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(format!(
                    "no {key} is given and the system has no root certificates: name the server's CA with {key}"
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| format!("TLS cannot be set up: {err}"))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Where and how to connect, from a store URL.
#[cfg(feature = "postgres")]
#[derive(Clone)]
pub(crate) struct PostgresUrl {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) tls: Tls,
    pub(crate) schema: Option<String>,
    pub(crate) pool: usize,
    pub(crate) listen: bool,
    /// The notification channel: one per schema, so that ledgers sharing a
    /// database in different schemas do not wake each other.
    pub(crate) channel: String,
}

#[cfg(feature = "postgres")]
impl fmt::Debug for PostgresUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresUrl")
            .field("hosts", &self.config.get_hosts())
            .field("dbname", &self.config.get_dbname())
            .field("schema", &self.schema)
            .field("pool", &self.pool)
            .field("listen", &self.listen)
            .field("tls", &matches!(self.tls, Tls::On(_)))
            .finish()
    }
}

#[cfg(feature = "postgres")]
impl PostgresUrl {
    /// Reads `url`; its store parameters are taken out, the rest is the
    /// client's.
    pub(crate) fn parse(url: &str) -> Result<Self, LedgerError> {
        let named =
            |message: String| LedgerError::invalid(format!("store URL {}: {message}", redacted_url(url)));
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut schema = None;
        let mut pool = DEFAULT_POOL;
        let mut listen = true;
        let mut ssl_mode = "prefer";
        let mut root_cert = None;
        let mut passed = Vec::new();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            match pair.split_once('=') {
                Some(("schema", value)) => {
                    let valid = !value.is_empty()
                        && value.len() <= 63
                        && value
                            .bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
                    if !valid {
                        return Err(named(format!(
                            "schema {value:?} is not 1 to 63 lowercase letters, digits or underscores"
                        )));
                    }
                    schema = Some(value.to_owned());
                }
                Some(("pool", value)) => {
                    pool = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=64).contains(n))
                        .ok_or_else(|| named(format!("pool {value:?} is not a number from 1 to 64")))?;
                }
                Some(("listen", value)) => {
                    listen = match value {
                        "true" => true,
                        "false" => false,
                        other => return Err(named(format!("listen {other:?} is not one of true, false"))),
                    };
                }
                // Read here, not by the client: it knows neither the
                // verify modes nor the root certificate file.
                Some(("sslmode", value)) => ssl_mode = value,
                Some(("sslrootcert", value)) => root_cert = Some(value),
                _ => passed.push(pair),
            }
        }
        let client_url = if passed.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", passed.join("&"))
        };
        let tls = Tls::new(ssl_mode, root_cert).map_err(named)?;
        let mut config =
            tokio_postgres::Config::from_str(&client_url).map_err(|err| named(err.to_string()))?;
        config.ssl_mode(match tls {
            Tls::Off => tokio_postgres::config::SslMode::Disable,
            Tls::On(_) => tokio_postgres::config::SslMode::Require,
        });
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("inflight");
        }
        // A peer that vanished without closing is noticed within seconds
        // when idle, and within TCP_USER_TIMEOUT mid-request.
        config.keepalives(true).keepalives_idle(Duration::from_secs(5));
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(TCP_USER_TIMEOUT);
        }
        let channel = match &schema {
            Some(schema) => format!("inflight_capacity_{schema}"),
            None => "inflight_capacity".to_owned(),
        };
        Ok(Self {
            config,
            tls,
            schema,
            pool,
            listen,
            channel,
        })
    }
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::*;

    #[test]
    fn a_url_names_what_is_wrong_with_it() {
        let message = |url: &str| PostgresUrl::parse(url).unwrap_err().to_string();
        assert!(message("postgres://u@h/db?pool=0").contains("pool \"0\" is not a number from 1 to 64"));
        assert!(message("postgres://u@h/db?listen=no").contains("listen \"no\" is not one of true, false"));
        assert!(message("postgres://u@h/db?schema=Bad-Name").contains("schema \"Bad-Name\""));
        assert!(message("postgres://u:secret@h/db?bogus=1").contains("u:***@h"));
        let settings =
            PostgresUrl::parse("postgresql://u@h:5433/db?schema=a1&pool=2&listen=false&application_name=x")
                .unwrap();
        assert_eq!((settings.pool, settings.listen), (2, false));
        assert_eq!(settings.schema.as_deref(), Some("a1"));
        assert_eq!(settings.config.get_application_name(), Some("x"));
        assert_eq!(settings.config.get_connect_timeout(), Some(&CONNECT_TIMEOUT));
        assert_eq!(settings.config.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
        let own = PostgresUrl::parse("postgres://u@h/db?tcp_user_timeout=5").unwrap();
        assert_eq!(own.config.get_tcp_user_timeout(), Some(&Duration::from_secs(5)));
    }

    #[test]
    fn tls_is_asked_for_with_sslmode_and_its_roots_are_checked() {
        let message = |url: &str| PostgresUrl::parse(url).unwrap_err().to_string();
        assert!(message("postgres://u@h/db?sslmode=allow").contains("sslmode \"allow\" is not one of"));
        assert!(
            message("postgres://u@h/db?sslmode=require&sslrootcert=/nonexistent/ca.pem")
                .contains("sslrootcert \"/nonexistent/ca.pem\" cannot be read")
        );
        assert!(message("postgres://u@h/db?sslrootcert=/etc/hosts").contains("set sslmode=require"));
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no certificate here\n").unwrap();
        let url = format!(
            "postgres://u@h/db?sslmode=require&sslrootcert={}",
            empty.display()
        );
        assert!(
            message(&url).contains("holds no certificate"),
            "{}",
            message(&url)
        );

        for (url, tls) in [
            ("postgres://u@h/db", false),
            ("postgres://u@h/db?sslmode=disable", false),
            ("postgres://u@h/db?sslmode=prefer", false),
        ] {
            let settings = PostgresUrl::parse(url).unwrap();
            assert_eq!(matches!(settings.tls, Tls::On(_)), tls, "{url}");
            assert_eq!(
                settings.config.get_ssl_mode(),
                postgres::config::SslMode::Disable,
                "{url}"
            );
        }
    }
}
