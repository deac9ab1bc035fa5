//! The idem RabbitMQ consumer against hand-written consumers on the same server, in one
//! run (`IDEM_RABBITMQ_URL`; the store loops need `IDEM_REDIS_URL` and
//! `IDEM_POSTGRES_URL`, `scripts/services up`):
//!
//! - `bare`: a lapin consumer that acks each delivery after the handler (a no-op that
//!   reads the key); the ceiling for the in-memory store;
//! - `dedup_redis`: the deduplication most teams write by hand: per delivery a Redis
//!   `SET key NX PX`, then the handler and a `SET key result PX` if it was new, then the
//!   ack. No leases, no fencing, no crash safety: a ceiling for idem on Redis, not a peer;
//! - `idem_memory`, `idem_redis`, `idem_postgres`: `IdemConsumer` (lease mode) on that
//!   store.
//!
//! Each iteration fills a fresh queue with `n` messages (not timed; fresh idempotency keys
//! each time) and counts from the first delivery to the `n`-th ack. Every consumer has the
//! same prefetch (`PREFETCH`) and handles one message at a time.
//!
//! `cargo bench -p benches --bench rabbitmq`

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput, criterion_group};
use futures::StreamExt;
use futures::future::BoxFuture;
use idem_core::{Backend, Engine, MemoryBackend};
use idem_postgres::{PgBackend, PgConfig};
use idem_rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem_rabbitmq::lapin::types::{AMQPValue, FieldTable, LongString};
use idem_rabbitmq::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idem_rabbitmq::{IdemConsumer, Message, Point, Probe, Verdict};
use idem_redis::{RedisBackend, RedisConfig};
use redis::aio::ConnectionManager;
use support::median;
use tokio::sync::Notify;

const PREFETCH: u16 = 32;
const SCHEMA: &str = "idem_rabbitmq_bench";
const REDIS_PREFIX: &str = "idem_rabbitmq_bench:";
const LOOPS: [(&str, &str); 5] = [
    (
        "bare",
        "lapin consumer, ack after the handler, no deduplication",
    ),
    (
        "dedup_redis",
        "by hand: Redis `SET NX PX`, the handler, `SET PX`, per delivery",
    ),
    ("idem_memory", "idem, in-memory store"),
    ("idem_redis", "idem, Redis"),
    ("idem_postgres", "idem, PostgreSQL (lease mode)"),
];
const RATIOS: [(&str, &str, &str); 3] = [
    ("idem_memory", "bare", "goal ≥ 0.8"),
    ("idem_redis", "dedup_redis", "goal ≥ 0.9"),
    ("idem_postgres", "bare", ""),
];

/// Every iteration's rate, by loop.
static RATES: Mutex<Vec<(&'static str, usize, f64)>> = Mutex::new(Vec::new());

fn url() -> String {
    std::env::var("IDEM_RABBITMQ_URL")
        .expect("IDEM_RABBITMQ_URL: run eval \"$(scripts/services up)\"")
}

/// What every loop does per message besides its bookkeeping.
fn handle(key: Option<&[u8]>) -> bytes::Bytes {
    support::handle(key)
}

/// A fresh queue holding `n` messages, each with its own `idempotency-key` header.
async fn fill(conn: &Connection, n: usize) -> String {
    let queue = support::unique("idem-bench");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm");
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("declare");
    let payload = vec![b'x'; 80];
    for i in 0..n {
        let mut headers = FieldTable::default();
        let id = format!("{queue}-{i}");
        headers.insert(
            "idempotency-key".into(),
            AMQPValue::LongString(LongString::from(id.as_str())),
        );
        ch.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            &payload,
            BasicProperties::default().with_headers(headers),
        )
        .await
        .expect("publish");
    }
    let returned = ch.wait_for_confirms().await.expect("confirms");
    assert!(returned.is_empty(), "unroutable bench messages");
    queue
}

