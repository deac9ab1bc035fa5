//! The idem consumer loop against hand-written loops on the same broker, in one run:
//!
//! - `bare`: an rdkafka `StreamConsumer` loop with the same commit policy (offset stored
//!   after each message is handled, async commit of stored offsets every second); the
//!   ceiling for the in-memory store;
//! - `dedup_redis`, `dedup_postgres`, `dedup_mysql`: the deduplication most teams write by
//!   hand, one poll batch at a time: Redis, a pipelined `SET NX PX` of the batch's keys then
//!   a pipelined `SET` of each result; PostgreSQL, `INSERT … ON CONFLICT DO NOTHING
//!   RETURNING` of the batch's keys then one `UPDATE … FROM unnest` of the results; MySQL or
//!   MariaDB, one multi-row `INSERT IGNORE … RETURNING` of the keys (MariaDB 10.5+; on MySQL,
//!   without `RETURNING`, the keys go in with a per-batch marker and, only when fewer rows
//!   went in than keys, a `SELECT` of the marker's rows says which) then one multi-row
//!   `INSERT … ON DUPLICATE KEY UPDATE` of the results. No leases, no fencing, no crash
//!   safety: a ceiling for idem on that store, not a peer;
//! - `tx_postgres`, `tx_mysql`: the exactly-once loop a team writes by hand on PostgreSQL or
//!   on MySQL (InnoDB): per poll batch, one transaction with one business-row insert per
//!   message (the same statement idem's transactional handler runs) and an upsert of each
//!   partition's next offset. No idempotency records: the ceiling for idem's transactional
//!   mode. One loop (`tx_loop`) over the statements of `support/sql.rs`;
//! - `tx_postgres_records`: `tx_postgres` plus one record per key in the same transaction
//!   (one `INSERT … ON CONFLICT DO NOTHING` of the batch's keys, one `UPDATE` of their
//!   results): the cheapest design that records keys, with no leases, attempts or fencing;
//! - `idem_memory`, `idem_redis`, `idem_postgres`, `idem_mysql` (lease mode),
//!   `idem_postgres_transactional`, `idem_mysql_transactional` (a one-row business insert
//!   per message; a chunk of a poll batch per transaction) and `idem_postgres_one_per_tx`
//!   (the same with `Transactional`'s default batch: one transaction per message, as before
//!   batching).
//!
//! Each iteration reads the same pre-produced topic with a fresh consumer group (so fresh
//! idempotency keys) and counts from the first message to the `n`-th one handled; the
//! group join is not counted. `n` is smaller for slower stores, so every iteration takes
//! about a second or two; each ratio compares loops over the same `n`. On librdkafka's
//! MockCluster always, and on the broker at `IDEM_KAFKA_BROKERS` (tansu) when it is set;
//! the store loops need `IDEM_REDIS_URL`, `IDEM_POSTGRES_URL` and `IDEM_MYSQL_URL`
//! (`scripts/services up`).
//!
//! `cargo bench -p benches --bench kafka`

#[path = "support/one_per_tx.rs"]
mod one_per_tx;
#[path = "support/sql.rs"]
mod sql;
mod support;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, SamplingMode, Throughput, criterion_group};
use futures::FutureExt;
use idem_core::layer::{Around, Call, Layered};
use idem_core::{Backend, Engine, MemoryBackend};
use idem_kafka::IdemConsumer;
use idem_kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use idem_kafka::rdkafka::message::{BorrowedMessage, Message as _};
use idem_kafka::rdkafka::mocking::MockCluster;
use idem_mysql::MySqlBackend;
use idem_postgres::{PgBackend, PgConfig};
use idem_redis::{RedisBackend, RedisConfig};
use redis::aio::ConnectionManager;
use support::{Produce, Timing, config, create_topic, handle, header_key, median, unique};

const PARTITIONS: i32 = 4;
/// Per partition: under MockCluster's retention of about 5 MiB per partition.
const PER_PARTITION: usize = 20_000;
const MESSAGES: usize = PARTITIONS as usize * PER_PARTITION;
const COMMIT_EVERY: Duration = Duration::from_secs(1);
/// The largest poll batch the hand-written loops take, as idem's default `batch_size`.
const BATCH: usize = 500;
const SCHEMA: &str = "idem_kafka_bench";
/// Every Redis key the bench writes starts with this: idem's records (its backend's prefix)
/// and the hand-written loops' keys, so [`Stores::reset`] finds them all.
const REDIS_PREFIX: &str = "idem_kafka_bench:";

async fn produce(brokers: &str, topic: &str) {
    let messages = (0..MESSAGES).map(|i| Produce {
        partition: i32::try_from(i % PARTITIONS as usize).expect("partition"),
        id: format!("pay-{i}"),
        key: None,
        payload: vec![b'x'; 80],
    });
    support::produce(brokers, topic, messages).await;
}

/// A hand-written consumer: manual offset store, async commit every second.
fn stream_consumer(brokers: &str, topic: &str, prefix: &str) -> StreamConsumer {
    let consumer: StreamConsumer = config(brokers, &unique(prefix))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    consumer
}

