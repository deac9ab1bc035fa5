//! Helpers shared by the loop tests (MockCluster) and the crash test (tansu).
#![allow(dead_code)]

pub mod broker;
pub mod faults;
pub mod ledger;
pub mod secure;
pub mod wire;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_core::{Backend, Engine};
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idem_kafka::rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use idem_kafka::rdkafka::mocking::MockCluster;
use idem_kafka::rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};
use idem_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use idem_kafka::{Point, Probe, Verdict};
use tokio::sync::Notify;

pub type Mock = MockCluster<'static, DefaultProducerContext>;

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

/// A MockCluster with `brokers` brokers and the given topics (name, partitions).
pub fn mock(brokers: i32, topics: &[(&str, i32)]) -> Mock {
    let cluster = MockCluster::new(brokers).expect("mock cluster");
    for (t, p) in topics {
        cluster.create_topic(t, *p, 1).expect("create topic");
    }
    cluster
}

/// A one-broker MockCluster with `topic` (of `partitions`) and its dead-letter topic
/// (`<topic>.dlq`, one partition), and its bootstrap servers.
pub fn mock_topic(topic: &str, partitions: i32) -> (Mock, String) {
    let cluster = mock(1, &[(topic, partitions), (&format!("{topic}.dlq"), 1)]);
    let brokers = cluster.bootstrap_servers();
    (cluster, brokers)
}

/// A client configuration with only `bootstrap.servers`: a plaintext wire.
pub fn plain(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    c
}

/// Creates topics through the admin API (for a real broker).
pub async fn create_topics(brokers: &str, topics: &[(&str, i32)]) {
    create_topics_on(&plain(brokers), topics).await;
}

/// Creates topics through the admin API, connecting with `config` (its wire's settings).
pub async fn create_topics_on(config: &ClientConfig, topics: &[(&str, i32)]) {
    let admin: AdminClient<DefaultClientContext> = config.create().expect("admin client");
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
    if let Ok(debug) = std::env::var("IDEM_KAFKA_DEBUG") {
        c.set("debug", debug)
            .set_log_level(idem_kafka::rdkafka::config::RDKafkaLogLevel::Debug);
    }
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

impl Out {
    /// A message on `partition` with the `idempotency-key` header `id` and `payload`.
    pub fn keyed(partition: i32, id: &str, payload: &str) -> Self {
        Out {
            partition: Some(partition),
            key: None,
            payload: payload.as_bytes().to_vec(),
            headers: vec![("idempotency-key".into(), id.as_bytes().to_vec())],
        }
    }
}

pub fn producer(brokers: &str) -> FutureProducer {
    plain(brokers)
        .set("linger.ms", "5")
        .create()
        .expect("producer")
}

/// Produces `msgs` in order and waits for every acknowledgement; returns (partition,
/// offset) of each.
pub async fn produce(brokers: &str, topic: &str, msgs: &[Out]) -> Vec<(i32, i64)> {
    produce_with(&producer(brokers), topic, msgs).await
}

/// [`produce`] through the producer `p` (a wire's own, or one with a codec).
pub async fn produce_with(p: &FutureProducer, topic: &str, msgs: &[Out]) -> Vec<(i32, i64)> {
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

/// A message read back from a topic.
#[derive(Clone, Debug)]
pub struct Read {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: HashMap<String, String>,
}

/// Reads every partition of `topic` from the beginning until `want` messages arrived or
/// `timeout` passed.
pub fn read_all(
    brokers: &str,
    topic: &str,
    partitions: i32,
    want: usize,
    timeout: Duration,
) -> Vec<Read> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("offset");
    }
    c.assign(&tpl).expect("assign");
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < want && start.elapsed() < timeout {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(100)) {
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            let v = h.value.map(|v| String::from_utf8_lossy(v).into_owned());
                            (h.key.to_owned(), v.unwrap_or_default())
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(Read {
                partition: m.partition(),
                offset: m.offset(),
                key: m.key().map(<[u8]>::to_vec),
                payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                headers,
            });
        }
    }
    out
}

/// The committed offsets of `group` on each partition of `topic` (-1 when none).
pub fn committed(brokers: &str, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    committed_on(&plain(brokers), group, topic, partitions)
}

