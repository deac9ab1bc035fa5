//! `rediss://` against a private TLS `redis-server` whose certificate a private CA signed.
//! Runs with the `tls` feature: `cargo test -p idem-redis --features tls --test tls`
//! (scripts/test does).
#![cfg(feature = "tls")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{HOUR, claim, closed_port};
use idem_conformance::unique_namespace;
use idem_core::backend::ClaimOutcome;
use idem_core::{Backend, Error, Key};
use idem_redis::{RedisBackend, RedisConfig};

fn run(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl is not installed (apt-get install openssl)");
    assert!(status.success(), "openssl {args:?} failed");
}

/// A CA, and a certificate for 127.0.0.1 that it signed, in a fresh directory.
fn certificates() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("idem-tls-{}", unique_namespace()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    run(
        &dir,
        &[
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        ]
        .into_iter()
        .chain([
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-subj",
            "/CN=idem test CA",
        ])
        .collect::<Vec<_>>(),
    );
    run(
        &dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
        ]
        .into_iter()
        .chain(["-out", "server.csr", "-subj", "/CN=127.0.0.1"])
        .collect::<Vec<_>>(),
    );
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").expect("ext");
    run(
        &dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
        ]
        .into_iter()
        .chain([
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.pem",
        ])
        .collect::<Vec<_>>(),
    );
    dir
}

struct TlsServer {
    port: u16,
    child: Child,
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn tls_server(dir: &Path) -> TlsServer {
    let port = closed_port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--tls-port",
            &port.to_string(),
        ])
        .args([
            "--tls-cert-file",
            "server.pem",
            "--tls-key-file",
            "server.key",
        ])
        .args(["--tls-ca-cert-file", "ca.pem", "--tls-auth-clients", "no"])
        .args(["--save", "", "--appendonly", "no"])
        .current_dir(dir)
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server is not installed: run `eval \"$(scripts/services up)\"`");
    let server = TlsServer { port, child };
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "TLS redis-server did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server
}

#[tokio::test]
async fn claims_over_tls_with_a_private_ca() {
    let dir = certificates();
    let server = tls_server(&dir).await;
    let ca = std::fs::read(dir.join("ca.pem")).expect("ca.pem");
    let url = format!("rediss://127.0.0.1:{}/", server.port);
    let config = RedisConfig::new(&url).with_tls_root_cert(ca);
    let backend = RedisBackend::connect(config)
        .await
        .expect("connect over TLS");
    let key = Key::new(unique_namespace(), "tls").expect("key");
    let ClaimOutcome::Acquired(lease) = backend.claim(&claim(&key, "w")).await.expect("claim")
    else {
        panic!("not acquired");
    };
    backend
        .complete(&lease, Bytes::from_static(b"sealed"), HOUR)
        .await
        .expect("complete");
    let replay = backend.claim(&claim(&key, "v")).await.expect("claim");
    assert_eq!(
        replay,
        ClaimOutcome::Completed(Bytes::from_static(b"sealed"))
    );

    // Without the CA the server's certificate is not trusted; plain TCP gets no answer.
    let untrusted = RedisConfig::new(&url).with_timeout(Duration::from_millis(500));
    let res = RedisBackend::connect(untrusted).await;
    assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
    let plain = format!("redis://127.0.0.1:{}/", server.port);
    let res =
        RedisBackend::connect(RedisConfig::new(plain).with_timeout(Duration::from_millis(500)))
            .await;
    assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
