//! TLS for `inflight serve`: rustls (ring), a certificate chain and key from
//! PEM files, re-read on every [`Reload`] without dropping a connection.
//!
//! The files come from `[server.tls] cert = "..."`, `key = "..."` in the
//! configuration file, or `--tls-cert` / `--tls-key` (`INFLIGHT_TLS_CERT`,
//! `INFLIGHT_TLS_KEY`), which win; both or neither. Relative paths are from
//! the working directory, as the store's are.
//!
//! The server config asks a resolver for its certificate on each handshake;
//! the resolver holds the current pair behind a lock that a reload swaps.
//! So a reload changes what new handshakes present, and connections already
//! open go on with the pair they were made with. A reload that cannot read
//! the files keeps the old pair and logs why.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};

use inflight::config::ConfigError;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use crate::reload::Reload;

/// The key that names the certificate chain file.
const CERT: &str = "server.tls.cert";
/// The key that names the private key file.
const KEY: &str = "server.tls.key";

/// Where the certificate chain and the private key are: PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, the server's own certificate first.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

impl TlsFiles {
    /// Merges the flags (`cert`, `key`) over the `tls` table of the
    /// `[server]` table, each file on its own.
    ///
    /// # Errors
    /// One of the two without the other, a `tls` that is not a table, an
    /// unknown key in it, or a path that is not a non-empty string, naming
    /// the key.
    pub fn resolve(
        cert: Option<&Path>,
        key: Option<&Path>,
        server: Option<&toml::Table>,
    ) -> Result<Option<Self>, ConfigError> {
        let (mut file_cert, mut file_key) = (None, None);
        if let Some(value) = server.and_then(|server| server.get("tls")) {
            let table = value
                .as_table()
                .ok_or_else(|| ConfigError::new("server.tls", "must be a table with cert and key"))?;
            for (name, value) in table {
                let slot = match name.as_str() {
                    "cert" => &mut file_cert,
                    "key" => &mut file_key,
                    _ => {
                        return Err(ConfigError::new(
                            format!("server.tls.{name}"),
                            "is not a setting; [server.tls] takes cert and key",
                        ))
                    }
                };
                let path = value
                    .as_str()
                    .filter(|path| !path.trim().is_empty())
                    .ok_or_else(|| {
                        ConfigError::new(
                            format!("server.tls.{name}"),
                            format!("must be the path of a PEM file, got {value}"),
                        )
                    })?;
                *slot = Some(PathBuf::from(path));
            }
        }
        let given = |path: Option<&Path>| {
            path.filter(|path| !path.as_os_str().is_empty())
                .map(Path::to_owned)
        };
        let cert = given(cert).or(file_cert);
        let key = given(key).or(file_key);
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(Self { cert, key })),
            (None, None) => Ok(None),
            (Some(_), None) => Err(ConfigError::new(
                KEY,
                "is missing: TLS needs the key with the certificate (--tls-key, INFLIGHT_TLS_KEY)",
            )),
            (None, Some(_)) => Err(ConfigError::new(
                CERT,
                "is missing: TLS needs the certificate with the key (--tls-cert, INFLIGHT_TLS_CERT)",
            )),
        }
    }
}

/// The server's TLS: cheap to clone, every clone serves and reloads the
/// same pair.
#[derive(Debug, Clone)]
pub struct Tls {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    current: Arc<Current>,
    config: Arc<ServerConfig>,
}

/// The pair new handshakes get.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // A poisoned lock still holds a whole pair: a swap cannot half-happen.
        Some(Arc::clone(&self.0.read().unwrap_or_else(PoisonError::into_inner)))
    }
}

impl Tls {
    /// Reads `files` and builds the server's TLS configuration: TLS 1.2 and
    /// 1.3, HTTP/1.1 as the only application protocol.
    ///
    /// # Errors
    /// A file that cannot be read, holds no PEM certificate (or key), or a
    /// key that rustls cannot use or that does not go with the certificate,
    /// naming the key and the file.
    pub fn load(files: &TlsFiles) -> Result<Self, ConfigError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let pair = certified_key(files, &provider)?;
        let current = Arc::new(Current(RwLock::new(Arc::new(pair))));
        let mut config = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|err| ConfigError::new("server.tls", format!("cannot set up TLS: {err}")))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(&current) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            files: files.clone(),
            provider,
            current,
            config: Arc::new(config),
        })
    }

    /// The files it reads.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Re-reads the files: new handshakes get the new pair, open
    /// connections keep theirs.
    ///
    /// # Errors
    /// As [`Tls::load`]; the old pair is kept.
    pub fn reload(&self) -> Result<(), ConfigError> {
        let pair = Arc::new(certified_key(&self.files, &self.provider)?);
        *self.current.0.write().unwrap_or_else(PoisonError::into_inner) = pair;
        Ok(())
    }

    /// Re-reads the files on every reload of `reload`, logging the outcome.
    pub fn reload_on(&self, reload: &Reload) -> JoinHandle<()> {
        let tls = self.clone();
        // Two small files: read on the runtime's thread, as rarely as an
        // operator sends SIGHUP.
        reload.each(move || match tls.reload() {
            Ok(()) => tracing::info!(
                cert = %tls.files.cert.display(),
                key = %tls.files.key.display(),
                "re-read the TLS certificate and key; new connections use them"
            ),
            Err(err) => tracing::error!(
                error = %err,
                "cannot re-read the TLS certificate and key; still serving the previous ones"
            ),
        })
    }

    /// What accepts TLS connections with this configuration.
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(Arc::clone(&self.config))
    }
}

