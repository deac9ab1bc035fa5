//! Produce-to-settle latency of the Kafka loop at a fixed offered rate: the bare rdkafka
//! loop and idem on its in-memory store, on Redis and on PostgreSQL (lease mode), on the
//! broker at `IDEM_KAFKA_BROKERS` (tansu) and on librdkafka's MockCluster, with one store
//! round trip of each store measured in the same run. Batching trades latency for
//! throughput; this shows what it costs.
//!
//! Per loop and broker: a fresh topic of 4 partitions and a fresh consumer group (so fresh
//! idempotency keys). The loop is started and one message per partition is produced and
//! waited for until settled (the group join is not measured). Then a producer on a thread of
//! its own offers `IDEM_LATENCY_RATE` messages/s (default 20,000), message `i` sent at
//! `t0 + i / rate` (a schedule, so sleeps do not drift; a late producer catches up at
//! once), for a warm-up second and then `IDEM_LATENCY_SECS` seconds (default 5). Only the
//! messages after the warm-up are counted.
//!
//! A message's latency runs from the instant the producer hands it to librdkafka
//! (`send_result`) to its settle: for the bare loop, once the no-op handler
//! returned and its offset is stored in the client (`store_offset_from_message`); for idem,
//! when the loop's [`Probe`] is asked at [`Point::AfterSettle`] for it (the record is
//! settled in the store; its offset not yet stored). Messages are matched by partition and
//! offset: the producer keeps each message's send instant and reads its offset from the
//! delivery report; the loop keeps each offset's settle instant.
//!
//! The goal (issue #33): idem's p99 at most twice the bare loop's p99 on the same broker
//! plus one store round trip (the p99 of Redis `PING` or PostgreSQL `SELECT 1`, measured
//! through the same kind of client just before the loop ran; zero for the in-memory store).
//! The verdict column is computed from the run's own figures.
//!
//! The consumers' `fetch.wait.max.ms` is `IDEM_LATENCY_FETCH_WAIT_MS` (default 10, not
//! librdkafka's 500: tansu and MockCluster answer a fetch that finds no data only once that
//! wait is over, where Kafka answers when data arrives, so 500 ms would spread every loop's
//! latency up to it); the producer's `linger.ms` is `IDEM_LATENCY_LINGER_MS` (default 5,
//! librdkafka's; at 1 tansu falls behind the produce requests at 20,000 msg/s).
//!
//! Needs `IDEM_KAFKA_BROKERS`, `IDEM_REDIS_URL` and `IDEM_POSTGRES_URL`
//! (`eval "$(scripts/services up)"`).
//!
//! `cargo bench -p benches --bench kafka_latency`

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use idem_core::{Backend, Engine, MemoryBackend};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use idem_kafka::rdkafka::message::{Header, Message as _, OwnedHeaders};
use idem_kafka::rdkafka::mocking::MockCluster;
use idem_kafka::rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use idem_kafka::{IdemConsumer, Point, Probe, Verdict};
use idem_postgres::{PgBackend, PgConfig};
use idem_redis::{RedisBackend, RedisConfig};
use redis::aio::ConnectionManager;
use support::{Produce, config, create_topic, handle, header_key, unique};
use tokio_util::sync::CancellationToken;

const PARTITIONS: i32 = 4;
const COMMIT_EVERY: Duration = Duration::from_secs(1);
/// Offered before the measured messages, not counted.
const WARM_UP: Duration = Duration::from_secs(1);
const PAYLOAD: usize = 80;
/// How long a loop may take to join its group and settle its first messages.
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a loop may take, after the last message is sent, to settle the rest.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
/// Store round trips timed per store, after as many untimed.
const ROUND_TRIPS: usize = 2_000;
const SCHEMA: &str = "idem_kafka_latency";
const REDIS_PREFIX: &str = "idem_kafka_latency:";

/// The offered load.
#[derive(Clone, Copy)]
struct Load {
    /// Messages per second.
    rate: f64,
    /// Measured seconds, after the warm-up.
    secs: f64,
    /// The consumers' `fetch.wait.max.ms`.
    fetch_wait_ms: u64,
    /// The producer's `linger.ms`.
    linger_ms: u64,
}

