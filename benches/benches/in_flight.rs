//! Key-ordered concurrency with a slow handler: every loop's handler sleeps 20 ms (a card
//! charge, an HTTP call), on 4 partitions of the real broker (tansu, `IDEM_KAFKA_BROKERS`),
//! in one run:
//!
//! - `bare_sequential`: an rdkafka `StreamConsumer` loop that runs one handler at a time;
//! - `idem_1`: the idem loop with one handler in flight per partition (the default);
//! - `idem_64_memory`, `idem_64_redis`: 64 in flight per partition, ordered by the Kafka
//!   message key (1,000 entities), on the memory store and on Redis (`IDEM_REDIS_URL`).
//!
//! Each idem run checks on its output that no two messages of one entity ran at once and
//! that each entity's messages started in offset order. The target is `idem_64` at 40× the
//! bare sequential loop or more (4 partitions × 64 handlers bound it at 256×; with one
//! sequential loop as the baseline, the per-partition bound alone is 4×).
//!
//! `cargo bench -p benches --bench in_flight`; `IDEM_BENCH_HANDLER_MS=200` sleeps that
//! long instead (each loop then handles proportionally fewer messages per sample).

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::{Backend, Engine, MemoryBackend};
use idem_kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use idem_kafka::{IdemConsumer, OrderBy};
use idem_redis::{RedisBackend, RedisConfig};
use support::{Produce, Timing, config, create_topic, median, unique};

const PARTITIONS: i32 = 4;
const MESSAGES: usize = 20_000;
const ENTITIES: usize = 1_000;

/// How long every handler sleeps: `IDEM_BENCH_HANDLER_MS`, 20 ms unless set.
fn work() -> Duration {
    static MS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let ms = MS.get_or_init(|| {
        std::env::var("IDEM_BENCH_HANDLER_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&ms| ms > 0)
            .unwrap_or(20)
    });
    Duration::from_millis(*ms)
}

/// `n` messages at 20 ms a handler, as many as take the same time at `work()`.
fn scaled(n: usize) -> usize {
    let ms = usize::try_from(work().as_millis()).unwrap_or(usize::MAX);
    (n * 20 / ms).max(4)
}

async fn produce(brokers: &str, topic: &str) {
    let messages = (0..MESSAGES).map(|i| Produce {
        partition: i32::try_from(i % PARTITIONS as usize).expect("partition"),
        id: format!("op-{i}"),
        key: Some(format!("entity-{}", i % ENTITIES)),
        payload: format!("op-{i}").into_bytes(),
    });
    support::produce(brokers, topic, messages).await;
}

/// One handler at a time on one consumer, `n` messages. Returns the time from the first
/// message to the `n`-th.
async fn bare_sequential(brokers: &str, topic: &str, n: usize) -> Duration {
    let consumer: StreamConsumer = config(brokers, &unique("bare"))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    let mut first = None;
    for _ in 0..n {
        let m = consumer.recv().await.expect("message");
        first.get_or_insert_with(Instant::now);
        tokio::time::sleep(work()).await;
        consumer.store_offset_from_message(&m).expect("store");
    }
    first.map_or(Duration::ZERO, |t| t.elapsed())
}

/// One entity's handler starts as (partition, offset), in start order, and how many of its
/// handlers run now.
type Starts = (Vec<(i32, i64)>, usize);

/// Per entity, what its handlers did.
#[derive(Default)]
struct Order {
    starts: Mutex<HashMap<Vec<u8>, Starts>>,
    overlaps: Mutex<usize>,
}

impl Order {
    fn start(&self, entity: &[u8], at: (i32, i64)) {
        let mut starts = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        let (seen, running) = starts.entry(entity.to_vec()).or_default();
        seen.push(at);
        *running += 1;
        if *running > 1 {
            *self.overlaps.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        }
    }

    fn end(&self, entity: &[u8]) {
        if let Some((_, running)) = self
            .starts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(entity)
        {
            *running -= 1;
        }
    }

    /// Panics unless every entity ran one at a time and in offset order per partition.
    fn check(&self) {
        let overlaps = *self.overlaps.lock().unwrap_or_else(|e| e.into_inner());
        assert_eq!(overlaps, 0, "an entity ran two handlers at once");
        for (entity, (starts, _)) in self.starts.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let mut by_partition: HashMap<i32, i64> = HashMap::new();
            for &(p, o) in starts {
                let last = by_partition.entry(p).or_insert(-1);
                assert!(
                    o > *last,
                    "{entity:?} ran {o} after {last} on partition {p}"
                );
                *last = o;
            }
        }
    }
}