/// The next poll batch: one message, waited for, then whatever is ready, up to `BATCH`.
async fn poll_batch(consumer: &StreamConsumer) -> Vec<BorrowedMessage<'_>> {
    let mut batch = vec![consumer.recv().await.expect("message")];
    while batch.len() < BATCH {
        match consumer.recv().now_or_never() {
            Some(Ok(m)) => batch.push(m),
            _ => break,
        }
    }
    batch
}

/// The bare loop: `recv`, the handler, `store_offset_from_message`, an async commit every
/// second. Returns the time from the first message to the `n`-th.
async fn bare(brokers: &str, topic: &str, n: usize) -> Duration {
    let consumer = stream_consumer(brokers, topic, "bare");
    let mut first = None;
    let mut last_commit = Instant::now();
    for _ in 0..n {
        let m = consumer.recv().await.expect("message");
        if first.is_none() {
            support::window(true);
        }
        first.get_or_insert_with(Instant::now);
        std::hint::black_box(handle(header_key(&m)));
        consumer.store_offset_from_message(&m).expect("store");
        if last_commit.elapsed() >= COMMIT_EVERY {
            last_commit = Instant::now();
            let _ = consumer.commit_consumer_state(CommitMode::Async);
        }
    }
    let took = first.map_or(Duration::ZERO, |t| t.elapsed());
    support::window(false);
    let _ = consumer.commit_consumer_state(CommitMode::Sync);
    took
}

/// The store side of a hand-written deduplicating loop.
enum Dedup {
    Redis(ConnectionManager),
    Postgres(sql::Postgres),
    MySql(sql::MySql),
}

impl Dedup {
    /// Marks the batch's keys taken; returns which were new.
    async fn mark(&mut self, keys: &[String]) -> Vec<bool> {
        match self {
            Dedup::Redis(conn) => {
                let mut pipe = redis::pipe();
                for key in keys {
                    pipe.cmd("SET")
                        .arg(key)
                        .arg("p")
                        .arg("NX")
                        .arg("PX")
                        .arg(30_000);
                }
                let replies: Vec<Option<String>> = pipe.query_async(conn).await.expect("SET NX");
                replies.iter().map(Option::is_some).collect()
            }
            Dedup::Postgres(pg) => sql::mark(pg, keys).await,
            Dedup::MySql(my) => sql::mark(my, keys).await,
        }
    }

    /// Stores the results of the keys handled.
    async fn store(&mut self, keys: &[String], results: &[Vec<u8>]) {
        if keys.is_empty() {
            return;
        }
        match self {
            Dedup::Redis(conn) => {
                let mut pipe = redis::pipe();
                for (key, r) in keys.iter().zip(results) {
                    pipe.cmd("SET")
                        .arg(key)
                        .arg(r.as_slice())
                        .arg("PX")
                        .arg(86_400_000)
                        .ignore();
                }
                let () = pipe.query_async(conn).await.expect("SET");
            }
            Dedup::Postgres(pg) => sql::answer(pg, keys, results).await,
            Dedup::MySql(my) => sql::answer(my, keys, results).await,
        }
    }
}

/// A hand-written deduplicating loop: per poll batch, mark the keys, handle the new ones,
/// store their results, store the offsets. Returns the time from the first message to the
/// `n`-th.
async fn dedup(brokers: &str, topic: &str, n: usize, mut store: Dedup) -> Duration {
    let consumer = stream_consumer(brokers, topic, "dedup");
    let run = unique(&format!("{REDIS_PREFIX}run"));
    let mut frame = HandLoop::new(&consumer, n);
    let mut fresh = 0;
    while let Some(batch) = frame.next().await {
        let keys = run_keys(&run, &batch);
        let new = store.mark(&keys).await;
        let (mut done, mut results) = (Vec::new(), Vec::new());
        for ((m, key), new) in batch.iter().zip(&keys).zip(new) {
            if new {
                results.push(handle(header_key(m)).to_vec());
                done.push(key.clone());
            }
        }
        fresh += done.len();
        store.store(&done, &results).await;
        frame.done(&batch);
    }
    debug_assert_eq!(fresh, frame.seen, "a fresh run's keys are all new");
    frame.finish()
}

/// The hand-written loop with an in-memory record per key, the cheapest design that keeps
/// one: per message of a poll batch, an insert-if-absent of its key into a `HashMap` (a
/// fresh map per iteration, so fresh keys), the handler for a new key, then its result
/// stored under the key; the batch's offsets stored as in every hand-written loop. No
/// leases, fencing, attempts, payload check or crash safety: the ceiling for idem on its
/// in-memory store. Returns the time from the first message to the `n`-th.
async fn dedup_memory(brokers: &str, topic: &str, n: usize) -> Duration {
    let consumer = stream_consumer(brokers, topic, "dedupmem");
    let records: Mutex<HashMap<Vec<u8>, Option<Bytes>>> = Mutex::new(HashMap::new());
    let mut frame = HandLoop::new(&consumer, n);
    while let Some(batch) = frame.next().await {
        for m in &batch {
            let key = header_key(m).unwrap_or_default();
            let new = match records
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(key.to_vec())
            {
                Entry::Vacant(slot) => {
                    slot.insert(None);
                    true
                }
                Entry::Occupied(_) => false,
            };
            if new {
                let result = handle(Some(key));
                if let Some(slot) = records
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_mut(key)
                {
                    *slot = Some(result);
                }
            }
        }
        frame.done(&batch);
    }
    std::hint::black_box(&records);
    frame.finish()
}

