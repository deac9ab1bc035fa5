//! The idem consumer loop with the in-memory store against a bare rdkafka `StreamConsumer`
//! loop with the same commit policy (offset stored after each message is handled, async
//! commit of stored offsets every second), on the same broker, in one run.
//!
//! Each iteration reads the same pre-produced topic with a fresh consumer group (so fresh
//! idempotency keys) and counts from the first message to the last one handled; the group
//! join is not counted. On librdkafka's MockCluster always, and on the broker at
//! `IDEM_KAFKA_BROKERS` (tansu) when it is set.
//!
//! `cargo bench -p benches --bench kafka`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use idem_core::{Engine, MemoryBackend};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use idem_kafka::rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use idem_kafka::rdkafka::mocking::MockCluster;
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::{IdemConsumer, Point, Probe, Verdict};
use tokio::sync::Notify;

const PARTITIONS: i32 = 4;
/// Per partition: under MockCluster's retention of about 5 MiB per partition.
const PER_PARTITION: usize = 20_000;
const MESSAGES: usize = PARTITIONS as usize * PER_PARTITION;
const COMMIT_EVERY: Duration = Duration::from_secs(1);

fn config(brokers: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("fetch.queue.backoff.ms", "10");
    c
}

fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// What both loops do per message besides their bookkeeping: read the key, answer.
fn handle(key: Option<&[u8]>) -> Bytes {
    Bytes::from(format!("ok {}", key.map_or(0, <[u8]>::len)))
}

async fn produce(brokers: &str, topic: &str) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .expect("producer");
    let payload = vec![b'x'; 80];
    let mut pending = Vec::with_capacity(MESSAGES);
    for i in 0..MESSAGES {
        let key = format!("pay-{i}");
        let headers = OwnedHeaders::new().insert(Header {
            key: "idempotency-key",
            value: Some(key.as_bytes()),
        });
        let partition = i32::try_from(i % PARTITIONS as usize).expect("partition");
        let record = FutureRecord::<[u8], [u8]>::to(topic)
            .partition(partition)
            .payload(&payload)
            .headers(headers);
        pending.push(
            producer
                .send_result(record)
                .map_err(|(e, _)| e)
                .expect("enqueue"),
        );
    }
    for d in pending {
        d.await.expect("delivery").expect("delivered");
    }
}

/// The bare loop: `StreamConsumer::recv`, the handler, `store_offset_from_message`, an
/// async commit every second. Returns the time from the first message to the last.
async fn bare(brokers: &str, topic: &str) -> Duration {
    let consumer: StreamConsumer = config(brokers, &unique("bare"))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    let mut first = None;
    let mut last_commit = Instant::now();
    for _ in 0..MESSAGES {
        let m = consumer.recv().await.expect("message");
        first.get_or_insert_with(Instant::now);
        let key = m
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "idempotency-key"))
            .and_then(|h| h.value);
        std::hint::black_box(handle(key));
        consumer.store_offset_from_message(&m).expect("store");
        if last_commit.elapsed() >= COMMIT_EVERY {
            last_commit = Instant::now();
            let _ = consumer.commit_consumer_state(CommitMode::Async);
        }
    }
    let took = first.map_or(Duration::ZERO, |t| t.elapsed());
    let _ = consumer.commit_consumer_state(CommitMode::Sync);
    took
}

/// Counts settled messages and notes when the first claim started.
struct Timing {
    first: Mutex<Option<Instant>>,
    settled: AtomicU64,
    done: Notify,
}

impl Probe for Timing {
    fn reached(&self, point: Point, _: &str, _: i32, _: i64) -> Verdict {
        match point {
            Point::BeforeClaim => {
                let mut first = self.first.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert_with(Instant::now);
            }
            Point::AfterSettle
                if self.settled.fetch_add(1, Ordering::Relaxed) + 1 == MESSAGES as u64 =>
            {
                self.done.notify_one();
            }
            _ => {}
        }
        Verdict::Continue
    }
}

