//! The broker killed with `kill -9` during a run and restarted on the same storage, while
//! the consumers keep running: they must resume on their own, lose nothing, and (in
//! transactional mode) apply nothing twice.
//!
//! The test starts a tansu broker of its own (`IDEM_TANSU_BIN`) whose log is kept in an
//! S3 bucket (`IDEM_S3_ENDPOINT`, moto's server from `scripts/services`), so a restart
//! finds every topic, message and committed offset again. The side effect of a payment is
//! a row of a PostgreSQL `ledger` table with no uniqueness (`IDEM_POSTGRES_URL`).
//!
//! Payments go out in waves, one wave per kill plus one: once half of a wave is in the
//! ledger the broker is killed, left down for `DOWN`, and started again; the next wave
//! is produced after the restart. Short by default (1,000 payments, one kill); with
//! `IDEM_FAULTS_FULL=1` (as `scripts/faults` runs it) 5,000 payments and two kills.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Out;
use common::ledger::{self, payment};
use idem_core::{Backend, Engine};
use idem_kafka::IdemConsumer;
use idem_postgres::PgBackend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PARTITIONS: i32 = 4;
/// Every fifth payment is sent twice.
const DUPLICATE_EVERY: usize = 5;
/// How long the broker stays down at each kill.
const DOWN: Duration = Duration::from_secs(3);
const CONSUMERS: u32 = 2;
const TIMEOUT: Duration = Duration::from_secs(240);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_killed_transactional_postgres() {
    let figures = scenario(Mode::Transactional).await;
    assert_eq!(figures.doubles, 0, "transactional mode: each payment once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_killed_lease_redis() {
    let figures = scenario(Mode::Lease).await;
    // Nothing crashed but the broker: a double effect needs a lapsed lease.
    assert!(figures.doubles <= figures.payments / 100, "{figures:?}");
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// PostgreSQL transactional mode: the ledger row in the handler's transaction.
    Transactional,
    /// Redis lease mode: the ledger row committed on its own before the handler returns.
    Lease,
}

/// The size of a run: the short one in CI, the full one with `IDEM_FAULTS_FULL=1`.
fn size() -> (usize, usize) {
    match std::env::var("IDEM_FAULTS_FULL").as_deref() {
        Ok("1") => (5000, 2),
        _ => (1000, 1),
    }
}

#[derive(Debug, Default)]
struct Figures {
    payments: usize,
    kills: usize,
    effects: usize,
    doubles: usize,
    /// From each restart to the first payment applied after it.
    recoveries: Vec<Duration>,
    seconds: f64,
}

/// A tansu broker of the test's own, on `port`, its log in `bucket`.
struct Broker {
    bin: String,
    endpoint: String,
    bucket: String,
    port: u16,
    child: Option<Child>,
}

impl Broker {
    async fn start(bin: String, endpoint: String) -> Broker {
        let bucket = common::unique("tansu").replace('_', "-").to_lowercase();
        create_bucket(&endpoint, &bucket).await;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut broker = Broker {
            bin,
            endpoint,
            bucket,
            port,
            child: None,
        };
        broker.spawn().await;
        broker
    }

    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the broker on its bucket and waits until it accepts connections.
    async fn spawn(&mut self) {
        let url = format!("tcp://{}", self.address());
        let child = Command::new(&self.bin)
            .args(["broker", "--storage-engine"])
            .arg(format!("s3://{}/", self.bucket))
            .args(["--listener-url", &url, "--advertised-listener-url", &url])
            .env("AWS_ENDPOINT", &self.endpoint)
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "idem")
            .env("AWS_SECRET_ACCESS_KEY", "idem")
            .env("AWS_DEFAULT_REGION", "us-east-1")
            .env("AWS_REGION", "us-east-1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu (IDEM_TANSU_BIN)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(self.address())
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "tansu did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `kill -9`: no clean shutdown of any kind.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Creates `bucket` with one unsigned `PUT` (moto does not check signatures).
async fn create_bucket(endpoint: &str, bucket: &str) {
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(host)
        .await
        .expect("connect to IDEM_S3_ENDPOINT");
    let request = format!(
        "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes()).await.expect("PUT");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.expect("answer");
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "create bucket: {answer}"
    );
}

async fn scenario(mode: Mode) -> Figures {
    let bin = idem_conformance::service_env("IDEM_TANSU_BIN");
    let endpoint = idem_conformance::service_env("IDEM_S3_ENDPOINT");
    common::install_metrics();
    common::log_from_env();
    let (payments, kills) = size();
    let mut broker = Broker::start(bin, endpoint).await;
    let brokers = broker.address();
    let topic = common::unique("broker_crash");
    common::create_topics(&brokers, &[(topic.as_str(), PARTITIONS)]).await;
    let (ledger_db, ledger) = common::postgres().await;
    let group = common::unique("broker_crash");
    let started = Instant::now();

    let stop = tokio_util::sync::CancellationToken::new();
    let mut runs = Vec::new();
    for instance in 0..CONSUMERS {
        let at = Place {
            brokers: &brokers,
            topic: &topic,
            group: &group,
        };
        let consumer = consumer(mode, at, &ledger_db, &ledger, instance, stop.clone()).await;
        runs.push(tokio::spawn(consumer.run()));
    }

    let mut figures = Figures {
        payments,
        kills,
        ..Figures::default()
    };
    let waves = kills + 1;
    let mut ends = vec![0i64; PARTITIONS as usize];
    for wave in 0..waves {
        let range = (wave * payments / waves)..((wave + 1) * payments / waves);
        let msgs = messages(range.clone());
        for (partition, offset) in common::produce(&brokers, &topic, &msgs).await {
            let p = usize::try_from(partition).expect("partition");
            ends[p] = ends[p].max(offset + 1);
        }
        if wave == kills {
            break;
        }
        // Half of this wave applied: kill the broker while the rest is in flight.
        let half = range.start + range.len() / 2;
        wait_applied(&ledger_db, &ledger, half).await;
        broker.kill();
        let applied_at_kill = applied(&ledger_db, &ledger).await;
        tokio::time::sleep(DOWN).await;
        broker.spawn().await;
        let restarted = Instant::now();
        // Recovery: the first payment applied after the restart (the ledger has no
        // signal; asked every 20 ms). The wave's rest is waiting in the broker.
        if applied_at_kill < range.end {
            wait_applied(&ledger_db, &ledger, applied_at_kill + 1).await;
            figures.recoveries.push(restarted.elapsed());
        }
    }

    wait_applied(&ledger_db, &ledger, payments).await;
    common::wait_committed(&brokers, &group, &topic, &ends, Duration::from_secs(60)).await;
    stop.cancel();
    for run in runs {
        run.await
            .expect("consumer task")
            .expect("the consumer ends cleanly");
    }
    let label = format!("broker crash, {mode:?}");
    let exactly_once = mode == Mode::Transactional;
    let tally = ledger::check(ledger_db.pool(), &ledger, payments, exactly_once, &label).await;
    (figures.effects, figures.doubles) = (tally.effects, tally.doubles);
    figures.seconds = started.elapsed().as_secs_f64();
    // A row of `scripts/faults`' table: scenario, messages, faults, effects, doubles,
    // time to recover, run time.
    let recoveries: Vec<String> = figures
        .recoveries
        .iter()
        .map(|d| format!("{:.2} s", d.as_secs_f64()))
        .collect();
    eprintln!(
        "| broker kill -9 ({} s down), {} | {} | {} | {} | {} | {} | {:.1} s |",
        DOWN.as_secs(),
        match mode {
            Mode::Transactional => "PostgreSQL transactional",
            Mode::Lease => "Redis lease",
        },
        figures.payments,
        figures.kills,
        figures.effects,
        figures.doubles,
        recoveries.join(", "),
        figures.seconds,
    );
    assert_eq!(figures.effects, figures.payments + figures.doubles);
    common::drop_schema(&ledger_db).await;
    figures
}

/// The payments of `range`, every fifth twice, spread over the partitions.
fn messages(range: std::ops::Range<usize>) -> Vec<Out> {
    let mut out = Vec::new();
    for i in range {
        let partition = i32::try_from(i).expect("i") % PARTITIONS;
        let id = format!("pay-{i}");
        out.push(Out::keyed(partition, &id, "debit 10"));
        if i % DUPLICATE_EVERY == 0 {
            out.push(Out::keyed(partition, &id, "debit 10"));
        }
    }
    out
}

/// Where a consumer reads.
#[derive(Clone, Copy)]
struct Place<'a> {
    brokers: &'a str,
    topic: &'a str,
    group: &'a str,
}

/// A consumer of the group applying payments to `ledger`, until `stop`.
async fn consumer(
    mode: Mode,
    at: Place<'_>,
    ledger_db: &PgBackend,
    ledger: &str,
    instance: u32,
    stop: tokio_util::sync::CancellationToken,
) -> IdemConsumer {
    let mut config = common::consumer_config(at.brokers);
    config.set("group.id", at.group);
    let builder = IdemConsumer::builder(config)
        .topics([at.topic])
        .commit_interval(Duration::from_millis(200))
        .shutdown(async move { stop.cancelled().await });
    let group = at.group;
    let table = ledger.to_owned();
    let instance = i32::try_from(instance).expect("instance");
    match mode {
        Mode::Transactional => {
            let engine = common::engine(Arc::new(ledger_db.clone()), "tx", Duration::from_secs(5));
            builder
                .engine(engine)
                .transactional(ledger_db.clone(), move |msg, tx, lease| {
                    let table = table.clone();
                    Box::pin(async move {
                        let id = payment(&msg)?;
                        let q = format!(
                            "INSERT INTO {table} (payment, token, instance, kind) VALUES ($1, $2, $3, $4)"
                        );
                        sqlx::query(sqlx::AssertSqlSafe(q))
                            .bind(&id)
                            .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                            .bind(instance)
                            .bind(format!("{:?}", lease.kind))
                            .execute(&mut **tx)
                            .await?;
                        Ok(bytes::Bytes::from(format!("paid {id}")))
                    })
                })
                .build()
                .expect("consumer")
        }
        Mode::Lease => {
            let url = idem_conformance::service_env("IDEM_REDIS_URL");
            let prefix = format!("idem-broker-crash:{group}:");
            let redis = idem_redis::RedisBackend::connect(
                idem_redis::RedisConfig::new(url).with_prefix(prefix),
            )
            .await
            .expect("connect to IDEM_REDIS_URL");
            let store: Arc<dyn Backend> = Arc::new(redis);
            let engine: Engine =
                common::engine(store, &format!("w{instance}"), Duration::from_secs(5));
            let pool = ledger_db.pool().clone();
            builder
                .engine(engine)
                .handler(move |msg, ctx| {
                    let (table, pool) = (table.clone(), pool.clone());
                    async move {
                        let id = payment(&msg)?;
                        let ctx =
                            ctx.ok_or_else(|| idem_core::HandlerError::permanent("no lease"))?;
                        let q = format!(
                            "INSERT INTO {table} (payment, token, instance, kind) VALUES ($1, $2, $3, $4)"
                        );
                        sqlx::query(sqlx::AssertSqlSafe(q))
                            .bind(&id)
                            .bind(i64::try_from(ctx.token()).unwrap_or(i64::MAX))
                            .bind(instance)
                            .bind(format!("{:?}", ctx.kind()))
                            .execute(&pool)
                            .await
                            .map_err(|e| idem_core::HandlerError::retry(format!("ledger: {e}")))?;
                        Ok(bytes::Bytes::from(format!("paid {id}")))
                    }
                })
                .build()
                .expect("consumer")
        }
    }
}

/// How many distinct payments the ledger holds.
async fn applied(ledger_db: &PgBackend, ledger: &str) -> usize {
    common::ledger_counts(ledger_db, ledger).await.len()
}

/// Waits until `n` distinct payments are in the ledger.
async fn wait_applied(ledger_db: &PgBackend, ledger: &str, n: usize) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let got = applied(ledger_db, ledger).await;
        if got >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{got} payments applied, never {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
