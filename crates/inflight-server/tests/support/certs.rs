//! Certificates made at test time (rcgen), and a rustls client.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use inflight_server::TlsFiles;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// A certificate authority made for the test.
pub struct Ca(CertifiedIssuer<'static, KeyPair>);

impl Ca {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Self(CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap())
    }

    /// A server certificate for localhost and 127.0.0.1, signed by this CA,
    /// written to `files` in PEM; returns its DER.
    pub fn issue(&self, files: &TlsFiles) -> CertificateDer<'static> {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        let cert = params.signed_by(&key, &self.0).unwrap();
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        cert.der().clone()
    }

    /// The CA's own certificate, in PEM.
    pub fn pem(&self) -> String {
        self.0.pem()
    }

    /// A client that trusts this CA only.
    pub fn client(&self) -> TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.0.der().clone()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        TlsConnector::from(Arc::new(config))
    }
}

/// `server.crt` and `server.key` in `dir`.
pub fn files(dir: &Path) -> TlsFiles {
    TlsFiles {
        cert: dir.join("server.crt"),
        key: dir.join("server.key"),
    }
}

/// A TLS connection to `addr` as `localhost`.
pub async fn connect(client: &TlsConnector, addr: SocketAddr) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    client
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

/// The certificate the server presented on `stream`.
pub fn presented(stream: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    stream.get_ref().1.peer_certificates().expect("a certificate")[0].clone()
}