async fn drop_queue(conn: &Connection, queue: &str) {
    let ch = conn.create_channel().await.expect("channel");
    for q in [queue.to_owned(), format!("{queue}.dlq")] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

fn key_of(props: &BasicProperties) -> Option<Vec<u8>> {
    match props.headers().as_ref()?.inner().get("idempotency-key")? {
        AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
        _ => None,
    }
}

/// A hand-written consumer of `queue`: per delivery `check` (true: handle it), the
/// handler, `record`, then the ack. Returns the time from the first delivery to the n-th
/// ack.
async fn hand_loop(queue: &str, n: usize, mut store: Option<ConnectionManager>) -> Duration {
    // A connection of its own, as each idem consumer has.
    let conn = Connection::connect(&url(), ConnectionProperties::default())
        .await
        .expect("connect");
    let ch: Channel = conn.create_channel().await.expect("channel");
    ch.basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut deliveries = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let mut first = None;
    for _ in 0..n {
        let d = deliveries
            .next()
            .await
            .expect("delivery")
            .expect("delivery");
        first.get_or_insert_with(Instant::now);
        let key = key_of(&d.properties);
        match &mut store {
            None => {
                std::hint::black_box(handle(key.as_deref()));
            }
            Some(conn) => {
                let k = format!(
                    "{REDIS_PREFIX}{}",
                    String::from_utf8_lossy(key.as_deref().unwrap_or_default())
                );
                let new: Option<String> = redis::cmd("SET")
                    .arg(&k)
                    .arg("pending")
                    .arg("NX")
                    .arg("PX")
                    .arg(60_000)
                    .query_async(conn)
                    .await
                    .expect("SET NX");
                if new.is_some() {
                    let result = handle(key.as_deref());
                    let () = redis::cmd("SET")
                        .arg(&k)
                        .arg(&result[..])
                        .arg("PX")
                        .arg(3_600_000)
                        .query_async(conn)
                        .await
                        .expect("SET");
                }
            }
        }
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    let took = first.map_or(Duration::ZERO, |f| f.elapsed());
    let _ = conn.close(200, "done".into()).await;
    took
}

/// Times an idem consumer from its first claim to its `n`-th ack.
struct Timing {
    n: u64,
    first: Mutex<Option<Instant>>,
    acked: AtomicU64,
    done: Notify,
}

impl Probe for Timing {
    fn reached(&self, point: Point, _: &Message) -> Verdict {
        match point {
            Point::BeforeClaim => {
                let mut first = self.first.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert_with(Instant::now);
            }
            Point::AfterAck if self.acked.fetch_add(1, Ordering::Relaxed) + 1 == self.n => {
                self.done.notify_one();
            }
            _ => {}
        }
        Verdict::Continue
    }
}

async fn idem_loop(queue: &str, n: usize, store: Arc<dyn Backend>) -> Duration {
    let timing = Arc::new(Timing {
        n: n as u64,
        first: Mutex::new(None),
        acked: AtomicU64::new(0),
        done: Notify::new(),
    });
    let stop = tokio_util::sync::CancellationToken::new();
    let engine = Engine::builder(store).build().expect("engine");
    let consumer = IdemConsumer::builder(url())
        .queue(queue)
        .engine(engine)
        .prefetch(PREFETCH)
        .probe(timing.clone())
        .shutdown(stop.clone().cancelled_owned())
        .handler(|m, _| async move { Ok(handle(m.idempotency_key().map(|k| k.id().as_bytes()))) })
        .build()
        .expect("consumer");
    let run = tokio::spawn(consumer.run());
    timing.done.notified().await;
    let took = timing
        .first
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .map_or(Duration::ZERO, |f| f.elapsed());
    stop.cancel();
    run.await.expect("join").expect("run");
    took
}

/// The stores, when their services are configured.
struct Stores {
    redis: Option<(RedisBackend, ConnectionManager)>,
    postgres: Option<PgBackend>,
}

async fn stores() -> Stores {
    let var = |v: &str| std::env::var(v).ok().filter(|s| !s.trim().is_empty());
    let redis = match var("IDEM_REDIS_URL") {
        None => None,
        Some(url) => {
            let backend = RedisBackend::connect(RedisConfig::new(&url).with_prefix(REDIS_PREFIX))
                .await
                .expect("redis");
            let raw = ConnectionManager::new(redis::Client::open(url).expect("client"))
                .await
                .expect("redis");
            Some((backend, raw))
        }
    };
    let postgres = match var("IDEM_POSTGRES_URL") {
        None => None,
        Some(url) => {
            let pg = PgBackend::connect(PgConfig::new(url).with_schema(SCHEMA))
                .await
                .expect("pg");
            pg.migrate().await.expect("migrate");
            Some(pg)
        }
    };
    Stores { redis, postgres }
}

impl Stores {
    async fn reset(&self) {
        if let Some((_, raw)) = &self.redis {
            support::clear_redis(raw, REDIS_PREFIX).await;
        }
        if let Some(pg) = &self.postgres {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "TRUNCATE {SCHEMA}.idem_records"
            )))
            .execute(pg.pool())
            .await
            .expect("TRUNCATE");
        }
    }
}

