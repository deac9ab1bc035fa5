//! A payment consumer in a process of its own, for the SIGKILL test (`tests/sigkill.rs`
//! starts several, kills them with SIGKILL at random moments and starts replacements). It
//! consumes `--queue` and applies each payment (the `idempotency-key` header) as a row of
//! the table `<schema>.ledger` (payment, token, instance) in PostgreSQL
//! (`IDEM_POSTGRES_URL`, idem's tables migrated in `--schema` beforehand), until its stdin
//! closes or reads `stop`. Two modes:
//!
//! - `--mode transactional`: the ledger row is written in the handler's transaction;
//! - `--mode lease`: the row is committed on its own before the handler returns, so a kill
//!   between the row and the settle leaves a real double effect for the takeover.
//!
//! It prints `settled <payment> <copy>` for each delivery whose record is settled, before
//! its ack (`<copy>` is the delivery's `copy` header, `-` if none), and `stopped` after a
//! clean stop; on bad input it prints `worker: error: ...` to stderr and exits with
//! status 2.
//!
//! ```sh
//! IDEM_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//! IDEM_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo run -p idem-rabbitmq --example rabbitmq_worker -- --mode lease --queue payments \
//!   --schema ledger_1 [--instance 0] [--lease-ms 1000]
//! ```

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use idem_core::{Bytes, Engine, HandlerError};
use idem_postgres::{PgBackend, PgConfig};
use idem_rabbitmq::{IdemConsumer, Message, Point, Probe, Verdict};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const USAGE: &str = "usage: worker --mode transactional|lease --queue <q> --schema <schema> \
     [--instance <n>] [--lease-ms <ms>]";

struct Args {
    transactional: bool,
    queue: String,
    schema: String,
    instance: i32,
    lease: Duration,
}

fn parse() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let (mut mode, mut queue, mut schema) = (None, None, None);
    let (mut instance, mut lease_ms) = (0, 1000);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--mode" => mode = Some(value()?),
            "--queue" => queue = Some(value()?),
            "--schema" => schema = Some(value()?),
            "--instance" => instance = value()?.parse().map_err(|e| format!("--instance: {e}"))?,
            "--lease-ms" => lease_ms = value()?.parse().map_err(|e| format!("--lease-ms: {e}"))?,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let transactional = match mode.as_deref() {
        Some("transactional") => true,
        Some("lease") => false,
        other => {
            return Err(format!(
                "--mode must be transactional or lease, not {other:?}"
            ));
        }
    };
    let schema = schema.ok_or("--schema is required")?;
    if !schema
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(format!("--schema {schema:?}: letters, digits and _ only"));
    }
    Ok(Args {
        transactional,
        queue: queue.ok_or("--queue is required")?,
        schema,
        instance,
        lease: Duration::from_millis(lease_ms),
    })
}

/// Prints each settled delivery on stdout, where the test reads it: before the ack, so
/// that a kill between the two leaves a redelivery to print it again, never an ack that
/// was not printed.
struct Settled;

impl Probe for Settled {
    fn reached(&self, point: Point, m: &Message) -> Verdict {
        if point == Point::AfterSettle {
            let id = m.idempotency_key().map_or("-", |k| k.id());
            let copy = m
                .header("copy")
                .map_or("-".into(), |c| String::from_utf8_lossy(c).into_owned());
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "settled {id} {copy}");
            let _ = out.flush();
        }
        Verdict::Continue
    }
}

fn env(var: &str) -> Result<String, String> {
    std::env::var(var).map_err(|_| format!("{var} is not set"))
}

async fn run(args: Args) -> Result<(), String> {
    let pg = PgBackend::connect(PgConfig::new(env("IDEM_POSTGRES_URL")?).with_schema(&args.schema))
        .await
        .map_err(|e| e.to_string())?;
    let engine = Engine::builder(Arc::new(pg.clone()))
        .owner(format!("worker-{}", args.instance))
        .lease_ttl(args.lease)
        .build()
        .map_err(|e| e.to_string())?;
    let stop = CancellationToken::new();
    let on_stdin = stop.clone();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            match line {
                Ok(l) if l.trim() == "stop" => break,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        on_stdin.cancel();
    });
    let insert = format!(
        "INSERT INTO \"{}\".ledger (payment, token, instance) VALUES ($1, $2, $3)",
        args.schema
    );
    let instance = args.instance;
    let builder = IdemConsumer::builder(env("IDEM_RABBITMQ_URL")?)
        .queue(&args.queue)
        .engine(engine)
        .probe(Arc::new(Settled))
        .backoff(Duration::from_millis(20), Duration::from_millis(500))
        .shutdown(stop.cancelled_owned());
    let consumer = if args.transactional {
        builder.transactional(pg, move |m: Message, tx, lease| {
            let insert = insert.clone();
            async move {
                let payment = m
                    .idempotency_key()
                    .map(|k| k.id().to_owned())
                    .unwrap_or_default();
                sqlx::query(AssertSqlSafe(insert))
                    .bind(payment)
                    .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                    .bind(instance)
                    .execute(&mut **tx)
                    .await
                    .map_err(HandlerError::retry)?;
                Ok(Bytes::from_static(b"booked"))
            }
            .boxed()
        })
    } else {
        let pool = pg.pool().clone();
        builder.handler(move |m, ctx| {
            let (insert, pool) = (insert.clone(), pool.clone());
            async move {
                let payment = m
                    .idempotency_key()
                    .map(|k| k.id().to_owned())
                    .unwrap_or_default();
                let token = ctx.map_or(0, |c| c.token());
                sqlx::query(AssertSqlSafe(insert))
                    .bind(payment)
                    .bind(i64::try_from(token).unwrap_or(i64::MAX))
                    .bind(instance)
                    .execute(&pool)
                    .await
                    .map_err(HandlerError::retry)?;
                Ok(Bytes::from_static(b"booked"))
            }
        })
    };
    consumer
        .build()
        .map_err(|e| e.to_string())?
        .run()
        .await
        .map_err(|e| e.to_string())?;
    println!("stopped");
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let result = match parse() {
        Ok(args) => run(args).await,
        Err(e) => Err(format!("{e}\n{USAGE}")),
    };
    if let Err(e) = result {
        eprintln!("worker: error: {e}");
        std::process::exit(2);
    }
}
