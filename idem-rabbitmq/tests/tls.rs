//! AMQPS: the consumer over a TLS-only RabbitMQ node (`IDEM_RABBITMQ_TLS_URL`, serving a
//! certificate of the test CA `IDEM_TLS_CA`), and the connect failures that end `run()` at
//! start with an error naming the server and the problem.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Effects, Queue, Watch};
use idem_core::{Engine, MemoryBackend};
use idem_rabbitmq::lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use idem_rabbitmq::lapin::{Connection, ConnectionProperties};
use idem_rabbitmq::{ConnectFailure, ConsumerBuilder, Error, IdemConsumer};
use tokio_util::sync::CancellationToken;

const WITHIN: Duration = Duration::from_secs(30);
/// A failed connect answers at once on loopback: well within this.
const FAILS_WITHIN: Duration = Duration::from_secs(10);

fn env(name: &str) -> String {
    idem_conformance::service_env(name)
}

/// The TLS node's URL (`amqps://guest:guest@localhost:15671/%2f`).
fn tls_url() -> String {
    env("IDEM_RABBITMQ_TLS_URL")
}

/// `url` with its scheme `from` made `to`.
fn with_scheme(url: &str, from: &str, to: &str) -> String {
    let rest = url
        .strip_prefix(from)
        .unwrap_or_else(|| panic!("{url} is not {from}"));
    format!("{to}{rest}")
}

/// `host:port` of `url`.
fn server(url: &str) -> String {
    let rest = url.split_once('@').map_or(url, |(_, r)| r);
    let rest = rest.split_once("://").map_or(rest, |(_, r)| r);
    rest.split('/').next().unwrap_or(rest).to_owned()
}

