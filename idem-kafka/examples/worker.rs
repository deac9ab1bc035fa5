//! A payment consumer in a process of its own, for the SIGKILL test (`tests/sigkill.rs`
//! starts several, kills them with SIGKILL at random moments and starts replacements). It
//! joins `--group` on `--topic` and applies each payment (the `idempotency-key` header)
//! as a row of the table `<schema>.ledger` (payment, token, instance, kind), until its
//! stdin closes or reads `stop`. Two modes:
//!
//! - `--mode transactional`: the store is PostgreSQL or, given a `mysql://` or
//!   `mariadb://` URL, MySQL (`--store`, idem's tables migrated in `--schema`), and the
//!   ledger row is written in the handler's transaction, in the same database (`--ledger`
//!   is not used).
//! - `--mode lease`: the store is Redis (`--store redis://…`, keys under
//!   `idem-sigkill:<group>:`), PostgreSQL (`postgres://…`) or MySQL (`mysql://…`) with
//!   idem's tables migrated in `--schema`, or DynamoDB (`http://…`, DynamoDB Local's
//!   endpoint, in the table `idem_sigkill`, created beforehand); the ledger row is committed on its own (in
//!   PostgreSQL, `--ledger`) before the handler returns, so a kill between the row and the
//!   settle leaves a real double effect for the takeover. `--max-unsettled <n>` sets
//!   `ConsumerBuilder::max_unsettled`: at most `n` effects per partition run without
//!   being settled, so a kill repeats at most `n` per partition it held.
//!
//! `--in-flight <n>` sets `ConsumerBuilder::in_flight`; `--assignment <strategy>` sets
//! librdkafka's `partition.assignment.strategy` (`range`, the default, `roundrobin`, or
//! `cooperative-sticky`).
//!
//! It logs to stderr when `RUST_LOG` is set (librdkafka's debug contexts too when
//! `RDKAFKA_DEBUG` names them, e.g. `cgrp`), and prints `settled partition=<p> offset=<o>`
//! for each message it settles,
//! `overlap payment=<id>` if a handler starts while another handler of the same payment
//! runs in this process, and `stopped settled=<n>` after a clean stop; on bad input it
//! prints `worker: error: ...` to stderr and exits with status 2.
//!
//! ```sh
//! cargo run -p idem-kafka --example worker -- --mode lease --brokers 127.0.0.1:19092 \
//!   --topic payments --group billing --store redis://127.0.0.1:6379/ \
//!   --ledger postgres://postgres@127.0.0.1:5432/test --schema ledger_1 [--instance 0] \
//!   [--lease-ms 2000] [--work-ms 0]
//! cargo run -p idem-kafka --example worker -- --mode transactional \
//!   --brokers 127.0.0.1:19092 --topic payments --group billing \
//!   --store mysql://root@127.0.0.1:3306/test --ledger unused --schema ledger_1
//! ```

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use idem_core::{Bytes, Engine, HandlerError};
use idem_dynamo::{DynamoBackend, DynamoConfig};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::{ConsumerBuilder, IdemConsumer, Message, Point, Probe, Verdict};
use idem_mysql::{MySqlBackend, MySqlConfig};
use idem_postgres::{PgBackend, PgConfig};
use idem_redis::{RedisBackend, RedisConfig};

const USAGE: &str = "usage: worker --mode transactional|lease --brokers <b> --topic <t> \
     --group <g> --store <postgres|mysql|redis|dynamodb http url> --ledger <postgres url> \
     --schema <schema> [--instance <n>] [--lease-ms <ms>] [--work-ms <ms>] \
     [--max-unsettled <n>] [--in-flight <n>] [--assignment <strategy>]";

/// Connections per pool: the tests run up to five SIGKILL scenarios at once, each with a
/// few workers, against one PostgreSQL that takes 100 connections.
const POOL: u32 = 4;

/// The DynamoDB table of lease mode (keys are namespaced by the group).
const DYNAMO_TABLE: &str = "idem_sigkill";

