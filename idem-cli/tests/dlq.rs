//! `idem dlq list` and `idem dlq replay` end to end, on the real broker (tansu,
//! `IDEM_KAFKA_BROKERS`) with Redis (`IDEM_REDIS_URL`) as the consumer's store: a message
//! is poisoned, the handler is fixed, a replay with `--reset` gets it handled once, and a
//! second replay sends nothing.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{fails, ok};
use idem_core::{Backend, Engine, HandlerError, Key, State};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::{IdemConsumer, Point, Probe, Selection, Verdict, read_letters};
use idem_redis::{RedisBackend, RedisConfig};
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(60);

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{}", std::process::id(), fastrand::u32(..))
}

fn kafka(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    c
}

async fn create_topics(brokers: &str, topics: &[&str]) {
    let admin: AdminClient<DefaultClientContext> = kafka(brokers).create().expect("admin");
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, 1, TopicReplication::Fixed(1)))
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for r in admin.create_topics(&new, &opts).await.expect("create") {
        r.expect("topic created");
    }
}

/// Tells the test each offset the consumer settles.
struct Settled(mpsc::UnboundedSender<i64>);

impl Probe for Settled {
    fn reached(&self, point: Point, _: &str, _: i32, offset: i64) -> Verdict {
        if point == Point::AfterSettle {
            let _ = self.0.send(offset);
        }
        Verdict::Continue
    }
}

async fn settled(rx: &mut mpsc::UnboundedReceiver<i64>, offset: i64) {
    let wait = async {
        while let Some(o) = rx.recv().await {
            if o == offset {
                return;
            }
        }
        panic!("the consumer stopped");
    };
    tokio::time::timeout(WAIT, wait)
        .await
        .unwrap_or_else(|_| panic!("offset {offset} not settled within {WAIT:?}"));
}

/// `base` then `more`.
fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    [base, more].concat()
}

