//! Network faults between the consumer and its store, on the real broker (tansu,
//! `IDEM_KAFKA_BROKERS`): the store is reached through a TCP proxy (`idem_conformance::proxy`) that
//! the test switches while payments flow. Four waves of payments (1,000, every fifth sent
//! twice, the copy on another partition, so that a lapsed lease can be taken over by the
//! copy), each wave met by a fault once the consumer has started on it:
//!
//! 1. a latency window: 800 ms added to each chunk each way (a store call takes 1.6 s, above
//!    the heartbeat, a third of the 2 s lease) for 3 s, with every connection reset in the
//!    middle of it, when calls are in flight in both directions;
//! 2. every connection reset again, mid-run, without latency;
//! 3. a 5 s blackhole: nothing forwarded, both ways, past the store's timeout.
//!
//! Each payment's side effect is a row of a PostgreSQL `ledger` table (no uniqueness; the
//! `IDEM_POSTGRES_URL` server) with the lease's token and claim kind. In lease mode the
//! store is Redis (`IDEM_REDIS_URL`) through the proxy and the row is written straight to
//! PostgreSQL; in transactional mode PostgreSQL itself is the store, through the proxy,
//! and the row is written in the handler's transaction. Checked at the end: every payment
//! in the ledger; in transactional mode each exactly once; in lease mode every later row
//! of a payment under a higher token than the one before, from a takeover; the group's
//! committed offsets at the end of every partition. Each test prints one line of figures.
//! `the_proxy_delays_stalls_and_resets` checks the proxy's switches on an echo server.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::faults::{self, Counters};
use common::ledger::{self, payment};
use common::{Out, Recorder};
use futures::FutureExt;
use idem_conformance::proxy::{self, Faults, Proxy};
use idem_core::{Backend, Context, Engine, HandlerError};
use idem_kafka::{ConsumerBuilder, IdemConsumer, Message};
use idem_postgres::{PgBackend, PgConfig};
use idem_redis::{RedisBackend, RedisConfig};

const PAYMENTS: usize = 1000;
/// Every fifth payment is sent twice: 200 copies.
const DUPLICATE_EVERY: usize = 5;
const PARTITIONS: i32 = 4;
const WAVES: usize = 4;
const LEASE: Duration = Duration::from_secs(2);
/// 800 ms added to each chunk each way (a round trip of 1.6 s, past the heartbeat, a third
/// of the lease, and within the Redis client's 2 s timeout) for 3 s; a 5 s blackhole.
const FAULTS: Faults = Faults::new()
    .with_latency(Duration::from_millis(800))
    .with_latency_for(Duration::from_secs(3))
    .with_blackhole_for(Duration::from_secs(5));
