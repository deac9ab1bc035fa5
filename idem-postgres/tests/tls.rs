//! PostgreSQL over TLS, on the TLS-only server `scripts/services` starts
//! (`IDEM_POSTGRES_TLS_URL`: `hostssl` lines only, scram-sha-256, a certificate from the
//! test CA `IDEM_TLS_CA`): `sslmode=require` and `verify-full` claim, complete and run
//! transactional mode over an encrypted session; a wrong password, an untrusted
//! certificate and a TLS mismatch each fail `connect` with `Error::Refused`, naming the
//! server and which refusal it is.

use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{Backend, Error, Fingerprint, Key, Outcome, Refusal, State, Transactional};
use idem_postgres::{PgBackend, PgConfig};
use sqlx::AssertSqlSafe;

const HOUR: Duration = Duration::from_secs(3600);

/// The TLS-only server's URL (user and password, no TLS parameters) with `params` added.
fn url(params: &str) -> String {
    let base = idem_conformance::service_env("IDEM_POSTGRES_TLS_URL");
    if params.is_empty() {
        base
    } else {
        format!("{base}?{params}")
    }
}

/// `sslmode=verify-full` against the test CA.
fn verify_full() -> String {
    let ca = idem_conformance::service_env("IDEM_TLS_CA");
    url(&format!("sslmode=verify-full&sslrootcert={ca}"))
}

/// The server as error messages name it.
fn server() -> String {
    let base = url::Url::parse(&url("")).expect("IDEM_POSTGRES_TLS_URL parses");
    let host = base.host_str().expect("a host");
    format!("{host}:{}", base.port().unwrap_or(5432))
}

async fn connect(url: String) -> PgBackend {
    let backend = PgBackend::connect(PgConfig::new(url).with_max_connections(2))
        .await
        .expect("connect over TLS");
    backend.migrate().await.expect("migrate");
    backend
}

/// What the server says of this session: encrypted, and with which protocol.
async fn session_tls(backend: &PgBackend) -> (bool, Option<String>) {
    sqlx::query_as("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(backend.pool())
        .await
        .expect("read pg_stat_ssl")
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
async fn claims_and_completes(backend: &PgBackend) {
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
async fn sslmode_require_claims_and_completes_over_an_encrypted_session() {
    let backend = connect(url("sslmode=require")).await;
    let (ssl, version) = session_tls(&backend).await;
    assert!(ssl, "pg_stat_ssl reports the session encrypted");
    assert!(version.is_some_and(|v| v.starts_with("TLS")));
    claims_and_completes(&backend).await;
}

#[tokio::test]
async fn verify_full_with_the_ca_claims_and_completes_over_an_encrypted_session() {
    let backend = connect(verify_full()).await;
    assert!(session_tls(&backend).await.0, "pg_stat_ssl: encrypted");
    claims_and_completes(&backend).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_mode_over_verify_full_commits_the_write_with_the_record() {
    let backend = connect(verify_full()).await;
    let ns = idem_conformance::unique_namespace();
    let ledger = format!("\"idem\".\"ledger_{}\"", ns.replace('-', "_"));
    let create = format!("CREATE TABLE {ledger} (k text NOT NULL, ssl boolean NOT NULL)");
    sqlx::query(AssertSqlSafe(create))
        .execute(backend.pool())
        .await
        .expect("create ledger");
    let c = claim(&ns, "order-1");
    for _ in 0..2 {
        let table = ledger.clone();
        // The handler's write records what the server says of its own session.
        let outcome = backend
            .execute_in_transaction(&c, HOUR, None, move |tx, _| {
                async move {
                    let q = format!(
                        "INSERT INTO {table} (k, ssl) \
                         SELECT 'order-1', ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
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
    let q = format!("SELECT k, ssl FROM {ledger}");
    let rows: Vec<(String, bool)> = sqlx::query_as(AssertSqlSafe(q))
        .fetch_all(backend.pool())
        .await
        .expect("read ledger");
    assert_eq!(
        rows,
        vec![("order-1".to_owned(), true)],
        "one write, over TLS"
    );
    let record = backend.get(&c.key).await.expect("get").expect("record");
    assert_eq!(record.state, State::Completed);
    let drop = format!("DROP TABLE {ledger}");
    let _ = sqlx::query(AssertSqlSafe(drop))
        .execute(backend.pool())
        .await;
}

/// `connect`'s error for `url`: `Refused` by `server` for `want`; its message.
async fn refused(url: String, server: &str, want: Refusal) -> String {
    let config = PgConfig::new(url).with_connect_timeout(Duration::from_secs(5));
    let err = PgBackend::connect(config)
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
    assert_eq!((named.as_str(), *why), (server, want), "{err}");
    assert!(err.to_string().contains(server), "{err}");
    message.clone()
}

#[tokio::test]
async fn a_wrong_password_fails_connect_naming_the_server() {
    let mut wrong = url::Url::parse(&verify_full()).expect("url");
    wrong
        .set_password(Some("not-the-password"))
        .expect("password");
    let message = refused(wrong.into(), &server(), Refusal::Authentication).await;
    assert!(
        message.contains("password authentication failed"),
        "{message}"
    );
    assert!(!message.contains("not-the-password"), "{message}");
}

#[tokio::test]
async fn verify_full_without_the_ca_fails_connect_as_an_untrusted_certificate() {
    // The webpki roots do not hold the test CA.
    let want = Refusal::UntrustedCertificate;
    let message = refused(url("sslmode=verify-full"), &server(), want).await;
    assert!(message.contains("sslrootcert"), "{message}");
}

#[tokio::test]
async fn plaintext_against_the_tls_only_server_fails_connect_as_a_tls_mismatch() {
    let message = refused(url("sslmode=disable"), &server(), Refusal::TlsMismatch).await;
    assert!(message.contains("accepts only TLS"), "{message}");
}

/// A server without TLS answers the client's `SSLRequest` with a single `N`: that is all
/// a plaintext-only PostgreSQL says before the client decides, so a listener that says
/// just that stands in for one.
#[tokio::test]
async fn sslmode_require_against_a_plaintext_server_fails_connect_as_a_tls_mismatch() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let plaintext_only = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut request = [0u8; 8];
        socket.read_exact(&mut request).await.expect("SSLRequest");
        // Length 8, then the SSLRequest code 80877103.
        assert_eq!(request, [0, 0, 0, 8, 4, 210, 22, 47], "an SSLRequest");
        socket.write_all(b"N").await.expect("answer");
    });
    let target = format!("postgres://idem:pw@127.0.0.1:{port}/test?sslmode=require");
    let server = format!("127.0.0.1:{port}");
    let message = refused(target, &server, Refusal::TlsMismatch).await;
    assert!(message.contains("does not offer TLS"), "{message}");
    plaintext_only
        .await
        .expect("the listener saw the SSLRequest");
}