fn rabbitmq(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (conn, stores) = rt.block_on(async {
        let conn = Connection::connect(&url(), ConnectionProperties::default())
            .await
            .expect("connect");
        (Arc::new(conn), stores().await)
    });
    let mut g = c.benchmark_group("rabbitmq");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    let mut case =
        |which: &'static str, n: usize, run: &dyn Fn(String) -> BoxFuture<'static, Duration>| {
            g.throughput(Throughput::Elements(n as u64));
            g.bench_function(which, |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            stores.reset().await;
                            let queue = fill(&conn, n).await;
                            // On a worker thread, as the idem consumer runs, not on the thread of
                            // `block_on`.
                            let took = tokio::spawn(run(queue.clone())).await.expect("join");
                            drop_queue(&conn, &queue).await;
                            let rate = n as f64 / took.as_secs_f64().max(1e-9);
                            RATES
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((which, n, rate));
                            total += took;
                        }
                        total
                    })
                })
            });
        };
    let n = 10_000;
    case("bare", n, &move |q| {
        Box::pin(async move { hand_loop(&q, n, None).await })
    });
    case("idem_memory", n, &move |q| {
        Box::pin(async move { idem_loop(&q, n, Arc::new(MemoryBackend::new())).await })
    });
    if let Some((backend, raw)) = &stores.redis {
        let raw = raw.clone();
        case("dedup_redis", n, &move |q| {
            let raw = raw.clone();
            Box::pin(async move { hand_loop(&q, n, Some(raw)).await })
        });
        let backend = backend.clone();
        case("idem_redis", n, &move |q| {
            let store: Arc<dyn Backend> = Arc::new(backend.clone());
            Box::pin(async move { idem_loop(&q, n, store).await })
        });
    }
    if let Some(pg) = &stores.postgres {
        let pg = pg.clone();
        let n = n / 4;
        case("idem_postgres", n, &move |q| {
            let store: Arc<dyn Backend> = Arc::new(pg.clone());
            Box::pin(async move { idem_loop(&q, n, store).await })
        });
    }
    g.finish();
    summary();
}

fn summary() {
    let rates = RATES.lock().unwrap_or_else(|e| e.into_inner());
    let of = |which: &str| median(rates.iter().filter(|r| r.0 == which).map(|r| r.2).collect());
    println!(
        "\n{}\n",
        support::provenance("rabbitmq", "RabbitMQ at IDEM_RABBITMQ_URL")
    );
    println!("| loop | what | msg/s |");
    println!("|:---|:---|---:|");
    for (which, what) in LOOPS {
        if of(which) > 0.0 {
            println!("| `{which}` | {what} | {:.0} |", of(which));
        }
    }
    for (which, over, goal) in RATIOS {
        let (a, b) = (of(which), of(over));
        if a > 0.0 && b > 0.0 {
            println!("| `{which}` ÷ `{over}` | {goal} | {:.2} |", a / b);
        }
    }
    let sizes: Vec<String> = LOOPS
        .iter()
        .filter_map(|(w, _)| {
            rates
                .iter()
                .find(|r| r.0 == *w)
                .map(|r| format!("{} for {w}", r.1))
        })
        .collect();
    let counts: Vec<usize> = LOOPS
        .iter()
        .map(|(w, _)| rates.iter().filter(|r| r.0 == *w).count())
        .filter(|&k| k > 0)
        .collect();
    println!(
        "\nmsg/s: the median of each loop's iterations ({}–{} each); an iteration fills a fresh \
         queue with n messages of 80 bytes and counts from the first delivery to the n-th ack \
         (n = {}). Prefetch {PREFETCH}; the hand-written loops one delivery at a time, idem \
         with its defaults (in_flight 1, deliveries that arrived together in one claim and \
         one settle, up to 32).",
        counts.iter().min().unwrap_or(&0),
        counts.iter().max().unwrap_or(&0),
        sizes.join("; ")
    );
}

criterion_group!(benches, rabbitmq);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