/// Every fiftieth payment's handler holds its lease 1 s after its effect, so that
/// heartbeats are in flight when faults hit.
const SLOW_EVERY: usize = 50;
const SLOW: Duration = Duration::from_secs(1);
/// PostgreSQL's statement and connect timeouts in transactional mode: above the latency's
/// round trip, below the blackhole.
const PG_TIMEOUT: Duration = Duration::from_secs(3);
/// The most any one wait of the test may take.
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn network_faults_redis_lease() {
    scenario(Mode::Lease, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn network_faults_redis_lease_in_flight_8() {
    scenario(Mode::Lease, 8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn network_faults_postgres_transactional() {
    scenario(Mode::Transactional, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn network_faults_postgres_transactional_in_flight_8() {
    scenario(Mode::Transactional, 8).await;
}

/// The proxy itself, over an echo server: each switch does what it says.
#[tokio::test]
async fn the_proxy_delays_stalls_and_resets() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let upstream = echo.local_addr().expect("address").to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = echo.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let proxy = Proxy::start(&upstream).await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    let mut buf = [0u8; 1];
    let round_trip = async |conn: &mut tokio::net::TcpStream, buf: &mut [u8; 1]| {
        let at = Instant::now();
        conn.write_all(b"x").await.expect("write");
        conn.read_exact(buf).await.expect("read");
        at.elapsed()
    };
    assert!(round_trip(&mut conn, &mut buf).await < Duration::from_millis(250));

    proxy.latency(Duration::from_millis(200));
    let slow = round_trip(&mut conn, &mut buf).await;
    assert!(
        slow >= Duration::from_millis(400),
        "{slow:?}: both ways delayed"
    );
    proxy.latency(Duration::ZERO);

    proxy.blackhole(true);
    conn.write_all(b"y").await.expect("write");
    let stalled = tokio::time::timeout(Duration::from_millis(300), conn.read_exact(&mut buf));
    assert!(
        stalled.await.is_err(),
        "nothing comes back through a blackhole"
    );
    proxy.blackhole(false);
    conn.read_exact(&mut buf)
        .await
        .expect("held back, then delivered");
    assert_eq!(&buf, b"y");

    assert_eq!((proxy.accepted(), proxy.open()), (1, 1));
    assert_eq!(proxy.reset(), 1);
    let read = conn.read(&mut buf).await;
    assert!(
        read.as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "{read:?}: cut with a reset"
    );
    let mut again = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    assert!(round_trip(&mut again, &mut buf).await < Duration::from_millis(250));
    assert_eq!((proxy.accepted(), proxy.open()), (2, 1));
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Redis through the proxy; effects straight to PostgreSQL.
    Lease,
    /// PostgreSQL through the proxy, effects in its transactions.
    Transactional,
}

/// Handlers running now, by payment: a second handler of a key that is running already is
/// an overlap.
#[derive(Default)]
struct Running {
    keys: Mutex<HashMap<String, u32>>,
    overlaps: Mutex<u32>,
}

/// A handler counted in [`Running`] until dropped.
struct Entered {
    running: Arc<Running>,
    id: String,
}

impl Running {
    fn enter(self: &Arc<Self>, id: &str) -> Entered {
        let mut keys = self.keys.lock().expect("lock");
        let n = keys.entry(id.to_owned()).or_default();
        if *n > 0 {
            *self.overlaps.lock().expect("lock") += 1;
        }
        *n += 1;
        Entered {
            running: self.clone(),
            id: id.to_owned(),
        }
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        let mut keys = self.running.keys.lock().expect("lock");
        if let Some(n) = keys.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                keys.remove(&self.id);
            }
        }
    }
}

fn is_slow(id: &str) -> bool {
    id.strip_prefix("pay-")
        .and_then(|n| n.parse::<usize>().ok())
        .is_some_and(|n| n % SLOW_EVERY == 0)
}

/// What a run saw, printed in one line: the fault tests' figures, and handlers of one key
/// that ran at once.
#[derive(Debug, Default)]
struct Figures {
    all: faults::Figures,
    overlaps: u32,
}

faults::extends_figures!(Figures);

async fn scenario(mode: Mode, in_flight: usize) {
    let started = Instant::now();
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let store_url = idem_conformance::service_env(match mode {
        Mode::Lease => "IDEM_REDIS_URL",
        Mode::Transactional => "IDEM_POSTGRES_URL",
    });
    let (direct, ledger) = common::postgres().await;
    common::install_metrics();
    common::log_from_env();
    let topic = common::unique("netfault");
    let group = common::unique("netfault-group");
    let dlq = format!("{topic}.dlq");
    common::create_topics(&brokers, &[(&topic, PARTITIONS), (&dlq, 1)]).await;

    let running = Arc::new(Running::default());
    let insert =
        format!("INSERT INTO {ledger} (payment, token, instance, kind) VALUES ($1, $2, 0, $3)");
    let builder = IdemConsumer::builder(common::consumer_config(&brokers))
        .topics([topic.as_str()])
        .group(group.as_str())
        .batch_size(50)
        .in_flight(in_flight)
        .commit_interval(Duration::from_millis(200))
        .revoke_timeout(Duration::from_secs(5))
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(500));
    let (proxy, builder, label) = match mode {
        Mode::Lease => {
            let (proxy, b) =
                lease_mode(builder, &store_url, &direct, insert, running.clone()).await;
            (proxy, b, "Redis, lease mode")
        }
        Mode::Transactional => {
            let (proxy, b) =
                transactional_mode(builder, &store_url, &direct, insert, running.clone()).await;
            (proxy, b, "PostgreSQL, transactional mode")
        }
    };
    let label = format!("{label}, in_flight {in_flight}");

    let recorder = Recorder::new();
    let consumer = common::start(builder, &recorder);
    let outs = ledger::payments(PAYMENTS, DUPLICATE_EVERY, PARTITIONS);
    let waves: Vec<&[Out]> = outs.chunks(outs.len().div_ceil(WAVES)).collect();
    let mut ends = vec![0i64; PARTITIONS as usize];
    let mut produced = 0;
    let mut figures = Figures::default();
    let mut last_fault_end = Instant::now();
    for (n, wave) in waves.iter().enumerate() {
        for (p, o) in common::produce(&brokers, &topic, wave).await {
            let end = &mut ends[usize::try_from(p).expect("partition")];
            *end = (*end).max(o + 1);
        }
        // The fault comes once the consumer has started on the wave.
        recorder.wait_settled(produced + 1, WAIT).await;
        produced += wave.len();
        figures.faults.extend(FAULTS.inject(n, &proxy).await);
        last_fault_end = Instant::now();
        recorder.wait_settled(produced, WAIT).await;
        if n > 0 {
            figures
                .recovered
                .push(last_fault_end.elapsed().as_secs_f64());
        }
    }

    // Done once every payment is in the ledger and the committed offsets reach the end;
    // neither signals, so both are polled.
    let deadline = Instant::now() + WAIT;
    loop {
        let applied = common::ledger_counts(&direct, &ledger).await;
        let at = committed(&brokers, &group, &topic).await;
        if applied.len() == PAYMENTS && at == ends {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{label}: not done in {WAIT:?}: {} of {PAYMENTS} payments in the ledger, committed \
             {at:?}, end {ends:?}",
            applied.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    figures.committed_after_last = last_fault_end.elapsed().as_secs_f64();
    consumer.stop().await;
    figures.connections = proxy.accepted();
    figures.counters = Counters::read(&topic);
    figures.overlaps = *running.overlaps.lock().expect("lock");

    let transactional = mode == Mode::Transactional;
    let tally = ledger::check_run(
        &direct,
        &ledger,
        &group,
        &topic,
        &ends,
        PAYMENTS,
        transactional,
        &label,
    )
    .await;
    (figures.effects, figures.doubles) = (tally.effects, tally.doubles);
    figures.takeovers = tally.takeovers;
    figures.seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "netfault ({label}): faults [{}]; {} effects, {} doubles, {} effects under a takeover, {} \
         overlapping handlers; {}; settled all {} s after each fault, committed to the end \
         {:.1} s after the last; {} proxied connections; {:.1} s",
        figures.faults.join(", "),
        figures.effects,
        figures.doubles,
        figures.takeovers,
        figures.overlaps,
        figures.counters,
        faults::seconds(&figures.recovered),
        figures.committed_after_last,
        figures.connections,
        figures.seconds
    );
    // A row of `scripts/faults`' table.
    let scenario = format!(
        "store network faults ({}), {label}",
        figures.faults.join(", ")
    );
    eprintln!("{}", figures.row(&scenario, PAYMENTS));
    common::drop_schema(&direct).await;
}

/// Redis at `url` through a proxy as the store, and a handler that writes its effect straight to
/// PostgreSQL with `insert`, before it returns (a double effect would show).
async fn lease_mode(
    builder: ConsumerBuilder,
    url: &str,
    direct: &PgBackend,
    insert: String,
    running: Arc<Running>,
) -> (Proxy, ConsumerBuilder) {
    let proxy = Proxy::start(&proxy::split_url(url, 6379).1).await;
    let config = RedisConfig::new(proxy::through(url, 6379, &proxy))
        .with_prefix(format!("{}:", common::unique("idem-netfault")));
    let redis = RedisBackend::connect(config).await;
    let redis = redis.expect("connect to IDEM_REDIS_URL through the proxy");
    let pool = direct.pool().clone();
    let handler = move |msg: Message, ctx: Option<Context>| {
        let (pool, insert, running) = (pool.clone(), insert.clone(), running.clone());
        async move {
            let id = payment(&msg)?;
            let ctx = ctx.ok_or_else(|| HandlerError::permanent("no lease"))?;
            let _entered = running.enter(&id);
            sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(&id)
                .bind(i64::try_from(ctx.token()).unwrap_or(i64::MAX))
                .bind(format!("{:?}", ctx.kind()))
                .execute(&pool)
                .await
                .map_err(|e| HandlerError::retry(format!("ledger: {e}")))?;
            if is_slow(&id) {
                tokio::time::sleep(SLOW).await;
            }
            Ok(Bytes::from(format!("paid {id}")))
        }
    };
    let builder = builder.engine(engine(Arc::new(redis))).handler(handler);
    (proxy, builder)
}

/// PostgreSQL at `url` through a proxy as the store (in `direct`'s schema, where the ledger is),
/// and a handler that writes its effect with `insert` in its transaction.
async fn transactional_mode(
    builder: ConsumerBuilder,
    url: &str,
    direct: &PgBackend,
    insert: String,
    running: Arc<Running>,
) -> (Proxy, ConsumerBuilder) {
    let proxy = Proxy::start(&proxy::split_url(url, 5432).1).await;
    let config = PgConfig::new(proxy::through(url, 5432, &proxy))
        .with_schema(direct.schema())
        .with_max_connections(16)
        .with_query_timeout(PG_TIMEOUT)
        .with_connect_timeout(PG_TIMEOUT);
    let pg = PgBackend::connect(config).await;
    let pg = pg.expect("connect to IDEM_POSTGRES_URL through the proxy");
    let builder = builder.engine(engine(Arc::new(pg.clone())));
    // Given inline: the handler must be general over the transaction's lifetime.
    let builder = builder.transactional(pg, move |msg, tx, lease| {
        let (insert, running) = (insert.clone(), running.clone());
        async move {
            let id = payment(&msg)?;
            let _entered = running.enter(&id);
            sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(&id)
                .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                .bind(format!("{:?}", lease.kind))
                .execute(&mut **tx)
                .await?;
            if is_slow(&id) {
                tokio::time::sleep(SLOW).await;
            }
            Ok(Bytes::from(format!("paid {id}")))
        }
        .boxed()
    });
    (proxy, builder)
}

/// An engine with the test's short lease; lapses spend attempts, so it allows ten.
fn engine(backend: Arc<dyn Backend>) -> Engine {
    Engine::builder(backend)
        .owner("netfault")
        .lease_ttl(LEASE)
        .max_attempts(10)
        .retention(Duration::from_secs(600))
        .build()
        .expect("engine")
}

/// The group's committed offsets on each partition of `topic` (-1 when none).
async fn committed(brokers: &str, group: &str, topic: &str) -> Vec<i64> {
    let (b, g, t) = (brokers.to_owned(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || common::committed(&b, &g, &t, PARTITIONS))
        .await
        .expect("committed offsets")
}