/// The idem loop over a fresh in-memory store. Returns the time from the first claim to
/// the last message settled.
async fn idem(brokers: &str, topic: &str) -> Duration {
    let timing = Arc::new(Timing {
        first: Mutex::new(None),
        settled: AtomicU64::new(0),
        done: Notify::new(),
    });
    let engine = Engine::builder(Arc::new(MemoryBackend::new()))
        .build()
        .expect("engine");
    let stop = tokio_util::sync::CancellationToken::new();
    let signal = stop.clone();
    let consumer = IdemConsumer::builder(config(brokers, &unique("idem")))
        .topics([topic])
        .engine(engine)
        .commit_interval(COMMIT_EVERY)
        .probe(timing.clone())
        .shutdown(async move { signal.cancelled().await })
        .handler(|msg, _| async move { Ok(handle(msg.key().map(|k| k.id().as_bytes()))) })
        .build()
        .expect("idem consumer");
    let task = tokio::spawn(consumer.run());
    timing.done.notified().await;
    let end = Instant::now();
    let first = timing
        .first
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or(end);
    stop.cancel();
    task.await.expect("task").expect("run");
    end - first
}

/// Rates (messages per second) of each loop on each broker, for the summary.
static RATES: Mutex<Vec<(String, &'static str, f64)>> = Mutex::new(Vec::new());

fn record(broker: &str, which: &'static str, took: Duration) {
    let rate = MESSAGES as f64 / took.as_secs_f64().max(1e-9);
    RATES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((broker.to_owned(), which, rate));
}

/// Runs `run` `iters` times, noting each rate, and returns the total time measured.
fn timed<F, Fut>(
    rt: &tokio::runtime::Runtime,
    iters: u64,
    broker: &str,
    which: &'static str,
    run: F,
) -> Duration
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    rt.block_on(async {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let took = run().await;
            record(broker, which, took);
            total += took;
        }
        total
    })
}

fn on_broker(
    c: &mut Criterion,
    rt: &tokio::runtime::Runtime,
    name: &str,
    brokers: &str,
    topic: &str,
) {
    rt.block_on(produce(brokers, topic));
    let mut g = c.benchmark_group(format!("kafka_{name}"));
    g.throughput(Throughput::Elements(MESSAGES as u64))
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    g.bench_function("bare_stream_consumer", |b| {
        b.iter_custom(|iters| timed(rt, iters, name, "bare", || bare(brokers, topic)))
    });
    g.bench_function("idem_loop_memory", |b| {
        b.iter_custom(|iters| timed(rt, iters, name, "idem", || idem(brokers, topic)))
    });
    g.finish();
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn kafka(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let cluster = MockCluster::new(1).expect("mock cluster");
    let topic = unique("bench");
    cluster.create_topic(&topic, PARTITIONS, 1).expect("topic");
    on_broker(c, &rt, "mockcluster", &cluster.bootstrap_servers(), &topic);

    match std::env::var("IDEM_KAFKA_BROKERS") {
        Ok(brokers) if !brokers.is_empty() => {
            let topic = unique("bench");
            rt.block_on(async {
                let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                    .set("bootstrap.servers", &brokers)
                    .create()
                    .expect("admin");
                let new = NewTopic::new(&topic, PARTITIONS, TopicReplication::Fixed(1));
                for r in admin
                    .create_topics([&new], &AdminOptions::new())
                    .await
                    .expect("create topic")
                {
                    r.expect("topic created");
                }
            });
            on_broker(c, &rt, "tansu", &brokers, &topic);
        }
        _ => println!(
            "tansu skipped: IDEM_KAFKA_BROKERS is not set (eval \"$(scripts/services up kafka)\")"
        ),
    }

    let rates = RATES.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut brokers: Vec<&String> = rates.iter().map(|(b, ..)| b).collect();
    brokers.dedup();
    for broker in brokers {
        let of = |which: &str| {
            median(
                rates
                    .iter()
                    .filter(|(b, w, _)| b == broker && *w == which)
                    .map(|(.., r)| *r)
                    .collect(),
            )
        };
        let (bare, idem) = (of("bare"), of("idem"));
        println!(
            "kafka on {broker}: bare loop {:.0} msg/s, idem loop {:.0} msg/s, ratio {:.2} \
             (medians of every iteration, {MESSAGES} messages each)",
            bare,
            idem,
            idem / bare.max(1e-9)
        );
    }
}

criterion_group!(benches, kafka);
criterion_main!(benches);