/// What the command line asked for.
struct Args {
    mode: String,
    brokers: String,
    topic: String,
    group: String,
    store: String,
    ledger: String,
    schema: String,
    instance: i32,
    lease: Duration,
    work: Duration,
    /// `ConsumerBuilder::max_unsettled`, if given.
    max_unsettled: Option<usize>,
    in_flight: usize,
    /// `partition.assignment.strategy`.
    assignment: String,
}

impl Args {
    fn parse(raw: &[String]) -> Result<Args, String> {
        let mut flags: HashMap<&str, &str> = HashMap::new();
        let mut it = raw.iter();
        while let Some(flag) = it.next() {
            let name = flag
                .strip_prefix("--")
                .ok_or_else(|| format!("unexpected argument {flag:?}"))?;
            let value = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
            flags.insert(name, value);
        }
        let f = &mut flags;
        let args = Args {
            mode: text(f, "mode")?,
            brokers: text(f, "brokers")?,
            topic: text(f, "topic")?,
            group: text(f, "group")?,
            store: text(f, "store")?,
            ledger: text(f, "ledger")?,
            schema: text(f, "schema")?,
            instance: number(f, "instance", 0)?,
            lease: Duration::from_millis(number(f, "lease-ms", 2000)?),
            work: Duration::from_millis(number(f, "work-ms", 0)?),
            max_unsettled: f
                .contains_key("max-unsettled")
                .then(|| number(f, "max-unsettled", 0))
                .transpose()?,
            in_flight: number(f, "in-flight", 1)?,
            assignment: f.remove("assignment").unwrap_or("range").to_owned(),
        };
        if let Some(name) = flags.keys().next() {
            return Err(format!("unknown flag --{name}"));
        }
        if args.mode != "transactional" && args.mode != "lease" {
            return Err(format!("--mode {:?}: transactional or lease", args.mode));
        }
        let plain = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
        if args.schema.is_empty() || !args.schema.chars().all(plain) {
            return Err(format!("--schema {:?}: [a-z0-9_]+ only", args.schema));
        }
        Ok(args)
    }
}

fn text(flags: &mut HashMap<&str, &str>, name: &str) -> Result<String, String> {
    flags
        .remove(name)
        .map(str::to_owned)
        .ok_or_else(|| format!("missing --{name}"))
}

fn number<T: std::str::FromStr>(
    flags: &mut HashMap<&str, &str>,
    name: &str,
    default: T,
) -> Result<T, String> {
    flags.remove(name).map_or(Ok(default), |v| {
        v.parse()
            .map_err(|_| format!("--{name} {v:?}: not a number"))
    })
}

/// Prints a line for each settled message; writes to a closed stdout are dropped.
#[derive(Default)]
struct Settles(AtomicU64);

impl Probe for Settles {
    fn reached(&self, point: Point, _topic: &str, partition: i32, offset: i64) -> Verdict {
        if point == Point::AfterSettle {
            self.0.fetch_add(1, Ordering::Relaxed);
            let _ = writeln!(
                std::io::stdout().lock(),
                "settled partition={partition} offset={offset}"
            );
        }
        Verdict::Continue
    }
}

/// The payments whose handler runs now; a second handler of one of them says `overlap`.
#[derive(Clone, Default)]
struct Running(Arc<Mutex<HashSet<String>>>);

/// A payment marked running until dropped.
struct Runs(Running, String);

impl Running {
    fn enter(&self, id: &str) -> Runs {
        let fresh = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned());
        if !fresh {
            let _ = writeln!(std::io::stdout().lock(), "overlap payment={id}");
        }
        Runs(self.clone(), id.to_owned())
    }
}

impl Drop for Runs {
    fn drop(&mut self) {
        self.0
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.1);
    }
}

/// The payment id of a message, from its idempotency key.
fn payment(msg: &Message) -> Result<String, HandlerError> {
    msg.idempotency_key()
        .map(|k| k.id().to_owned())
        .ok_or_else(|| HandlerError::permanent("no payment id"))
}

/// Resolves once stdin reads `stop` or closes (the test ended, or dropped our stdin).
fn stop_on_stdin() -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            match line {
                Ok(l) if l.trim() == "stop" => break,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let _ = tx.send(());
    });
    rx
}