/// The batch's idempotency keys, prefixed by `run` so that every iteration's are fresh.
fn run_keys(run: &str, batch: &[BorrowedMessage<'_>]) -> Vec<String> {
    batch
        .iter()
        .map(|m| {
            let id = header_key(m)
                .map(String::from_utf8_lossy)
                .unwrap_or_default();
            format!("{run}/{id}")
        })
        .collect()
}

/// The frame every hand-written batch loop shares: `next` polls a batch (until `n`
/// messages came), `done` stores the batch's offsets and commits asynchronously every
/// `COMMIT_EVERY`, `finish` commits and returns the time from the first message to the
/// `n`-th.
struct HandLoop<'c> {
    consumer: &'c StreamConsumer,
    n: usize,
    seen: usize,
    first: Option<Instant>,
    last_commit: Instant,
}

impl<'c> HandLoop<'c> {
    fn new(consumer: &'c StreamConsumer, n: usize) -> Self {
        let last_commit = Instant::now();
        HandLoop {
            consumer,
            n,
            seen: 0,
            first: None,
            last_commit,
        }
    }

    async fn next(&mut self) -> Option<Vec<BorrowedMessage<'c>>> {
        if self.seen >= self.n {
            return None;
        }
        let batch = poll_batch(self.consumer).await;
        if self.first.is_none() {
            support::window(true);
        }
        self.first.get_or_insert_with(Instant::now);
        Some(batch)
    }

    fn done(&mut self, batch: &[BorrowedMessage<'c>]) {
        for m in batch {
            self.consumer.store_offset_from_message(m).expect("store");
        }
        self.seen += batch.len();
        if self.last_commit.elapsed() >= COMMIT_EVERY {
            self.last_commit = Instant::now();
            let _ = self.consumer.commit_consumer_state(CommitMode::Async);
        }
    }

    fn finish(self) -> Duration {
        let took = self.first.map_or(Duration::ZERO, |t| t.elapsed());
        support::window(false);
        let _ = self.consumer.commit_consumer_state(CommitMode::Sync);
        took
    }
}

/// The hand-written exactly-once loop on a SQL store: per poll batch, one transaction of
/// the business rows (one insert per message) and the partitions' next offsets, then the
/// offsets stored in Kafka. Returns the time from the first message to the `n`-th.
async fn tx_plain<S: sql::Sql>(brokers: &str, topic: &str, n: usize, store: S) -> Duration {
    tx_loop(brokers, topic, n, store, false).await
}

/// `tx_plain` that also keeps one record per key in the same transaction, the cheapest
/// design with records: per poll batch, one insert-if-absent of the batch's keys returning
/// those inserted (on PostgreSQL `INSERT … ON CONFLICT DO NOTHING RETURNING`), a business
/// insert for each new key, one write of their results (`UPDATE … FROM unnest`), the
/// offsets, one COMMIT. No leases, attempts or fencing: what any transactional design that
/// records keys must at least do, so the ceiling it leaves idem's transactional mode is the
/// cost of the records themselves.
async fn tx_records<S: sql::Sql>(brokers: &str, topic: &str, n: usize, store: S) -> Duration {
    tx_loop(brokers, topic, n, store, true).await
}

async fn tx_loop<S: sql::Sql>(
    brokers: &str,
    topic: &str,
    n: usize,
    store: S,
    records: bool,
) -> Duration {
    let group = unique("tx");
    let run = unique("run");
    let consumer = stream_consumer(brokers, topic, &group);
    let mut frame = HandLoop::new(&consumer, n);
    let mut fresh = 0;
    while let Some(batch) = frame.next().await {
        let mut tx = store.pool().begin().await.expect("begin");
        let mut next: std::collections::BTreeMap<i32, i64> = Default::default();
        let keys = run_keys(&run, &batch);
        let new: std::collections::HashSet<String> = if records {
            store.mark(&mut *tx, &keys).await
        } else {
            keys.iter().cloned().collect()
        };
        let (mut done, mut results) = (Vec::new(), Vec::new());
        for (m, key) in batch.iter().zip(&keys) {
            next.insert(m.partition(), m.offset() + 1);
            if !new.contains(key) {
                continue;
            }
            S::ledger(&mut *tx, key).await.expect("insert");
            results.push(handle(header_key(m)).to_vec());
            done.push(key.clone());
        }
        fresh += done.len();
        if records && !done.is_empty() {
            store.answer(&mut *tx, &done, &results).await;
        }
        for (part, next) in next {
            store.offset(&mut *tx, &group, topic, part, next).await;
        }
        tx.commit().await.expect("commit");
        frame.done(&batch);
    }
    debug_assert_eq!(fresh, frame.seen, "a fresh run's keys are all new");
    frame.finish()
}