/// The messages on `topic` now (read to its end).
fn on_topic(brokers: &str, topic: &str) -> usize {
    read_letters(&kafka(brokers), topic, &Selection::default(), WAIT)
        .expect("read the topic")
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_message_is_replayed_after_the_fix_and_handled_once() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let redis = idem_conformance::service_env("IDEM_REDIS_URL");
    let prefix = format!("{}:", unique("idemcli-dlq"));
    let sep = if redis.contains('?') { '&' } else { '?' };
    let url = format!("{redis}{sep}prefix={prefix}");
    let backend = Arc::new(
        RedisBackend::connect(RedisConfig::from_urls(&redis).with_prefix(prefix.clone()))
            .await
            .expect("connect to IDEM_REDIS_URL"),
    );
    let topic = unique("orders");
    let dlq = format!("{topic}.dlq");
    create_topics(&brokers, &[&topic, &dlq]).await;

    // The consumer, whose handler has a bug until `fixed`.
    let fixed = Arc::new(AtomicBool::new(false));
    let handled = Arc::new(Mutex::new(Vec::<String>::new()));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut config = kafka(&brokers);
    config
        .set("auto.offset.reset", "earliest")
        // tansu takes about half the session timeout to let a consumer join: 3 s, not 23 s.
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("topic.metadata.refresh.interval.ms", "500");
    let (fx, done) = (fixed.clone(), handled.clone());
    let consumer = IdemConsumer::builder(config)
        .topics([topic.as_str()])
        .group(unique("shop"))
        .namespace("shop")
        .engine(Engine::builder(backend.clone()).build().expect("engine"))
        .probe(Arc::new(Settled(tx)))
        .shutdown(async {
            let _ = stopped.await;
        })
        .handler(move |msg, _| {
            let (fixed, handled) = (fx.load(Ordering::SeqCst), done.clone());
            async move {
                if !fixed {
                    return Err(HandlerError::permanent("bug: amount \"5\" is not a number"));
                }
                let id = msg
                    .idempotency_key()
                    .map(|k| k.id().to_owned())
                    .unwrap_or_default();
                handled.lock().expect("lock").push(id);
                Ok(Bytes::from_static(b"charged"))
            }
        })
        .build()
        .expect("consumer");
    let running = tokio::spawn(consumer.run());

    let producer: FutureProducer = kafka(&brokers).create().expect("producer");
    let headers = OwnedHeaders::new().insert(Header {
        key: "idempotency-key",
        value: Some("order-1"),
    });
    let record = FutureRecord::to(&topic)
        .key("customer-7")
        .payload(r#"{"amount":"5"}"#)
        .headers(headers);
    producer.send(record, WAIT).await.expect("produce");
    settled(&mut rx, 0).await;
    let key = Key::new("shop", "order-1").expect("key");
    let poisoned = backend.get(&key).await.expect("get").expect("record");
    assert_eq!((poisoned.state, poisoned.permanent), (State::Failed, true));

    // list: the letter's origin, reason, error and attempts, from its headers.
    let list = ok(&["dlq", "list", "--brokers", &brokers, &dlq]);
    assert!(list.contains(&format!("{topic}/0/0")), "{list}");
    assert!(
        list.contains("poisoned") && list.contains("not a number"),
        "{list}"
    );
    assert!(
        list.contains("shop/order-1") && list.contains("1 letter(s)"),
        "{list}"
    );
    let json = ok(&["dlq", "list", "--brokers", &brokers, &dlq, "--json"]);
    let json: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(json[0]["original_topic"], topic.as_str());
    assert_eq!(json[0]["original_offset"], 0);
    assert_eq!(json[0]["reason"], "poisoned");
    assert_eq!(json[0]["attempts"], 1);
    let none = ok(&[
        "dlq",
        "list",
        "--brokers",
        &brokers,
        &dlq,
        "--reason",
        "mismatch",
    ]);
    assert!(none.contains("no letters"), "{none}");

    // replay: a selection is required, confirmation is required, memory: is refused.
    let replay = ["dlq", "replay", "--brokers", &brokers, &dlq, "-b", &url];
    let err = fails(&with(&replay, &["--reset", "--yes"]), 2);
    assert!(err.contains("--all"), "{err}");
    let err = fails(&with(&replay, &["--all", "--reset"]), 2);
    assert!(err.contains("without confirmation"), "{err}");
    let err = fails(
        &[
            "dlq",
            "replay",
            "--brokers",
            &brokers,
            &dlq,
            "-b",
            "memory:",
            "--all",
        ],
        2,
    );
    assert!(err.contains("consumer's store"), "{err}");
    let dry = ok(&with(&replay, &["--all", "--reset", "--dry-run"]));
    assert!(dry.contains(&format!("would send to {topic}/0")), "{dry}");
    assert!(dry.contains("nothing was sent"), "{dry}");
    assert_eq!(on_topic(&brokers, &topic), 1, "a dry run sends nothing");

    // The fix, then the replay with --reset: handled once.
    fixed.store(true, Ordering::SeqCst);
    let out = ok(&with(&replay, &["--all", "--reset", "--yes"]));
    assert!(out.contains("sent 1 letter(s); 0 already sent"), "{out}");
    assert!(out.contains("1 failed record(s) deleted"), "{out}");
    settled(&mut rx, 1).await;
    assert_eq!(*handled.lock().expect("lock"), ["order-1"]);
    let done = backend.get(&key).await.expect("get").expect("record");
    assert_eq!(done.state, State::Completed);

    // A second replay sends nothing: the topic holds the original and one copy.
    let again = ok(&with(&replay, &["--all", "--reset", "--yes"]));
    assert!(
        again.contains("sent 0 letter(s); 1 already sent"),
        "{again}"
    );
    assert_eq!(on_topic(&brokers, &topic), 2);
    let dry = ok(&with(&replay, &["--all", "--dry-run"]));
    assert!(
        dry.contains(&format!("already sent to {topic}/0 at offset 1")),
        "{dry}"
    );
    assert_eq!(*handled.lock().expect("lock"), ["order-1"]);
    assert_eq!(
        backend.get(&key).await.unwrap().unwrap().state,
        State::Completed
    );

    let _ = stop.send(());
    running.await.expect("task").expect("clean stop");
}

#[test]
fn a_missing_topic_and_a_dead_broker_are_one_line() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let missing = unique("missing.dlq");
    let err = fails(&["dlq", "list", "--brokers", &brokers, &missing], 1);
    assert!(err.contains("does not exist"), "{err}");
    let err = fails(
        &[
            "dlq",
            "list",
            "--brokers",
            "127.0.0.1:1",
            "--timeout",
            "500ms",
            "t.dlq",
        ],
        1,
    );
    assert!(err.contains("read dead-letter topic t.dlq"), "{err}");
}