async fn run(args: Args) -> Result<u64, String> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &args.brokers)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        // The rebalance timeout too: a group waits this long for a killed member to rejoin.
        .set("max.poll.interval.ms", "20000")
        .set("topic.metadata.refresh.interval.ms", "500")
        .set("partition.assignment.strategy", &args.assignment);
    // librdkafka's own debug contexts (`cgrp`, `fetch`, …), logged through `RUST_LOG`.
    if let Ok(contexts) = std::env::var("RDKAFKA_DEBUG") {
        config
            .set("debug", contexts)
            .set_log_level(rdkafka::config::RDKafkaLogLevel::Debug);
    }
    let stop = stop_on_stdin();
    let settles = Arc::new(Settles::default());
    let builder = IdemConsumer::builder(config)
        .topics([args.topic.as_str()])
        .group(args.group.as_str())
        .batch_size(50)
        .in_flight(args.in_flight)
        .commit_interval(Duration::from_millis(200))
        .revoke_timeout(Duration::from_secs(5))
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(500))
        .probe(settles.clone())
        .shutdown(async move {
            let _ = stop.await;
        });
    let builder = match args.max_unsettled {
        Some(n) => builder.max_unsettled(n),
        None => builder,
    };
    let consumer = if args.mode == "transactional" {
        transactional(builder, &args).await?
    } else {
        let insert = format!(
            "INSERT INTO \"{}\".ledger (payment, token, instance, kind) VALUES ($1, $2, $3, $4)",
            args.schema
        );
        lease(builder, &args, insert).await?
    };
    consumer.run().await.map_err(|e| format!("consumer: {e}"))?;
    Ok(settles.0.load(Ordering::Relaxed))
}

fn engine(backend: Arc<dyn idem_core::Backend>, args: &Args) -> Result<Engine, String> {
    Engine::builder(backend)
        .owner(format!("worker-{}", args.instance))
        .lease_ttl(args.lease)
        .max_attempts(10)
        .retention(Duration::from_secs(600))
        .build()
        .map_err(|e| format!("engine: {e}"))
}

/// Transactional mode: the ledger row commits with the record and offset, in one
/// PostgreSQL transaction or, for a `mysql://` or `mariadb://` store, one InnoDB
/// transaction.
async fn transactional(builder: ConsumerBuilder, args: &Args) -> Result<IdemConsumer, String> {
    let (instance, work) = (args.instance, args.work);
    let running = Running::default();
    // The handler: the same code for both stores, but for the statement's placeholders and
    // the type of the transaction it writes through.
    macro_rules! write_ledger {
        ($insert:expr) => {{
            let insert: String = $insert;
            move |msg: Message, tx, lease: idem_core::Lease| {
                let (insert, running) = (insert.clone(), running.clone());
                async move {
                    let id = payment(&msg)?;
                    let _runs = running.enter(&id);
                    tokio::time::sleep(work).await;
                    sqlx::query(sqlx::AssertSqlSafe(insert))
                        .bind(&id)
                        .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                        .bind(instance)
                        .bind(format!("{:?}", lease.kind))
                        .execute(&mut **tx)
                        .await?;
                    Ok(Bytes::from(format!("paid {id}")))
                }
                .boxed()
            }
        }};
    }
    let columns = "ledger (payment, token, instance, kind)";
    let schema = args.schema.as_str();
    let builder = if ["mysql://", "mariadb://"]
        .iter()
        .any(|s| args.store.starts_with(s))
    {
        let config = MySqlConfig::new(args.store.as_str())
            .with_schema(schema)
            .with_max_connections(POOL);
        let my = MySqlBackend::connect(config)
            .await
            .map_err(|e| format!("--store: {e}"))?;
        let insert = format!("INSERT INTO `{schema}`.{columns} VALUES (?, ?, ?, ?)");
        builder
            .engine(engine(Arc::new(my.clone()), args)?)
            .transactional(my, write_ledger!(insert))
    } else {
        let config = PgConfig::new(args.store.as_str())
            .with_schema(schema)
            .with_max_connections(POOL);
        let pg = PgBackend::connect(config)
            .await
            .map_err(|e| format!("--store: {e}"))?;
        let insert = format!("INSERT INTO \"{schema}\".{columns} VALUES ($1, $2, $3, $4)");
        builder
            .engine(engine(Arc::new(pg.clone()), args)?)
            .transactional(pg, write_ledger!(insert))
    };
    builder.build().map_err(|e| format!("consumer: {e}"))
}

