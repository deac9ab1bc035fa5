//! The broker helpers the crash harness needs, copied from idem-kafka's `tests/common`
//! (not a public crate): topics, producing, the consumer configuration and the loop's
//! counters.
#![allow(dead_code)]

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};

/// A unique name for a topic or group.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        fastrand::u32(..)
    )
}

/// Creates topics through the admin API.
pub async fn create_topics(brokers: &str, topics: &[(&str, i32)]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|(t, p)| NewTopic::new(t, *p, TopicReplication::Fixed(1)))
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for r in admin
        .create_topics(&new, &opts)
        .await
        .expect("create topics")
    {
        r.expect("topic created");
    }
}

/// The consumer configuration the tests use.
pub fn consumer_config(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("topic.metadata.refresh.interval.ms", "500");
    c
}

/// One message to produce.
#[derive(Clone, Debug, Default)]
pub struct Out {
    pub partition: Option<i32>,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Produces `msgs` in order and waits for every acknowledgement; returns (partition,
/// offset) of each.
pub async fn produce(brokers: &str, topic: &str, msgs: &[Out]) -> Vec<(i32, i64)> {
    let p: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    let mut pending = Vec::with_capacity(msgs.len());
    for m in msgs {
        let headers = m.headers.iter().fold(OwnedHeaders::new(), |h, (k, v)| {
            h.insert(Header {
                key: k,
                value: Some(v),
            })
        });
        let mut r = FutureRecord::<[u8], [u8]>::to(topic)
            .payload(&m.payload)
            .headers(headers);
        if let Some(k) = &m.key {
            r = r.key(k);
        }
        if let Some(part) = m.partition {
            r = r.partition(part);
        }
        let delivery = p
            .send_result(r)
            .map_err(|(e, _)| e)
            .expect("enqueue message");
        pending.push(delivery);
    }
    let mut at = Vec::with_capacity(pending.len());
    for d in pending {
        let d = d.await.expect("delivery future").expect("delivered");
        at.push((d.partition, d.offset));
    }
    at
}

static SNAPSHOTTER: std::sync::OnceLock<metrics_util::debugging::Snapshotter> =
    std::sync::OnceLock::new();

/// Installs a global debugging metrics recorder (once per test binary).
pub fn install_metrics() {
    SNAPSHOTTER.get_or_init(|| {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("metrics recorder");
        snapshotter
    });
}

/// The sum over partitions of counter `name` for `topic` since the start (a snapshot
/// resets counters, so the snapshots are summed).
pub fn counter(name: &str, topic: &str) -> u64 {
    use metrics_util::debugging::DebugValue;
    static SEEN: Mutex<Vec<(String, String, u64)>> = Mutex::new(Vec::new());
    let Some(snap) = SNAPSHOTTER.get() else {
        panic!("call install_metrics first");
    };
    let mut seen = SEEN.lock().expect("lock");
    for (k, _, _, v) in snap.snapshot().into_vec() {
        if let DebugValue::Counter(n) = v {
            let key = k.key();
            let t = key
                .labels()
                .find(|l| l.key() == "topic")
                .map(|l| l.value().to_owned())
                .unwrap_or_default();
            seen.push((key.name().to_owned(), t, n));
        }
    }
    seen.iter()
        .filter(|(n, t, _)| n == name && t == topic)
        .map(|(.., v)| v)
        .sum()
}

/// Logs to the test output when `RUST_LOG` is set.
pub fn log_from_env() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}