/// Which idem loop to run.
#[derive(Clone)]
enum Idem {
    Lease(Arc<dyn Backend>),
    Transactional(PgBackend),
    OnePerTx(PgBackend),
    MySqlTransactional(MySqlBackend),
}

/// The idem loop (a fresh group, so fresh keys). Returns the time from the first claim to
/// the `n`-th message settled.
async fn idem(brokers: &str, topic: &str, n: usize, mode: Idem) -> Duration {
    let timing = Arc::new(Timing::new(n));
    let stop = tokio_util::sync::CancellationToken::new();
    let signal = stop.clone();
    let builder = IdemConsumer::builder(config(brokers, &unique("idem")))
        .topics([topic])
        .commit_interval(COMMIT_EVERY)
        .probe(timing.clone())
        .shutdown(async move { signal.cancelled().await });
    let builder = match mode {
        Idem::Lease(backend) => builder
            .engine(Engine::builder(backend).build().expect("engine"))
            .handler(|msg, _| async move {
                Ok(handle(msg.idempotency_key().map(|k| k.id().as_bytes())))
            }),
        Idem::Transactional(pg) => builder.transactional(pg, ledger_row::<sql::Postgres>),
        Idem::OnePerTx(pg) => {
            builder.transactional(one_per_tx::OnePerTx(pg), ledger_row::<sql::Postgres>)
        }
        Idem::MySqlTransactional(my) => builder.transactional(my, ledger_row::<sql::MySql>),
    };
    let consumer = builder.build().expect("idem consumer");
    let task = tokio::spawn(consumer.run());
    timing.done.notified().await;
    let end = Instant::now();
    support::window(false);
    let first = timing.first(end);
    stop.cancel();
    task.await.expect("task").expect("run");
    end - first
}

/// The transactional handler: one business row per message, the hand-written
/// transaction loop's insert.
fn ledger_row<'t, S: sql::Sql>(
    msg: idem_kafka::Message,
    tx: &'t mut sqlx::Transaction<'static, S::Db>,
    _lease: idem_core::Lease,
) -> futures::future::BoxFuture<'t, Result<Bytes, idem_core::HandlerError>> {
    async move {
        let id = msg
            .idempotency_key()
            .map(|k| k.id().to_owned())
            .unwrap_or_default();
        S::ledger(&mut **tx, &id)
            .await
            .map_err(idem_core::HandlerError::retry)?;
        Ok(handle(Some(id.as_bytes())))
    }
    .boxed()
}

/// One iteration of a loop, for the summary.
struct Rate {
    /// `mockcluster` or `tansu`.
    broker: String,
    /// The loop.
    which: &'static str,
    /// Messages the iteration counted.
    n: usize,
    /// Messages per second.
    rate: f64,
}

/// Every iteration of each loop on each broker, for the summary.
static RATES: Mutex<Vec<Rate>> = Mutex::new(Vec::new());

/// Runs `run` `iters` times, each after `reset` (not timed), noting each rate, and returns
/// the total time measured.
fn timed<F, Fut>(
    rt: &tokio::runtime::Runtime,
    iters: u64,
    (broker, which, n): (&str, &'static str, usize),
    reset: &Stores,
    run: F,
) -> Duration
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    rt.block_on(async {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            reset.reset().await;
            let took = run().await;
            let rate = n as f64 / took.as_secs_f64().max(1e-9);
            RATES.lock().unwrap_or_else(|e| e.into_inner()).push(Rate {
                broker: broker.to_owned(),
                which,
                n,
                rate,
            });
            total += took;
        }
        total
    })
}

/// The durable stores, when their services are configured.
#[derive(Clone)]
struct Stores {
    redis: Option<(RedisBackend, ConnectionManager)>,
    postgres: Option<PgBackend>,
    mysql: Option<(MySqlBackend, sql::MySql)>,
}

impl Stores {
    /// Empties what earlier iterations left in the stores: the bench's Redis keys and its
    /// PostgreSQL and MySQL tables. Each iteration then starts on the same empty store;
    /// left to pile up (several million keys over a run), a growing Redis keyspace resized
    /// its tables under whichever loop was running, and the hand-written Redis loop's
    /// medians moved by 2x from run to run.
    async fn reset(&self) {
        if let Some((_, raw)) = &self.redis {
            support::clear_redis(raw, REDIS_PREFIX).await;
        }
        if let Some(pg) = &self.postgres {
            let tables = [
                "idem_records",
                "idem_offsets",
                "dedup",
                "ledger",
                "hand_offsets",
            ]
            .map(|t| format!("{SCHEMA}.{t}"))
            .join(", ");
            sqlx::query(sqlx::AssertSqlSafe(format!("TRUNCATE {tables}")))
                .execute(pg.pool())
                .await
                .expect("TRUNCATE");
        }
        if let Some((_, my)) = &self.mysql {
            my.reset().await;
        }
    }
}

fn env(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ => {
            println!("{var} is not set: its loops are skipped (eval \"$(scripts/services up)\")");
            None
        }
    }
}