/// The lease-mode store `--store` names: Redis, PostgreSQL, MySQL or DynamoDB Local.
async fn lease_store(args: &Args) -> Result<Arc<dyn idem_core::Backend>, String> {
    let url = args.store.as_str();
    let schema = args.schema.as_str();
    let store = |e: idem_core::Error| format!("--store: {e}");
    let backend: Arc<dyn idem_core::Backend> = if url.starts_with("redis") {
        let prefix = format!("idem-sigkill:{}:", args.group);
        let config = RedisConfig::new(url).with_prefix(prefix);
        Arc::new(RedisBackend::connect(config).await.map_err(store)?)
    } else if url.starts_with("postgres") {
        let config = PgConfig::new(url)
            .with_schema(schema)
            .with_max_connections(POOL);
        Arc::new(PgBackend::connect(config).await.map_err(store)?)
    } else if url.starts_with("mysql") || url.starts_with("mariadb") {
        let config = MySqlConfig::new(url)
            .with_schema(schema)
            .with_max_connections(POOL);
        Arc::new(MySqlBackend::connect(config).await.map_err(store)?)
    } else if url.starts_with("http") {
        // Every worker runs on this machine's clock: a small skew margin.
        let config =
            DynamoConfig::local(url, DYNAMO_TABLE).with_clock_skew(Duration::from_millis(50));
        Arc::new(DynamoBackend::connect(config).await.map_err(store)?)
    } else {
        return Err(format!(
            "--store {url:?}: a redis, postgres, mysql or http URL"
        ));
    };
    Ok(backend)
}

/// Lease mode: the ledger row commits on its own, before the settle.
async fn lease(
    builder: ConsumerBuilder,
    args: &Args,
    insert: String,
) -> Result<IdemConsumer, String> {
    let backend = lease_store(args).await?;
    let ledger = sqlx::postgres::PgPoolOptions::new()
        .max_connections(POOL)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&args.ledger)
        .await
        .map_err(|e| format!("--ledger: {e}"))?;
    let (instance, work) = (args.instance, args.work);
    let running = Running::default();
    builder
        .engine(engine(backend, args)?)
        .handler(move |msg, ctx| {
            let (insert, ledger, running) = (insert.clone(), ledger.clone(), running.clone());
            async move {
                let id = payment(&msg)?;
                let _runs = running.enter(&id);
                let ctx = ctx.ok_or_else(|| HandlerError::permanent("no lease"))?;
                tokio::time::sleep(work).await;
                sqlx::query(sqlx::AssertSqlSafe(insert))
                    .bind(&id)
                    .bind(i64::try_from(ctx.token()).unwrap_or(i64::MAX))
                    .bind(instance)
                    .bind(format!("{:?}", ctx.kind()))
                    .execute(&ledger)
                    .await
                    .map_err(|e| HandlerError::retry(format!("ledger: {e}")))?;
                Ok(Bytes::from(format!("paid {id}")))
            }
        })
        .build()
        .map_err(|e| format!("consumer: {e}"))
}

#[tokio::main]
async fn main() {
    // Logs to stderr (the test's worker log) when `RUST_LOG` is set.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let result = match Args::parse(&raw) {
        Ok(args) => run(args).await,
        Err(e) => Err(format!("{e}\n{USAGE}")),
    };
    match result {
        Ok(settled) => {
            let _ = writeln!(std::io::stdout().lock(), "stopped settled={settled}");
        }
        Err(e) => {
            eprintln!("worker: error: {e}");
            std::process::exit(2);
        }
    }
}