impl Load {
    fn from_env() -> Load {
        let num = |var: &str, default: f64| match std::env::var(var) {
            Ok(v) => match v.trim().parse::<f64>() {
                Ok(x) if x > 0.0 => x,
                _ => fail(&format!("{var}={v}: expected a positive number")),
            },
            Err(_) => default,
        };
        Load {
            rate: num("IDEM_LATENCY_RATE", 20_000.0),
            secs: num("IDEM_LATENCY_SECS", 5.0),
            fetch_wait_ms: num("IDEM_LATENCY_FETCH_WAIT_MS", 10.0).round() as u64,
            linger_ms: num("IDEM_LATENCY_LINGER_MS", 5.0).round() as u64,
        }
    }

    /// Messages offered during the warm-up.
    fn warm(&self) -> usize {
        (self.rate * WARM_UP.as_secs_f64()).round() as usize
    }

    /// Messages offered in all, the warm-up's included.
    fn total(&self) -> usize {
        self.warm() + (self.rate * self.secs).round() as usize
    }
}

fn fail(why: &str) -> ! {
    eprintln!("kafka_latency: {why}");
    std::process::exit(1)
}

fn required(var: &str) -> String {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => v,
        _ => fail(&format!(
            "{var} is not set: this bench needs tansu, Redis and PostgreSQL; start them with \
             eval \"$(scripts/services up)\""
        )),
    }
}

/// When each offset was settled, per partition: nanoseconds after `base`, plus one (0: not
/// yet). Offsets beyond the capacity are not kept (and show as unsettled).
struct Settles {
    base: Instant,
    parts: Vec<Vec<AtomicU64>>,
    count: AtomicUsize,
}

impl Settles {
    fn new(per_partition: usize) -> Arc<Settles> {
        Arc::new(Settles {
            base: Instant::now(),
            parts: (0..PARTITIONS)
                .map(|_| (0..per_partition).map(|_| AtomicU64::new(0)).collect())
                .collect(),
            count: AtomicUsize::new(0),
        })
    }

    fn slot(&self, partition: i32, offset: i64) -> Option<&AtomicU64> {
        let p = usize::try_from(partition).ok()?;
        let o = usize::try_from(offset).ok()?;
        self.parts.get(p)?.get(o)
    }

