//! The checks at start: `run()` reads the metadata of the source and dead-letter topics
//! before it joins the group, and fails at once, naming each missing topic, on MockCluster
//! and on tansu (`IDEM_KAFKA_BROKERS`); `skip_topic_check` lets a consumer start before its
//! topic exists and handle its messages once it does. A broker that cannot be reached
//! fails at start with `Error::Connect`, saying which failure it is: TLS to tansu's
//! plaintext port, plaintext to the TLS tansu (`IDEM_KAFKA_SSL_BROKERS`), a certificate no
//! trusted CA signed, and a wrong SASL password (`IDEM_KAFKA_SASL_BROKERS`).

mod common;

use std::time::{Duration, Instant};

use common::{
    Effects, Out, Recorder, builder, create_topics, memory_engine, mock, produce, unique,
};
use idem_kafka::{ConnectFailure, ConsumerBuilder, DeadLetterTopic, Error};

/// Well below the start timeout (10 s by default): a missing topic is answered at once.
const QUICK: Duration = Duration::from_secs(3);
const WAIT: Duration = Duration::from_secs(30);
/// The connection tests' start timeout: a connection's setup is bounded to half of it, so
/// a TLS handshake a plaintext listener never answers fails within 2 s.
const START_TIMEOUT: Duration = Duration::from_secs(4);

/// A lease-mode consumer of `topic` in a fresh group, over a memory store.
fn consumer(brokers: &str, topic: &str) -> ConsumerBuilder {
    builder(brokers, topic, &unique("g"))
        .engine(memory_engine())
        .handler(Effects::new().by_key())
}