async fn stores() -> Stores {
    let redis = match env("IDEM_REDIS_URL") {
        None => None,
        Some(url) => {
            let backend = RedisBackend::connect(RedisConfig::new(&url).with_prefix(REDIS_PREFIX))
                .await
                .expect("connect the Redis backend");
            let client = redis::Client::open(url.as_str()).expect("redis url");
            let raw = ConnectionManager::new(client).await.expect("connect Redis");
            Some((backend, raw))
        }
    };
    let postgres = match env("IDEM_POSTGRES_URL") {
        None => None,
        Some(url) => {
            let config = PgConfig::new(url)
                .with_schema(SCHEMA)
                .with_max_connections(16);
            let backend = PgBackend::connect(config)
                .await
                .expect("connect PostgreSQL");
            let pool = backend.pool().clone();
            for stmt in [
                format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"),
                format!("CREATE SCHEMA {SCHEMA}"),
            ] {
                sqlx::query(sqlx::AssertSqlSafe(stmt))
                    .execute(&pool)
                    .await
                    .expect("reset schema");
            }
            backend.migrate().await.expect("migrate");
            for stmt in [
                format!("CREATE TABLE {SCHEMA}.dedup (k text PRIMARY KEY, v bytea)"),
                format!("CREATE TABLE {SCHEMA}.ledger (k text NOT NULL)"),
                format!(
                    "CREATE TABLE {SCHEMA}.hand_offsets (grp text, topic text, part int, \
                     next bigint, PRIMARY KEY (grp, topic, part))"
                ),
            ] {
                sqlx::query(sqlx::AssertSqlSafe(stmt))
                    .execute(&pool)
                    .await
                    .expect("create bench tables");
            }
            Some(backend)
        }
    };
    let mysql = match env("IDEM_MYSQL_URL") {
        None => None,
        Some(url) => Some(sql::MySql::connect(&url).await),
    };
    Stores {
        redis,
        postgres,
        mysql,
    }
}

fn on_broker(
    c: &mut Criterion,
    rt: &tokio::runtime::Runtime,
    stores: &Stores,
    name: &str,
    brokers: &str,
    topic: &str,
) {
    rt.block_on(produce(brokers, topic));
    let mut g = c.benchmark_group(format!("kafka_{name}"));
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    let mut case =
        |which: &'static str,
         n: usize,
         run: &dyn Fn() -> futures::future::BoxFuture<'static, Duration>| {
            g.throughput(Throughput::Elements(n as u64));
            g.bench_function(which, |b| {
                b.iter_custom(|iters| timed(rt, iters, (name, which, n), stores, run))
            });
        };
    let (b, t) = (brokers.to_owned(), topic.to_owned());
    let at = move || (b.clone(), t.clone());
    let go = at.clone();
    case("bare", MESSAGES, &move || {
        let (b, t) = go();
        async move { bare(&b, &t, MESSAGES).await }.boxed()
    });
    let go = at.clone();
    case("dedup_memory", MESSAGES, &move || {
        let (b, t) = go();
        async move { dedup_memory(&b, &t, MESSAGES).await }.boxed()
    });
    let go = at.clone();
    case("idem_memory", MESSAGES, &move || {
        let (b, t) = go();
        let store: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
        async move { idem(&b, &t, MESSAGES, Idem::Lease(store)).await }.boxed()
    });
    if let Some((backend, raw)) = &stores.redis {
        let n = MESSAGES / 2;
        let (go, raw) = (at.clone(), raw.clone());
        case("dedup_redis", n, &move || {
            let ((b, t), raw) = (go(), raw.clone());
            async move { dedup(&b, &t, n, Dedup::Redis(raw)).await }.boxed()
        });
        let (go, backend) = (at.clone(), backend.clone());
        case("idem_redis", n, &move || {
            let ((b, t), store) = (go(), Arc::new(backend.clone()));
            async move { idem(&b, &t, n, Idem::Lease(store)).await }.boxed()
        });
    }
    if let Some(pg) = &stores.postgres {
        let n = MESSAGES / 5;
        let (go, pool) = (at.clone(), sql::Postgres(pg.pool().clone()));
        case("dedup_postgres", n, &move || {
            let ((b, t), pool) = (go(), pool.clone());
            async move { dedup(&b, &t, n, Dedup::Postgres(pool)).await }.boxed()
        });
        let (go, backend) = (at.clone(), pg.clone());
        case("idem_postgres", n, &move || {
            let ((b, t), store) = (go(), Arc::new(backend.clone()));
            async move { idem(&b, &t, n, Idem::Lease(store)).await }.boxed()
        });
        let (go, pool) = (at.clone(), sql::Postgres(pg.pool().clone()));
        case("tx_postgres", n, &move || {
            let ((b, t), pool) = (go(), pool.clone());
            async move { tx_plain(&b, &t, n, pool).await }.boxed()
        });
        let (go, pool) = (at.clone(), sql::Postgres(pg.pool().clone()));
        case("tx_postgres_records", n, &move || {
            let ((b, t), pool) = (go(), pool.clone());
            async move { tx_records(&b, &t, n, pool).await }.boxed()
        });
        let (go, backend) = (at.clone(), pg.clone());
        case("idem_postgres_transactional", n, &move || {
            let ((b, t), pg) = (go(), backend.clone());
            async move { idem(&b, &t, n, Idem::Transactional(pg)).await }.boxed()
        });
        let n = MESSAGES / 40;
        let (go, backend) = (at.clone(), pg.clone());
        case("idem_postgres_one_per_tx", n, &move || {
            let ((b, t), pg) = (go(), backend.clone());
            async move { idem(&b, &t, n, Idem::OnePerTx(pg)).await }.boxed()
        });
    }
    if let Some((backend, my)) = &stores.mysql {
        let n = MESSAGES / 5;
        let (go, hand) = (at.clone(), my.clone());
        case("dedup_mysql", n, &move || {
            let ((b, t), my) = (go(), hand.clone());
            async move { dedup(&b, &t, n, Dedup::MySql(my)).await }.boxed()
        });
        let (go, mysql) = (at.clone(), backend.clone());
        case("idem_mysql", n, &move || {
            let ((b, t), store) = (go(), Arc::new(mysql.clone()));
            async move { idem(&b, &t, n, Idem::Lease(store)).await }.boxed()
        });
        // The transaction loops run about a tenth as fast as `dedup_mysql` (a business
        // insert per message, one COMMIT a batch or a chunk): half the messages keep an
        // iteration near two seconds.
        let n = MESSAGES / 10;
        let (go, hand) = (at.clone(), my.clone());
        case("tx_mysql", n, &move || {
            let ((b, t), my) = (go(), hand.clone());
            async move { tx_plain(&b, &t, n, my).await }.boxed()
        });
        let (go, mysql) = (at.clone(), backend.clone());
        case("idem_mysql_transactional", n, &move || {
            let ((b, t), my) = (go(), mysql.clone());
            async move { idem(&b, &t, n, Idem::MySqlTransactional(my)).await }.boxed()
        });
    }
    g.finish();
}

