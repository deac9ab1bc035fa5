//! Consumer processes killed with SIGKILL on a real RabbitMQ and PostgreSQL
//! (`IDEM_RABBITMQ_URL`, `IDEM_POSTGRES_URL`). Three `rabbitmq_worker` examples consume a
//! queue of payments, each sent twice; one is killed and replaced at every few settled
//! deliveries, until every delivery was settled by one of them. Then the workers stop and the ledger
//! is read: no payment lost in either mode, none applied twice in transactional mode, and
//! in lease mode at most a batch of doubles per kill (the batch in hand).

mod common;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::Queue;
use idem_rabbitmq::lapin::BasicProperties;
use idem_rabbitmq::lapin::types::{AMQPValue, FieldTable, LongString};
use sqlx::AssertSqlSafe;

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
    /// Each delivery any worker settled: its payment and copy.
    settled: mpsc::Sender<String>,
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
        let settled = self.settled.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(what) = line.strip_prefix("settled ") {
                    let _ = settled.send(what.to_owned());
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

async fn killed_workers(mode: &'static str) {
    let schema = format!("idem_rabbit_kill_{mode}_{}", std::process::id());
    let pg = common::ledger_store(&schema).await;
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, mode).await;
    for copy in 0..2 {
        for k in 0..PAYMENTS {
            let mut headers = FieldTable::default();
            let text = |s: &str| AMQPValue::LongString(LongString::from(s));
            headers.insert("idempotency-key".into(), text(&format!("pay-{k}")));
            headers.insert("copy".into(), text(&copy.to_string()));
            q.publish_with(BasicProperties::default().with_headers(headers), b"charge")
                .await;
        }
    }
    let example = idem_conformance::process::build_workspace_example(
        concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
        // Not `worker`: idem-kafka has an example of that name, and both would be built
        // to `target/debug/examples/worker`, so one SIGKILL test could start the other's.
        "rabbitmq_worker",
    );
    let (tx, rx) = mpsc::channel();
    let mut pool = Pool {
        example: example.path().to_owned(),
        mode,
        queue: q.name.clone(),
        schema: schema.clone(),
        workers: HashMap::new(),
        next: 0,
        settled: tx,
    };
    for _ in 0..WORKERS {
        pool.start();
    }
    // A kill at every few settled deliveries, a replacement after each, until every
    // delivery was settled by some worker.
    let mut seen = HashSet::new();
    let every = 2 * PAYMENTS / (KILLS + 2);
    let mut kills = 0;
    while seen.len() < 2 * PAYMENTS {
        let what = rx.recv_timeout(WITHIN).unwrap_or_else(|_| {
            panic!(
                "{} of {} deliveries settled, then nothing for {WITHIN:?}",
                seen.len(),
                2 * PAYMENTS
            )
        });
        if seen.insert(what) && kills < KILLS && seen.len() >= (kills + 1) * every {
            pool.kill_one();
            pool.start();
            kills += 1;
        }
    }
    assert_eq!(kills, KILLS);
    // A clean stop: stdin says so, each says it stopped.
    for w in pool.workers.values_mut() {
        if let Some(mut stdin) = w.stdin.take() {
            let _ = writeln!(stdin, "stop");
        }
    }
    for (_, mut w) in pool.workers.drain() {
        let status = w.child.wait().expect("wait for a worker");
        assert!(status.success(), "a worker failed to stop: {status}");
    }

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
        "sigkill {mode}: {PAYMENTS} payments sent twice, {KILLS} kills, {} lost, {doubles} doubles",
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
        // A kill repeats at most the effects of the batch in hand: up to the prefetch
        // (32), the README's bound.
        assert!(
            doubles <= 32 * KILLS as i64,
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