    /// Notes `offset` settled now, unless it was already.
    fn mark(&self, partition: i32, offset: i64) {
        let nanos = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1;
        if let Some(slot) = self.slot(partition, offset)
            && slot
                .compare_exchange(0, nanos, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.count.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn at(&self, partition: i32, offset: i64) -> Option<Instant> {
        match self.slot(partition, offset)?.load(Ordering::Relaxed) {
            0 => None,
            n => Some(self.base + Duration::from_nanos(n - 1)),
        }
    }

    /// Waits until `n` offsets are settled or `timeout` passes; whether they were.
    async fn wait(&self, n: usize, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        while self.count.load(Ordering::Relaxed) < n {
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }
}

/// idem's settle: [`Point::AfterSettle`]. Always lets the loop go on.
impl Probe for Settles {
    fn reached(&self, point: Point, _: &str, partition: i32, offset: i64) -> Verdict {
        if point == Point::AfterSettle {
            self.mark(partition, offset);
        }
        Verdict::Continue
    }
}

/// The loops measured.
#[derive(Clone)]
enum Loop {
    Bare,
    Idem(&'static str, Arc<dyn Backend>),
}

impl Loop {
    fn names(&self) -> (&'static str, &'static str) {
        match self {
            Loop::Bare => ("bare", "–"),
            Loop::Idem(store, _) => ("idem", store),
        }
    }
}

/// The bare loop: `recv`, the handler, `store_offset_from_message`, then the settle; an
/// async commit of stored offsets every second.
async fn bare(consumer: StreamConsumer, settles: Arc<Settles>, stop: CancellationToken) {
    let mut last_commit = Instant::now();
    loop {
        let m = tokio::select! {
            () = stop.cancelled() => break,
            m = consumer.recv() => m.expect("message"),
        };
        std::hint::black_box(handle(header_key(&m)));
        consumer.store_offset_from_message(&m).expect("store");
        settles.mark(m.partition(), m.offset());
        if last_commit.elapsed() >= COMMIT_EVERY {
            last_commit = Instant::now();
            let _ = consumer.commit_consumer_state(CommitMode::Async);
        }
    }
    let _ = consumer.commit_consumer_state(CommitMode::Sync);
}

/// A consumer's settings: [`support::config`] and `fetch.wait.max.ms`.
fn consumer_config(brokers: &str, group: &str, load: Load) -> ClientConfig {
    let mut c = config(brokers, group);
    c.set("fetch.wait.max.ms", load.fetch_wait_ms.to_string());
    c
}

/// Starts `which` on `topic` with a fresh group; it settles into `settles` until `stop`.
fn start(
    which: &Loop,
    (brokers, topic): (&str, &str),
    load: Load,
    settles: &Arc<Settles>,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    match which {
        Loop::Bare => {
            let consumer: StreamConsumer = consumer_config(brokers, &unique("latency-bare"), load)
                .set("enable.auto.commit", "false")
                .set("enable.auto.offset.store", "false")
                .create()
                .expect("consumer");
            consumer.subscribe(&[topic]).expect("subscribe");
            tokio::spawn(bare(consumer, settles.clone(), stop.clone()))
        }
        Loop::Idem(_, backend) => {
            let signal = stop.clone();
            let consumer =
                IdemConsumer::builder(consumer_config(brokers, &unique("latency-idem"), load))
                    .topics([topic])
                    .commit_interval(COMMIT_EVERY)
                    .probe(settles.clone())
                    .shutdown(async move { signal.cancelled().await })
                    .engine(Engine::builder(backend.clone()).build().expect("engine"))
                    .handler(|msg, _| async move {
                        Ok(handle(msg.idempotency_key().map(|k| k.id().as_bytes())))
                    })
                    .build()
                    .expect("idem consumer");
            tokio::spawn(async move { consumer.run().await.expect("idem loop") })
        }
    }
}

/// What the paced producer sent: per message, its send instant, its delivered partition
/// and offset (none if it was not delivered) and when its delivery report was seen.
struct Sent {
    at: Vec<Instant>,
    placed: Vec<Option<(i32, i64)>>,
    delivered: Vec<Instant>,
    /// The most the producer was behind its schedule.
    behind: Duration,
}

/// Sends `load.total()` messages, message `i` to partition `i % PARTITIONS` at
/// `t0 + i / rate`, on the calling thread (a thread of its own), while another thread
/// awaits the delivery reports in order.
fn offer(brokers: &str, topic: &str, run: &str, load: Load) -> Sent {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", load.linger_ms.to_string())
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .expect("producer");
    let total = load.total();
    let payload = vec![b'x'; PAYLOAD];
    let mut at = Vec::with_capacity(total);
    let (pending, reports) = std::sync::mpsc::channel::<DeliveryFuture>();
    let reports = std::thread::spawn(move || {
        let mut seen = Vec::with_capacity(total);
        for d in reports {
            let placed = match futures::executor::block_on(d) {
                Ok(Ok(d)) => Some((d.partition, d.offset)),
                _ => None,
            };
            seen.push((placed, Instant::now()));
        }
        seen
    });
    let mut behind = Duration::ZERO;
    let t0 = Instant::now() + Duration::from_millis(10);
    for i in 0..total {
        let due = t0 + Duration::from_secs_f64(i as f64 / load.rate);
        let now = Instant::now();
        if now < due {
            std::thread::sleep(due - now);
        } else {
            behind = behind.max(now - due);
        }
        let id = format!("{run}-{i}");
        let headers = OwnedHeaders::new().insert(Header {
            key: "idempotency-key",
            value: Some(id.as_bytes()),
        });
        let record = FutureRecord::<[u8], [u8]>::to(topic)
            .partition(i32::try_from(i % PARTITIONS as usize).expect("partition"))
            .payload(&payload)
            .headers(headers);
        at.push(Instant::now());
        let report = producer
            .send_result(record)
            .map_err(|(e, _)| e)
            .expect("enqueue");
        pending.send(report).expect("report thread");
    }
    drop(pending);
    let (placed, delivered) = reports.join().expect("report thread").into_iter().unzip();
    Sent {
        at,
        placed,
        delivered,
        behind,
    }
}

/// Latencies of one loop on one broker.
struct Row {
    broker: &'static str,
    which: Loop,
    offered: f64,
    /// Measured messages settled per second, from the first measured settle to the last.
    achieved: f64,
    /// In microseconds.
    latency: Histogram<u64>,
    /// From send to delivery report, in microseconds.
    delivery: Histogram<u64>,
    /// Measured messages never settled (or never delivered).
    unsettled: usize,
    /// The store's round trip, in microseconds (none for the in-memory store and `bare`).
    round_trip: Option<Histogram<u64>>,
    behind: Duration,
}

fn histogram() -> Histogram<u64> {
    Histogram::new(3).expect("histogram")
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// One loop on one broker, on a fresh topic: started, primed, offered the load, drained.
async fn measure(
    broker: &'static str,
    brokers: &str,
    topic: &str,
    which: Loop,
    load: Load,
    round_trip: Option<Histogram<u64>>,
) -> Row {
    let total = load.total();
    // One primer per partition, then the paced messages, spread evenly.
    let settles = Settles::new(2 + total / PARTITIONS as usize + 16);
    let stop = CancellationToken::new();
    let task = start(&which, (brokers, topic), load, &settles, &stop);
    let run = unique("latency");
    let primers = (0..PARTITIONS).map(|p| Produce {
        partition: p,
        id: format!("{run}-prime-{p}"),
        key: None,
        payload: vec![b'x'; PAYLOAD],
    });
    support::produce(brokers, topic, primers).await;
    if !settles.wait(PARTITIONS as usize, JOIN_TIMEOUT).await {
        fail(&format!(
            "{broker} {}: the loop settled no first message per partition in {JOIN_TIMEOUT:?}",
            which.names().0
        ));
    }
    let (b, t, r) = (brokers.to_owned(), topic.to_owned(), run.clone());
    let sent = tokio::task::spawn_blocking(move || offer(&b, &t, &r, load))
        .await
        .expect("producer");
    let all = settles
        .wait(PARTITIONS as usize + total, DRAIN_TIMEOUT)
        .await;
    stop.cancel();
    task.await.expect("loop task");

    let (mut latency, mut delivery) = (histogram(), histogram());
    let mut unsettled = 0;
    let (mut first_settle, mut last_settle) = (None::<Instant>, None::<Instant>);
    let warm = load.warm();
    for ((sent_at, placed), delivered) in sent.at[warm..]
        .iter()
        .zip(&sent.placed[warm..])
        .zip(&sent.delivered[warm..])
    {
        delivery
            .record(micros(delivered.saturating_duration_since(*sent_at)))
            .expect("record");
        let Some(settled) = placed.and_then(|(p, o)| settles.at(p, o)) else {
            unsettled += 1;
            continue;
        };
        latency
            .record(micros(settled.saturating_duration_since(*sent_at)))
            .expect("record");
        first_settle = Some(first_settle.map_or(settled, |f| f.min(settled)));
        last_settle = Some(last_settle.map_or(settled, |l| l.max(settled)));
    }
    let achieved = match (first_settle, last_settle) {
        (Some(f), Some(l)) if l > f => latency.len() as f64 / (l - f).as_secs_f64(),
        _ => 0.0,
    };
    let row = Row {
        broker,
        which,
        offered: load.rate,
        achieved,
        latency,
        delivery,
        unsettled,
        round_trip,
        behind: sent.behind,
    };
    let (consumer, store) = row.which.names();
    println!(
        "{broker} {consumer} {store}: {} settled, {} not{}; p50 {:.2} ms, p99 {:.2} ms, max \
         {:.2} ms; {:.0} msg/s; delivery report p50 {:.2} ms, p99 {:.2} ms; producer at most \
         {:.2} ms behind schedule",
        row.latency.len(),
        row.unsettled,
        if all { "" } else { " (drain timed out)" },
        ms(row.latency.value_at_quantile(0.5)),
        ms(row.latency.value_at_quantile(0.99)),
        ms(row.latency.max()),
        row.achieved,
        ms(row.delivery.value_at_quantile(0.5)),
        ms(row.delivery.value_at_quantile(0.99)),
        row.behind.as_secs_f64() * 1e3,
    );
    row
}

fn ms(micros: u64) -> f64 {
    micros as f64 / 1e3
}

/// Times `ROUND_TRIPS` calls of `call`, one after the other, after as many untimed.
async fn round_trips<F, Fut>(mut call: F) -> Histogram<u64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for _ in 0..ROUND_TRIPS {
        call().await;
    }
    let mut h = histogram();
    for _ in 0..ROUND_TRIPS {
        let began = Instant::now();
        call().await;
        h.record(micros(began.elapsed())).expect("record");
    }
    h
}

/// The stores and a raw client of each, for the round trips.
struct Stores {
    redis: RedisBackend,
    redis_raw: ConnectionManager,
    postgres: PgBackend,
}

impl Stores {
    async fn connect(redis_url: &str, postgres_url: &str) -> Stores {
        let redis = RedisBackend::connect(RedisConfig::new(redis_url).with_prefix(REDIS_PREFIX))
            .await
            .expect("connect the Redis backend");
        let client = redis::Client::open(redis_url).expect("redis url");
        let redis_raw = ConnectionManager::new(client).await.expect("connect Redis");
        let config = PgConfig::new(postgres_url)
            .with_schema(SCHEMA)
            .with_max_connections(16);
        let postgres = PgBackend::connect(config)
            .await
            .expect("connect PostgreSQL");
        for stmt in [
            format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"),
            format!("CREATE SCHEMA {SCHEMA}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(stmt))
                .execute(postgres.pool())
                .await
                .expect("reset schema");
        }
        postgres.migrate().await.expect("migrate");
        let stores = Stores {
            redis,
            redis_raw,
            postgres,
        };
        stores.clear_redis().await;
        stores
    }

    /// Removes the keys earlier runs left in Redis.
    async fn clear_redis(&self) {
        support::clear_redis(&self.redis_raw, REDIS_PREFIX).await;
    }

    /// Redis `PING` round trips.
    async fn redis_round_trip(&self) -> Histogram<u64> {
        let conn = self.redis_raw.clone();
        round_trips(|| {
            let mut conn = conn.clone();
            async move {
                let _: String = redis::cmd("PING")
                    .query_async(&mut conn)
                    .await
                    .expect("PING");
            }
        })
        .await
    }

    /// PostgreSQL `SELECT 1` round trips, through the backend's own pool.
    async fn postgres_round_trip(&self) -> Histogram<u64> {
        let pool = self.postgres.pool().clone();
        round_trips(|| {
            let pool = pool.clone();
            async move {
                let one: i32 = sqlx::query_scalar("SELECT 1")
                    .fetch_one(&pool)
                    .await
                    .expect("SELECT 1");
                assert_eq!(one, 1);
            }
        })
        .await
    }
}

/// Every loop on one broker; `new_topic` makes a fresh topic of `PARTITIONS` partitions.
fn on_broker(
    rt: &tokio::runtime::Runtime,
    stores: &Stores,
    load: Load,
    (broker, brokers): (&'static str, &str),
    new_topic: &dyn Fn() -> String,
) -> Vec<Row> {
    let mut rows = Vec::new();
    let memory: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let redis: Arc<dyn Backend> = Arc::new(stores.redis.clone());
    let postgres: Arc<dyn Backend> = Arc::new(stores.postgres.clone());
    for which in [
        Loop::Bare,
        Loop::Idem("memory", memory),
        Loop::Idem("Redis", redis),
        Loop::Idem("PostgreSQL", postgres),
    ] {
        let topic = new_topic();
        let row = rt.block_on(async {
            let round_trip = match &which {
                Loop::Idem("Redis", _) => Some(stores.redis_round_trip().await),
                Loop::Idem("PostgreSQL", _) => Some(stores.postgres_round_trip().await),
                _ => None,
            };
            measure(broker, brokers, &topic, which, load, round_trip).await
        });
        rows.push(row);
    }
    rows
}

/// The table: per broker and loop, the latencies, the store's round trip, the goal's bound
/// (2 × the bare loop's p99 on that broker + the store's round-trip p99) and whether idem's
/// p99 stays within it.
fn summary(rows: &[Row], load: Load) {
    let brokers = "tansu at IDEM_KAFKA_BROKERS and MockCluster";
    println!("\n{}\n", support::provenance("kafka_latency", brokers));
    println!(
        "| broker | consumer | store | offered msg/s | achieved msg/s | delivery report p99 ms | p50 ms | \
         p99 ms | max ms | store round trip p50 / p99 ms | goal: p99 ≤ ms | goal |"
    );
    println!("|:---|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|:---|");
    for row in rows {
        let (consumer, store) = row.which.names();
        let p99 = row.latency.value_at_quantile(0.99);
        let bare = rows
            .iter()
            .find(|r| r.broker == row.broker && matches!(r.which, Loop::Bare))
            .filter(|r| !r.latency.is_empty())
            .map(|r| r.latency.value_at_quantile(0.99));
        let trip = row
            .round_trip
            .as_ref()
            .map(|h| (h.value_at_quantile(0.5), h.value_at_quantile(0.99)));
        let trip_cell = match (&row.which, trip) {
            (_, Some((p50, p99))) => format!("{:.3} / {:.3}", ms(p50), ms(p99)),
            (Loop::Idem(..), None) => "0 (in process)".into(),
            (Loop::Bare, None) => "–".into(),
        };
        let (bound, verdict) = match (&row.which, bare) {
            (Loop::Bare, _) => ("–".to_owned(), "–".to_owned()),
            (Loop::Idem(..), None) => ("–".to_owned(), "no bare p99".to_owned()),
            (Loop::Idem(..), Some(bare)) => {
                let bound = 2 * bare + trip.map_or(0, |(_, p99)| p99);
                let verdict = if row.unsettled > 0 {
                    format!("not met ({} unsettled)", row.unsettled)
                } else if row.latency.is_empty() || p99 > bound {
                    "not met".to_owned()
                } else {
                    "met".to_owned()
                };
                (format!("{:.2}", ms(bound)), verdict)
            }
        };
        let quantile = |q: f64| {
            if row.latency.is_empty() {
                "–".to_owned()
            } else {
                format!("{:.2}", ms(row.latency.value_at_quantile(q)))
            }
        };
        println!(
            "| {} | {consumer} | {store} | {:.0} | {:.0} | {:.2} | {} | {} | {} | {trip_cell} | {bound} \
             | {verdict} |",
            row.broker,
            row.offered,
            row.achieved,
            ms(row.delivery.value_at_quantile(0.99)),
            quantile(0.5),
            quantile(0.99),
            if row.latency.is_empty() {
                "–".to_owned()
            } else {
                format!("{:.2}", ms(row.latency.max()))
            },
        );
    }
    println!(
        "\nLatency: from the producer handing a message to librdkafka (`linger.ms` = {}; \
         message i sent at t0 + i/rate) to its settle (bare: handler returned and offset \
         stored; idem: `Point::AfterSettle`), matched by partition and offset; delivery report: from the same send to the \
         producer's delivery report (the broker's ack, part of every row's latency). Per row a fresh \
         topic and group, {PARTITIONS} partitions, {PAYLOAD}-byte payloads; {:.0} s of warm-up \
         not counted, then {:.0} s counted ({} messages). Offsets committed every {COMMIT_EVERY:?}, \
         idem's default batch size (500); consumers' `fetch.wait.max.ms` = {}. Store round trip: {ROUND_TRIPS} Redis `PING`s or \
         PostgreSQL `SELECT 1`s one after another just before the row, through a \
         `ConnectionManager` or the backend's pool. Goal: idem's p99 ≤ 2 × bare's p99 on the \
         same broker + the store's round-trip p99.",
        load.linger_ms,
        WARM_UP.as_secs_f64(),
        load.secs,
        load.total() - load.warm(),
        load.fetch_wait_ms,
    );
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not, and gets no load run.
    if !std::env::args().any(|a| a == "--bench") {
        println!("kafka_latency: a load run; `cargo bench -p benches --bench kafka_latency`");
        return;
    }
    let brokers = required("IDEM_KAFKA_BROKERS");
    let redis_url = required("IDEM_REDIS_URL");
    let postgres_url = required("IDEM_POSTGRES_URL");
    let load = Load::from_env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let stores = rt.block_on(Stores::connect(&redis_url, &postgres_url));

    let mut rows = on_broker(&rt, &stores, load, ("tansu", &brokers), &|| {
        let topic = unique("latency");
        rt.block_on(create_topic(&brokers, &topic, PARTITIONS));
        topic
    });
    let cluster = MockCluster::new(1).expect("mock cluster");
    let mock = cluster.bootstrap_servers();
    rows.extend(on_broker(
        &rt,
        &stores,
        load,
        ("MockCluster", &mock),
        &|| {
            let topic = unique("latency");
            cluster.create_topic(&topic, PARTITIONS, 1).expect("topic");
            cluster
                .create_topic(&format!("{topic}.dlq"), 1, 1)
                .expect("dead-letter topic");
            topic
        },
    ));
    summary(&rows, load);
}