/// The summary's loops, in order: what each is, in a few words.
const LOOPS: [(&str, &str); 15] = [
    ("bare", "rdkafka loop, no deduplication"),
    ("dedup_memory", "by hand: HashMap insert, then the result"),
    (
        "dedup_redis",
        "by hand: Redis `SET NX PX`, then `SET PX`, per poll batch",
    ),
    (
        "dedup_postgres",
        "by hand: PostgreSQL `INSERT … ON CONFLICT DO NOTHING`, then `UPDATE`, per poll batch",
    ),
    ("idem_memory", "idem, in-memory store"),
    ("idem_redis", "idem, Redis"),
    ("idem_postgres", "idem, PostgreSQL (lease mode)"),
    (
        "tx_postgres",
        "by hand: one PostgreSQL transaction per poll batch, rows and offsets",
    ),
    ("tx_postgres_records", "`tx_postgres` and a record per key"),
    (
        "idem_postgres_transactional",
        "idem, PostgreSQL transactional mode",
    ),
    (
        "idem_postgres_one_per_tx",
        "idem, transactional, one message per transaction",
    ),
    (
        "dedup_mysql",
        "by hand: MySQL `INSERT IGNORE` (`RETURNING` on MariaDB), then `INSERT … ON DUPLICATE \
         KEY UPDATE`, per poll batch",
    ),
    ("idem_mysql", "idem, MySQL (lease mode)"),
    (
        "tx_mysql",
        "by hand: one MySQL transaction per poll batch, rows and offsets",
    ),
    ("idem_mysql_transactional", "idem, MySQL transactional mode"),
];

/// The summary's ratios: a loop over its ceiling.
const RATIOS: [(&str, &str); 13] = [
    ("idem_memory", "dedup_memory"),
    ("idem_redis", "dedup_redis"),
    ("idem_postgres", "dedup_postgres"),
    ("idem_mysql", "dedup_mysql"),
    ("idem_memory", "bare"),
    ("idem_redis", "bare"),
    ("idem_postgres", "bare"),
    ("idem_mysql", "bare"),
    ("dedup_memory", "bare"),
    ("tx_postgres_records", "tx_postgres"),
    ("idem_postgres_transactional", "tx_postgres"),
    ("idem_postgres_one_per_tx", "tx_postgres"),
    ("idem_mysql_transactional", "tx_mysql"),
];