/// [`committed`], connecting with `config` (its wire's settings).
pub fn committed_on(config: &ClientConfig, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let c: BaseConsumer = config
        .clone()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("offset reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let got = c
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    let offsets = got
        .elements()
        .iter()
        .map(|e| match e.offset() {
            Offset::Offset(o) => o,
            _ => -1,
        })
        .collect();
    // Drop the list before the consumer (see INFRA.md).
    drop(got);
    drop(c);
    offsets
}

/// Waits until `group`'s committed offsets on `topic` are `want`, asking the broker every
/// 50 ms (it sends no signal); fails the test if they are not by `within`.
pub async fn wait_committed(
    brokers: &str,
    group: &str,
    topic: &str,
    want: &[i64],
    within: Duration,
) {
    wait_committed_on(&plain(brokers), group, topic, want, within).await;
}

/// [`wait_committed`], connecting with `config` (its wire's settings).
pub async fn wait_committed_on(
    config: &ClientConfig,
    group: &str,
    topic: &str,
    want: &[i64],
    within: Duration,
) {
    let partitions = i32::try_from(want.len()).expect("partitions");
    let deadline = std::time::Instant::now() + within;
    loop {
        let got = committed_on(config, group, topic, partitions);
        if got == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "committed {got:?}, never {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An engine over `backend` with a short lease.
pub fn engine(backend: Arc<dyn Backend>, owner: &str, lease: Duration) -> Engine {
    Engine::builder(backend)
        .owner(owner)
        .lease_ttl(lease)
        .max_attempts(3)
        .build()
        .expect("engine")
}

/// An engine over a fresh memory store, owner `w1`, a 5 s lease, 3 attempts.
pub fn memory_engine() -> Engine {
    engine(
        Arc::new(idem_core::MemoryBackend::new()),
        "w1",
        Duration::from_secs(5),
    )
}

/// A probe that records every settled message and can crash on demand.
#[derive(Default)]
pub struct Recorder {
    settled: Mutex<BTreeMap<i32, BTreeSet<i64>>>,
    points: Mutex<Vec<(Point, i32, i64)>>,
    notify: Notify,
}

impl Recorder {
    pub fn new() -> Arc<Self> {
        Arc::new(Recorder::default())
    }

    /// How many distinct messages settled.
    pub fn settled_count(&self) -> usize {
        self.settled
            .lock()
            .expect("lock")
            .values()
            .map(BTreeSet::len)
            .sum()
    }

    pub fn settled_on(&self, partition: i32) -> BTreeSet<i64> {
        self.settled
            .lock()
            .expect("lock")
            .get(&partition)
            .cloned()
            .unwrap_or_default()
    }

    pub fn points(&self) -> Vec<(Point, i32, i64)> {
        self.points.lock().expect("lock").clone()
    }

    /// Waits until `n` distinct messages settled; panics after `timeout`.
    pub async fn wait_settled(&self, n: usize, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.notify.notified();
            let have = self.settled_count();
            if have >= n {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("only {have} of {n} messages settled in {timeout:?}");
            }
        }
    }
}

impl Probe for Recorder {
    fn reached(&self, point: Point, _topic: &str, partition: i32, offset: i64) -> Verdict {
        self.points
            .lock()
            .expect("lock")
            .push((point, partition, offset));
        if point == Point::AfterSettle {
            self.settled
                .lock()
                .expect("lock")
                .entry(partition)
                .or_default()
                .insert(offset);
            self.notify.notify_waiters();
        }
        Verdict::Continue
    }
}

/// Counts handler runs per key id.
#[derive(Default)]
pub struct Effects {
    runs: Mutex<HashMap<String, u32>>,
}

impl Effects {
    pub fn new() -> Arc<Self> {
        Arc::new(Effects::default())
    }

    pub fn apply(&self, id: &str) -> Bytes {
        *self
            .runs
            .lock()
            .expect("lock")
            .entry(id.to_owned())
            .or_default() += 1;
        Bytes::from(format!("done {id}"))
    }

    pub fn runs(&self, id: &str) -> u32 {
        self.runs
            .lock()
            .expect("lock")
            .get(id)
            .copied()
            .unwrap_or(0)
    }

    pub fn total(&self) -> u32 {
        self.runs.lock().expect("lock").values().sum()
    }

    pub fn distinct(&self) -> usize {
        self.runs.lock().expect("lock").len()
    }
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

/// A metric's labels, as (key, value).
type Labels = Vec<(String, String)>;

/// Counters and gauges summed over the snapshots since the start: a snapshot resets both
/// to zero, so a gauge moved only by increments (as the loop's are, but `low_water_lag`)
/// is the sum of its snapshots. Gauges by (name, topic, partition).
struct Readings {
    /// Each counter's name, labels and count in one snapshot.
    counters: Vec<(String, Labels, u64)>,
    gauges: BTreeMap<(String, String, String), f64>,
}

/// Takes a snapshot of the recorder into the running readings.
fn readings() -> std::sync::MutexGuard<'static, Readings> {
    use metrics_util::debugging::DebugValue;
    static READINGS: Mutex<Readings> = Mutex::new(Readings {
        counters: Vec::new(),
        gauges: BTreeMap::new(),
    });
    let Some(snap) = SNAPSHOTTER.get() else {
        panic!("call install_metrics first");
    };
    let mut readings = READINGS.lock().expect("lock");
    for (k, _, _, v) in snap.snapshot().into_vec() {
        let key = k.key();
        let label = |name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map(|l| l.value().to_owned())
                .unwrap_or_default()
        };
        let name = key.name().to_owned();
        match v {
            DebugValue::Counter(n) => {
                let labels = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                readings.counters.push((name, labels, n));
            }
            DebugValue::Gauge(g) => {
                let at = (name, label("topic"), label("partition"));
                *readings.gauges.entry(at).or_default() += g.0;
            }
            _ => {}
        }
    }
    readings
}

/// The sum over partitions of counter `name` for `topic` since the start.
pub fn counter(name: &str, topic: &str) -> u64 {
    counter_by(name, "topic", topic)
}

/// The sum of counter `name` where label `label` is `value`, since the start.
pub fn counter_by(name: &str, label: &str, value: &str) -> u64 {
    readings()
        .counters
        .iter()
        .filter(|(n, labels, _)| n == name && labels.iter().any(|(k, v)| k == label && v == value))
        .map(|(.., v)| v)
        .sum()
}

/// The value now of gauge `name` for `topic`/`partition`, moved only by increments (0 if
/// never moved).
pub fn gauge(name: &str, topic: &str, partition: i32) -> f64 {
    let at = (name.to_owned(), topic.to_owned(), partition.to_string());
    readings().gauges.get(&at).copied().unwrap_or(0.0)
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

/// A migrated PostgreSQL backend in a schema of its own, with a `ledger` table of
/// (payment, token, instance, kind) rows in the order written (`seq`) and no uniqueness,
/// so a double effect would show.
pub async fn postgres() -> (idem_postgres::PgBackend, String) {
    let url = idem_conformance::service_env("IDEM_POSTGRES_URL");
    let schema = format!("kafkatest_{}_{}", std::process::id(), fastrand::u32(..));
    let config = idem_postgres::PgConfig::new(url)
        .with_schema(schema.clone())
        .with_max_connections(30);
    let backend = idem_postgres::PgBackend::connect(config)
        .await
        .expect("connect to IDEM_POSTGRES_URL");
    backend.migrate().await.expect("migrate");
    let ledger = format!("\"{schema}\".ledger");
    let create = format!(
        "CREATE TABLE {ledger} (payment text NOT NULL, token bigint NOT NULL, \
         instance int NOT NULL, kind text NOT NULL DEFAULT '', seq bigserial)"
    );
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(backend.pool())
        .await
        .expect("create ledger");
    (backend, ledger)
}

/// Rows per payment in `ledger`.
pub async fn ledger_counts(
    backend: &idem_postgres::PgBackend,
    ledger: &str,
) -> HashMap<String, i64> {
    let q = format!("SELECT payment, count(*) FROM {ledger} GROUP BY payment");
    sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(q))
        .fetch_all(backend.pool())
        .await
        .expect("ledger counts")
        .into_iter()
        .collect()
}

/// Drops the schema of a test backend.
pub async fn drop_schema(backend: &idem_postgres::PgBackend) {
    let q = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", backend.schema());
    let _ = sqlx::query(sqlx::AssertSqlSafe(q))
        .execute(backend.pool())
        .await;
}

/// A consumer of `topic` in `group` with the loop tests' settings: commits every 50 ms,
/// retries after 10 ms to 100 ms.
pub fn builder(brokers: &str, topic: &str, group: &str) -> idem_kafka::ConsumerBuilder {
    builder_with(consumer_config(brokers), topic, group)
}

/// [`builder`] over `config`: [`consumer_config`] with a wire's own settings added.
pub fn builder_with(config: ClientConfig, topic: &str, group: &str) -> idem_kafka::ConsumerBuilder {
    idem_kafka::IdemConsumer::builder(config)
        .topics([topic])
        .group(group)
        .commit_interval(Duration::from_millis(50))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(100))
}

