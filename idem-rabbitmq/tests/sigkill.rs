//! Consumer processes killed with SIGKILL on a real RabbitMQ and PostgreSQL
//! (`IDEM_RABBITMQ_URL`, `IDEM_POSTGRES_URL`). Three `worker` examples consume a queue of
//! payments, each sent twice; one is killed and replaced at every few acks. Then the
//! workers stop, a last consumer in this process drains what is left, and the ledger is
//! read: no payment lost in either mode, none applied twice in transactional mode, and in
//! lease mode at most one double per kill (the message in hand).

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use common::{Queue, Watch};
use idem_core::Engine;
use idem_postgres::{PgBackend, PgConfig};
use idem_rabbitmq::IdemConsumer;
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const PAYMENTS: usize = 150;
const WORKERS: usize = 3;
const KILLS: usize = 6;
const WITHIN: Duration = Duration::from_secs(60);

struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
}

struct Pool {
    example: std::path::PathBuf,
    mode: &'static str,
    queue: String,
    schema: String,
    workers: HashMap<usize, Worker>,
    next: usize,
    /// One message per ack any worker printed.
    acks: mpsc::Sender<()>,
}

impl Pool {
    fn start(&mut self) {
        let instance = self.next;
        self.next += 1;
        let mut child = Command::new(&self.example)
            .args([
                "--mode",
                self.mode,
                "--queue",
                &self.queue,
                "--schema",
                &self.schema,
            ])
            .args(["--instance", &instance.to_string(), "--lease-ms", "1000"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start a worker");
        let stdout = child.stdout.take().expect("stdout");
        let acks = self.acks.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("acked ") {
                    let _ = acks.send(());
                }
            }
        });
        let stdin = child.stdin.take();
        self.workers.insert(instance, Worker { child, stdin });
    }

    /// SIGKILLs a random worker.
    fn kill_one(&mut self) {
        let ids: Vec<usize> = self.workers.keys().copied().collect();
        let id = ids[fastrand::usize(..ids.len())];
        let mut w = self.workers.remove(&id).expect("worker");
        w.child.kill().expect("SIGKILL a worker");
        let _ = w.child.wait();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for w in self.workers.values_mut() {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}

async fn ledger(schema: &str) -> PgBackend {
    let url = idem_conformance::service_env("IDEM_POSTGRES_URL");
    let pg = PgBackend::connect(PgConfig::new(url).with_schema(schema))
        .await
        .expect("connect to IDEM_POSTGRES_URL");
    let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
    sqlx::query(AssertSqlSafe(drop))
        .execute(pg.pool())
        .await
        .expect("drop");
    pg.migrate().await.expect("migrate");
    let table = format!(
        "CREATE TABLE \"{schema}\".ledger (payment text NOT NULL, token bigint, instance int)"
    );
    sqlx::query(AssertSqlSafe(table))
        .execute(pg.pool())
        .await
        .expect("ledger");
    pg
}

async fn killed_workers(mode: &'static str) {
    let schema = format!("idem_rabbit_kill_{mode}_{}", std::process::id());
    let pg = ledger(&schema).await;
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, mode).await;
    for _copy in 0..2 {
        for k in 0..PAYMENTS {
            q.publish(Some(format!("pay-{k}").as_bytes()), b"charge")
                .await;
        }
    }
    let example = idem_conformance::process::build_example(
        concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
        "idem-rabbitmq",
        "worker",
    );
    let (tx, rx) = mpsc::channel();
    let mut pool = Pool {
        example: example.path().to_owned(),
        mode,
        queue: q.name.clone(),
        schema: schema.clone(),
        workers: HashMap::new(),
        next: 0,
        acks: tx,
    };
    for _ in 0..WORKERS {
        pool.start();
    }
    // A kill at every few acks, a replacement after each.
    let mut acks = 0;
    let every = 2 * PAYMENTS / (KILLS + 2);
    for _ in 0..KILLS {
        let target = acks + every;
        while acks < target {
            rx.recv_timeout(WITHIN).expect("a worker acks");
            acks += 1;
        }
        pool.kill_one();
        pool.start();
    }
    // A clean stop of the rest: stdin closes, each says it stopped.
    for w in pool.workers.values_mut() {
        if let Some(mut stdin) = w.stdin.take() {
            let _ = writeln!(stdin, "stop");
        }
    }
    for (_, mut w) in pool.workers.drain() {
        let status = w.child.wait().expect("wait for a worker");
        assert!(status.success(), "a worker failed to stop: {status}");
    }

    // What the workers left is drained here, by the same handler.
    let left = q.ready(&q.name).await as usize;
    let (watch, stop) = (Watch::new(), CancellationToken::new());
    let insert =
        format!("INSERT INTO \"{schema}\".ledger (payment, token, instance) VALUES ($1, $2, -1)");
    let pool_pg = pg.pool().clone();
    let engine = Engine::builder(Arc::new(pg.clone()))
        .lease_ttl(Duration::from_secs(1))
        .build()
        .expect("engine");
    let drain = IdemConsumer::builder(common::url())
        .queue(&q.name)
        .engine(engine)
        .probe(watch.clone())
        .backoff(Duration::from_millis(20), Duration::from_millis(500))
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |m, ctx| {
            let (insert, pool) = (insert.clone(), pool_pg.clone());
            async move {
                let payment = m.key().map(|k| k.id().to_owned()).unwrap_or_default();
                sqlx::query(AssertSqlSafe(insert))
                    .bind(payment)
                    .bind(ctx.map_or(0, |c| c.token() as i64))
                    .execute(&pool)
                    .await
                    .map_err(idem_core::HandlerError::retry)?;
                Ok(Bytes::from_static(b"booked"))
            }
        })
        .build()
        .expect("build");
    let run = tokio::spawn(drain.run());
    watch.acked(left, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    assert_eq!(q.ready(&q.name).await, 0, "every delivery acked");

    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT payment, count(*) FROM \"{schema}\".ledger GROUP BY payment"
    )))
    .fetch_all(pg.pool())
    .await
    .expect("ledger");
    let counts: HashMap<String, i64> = rows.into_iter().collect();
    let lost: Vec<String> = (0..PAYMENTS)
        .map(|k| format!("pay-{k}"))
        .filter(|p| !counts.contains_key(p))
        .collect();
    let doubles: i64 = counts.values().map(|c| c - 1).sum();
    println!(
        "sigkill {mode}: {PAYMENTS} payments sent twice, {KILLS} kills, {} drained here, \
         {} lost, {doubles} doubles",
        left,
        lost.len()
    );
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(
        counts.len(),
        PAYMENTS,
        "only the payments sent are in the ledger"
    );
    if mode == "transactional" {
        assert_eq!(doubles, 0, "transactional mode applies each payment once");
    } else {
        assert!(
            doubles <= KILLS as i64,
            "{doubles} doubles from {KILLS} kills"
        );
    }
    q.delete().await;
    let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
    let _ = sqlx::query(AssertSqlSafe(drop)).execute(pg.pool()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_lose_nothing_in_lease_mode() {
    killed_workers("lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_apply_each_payment_once_in_transactional_mode() {
    killed_workers("transactional").await;
}