/// Runs `builder` and expects it to fail at start, quickly, with missing topics.
async fn missing(builder: ConsumerBuilder) -> (Vec<String>, Vec<String>) {
    let began = Instant::now();
    let run = builder.build().expect("consumer").run();
    let err = tokio::time::timeout(WAIT, run)
        .await
        .expect("run() returned")
        .expect_err("run() fails at start");
    assert!(began.elapsed() < QUICK, "took {:?}", began.elapsed());
    match err {
        Error::MissingTopics {
            sources,
            dead_letter,
        } => (sources, dead_letter),
        other => panic!("not MissingTopics: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misspelt_source_topic_fails_at_start() {
    let topic = unique("payments");
    let dlq = format!("{topic}.dlq");
    let cluster = mock(1, &[(&topic, 1), (&dlq, 1)]);
    let typo = format!("{topic}s");
    let fixed = DeadLetterTopic::Fixed(dlq);
    let (sources, dead_letter) =
        missing(consumer(&cluster.bootstrap_servers(), &typo).dead_letter_topic(fixed)).await;
    assert_eq!(sources, [typo]);
    assert!(dead_letter.is_empty(), "{dead_letter:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_topic_fails_at_start() {
    let topic = unique("payments");
    let cluster = mock(1, &[(&topic, 1)]);
    let brokers = cluster.bootstrap_servers();
    let (sources, dead_letter) = missing(consumer(&brokers, &topic)).await;
    assert!(sources.is_empty(), "{sources:?}");
    assert_eq!(dead_letter, [format!("{topic}.dlq")]);
    let elsewhere = DeadLetterTopic::Fixed(unique("letters"));
    let (_, dead_letter) =
        missing(consumer(&brokers, &topic).dead_letter_topic(elsewhere.clone())).await;
    let DeadLetterTopic::Fixed(name) = elsewhere else {
        unreachable!()
    };
    assert_eq!(dead_letter, [name]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_topics_fail_at_start_on_tansu() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let topic = unique("start");
    let other = unique("start");
    create_topics(&brokers, &[(&topic, 1), (&format!("{other}.dlq"), 1)]).await;
    // `topic` has no dead-letter topic; `<other>` has one but does not exist itself.
    let (sources, dead_letter) =
        missing(consumer(&brokers, &topic).topics([topic.clone(), other.clone()])).await;
    assert_eq!(sources, [other]);
    assert_eq!(dead_letter, [format!("{topic}.dlq")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_topic_check_starts_before_the_topics_exist() {
    let topic = unique("later");
    let dlq = format!("{topic}.dlq");
    let cluster = mock(1, &[]);
    let brokers = cluster.bootstrap_servers();
    let effects = Effects::new();
    let recorder = Recorder::new();
    let stop = tokio_util::sync::CancellationToken::new();
    let consumer = builder(&brokers, &topic, &unique("g"))
        .engine(memory_engine())
        .handler(effects.by_key())
        .skip_topic_check()
        .probe(recorder.clone())
        .shutdown(stop.clone().cancelled_owned())
        .build()
        .expect("consumer");
    let task = tokio::spawn(consumer.run());
    // No signal tells a consumer waiting for its topic: a window well past the check,
    // which answers a missing topic within milliseconds on MockCluster.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!task.is_finished(), "run() ended: {:?}", task.await);
    cluster.create_topic(&topic, 1, 1).expect("create topic");
    cluster.create_topic(&dlq, 1, 1).expect("create dlq");
    produce(
        &brokers,
        &topic,
        &[Out::keyed(0, "p1", "x"), Out::keyed(0, "p2", "x")],
    )
    .await;
    recorder.wait_settled(2, WAIT).await;
    stop.cancel();
    task.await.expect("task").expect("clean stop");
    assert_eq!((effects.runs("p1"), effects.runs("p2")), (1, 1));
}

/// A consumer of an existing-or-not topic at `brokers` with `settings` on its client
/// config, expected to fail at start, quickly, with [`Error::Connect`].
async fn refused(brokers: &str, settings: &[(&str, &str)]) -> (String, ConnectFailure, String) {
    common::log_from_env();
    let mut config = common::consumer_config(brokers);
    for (k, v) in settings {
        config.set(*k, *v);
    }
    let consumer = idem_kafka::IdemConsumer::builder(config)
        .topics([unique("t")])
        .group(unique("g"))
        .engine(memory_engine())
        .handler(Effects::new().by_key())
        .start_timeout(START_TIMEOUT)
        .build()
        .expect("consumer");
    let began = Instant::now();
    let err = tokio::time::timeout(WAIT, consumer.run())
        .await
        .expect("run() returned")
        .expect_err("run() fails at start");
    assert!(began.elapsed() < QUICK, "took {:?}: {err}", began.elapsed());
    match err {
        Error::Connect {
            broker,
            failure,
            detail,
        } => {
            println!("{broker}: {failure} after {:?}: {detail}", began.elapsed());
            (broker, failure, detail)
        }
        other => panic!("not Connect: {other}"),
    }
}

/// The port of the first broker of `brokers` (`host:port,...`).
fn port(brokers: &str) -> &str {
    let first = brokers.split(',').next().unwrap_or(brokers);
    first.rsplit(':').next().unwrap_or(first)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_a_plaintext_listener_fails_at_start_as_a_mismatch() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let ca = idem_conformance::service_env("IDEM_TLS_CA");
    let (broker, failure, detail) = refused(
        &brokers,
        &[("security.protocol", "SSL"), ("ssl.ca.location", &ca)],
    )
    .await;
    assert_eq!(failure, ConnectFailure::TlsMismatch, "{broker}: {detail}");
    assert!(broker.contains(port(&brokers)), "{broker}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_to_a_tls_listener_fails_at_start_as_a_mismatch() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_SSL_BROKERS");
    let (broker, failure, detail) = refused(&brokers, &[("security.protocol", "PLAINTEXT")]).await;
    assert_eq!(failure, ConnectFailure::TlsMismatch, "{broker}: {detail}");
    assert!(broker.contains(port(&brokers)), "{broker}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_no_trusted_ca_signed_fails_at_start() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_SSL_BROKERS");
    // The system's public CAs: none of them signed the test CA's certificate.
    let (broker, failure, detail) = refused(
        &brokers,
        &[
            ("security.protocol", "SSL"),
            ("ssl.ca.location", "/etc/ssl/certs/ca-certificates.crt"),
        ],
    )
    .await;
    assert_eq!(
        failure,
        ConnectFailure::UntrustedCertificate,
        "{broker}: {detail}"
    );
    assert!(broker.contains(port(&brokers)), "{broker}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_fails_at_start() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_SASL_BROKERS");
    let user = idem_conformance::service_env("IDEM_KAFKA_SASL_USER");
    let ca = idem_conformance::service_env("IDEM_TLS_CA");
    let (broker, failure, detail) = refused(
        &brokers,
        &[
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", &ca),
            ("sasl.mechanism", "SCRAM-SHA-256"),
            ("sasl.username", &user),
            ("sasl.password", "not-the-password"),
        ],
    )
    .await;
    assert_eq!(
        failure,
        ConnectFailure::Authentication,
        "{broker}: {detail}"
    );
    assert!(broker.contains(port(&brokers)), "{broker}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_the_broker_requires_and_lacks_fails_at_start() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_SSL_BROKERS");
    let ca = idem_conformance::service_env("IDEM_TLS_CA");
    // The CA is right; the broker asks for a client certificate and gets none.
    let (broker, failure, detail) = refused(
        &brokers,
        &[("security.protocol", "SSL"), ("ssl.ca.location", &ca)],
    )
    .await;
    assert_eq!(
        failure,
        ConnectFailure::Authentication,
        "{broker}: {detail}"
    );
    assert!(broker.contains(port(&brokers)), "{broker}");
}
