//! MySQL/MariaDB over TLS, on the TLS-only MariaDB `scripts/services` starts
//! (`IDEM_MYSQL_TLS_URL`: `require_secure_transport=ON`, a certificate from the test CA
//! `IDEM_TLS_CA`): `ssl-mode=REQUIRED` and `VERIFY_IDENTITY` claim, complete and run
//! transactional mode over an encrypted session; a wrong password, an untrusted
//! certificate and a TLS mismatch each fail `connect` with `Error::Refused`, naming the
//! server and which refusal it is.

use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{Backend, Error, Fingerprint, Key, Outcome, Refusal, State, Transactional};
use idem_mysql::{MySqlBackend, MySqlConfig};
use sqlx::AssertSqlSafe;

const HOUR: Duration = Duration::from_secs(3600);

/// `var`'s URL (user and password, no TLS parameters) with `params` added.
fn url_of(var: &str, params: &str) -> String {
    let base = idem_conformance::service_env(var);
    if params.is_empty() {
        base
    } else {
        format!("{base}?{params}")
    }
}

/// The TLS-only server's URL with `params` added.
fn url(params: &str) -> String {
    url_of("IDEM_MYSQL_TLS_URL", params)
}

/// `ssl-mode=VERIFY_IDENTITY` against the test CA.
fn verify_identity() -> String {
    let ca = idem_conformance::service_env("IDEM_TLS_CA");
    url(&format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"))
}

/// The server of `url`, as error messages name it.
fn server(url: &str) -> String {
    let url = url::Url::parse(url).expect("the URL parses");
    let host = url.host_str().expect("a host");
    format!("{host}:{}", url.port().unwrap_or(3306))
}

async fn connect(url: String) -> MySqlBackend {
    let backend = MySqlBackend::connect(MySqlConfig::new(url).with_max_connections(2))
        .await
        .expect("connect over TLS");
    backend.migrate().await.expect("migrate");
    backend
}

/// The cipher the server says this session uses (empty when it is plaintext).
async fn session_cipher(backend: &MySqlBackend) -> String {
    let (_, cipher): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .fetch_one(backend.pool())
        .await
        .expect("read Ssl_cipher");
    cipher
}

fn claim(ns: &str, id: &str) -> Claim {
    Claim {
        key: Key::new(ns, id).expect("key"),
        owner: "w".into(),
        lease_ttl: Duration::from_secs(30),
        fingerprint: Some(Fingerprint::of(id.as_bytes())),
        max_attempts: 3,
        retention: HOUR,
    }
}

/// Claims and completes a key, then claims it again: the stored response comes back.
async fn claims_and_completes(backend: &MySqlBackend) {
    let ns = idem_conformance::unique_namespace();
    let c = claim(&ns, "order-1");
    let ClaimOutcome::Acquired(lease) = backend.claim(&c).await.expect("claim") else {
        panic!("a new key is acquired");
    };
    let response = Bytes::from_static(b"charged");
    backend
        .complete(&lease, response.clone(), HOUR)
        .await
        .expect("complete");
    let again = backend.claim(&c).await.expect("claim again");
    assert_eq!(again, ClaimOutcome::Completed(response));
    let record = backend.get(&c.key).await.expect("get").expect("a record");
    assert_eq!(record.state, State::Completed);
}

#[tokio::test]
async fn ssl_mode_required_claims_and_completes_over_an_encrypted_session() {
    let backend = connect(url("ssl-mode=REQUIRED")).await;
    let cipher = session_cipher(&backend).await;
    assert!(
        !cipher.is_empty(),
        "the server reports a cipher: {cipher:?}"
    );
    claims_and_completes(&backend).await;
}

#[tokio::test]
async fn verify_identity_with_the_ca_claims_and_completes_over_an_encrypted_session() {
    let backend = connect(verify_identity()).await;
    let cipher = session_cipher(&backend).await;
    assert!(
        !cipher.is_empty(),
        "the server reports a cipher: {cipher:?}"
    );
    claims_and_completes(&backend).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_mode_over_verify_identity_commits_the_write_with_the_record() {
    let backend = connect(verify_identity()).await;
    let ns = idem_conformance::unique_namespace();
    let ledger = format!("ledger_{}", ns.replace('-', "_"));
    let create = format!("CREATE TABLE {ledger} (k VARCHAR(64) NOT NULL, cipher TEXT NOT NULL)");
    sqlx::query(AssertSqlSafe(create))
        .execute(backend.pool())
        .await
        .expect("create ledger");
    let c = claim(&ns, "order-1");
    for _ in 0..2 {
        let table = ledger.clone();
        // The handler's write records the cipher of its own session.
        let outcome = backend
            .execute_in_transaction(&c, HOUR, None, move |tx, _| {
                async move {
                    let q = format!(
                        "INSERT INTO {table} (k, cipher) SELECT 'order-1', VARIABLE_VALUE \
                         FROM information_schema.SESSION_STATUS WHERE VARIABLE_NAME = 'SSL_CIPHER'"
                    );
                    sqlx::query(AssertSqlSafe(q)).execute(&mut **tx).await?;
                    Ok(Bytes::from_static(b"booked"))
                }
                .boxed()
            })
            .await
            .expect("execute");
        assert!(
            matches!(&outcome, Outcome::Executed(b) | Outcome::Replayed(b) if *b == "booked"),
            "{outcome:?}"
        );
    }
    let q = format!("SELECT k, cipher FROM {ledger}");
    let rows: Vec<(String, String)> = sqlx::query_as(AssertSqlSafe(q))
        .fetch_all(backend.pool())
        .await
        .expect("read ledger");
    let drop = format!("DROP TABLE {ledger}");
    let _ = sqlx::query(AssertSqlSafe(drop))
        .execute(backend.pool())
        .await;
    assert_eq!(rows.len(), 1, "one write: {rows:?}");
    assert!(!rows[0].1.is_empty(), "the write's session was encrypted");
    let record = backend.get(&c.key).await.expect("get").expect("record");
    assert_eq!(record.state, State::Completed);
}

/// `connect`'s error for `url`: `Refused` by its server for `want`; its message.
async fn refused(url: String, want: Refusal) -> String {
    let server = server(&url);
    let config = MySqlConfig::new(url).with_connect_timeout(Duration::from_secs(5));
    let err = MySqlBackend::connect(config)
        .await
        .expect_err("the server refuses this connection");
    let Error::Refused {
        server: named,
        why,
        message,
        ..
    } = &err
    else {
        panic!("a refusal is Error::Refused, not {err:?}");
    };
    assert_eq!((named.as_str(), *why), (server.as_str(), want), "{err}");
    assert!(err.to_string().contains(&server), "{err}");
    message.clone()
}

#[tokio::test]
async fn a_wrong_password_fails_connect_naming_the_server() {
    let mut wrong = url::Url::parse(&verify_identity()).expect("url");
    wrong
        .set_password(Some("not-the-password"))
        .expect("password");
    let message = refused(wrong.into(), Refusal::Authentication).await;
    assert!(message.contains("Access denied"), "{message}");
    assert!(!message.contains("TLS"), "TLS was on: {message}");
    assert!(!message.contains("not-the-password"), "{message}");
}

#[tokio::test]
async fn verify_identity_without_the_ca_fails_connect_as_an_untrusted_certificate() {
    // The webpki roots do not hold the test CA.
    let want = Refusal::UntrustedCertificate;
    let message = refused(url("ssl-mode=VERIFY_IDENTITY"), want).await;
    assert!(message.contains("ssl-ca"), "{message}");
}

#[tokio::test]
async fn ssl_mode_required_against_a_plaintext_server_fails_connect_as_a_tls_mismatch() {
    // The machine's MariaDB (or the one `scripts/services` starts on 13306) has TLS off.
    let plaintext = url_of("IDEM_MYSQL_URL", "ssl-mode=REQUIRED");
    let message = refused(plaintext, Refusal::TlsMismatch).await;
    assert!(message.contains("does not offer TLS"), "{message}");
}

/// MariaDB refuses a plaintext login to a server requiring TLS as it refuses a wrong
/// password (error 1045): with TLS turned off, the message names both causes.
#[tokio::test]
async fn plaintext_against_the_tls_only_server_fails_connect_naming_tls() {
    let message = refused(url("ssl-mode=DISABLED"), Refusal::Authentication).await;
    assert!(message.contains("requires TLS"), "{message}");
    assert!(message.contains("ssl-mode=DISABLED"), "{message}");
}
