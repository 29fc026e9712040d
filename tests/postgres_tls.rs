//! The PostgreSQL store over TLS, against a private cluster that takes TLS
//! connections only (`hostssl` in its `pg_hba.conf`), with a certificate
//! from a CA made for the test: `sslmode=require` with that CA as
//! `sslrootcert` is served; without TLS, or with roots that do not know the
//! CA, `inflight serve` refuses to start and says why.

mod common;

use std::path::Path;
use std::process::Command as StdCommand;

use common::cluster::Cluster;
use common::{inflight, Launch, Server};
use serde_json::json;

/// Runs `openssl` in `dir`, failing the test with what it printed.
fn openssl(dir: &Path, args: &[&str]) {
    let output = StdCommand::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the TLS test needs the openssl program to make its certificates");
    assert!(
        output.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A CA (`ca.crt`) and a server certificate it signed for 127.0.0.1 and
/// localhost (`server.crt`, `server.key`), in `dir`.
fn certificates(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509", "-days", "2", "-subj", "/CN=inflight test CA"];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.crt"]);
    openssl(dir, &ca);
    let mut request = vec!["req", "-subj", "/CN=localhost"];
    request.extend(ec);
    request.extend(["-keyout", "server.key", "-out", "server.csr"]);
    openssl(dir, &request);
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName = IP:127.0.0.1, DNS:localhost\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-extfile",
            "server.ext",
            "-out",
            "server.crt",
        ],
    );
}

/// A started cluster that takes TCP connections over TLS only, and the
/// path of the CA that signed its certificate.
async fn tls_only_cluster() -> (Cluster, String) {
    let cluster = Cluster::init("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'").await;
    let certs = tempfile::tempdir().unwrap();
    certificates(certs.path());
    for file in ["server.crt", "server.key"] {
        let to = cluster.data.join(file);
        std::fs::copy(certs.path().join(file), &to).unwrap();
        if cluster.as_postgres {
            let owned = StdCommand::new("chown")
                .arg("postgres:")
                .arg(&to)
                .status()
                .unwrap();
            assert!(
                owned.success(),
                "cannot give {} to the postgres user",
                to.display()
            );
        }
    }
    // PostgreSQL refuses a key that others may read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        cluster.data.join("server.key"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    std::fs::write(
        cluster.data.join("pg_hba.conf"),
        "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
    )
    .unwrap();
    cluster.up().await;
    let ca = cluster.dir.path().join("ca.crt");
    std::fs::copy(certs.path().join("ca.crt"), &ca).unwrap();
    (cluster, ca.display().to_string())
}

/// What `inflight serve` printed when it refused to start on `store`.
async fn refused(store: &str) -> String {
    let output = inflight()
        .args(["serve", "--listen", "127.0.0.1:0", "--store", store])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "serve started on {store}: {stderr}");
    eprintln!("refused: {}", stderr.trim());
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_speaks_tls_to_a_server_that_takes_nothing_else() {
    let (cluster, ca) = tls_only_cluster().await;

    let url = format!("{}?sslmode=require&sslrootcert={ca}", cluster.url());
    let server = Server::start(Launch {
        store: Some(url),
        ..Launch::default()
    })
    .await;
    let id = server
        .begin(json!({"service": "kb", "provider": "ollama", "class": "embedding"}))
        .await;
    let (status, record) = server
        .post(&format!("/v1/activities/{id}/start"), json!({}))
        .await;
    assert_eq!(status, 200, "{record}");
    let (status, record) = server
        .post(&format!("/v1/activities/{id}/settle"), json!({"success": true}))
        .await;
    assert_eq!(status, 200, "{record}");
    assert_eq!(record["state"], "succeeded");
    server.crash().await;

    // Without TLS, the server's refusal is passed on.
    let plain = refused(&cluster.url()).await;
    assert!(plain.contains("no encryption"), "{plain}");

    // TLS, but the CA is not among the system's roots.
    let unknown = refused(&format!("{}?sslmode=require", cluster.url())).await;
    assert!(unknown.to_lowercase().contains("certificate"), "{unknown}");

    // A root file that does not exist is named.
    let missing = refused(&format!(
        "{}?sslmode=require&sslrootcert=/nonexistent/ca.crt",
        cluster.url()
    ))
    .await;
    assert!(
        missing.contains("sslrootcert \"/nonexistent/ca.crt\""),
        "{missing}"
    );
}