/// A test connection to the TLS node (trusting the test CA, with the client certificate
/// when `client`) for declaring and publishing.
async fn tls_connect(url: &str, client: bool) -> Connection {
    let pem = |name: &str| std::fs::read(env(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let config = OwnedTLSConfig {
        cert_chain: Some(String::from_utf8(pem("IDEM_TLS_CA")).expect("a PEM CA")),
        identity: client.then(|| OwnedIdentity::PKCS8 {
            pem: pem("IDEM_TLS_CLIENT_CERT"),
            key: pem("IDEM_TLS_CLIENT_KEY"),
        }),
    };
    let runtime = idem_rabbitmq::lapin::runtime::default_runtime().expect("runtime");
    Connection::connect_with_config(url, ConnectionProperties::default(), config, runtime)
        .await
        .expect("connect to IDEM_RABBITMQ_TLS_URL with the test CA")
}

fn engine() -> Engine {
    Engine::builder(Arc::new(MemoryBackend::new()))
        .lease_ttl(Duration::from_secs(2))
        .build()
        .expect("engine")
}

/// A consumer of `queue` at `url` recording its effects, unbuilt: the test adds TLS.
fn consumer(url: &str, queue: &str, effects: &Effects, watch: &Arc<Watch>) -> ConsumerBuilder {
    let effects = effects.clone();
    IdemConsumer::builder(url)
        .queue(queue)
        .engine(engine())
        .probe(watch.clone())
        .handler(move |m, _| {
            let effects = effects.clone();
            async move {
                effects.record(&m);
                Ok(Bytes::from_static(b"done"))
            }
        })
}

/// Publishes `keys` payments twice each, consumes them with `builder`, and checks each ran
/// once and every delivery was acked.
async fn consumes_each_once(
    conn: &Connection,
    what: &str,
    keys: usize,
    builder: impl Fn(&str, &Effects, &Arc<Watch>) -> ConsumerBuilder,
) {
    let q = Queue::fresh(conn, what).await;
    for _copy in 0..2 {
        for k in 0..keys {
            q.publish(
                Some(format!("pay-{k}").as_bytes()),
                format!("charge {k}").as_bytes(),
            )
            .await;
        }
    }
    let (effects, watch, stop) = (Effects::default(), Watch::new(), CancellationToken::new());
    let consumer = builder(&q.name, &effects, &watch)
        .shutdown(stop.clone().cancelled_owned())
        .build()
        .expect("build");
    let run = tokio::spawn(consumer.run());
    watch.acked(2 * keys, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    for k in 0..keys {
        assert_eq!(effects.of(&format!("pay-{k}")), 1, "pay-{k} ran once");
    }
    assert_eq!(watch.acks(), 2 * keys, "each delivery acked once");
    assert_eq!(q.ready(&q.name).await, 0, "nothing left in the queue");
    assert_eq!(
        q.ready(&format!("{}.dlq", q.name)).await,
        0,
        "nothing dead-lettered"
    );
    q.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_the_test_ca_handles_each_message_once_and_acks_it() {
    let url = tls_url();
    let conn = tls_connect(&url, false).await;
    consumes_each_once(&conn, "tls", 10, |queue, effects, watch| {
        consumer(&url, queue, effects, watch).tls_ca_file(env("IDEM_TLS_CA"))
    })
    .await;
}

/// The node checks a client certificate against the CA and, with `auth_mechanism=external`,
/// logs in the user its CN names (`idem-client`): no password is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_in_with_external() {
    let url = format!("amqps://{}/%2f?auth_mechanism=external", server(&tls_url()));
    let conn = tls_connect(&url, true).await;
    consumes_each_once(&conn, "tls-cert", 5, |queue, effects, watch| {
        consumer(&url, queue, effects, watch)
            .tls_ca_file(env("IDEM_TLS_CA"))
            .tls_client_cert(env("IDEM_TLS_CLIENT_CERT"), env("IDEM_TLS_CLIENT_KEY"))
    })
    .await;
    // Without the certificate the server has no user to log in.
    let (problem, text) = fails_at_start(&url, true).await;
    assert_eq!(problem, ConnectFailure::Authentication, "{text}");
}

/// `run()` of a consumer of `url` (with the test CA when `ca`) fails at its first connect:
/// the problem, and the error's text.
async fn fails_at_start(url: &str, ca: bool) -> (ConnectFailure, String) {
    let watch = Watch::new();
    let mut builder = consumer(url, "idem-test-tls-never", &Effects::default(), &watch);
    if ca {
        builder = builder.tls_ca_file(env("IDEM_TLS_CA"));
    }
    let err = tokio::time::timeout(FAILS_WITHIN, builder.build().expect("build").run())
        .await
        .expect("fails at start, not later")
        .expect_err("the connect fails");
    assert_eq!(watch.acks(), 0);
    match err {
        Error::Connect {
            ref server,
            failure,
            ..
        } => {
            assert_eq!(*server, self::server(url), "{err}");
            (failure, err.to_string())
        }
        other => panic!("not a connect error: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_fails_at_start() {
    let url = tls_url();
    let (problem, text) = fails_at_start(&url, false).await;
    assert_eq!(problem, ConnectFailure::UntrustedCertificate, "{text}");
    assert!(text.contains(&server(&url)), "{text}");
    assert!(text.contains("certificate is not trusted"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_fails_at_start() {
    let url = tls_url().replacen("guest:guest@", "guest:not-the-password@", 1);
    let (problem, text) = fails_at_start(&url, true).await;
    assert_eq!(problem, ConnectFailure::Authentication, "{text}");
    assert!(text.contains(&server(&url)), "{text}");
    assert!(text.contains("refused the login"), "{text}");
    assert!(
        !text.contains("not-the-password"),
        "the password stays out: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_amqp_to_the_tls_port_fails_at_start() {
    let url = with_scheme(&tls_url(), "amqps://", "amqp://");
    let (problem, text) = fails_at_start(&url, false).await;
    assert_eq!(problem, ConnectFailure::NotPlainAmqp, "{text}");
    assert!(text.contains(&server(&url)), "{text}");
    assert!(text.contains("use amqps://"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_to_the_plain_port_fails_at_start() {
    let url = with_scheme(&env("IDEM_RABBITMQ_URL"), "amqp://", "amqps://");
    let (problem, text) = fails_at_start(&url, true).await;
    assert_eq!(problem, ConnectFailure::NotTls, "{text}");
    assert!(text.contains(&server(&url)), "{text}");
    assert!(text.contains("use amqp://"), "{text}");
}

#[test]
fn tls_settings_that_cannot_work_are_refused_at_build() {
    let watch = Watch::new();
    let build = |url: &str, ca: &str| {
        consumer(url, "q", &Effects::default(), &watch)
            .tls_ca_file(ca)
            .build()
            .expect_err("refused")
            .to_string()
    };
    let missing = build("amqps://localhost:15671/%2f", "/nonexistent/ca.pem");
    assert!(missing.contains("/nonexistent/ca.pem"), "{missing}");
    let not_pem = build("amqps://localhost:15671/%2f", "Cargo.toml");
    assert!(not_pem.contains("no PEM certificate"), "{not_pem}");
    let plain = build("amqp://localhost:5672/%2f", &env("IDEM_TLS_CA"));
    assert!(plain.contains("use amqps://"), "{plain}");
}