/// The idem loop with `in_flight` handlers per partition over `backend`. Returns the time
/// from the first claim to the `n`-th settled message, after checking per-entity order.
async fn idem(
    brokers: &str,
    topic: &str,
    n: usize,
    in_flight: usize,
    backend: Arc<dyn Backend>,
) -> Duration {
    let timing = Arc::new(Timing::new(n));
    let order = Arc::new(Order::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let signal = stop.clone();
    let seen = order.clone();
    let consumer = IdemConsumer::builder(config(brokers, &unique("idem")))
        .topics([topic])
        .engine(Engine::builder(backend).build().expect("engine"))
        .in_flight(in_flight)
        .order_by(OrderBy::MessageKey)
        .probe(timing.clone())
        .shutdown(async move { signal.cancelled().await })
        .handler(move |msg, _| {
            let order = seen.clone();
            async move {
                let entity = msg.message_key().cloned().unwrap_or_default();
                order.start(&entity, (msg.partition(), msg.offset()));
                tokio::time::sleep(work()).await;
                order.end(&entity);
                Ok(bytes::Bytes::from_static(b"charged"))
            }
        })
        .build()
        .expect("idem consumer");
    let task = tokio::spawn(consumer.run());
    timing.done.notified().await;
    let end = Instant::now();
    let took = end - timing.first(end);
    stop.cancel();
    task.await.expect("task").expect("run");
    order.check();
    took
}

static RATES: Mutex<Vec<(&'static str, f64)>> = Mutex::new(Vec::new());

fn bench(c: &mut Criterion) {
    let Some(brokers) = std::env::var("IDEM_KAFKA_BROKERS")
        .ok()
        .filter(|b| !b.is_empty())
    else {
        println!("IDEM_KAFKA_BROKERS is not set: eval \"$(scripts/services up)\"");
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let topic = unique("inflight");
    rt.block_on(async {
        create_topic(&brokers, &topic, PARTITIONS).await;
        produce(&brokers, &topic).await;
    });
    let redis: Option<Arc<dyn Backend>> = std::env::var("IDEM_REDIS_URL").ok().map(|url| {
        let backend = rt
            .block_on(RedisBackend::connect(RedisConfig::new(url)))
            .expect("connect to IDEM_REDIS_URL");
        Arc::new(backend) as Arc<dyn Backend>
    });
    let mut g = c.benchmark_group("in_flight_tansu");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    let mut case =
        |name: &'static str, n: usize, run: &dyn Fn() -> BoxFuture<'static, Duration>| {
            g.throughput(Throughput::Elements(n as u64));
            g.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let took = run().await;
                            let rate = n as f64 / took.as_secs_f64().max(1e-9);
                            RATES
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((name, rate));
                            total += took;
                        }
                        total
                    })
                })
            });
        };
    let at = (brokers.clone(), topic.clone());
    let go = at.clone();
    let n = scaled(100);
    case("bare_sequential", n, &move || {
        let (b, t) = go.clone();
        async move { bare_sequential(&b, &t, n).await }.boxed()
    });
    let go = at.clone();
    let n = scaled(400);
    case("idem_1_memory", n, &move || {
        let (b, t) = go.clone();
        async move { idem(&b, &t, n, 1, Arc::new(MemoryBackend::new())).await }.boxed()
    });
    let go = at.clone();
    let n = scaled(MESSAGES / 2);
    case("idem_64_memory", n, &move || {
        let (b, t) = go.clone();
        async move { idem(&b, &t, n, 64, Arc::new(MemoryBackend::new())).await }.boxed()
    });
    if let Some(redis) = redis {
        let go = at.clone();
        case("idem_64_redis", n, &move || {
            let ((b, t), store) = (go.clone(), redis.clone());
            async move { idem(&b, &t, n, 64, store).await }.boxed()
        });
    }
    g.finish();

    let rates = RATES.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let of = |which: &str| {
        median(
            rates
                .iter()
                .filter(|(w, _)| *w == which)
                .map(|(_, r)| *r)
                .collect(),
        )
    };
    let bare = of("bare_sequential");
    let ms = work().as_millis();
    println!("\n{ms} ms handler, {PARTITIONS} partitions on tansu (medians, messages/s):");
    println!("| loop | msg/s | ÷ bare sequential |");
    println!("|---|---|---|");
    for which in [
        "bare_sequential",
        "idem_1_memory",
        "idem_64_memory",
        "idem_64_redis",
    ] {
        let rate = of(which);
        if rate > 0.0 {
            println!("| {which} | {rate:.0} | {:.1}× |", rate / bare.max(1e-9));
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