/// Prints one Markdown table of every loop's median on each broker (MockCluster, tansu)
/// and the ratios of idem to its ceilings, after a line saying how, when, where and on
/// what it was measured: ready to paste into a README.
fn summary() {
    let rates = RATES.lock().unwrap_or_else(|e| e.into_inner());
    if rates.is_empty() {
        return;
    }
    let brokers = [("mockcluster", "MockCluster"), ("tansu", "tansu")];
    let brokers: Vec<_> = brokers
        .into_iter()
        .filter(|(b, _)| rates.iter().any(|r| r.broker == *b))
        .collect();
    let of = |broker: &str, which: &str| {
        median(
            rates
                .iter()
                .filter(|r| r.broker == broker && r.which == which)
                .map(|r| r.rate)
                .collect(),
        )
    };
    let cells = |value: &dyn Fn(&str) -> Option<String>| -> String {
        brokers
            .iter()
            .map(|(b, _)| value(b).unwrap_or_else(|| "–".into()))
            .collect::<Vec<_>>()
            .join(" | ")
    };
    println!("\n{}\n", provenance());
    let header: Vec<String> = brokers
        .iter()
        .map(|(_, name)| format!("{name} msg/s"))
        .collect();
    println!("| loop | what | {} |", header.join(" | "));
    println!("|:---|:---|{}|", vec!["---:"; brokers.len()].join("|"));
    for (which, what) in LOOPS {
        if brokers.iter().all(|(b, _)| of(b, which) == 0.0) {
            continue;
        }
        let rate = |b: &str| {
            Some(of(b, which))
                .filter(|r| *r > 0.0)
                .map(|r| format!("{r:.0}"))
        };
        println!("| `{which}` | {what} | {} |", cells(&rate));
    }
    for (which, ceiling) in RATIOS {
        let ratio = |b: &str| {
            let (a, c) = (of(b, which), of(b, ceiling));
            (a > 0.0 && c > 0.0).then(|| format!("{:.2}", a / c))
        };
        if brokers.iter().all(|(b, _)| ratio(b).is_none()) {
            continue;
        }
        let what = if ceiling == "bare" {
            "over the loop with no deduplication"
        } else {
            "over the same store by hand"
        };
        println!("| `{which}` ÷ `{ceiling}` | {what} | {} |", cells(&ratio));
    }
    let mut sizes: Vec<(usize, Vec<&str>)> = Vec::new();
    for (which, _) in LOOPS {
        if let Some(n) = rates.iter().find(|r| r.which == which).map(|r| r.n) {
            match sizes.iter_mut().find(|(m, _)| *m == n) {
                Some((_, loops)) => loops.push(which),
                None => sizes.push((n, vec![which])),
            }
        }
    }
    let sizes: Vec<String> = sizes
        .iter()
        .map(|(n, loops)| format!("{n} for {}", loops.join(", ")))
        .collect();
    let counts: Vec<usize> = brokers
        .iter()
        .flat_map(|(b, _)| LOOPS.iter().map(move |(w, _)| (*b, *w)))
        .map(|(b, w)| {
            rates
                .iter()
                .filter(|r| r.broker == b && r.which == w)
                .count()
        })
        .filter(|&k| k > 0)
        .collect();
    let (fewest, most) = (
        counts.iter().min().copied().unwrap_or(0),
        counts.iter().max().copied().unwrap_or(0),
    );
    let iterations = if fewest == most {
        format!("{most}")
    } else {
        format!("{fewest}–{most}")
    };
    println!(
        "\nmsg/s: the median of each loop's iterations ({iterations} each); an iteration reads n \
         messages with a fresh consumer group, from the first message to the n-th handled \
         (n = {}). {} partitions, poll batches of up to {BATCH}, offsets committed every {:?}.",
        sizes.join("; "),
        PARTITIONS,
        COMMIT_EVERY,
    );
}

/// The line above the summary: the command, the date, the commit, the cores and the brokers.
fn provenance() -> String {
    let brokers = match std::env::var("IDEM_KAFKA_BROKERS") {
        Ok(b) if !b.trim().is_empty() => "MockCluster and tansu at IDEM_KAFKA_BROKERS",
        _ => "MockCluster only, IDEM_KAFKA_BROKERS unset",
    };
    support::provenance("kafka", brokers)
}

fn kafka(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let stores = rt.block_on(stores());
    let cluster = MockCluster::new(1).expect("mock cluster");
    let topic = unique("bench");
    cluster.create_topic(&topic, PARTITIONS, 1).expect("topic");
    cluster
        .create_topic(&format!("{topic}.dlq"), 1, 1)
        .expect("dead-letter topic");
    on_broker(
        c,
        &rt,
        &stores,
        "mockcluster",
        &cluster.bootstrap_servers(),
        &topic,
    );

    if let Some(brokers) = env("IDEM_KAFKA_BROKERS") {
        let topic = unique("bench");
        rt.block_on(create_topic(&brokers, &topic, PARTITIONS));
        on_broker(c, &rt, &stores, "tansu", &brokers, &topic);
    }
    summary();
}

