//! `rediss://` with AUTH (the ElastiCache shape) against the private TLS-only Redis that
//! `scripts/services` starts (`IDEM_REDIS_TLS_URL`), whose certificate the test CA
//! (`IDEM_TLS_CA`) signed; and each wrong setting refused at connect, naming the server.
#![cfg(feature = "tls")]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{HOUR, claim};
use idem_conformance::{service_env, unique_namespace};
use idem_core::backend::ClaimOutcome;
use idem_core::{Backend, Error, Key, Refusal};
use idem_redis::{RedisBackend, RedisConfig};

fn ca() -> Vec<u8> {
    std::fs::read(service_env("IDEM_TLS_CA")).expect("read IDEM_TLS_CA")
}

fn tls_url() -> String {
    service_env("IDEM_REDIS_TLS_URL")
}

/// `host:port` of the TLS server.
fn tls_server() -> String {
    let url = url::Url::parse(&tls_url()).expect("IDEM_REDIS_TLS_URL");
    format!(
        "{}:{}",
        url.host_str().expect("host"),
        url.port().expect("port")
    )
}

/// What connecting with `config` is refused with.
async fn refused(config: RedisConfig) -> (String, Refusal, String) {
    let res = RedisBackend::connect(config.with_timeout(Duration::from_secs(2))).await;
    let err = match res {
        Err(e) => e,
        Ok(_) => panic!("connected, where a refusal was expected"),
    };
    let text = err.to_string();
    match err {
        Error::Refused { server, why, .. } => (server, why, text),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn claims_over_tls_with_auth_and_a_private_ca() {
    let config = RedisConfig::new(tls_url()).with_tls_root_cert(ca());
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
}

#[tokio::test]
async fn a_wrong_password_is_refused_naming_the_server() {
    let mut url = url::Url::parse(&tls_url()).expect("url");
    url.set_password(Some("not-the-password"))
        .expect("password");
    let (server, why, text) =
        refused(RedisConfig::new(url.as_str()).with_tls_root_cert(ca())).await;
    assert_eq!(why, Refusal::Authentication, "{text}");
    assert_eq!(server, tls_server());
    assert!(
        text.contains(&tls_server()) && text.contains("password"),
        "{text}"
    );
    assert!(
        !text.contains("not-the-password"),
        "the password leaked: {text}"
    );
}

#[tokio::test]
async fn an_untrusted_certificate_is_refused_naming_the_server() {
    // No CA given: the webpki roots do not hold the test CA.
    let (server, why, text) = refused(RedisConfig::new(tls_url())).await;
    assert_eq!(why, Refusal::UntrustedCertificate, "{text}");
    assert_eq!(server, tls_server());
    assert!(text.contains("certificate"), "{text}");
}

#[tokio::test]
async fn plaintext_to_the_tls_port_is_a_mismatch() {
    let plain = tls_url().replacen("rediss://", "redis://", 1);
    let (server, why, text) = refused(RedisConfig::new(plain)).await;
    assert_eq!(why, Refusal::TlsMismatch, "{text}");
    assert_eq!(server, tls_server());
    assert!(text.contains("rediss://"), "{text}");
}

#[tokio::test]
async fn tls_to_a_plaintext_server_times_out_saying_so() {
    // A plaintext Redis answers a TLS handshake with nothing at all, which is what a slow
    // server does too: `Unavailable`, with the likely cause named.
    let plain = service_env("IDEM_REDIS_URL");
    let tls = plain.replacen("redis://", "rediss://", 1);
    let config = RedisConfig::new(tls).with_tls_root_cert(ca());
    let res = RedisBackend::connect(config.with_timeout(Duration::from_millis(500))).await;
    let err = res
        .map(|_| ())
        .expect_err("a TLS handshake with a plaintext server");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(err.to_string().contains("is it a TLS port?"), "{err}");
}

#[tokio::test]
async fn a_server_that_is_down_stays_unavailable() {
    let url = format!("redis://127.0.0.1:{}/", common::closed_port());
    let res =
        RedisBackend::connect(RedisConfig::new(url).with_timeout(Duration::from_secs(1))).await;
    assert!(
        matches!(res, Err(Error::Unavailable { .. })),
        "{:?}",
        res.map(|_| ())
    );
}