/// Reads the chain and the key of `files` and checks that they go together.
fn certified_key(files: &TlsFiles, provider: &CryptoProvider) -> Result<CertifiedKey, ConfigError> {
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|items| items.collect::<Result<Vec<_>, _>>())
        .map_err(|err| pem_error(CERT, &files.cert, "certificate", err))?;
    if chain.is_empty() {
        return Err(pem_error(
            CERT,
            &files.cert,
            "certificate",
            pem::Error::NoItemsFound,
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|err| pem_error(KEY, &files.key, "private key", err))?;
    let key = provider.key_provider.load_private_key(key).map_err(|err| {
        file_error(
            KEY,
            &files.key,
            format!("holds a private key rustls cannot use: {err}"),
        )
    })?;
    let pair = CertifiedKey::new(chain, key);
    match pair.keys_match() {
        Ok(()) => Ok(pair),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => Err(file_error(
            KEY,
            &files.key,
            format!("is not the key of the certificate in {}", files.cert.display()),
        )),
        Err(err) => Err(file_error(
            CERT,
            &files.cert,
            format!("holds a certificate rustls cannot use: {err}"),
        )),
    }
}

fn pem_error(key: &str, path: &Path, what: &str, err: pem::Error) -> ConfigError {
    let problem = match err {
        pem::Error::Io(err) => format!("cannot be read: {err}"),
        pem::Error::NoItemsFound => format!("holds no PEM {what}"),
        other => format!("is not a valid PEM {what}: {other}"),
    };
    file_error(key, path, problem)
}

fn file_error(key: &str, path: &Path, problem: String) -> ConfigError {
    ConfigError::new(key, format!("{} {problem}", path.display()))
}

/// The connector of the server's own HTTP clients (the proxy's upstreams,
/// the OpenTelemetry collector): HTTP/1, `https://` over `tls`.
pub(crate) fn client_connector(
    tls: rustls::ClientConfig,
) -> hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector> {
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    // `https://` URLs go through the TLS connector.
    http.enforce_http(false);
    http.set_nodelay(true);
    hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        text.parse().expect("valid TOML")
    }

    fn resolve(cert: Option<&str>, key: Option<&str>, server: &str) -> Result<Option<TlsFiles>, ConfigError> {
        TlsFiles::resolve(cert.map(Path::new), key.map(Path::new), Some(&table(server)))
    }

    #[test]
    fn flags_win_over_the_file_file_by_file() {
        assert_eq!(resolve(None, None, "").unwrap(), None);
        let file = "[tls]\ncert = \"file.crt\"\nkey = \"file.key\"\n";
        let from_file = resolve(None, None, file).unwrap().unwrap();
        assert_eq!(from_file.cert, PathBuf::from("file.crt"));
        let over = resolve(Some("flag.crt"), Some(""), file).unwrap().unwrap();
        assert_eq!(
            (over.cert, over.key),
            (PathBuf::from("flag.crt"), PathBuf::from("file.key")),
            "an empty flag counts as unset"
        );
        assert!(resolve(Some("a.crt"), Some("a.key"), "").unwrap().is_some());
    }

    #[test]
    fn one_without_the_other_or_a_bad_value_names_the_key() {
        for (cert, key, server, named) in [
            (Some("a.crt"), None, "", KEY),
            (None, Some("a.key"), "", CERT),
            (None, None, "[tls]\ncert = \"a.crt\"\n", KEY),
            (None, None, "[tls]\nkey = \"a.key\"\n", CERT),
            (None, None, "tls = \"on\"\n", "server.tls"),
            (None, None, "[tls]\ncert = \"a.crt\"\nkey = 3\n", KEY),
            (None, None, "[tls]\ncert = \"\"\nkey = \"a.key\"\n", CERT),
            (
                None,
                None,
                "[tls]\ncert = \"a\"\nkey = \"b\"\nca = \"c\"\n",
                "server.tls.ca",
            ),
        ] {
            let err = resolve(cert, key, server).unwrap_err();
            assert_eq!(err.key, named, "{cert:?} {key:?} {server:?}: {err}");
        }
    }

    #[test]
    fn an_unreadable_or_invalid_file_is_named_with_why() {
        let dir = tempfile::tempdir().unwrap();
        let missing = TlsFiles {
            cert: dir.path().join("missing.crt"),
            key: dir.path().join("missing.key"),
        };
        let err = Tls::load(&missing).unwrap_err();
        assert_eq!(err.key, CERT);
        assert!(err.problem.contains("missing.crt cannot be read"), "{err}");

        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").unwrap();
        let files = TlsFiles {
            cert: garbage.clone(),
            key: garbage,
        };
        let err = Tls::load(&files).unwrap_err();
        assert_eq!(err.key, CERT);
        assert!(err.problem.contains("holds no PEM certificate"), "{err}");
    }
}