/// One loop, once, on a MockCluster, without Criterion: `IDEM_KAFKA_PROFILE=bare`,
/// `dedup_memory`, `idem_memory`, `dedup_redis`, `idem_redis`, `dedup_postgres`,
/// `idem_postgres`, `dedup_mysql` or `idem_mysql` (and `IDEM_KAFKA_PROFILE_N` messages, default all), for a profiler or
/// to see where a store loop's time goes. Under `valgrind --tool=callgrind
/// --instr-atstart=no`, with `IDEM_CALLGRIND=1`, collection runs from the first message
/// to the `n`-th only ([`support::window`]; the counts are in the dump, the output file
/// with `.1` appended), so the counts divided by `n` are the cost per message. Under
/// `perf record --control=fifo:FIFO -D -1` with `IDEM_PERF_CTL=FIFO` (a `mkfifo`), perf
/// samples in those windows only. It also prints the CPU time of the process's threads in
/// that window, per message. An idem loop
/// on a store also prints, per store operation, its calls, items per call and time per
/// call ([`Tally`]).
fn profile(which: &str) {
    let n = std::env::var("IDEM_KAFKA_PROFILE_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(MESSAGES)
        .min(MESSAGES);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let cluster = MockCluster::new(1).expect("mock cluster");
    let topic = unique("bench");
    cluster.create_topic(&topic, PARTITIONS, 1).expect("topic");
    cluster
        .create_topic(&format!("{topic}.dlq"), 1, 1)
        .expect("dead-letter topic");
    let brokers = cluster.bootstrap_servers();
    rt.block_on(produce(&brokers, &topic));
    let stores = if ["_redis", "_postgres", "_mysql"]
        .iter()
        .any(|s| which.ends_with(s))
    {
        let stores = rt.block_on(stores());
        rt.block_on(stores.reset());
        stores
    } else {
        Stores {
            redis: None,
            postgres: None,
            mysql: None,
        }
    };
    let runs: usize = std::env::var("IDEM_KAFKA_PROFILE_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for run in 0..runs {
        if run > 0 {
            rt.block_on(stores.reset());
        }
        profile_once(which, n, &rt, &brokers, &topic, &stores);
    }
}

/// One run of [`profile`]'s loop, printed.
fn profile_once(
    which: &str,
    n: usize,
    rt: &tokio::runtime::Runtime,
    brokers: &str,
    topic: &str,
    stores: &Stores,
) {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    let tally = Tally::default();
    let took = rt.block_on(async {
        match which {
            "bare" => bare(&brokers, &topic, n).await,
            "dedup_memory" => dedup_memory(&brokers, &topic, n).await,
            "idem_memory" => {
                let store = tally.wrap(MemoryBackend::new());
                idem(&brokers, &topic, n, Idem::Lease(store)).await
            }
            "dedup_redis" | "idem_redis" => {
                let (backend, raw) = stores.redis.clone().expect("IDEM_REDIS_URL");
                if which == "dedup_redis" {
                    dedup(&brokers, &topic, n, Dedup::Redis(raw)).await
                } else {
                    let store = tally.wrap(backend);
                    idem(&brokers, &topic, n, Idem::Lease(store)).await
                }
            }
            "dedup_postgres" | "idem_postgres" => {
                let pg = stores.postgres.clone().expect("IDEM_POSTGRES_URL");
                if which == "dedup_postgres" {
                    let pool = sql::Postgres(pg.pool().clone());
                    dedup(&brokers, &topic, n, Dedup::Postgres(pool)).await
                } else {
                    let store = tally.wrap(pg);
                    idem(&brokers, &topic, n, Idem::Lease(store)).await
                }
            }
            "dedup_mysql" | "idem_mysql" => {
                let (backend, my) = stores.mysql.clone().expect("IDEM_MYSQL_URL");
                if which == "dedup_mysql" {
                    dedup(&brokers, &topic, n, Dedup::MySql(my)).await
                } else {
                    let store = tally.wrap(backend);
                    idem(&brokers, &topic, n, Idem::Lease(store)).await
                }
            }
            other => panic!("IDEM_KAFKA_PROFILE={other}: see `profile` in benches/kafka.rs"),
        }
    });
    println!(
        "{which}: {n} messages in {took:?}, {:.0} msg/s, {:.0} ns of CPU per message",
        n as f64 / took.as_secs_f64().max(1e-9),
        support::window_cpu() as f64 / n as f64
    );
    for (thread, ns) in support::window_threads() {
        if ns > 0 {
            println!(
                "  {thread}: {:.0} ns of CPU per message",
                ns as f64 / n as f64
            );
        }
    }
    tally.print(n);
}

/// Per store operation (by name): calls, items and the time the calls took, summed.
#[derive(Clone, Default)]
struct Tally(Arc<Mutex<HashMap<&'static str, Sums>>>);

/// Calls, items and time.
type Sums = (u64, u64, Duration);

impl Tally {
    fn wrap<B: Backend + 'static>(&self, store: B) -> Arc<dyn Backend> {
        Arc::new(Layered::new(store, self.clone()))
    }

    fn print(&self, messages: usize) {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut ops: Vec<_> = map.iter().collect();
        ops.sort();
        for (op, (calls, items, time)) in ops {
            println!(
                "  {op}: {calls} calls, {:.1} items per call, {:.0} µs per call, \
                 {:.2} calls per message",
                *items as f64 / *calls as f64,
                time.as_secs_f64() * 1e6 / *calls as f64,
                *calls as f64 / messages as f64
            );
        }
    }
}

impl Around for Tally {
    fn around<'a, T: Send + 'a>(
        &'a self,
        call: Call<'a>,
        next: futures::future::BoxFuture<'a, idem_core::Result<T>>,
    ) -> futures::future::BoxFuture<'a, idem_core::Result<T>> {
        async move {
            let began = Instant::now();
            let answer = next.await;
            let took = began.elapsed();
            let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let entry = map.entry(call.op.name()).or_default();
            *entry = (entry.0 + 1, entry.1 + call.items as u64, entry.2 + took);
            answer
        }
        .boxed()
    }
}

criterion_group!(benches, kafka);

fn main() {
    if let Ok(which) = std::env::var("IDEM_KAFKA_PROFILE") {
        return profile(&which);
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