/// A consumer running on a task of its own.
pub struct Running {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<idem_kafka::Result<()>>,
}

/// Builds `builder` with `probe` (a [`Recorder`], usually) and a shutdown signal, and runs
/// it.
pub fn start<P: Probe>(builder: idem_kafka::ConsumerBuilder, probe: &Arc<P>) -> Running {
    let stop = tokio_util::sync::CancellationToken::new();
    let consumer = builder
        .probe(probe.clone())
        .shutdown(stop.clone().cancelled_owned())
        .build()
        .expect("consumer");
    Running {
        stop,
        task: tokio::spawn(consumer.run()),
    }
}

impl Running {
    /// Signals shutdown and checks the loop ended cleanly.
    pub async fn stop(self) {
        self.stop.cancel();
        self.task.await.expect("task").expect("clean stop");
    }
}

impl Effects {
    /// A handler that applies the message's key id (or `keyless`).
    pub fn by_key(
        self: &Arc<Self>,
    ) -> impl Fn(
        idem_kafka::Message,
        Option<idem_core::Context>,
    ) -> std::future::Ready<idem_kafka::HandlerResult>
    + Send
    + Sync
    + 'static {
        let effects = self.clone();
        move |msg, _| {
            let id = msg.idempotency_key().map_or("keyless", |k| k.id());
            std::future::ready(Ok(effects.apply(id)))
        }
    }
}
