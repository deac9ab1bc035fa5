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

use std::time::{Duration, Instant};

use common::Out;
use common::broker::Broker;
use common::ledger::{self, Mode};
use idem_kafka::IdemConsumer;
use idem_postgres::PgBackend;

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

async fn scenario(mode: Mode) -> Figures {
    let bin = idem_conformance::service_env("IDEM_TANSU_BIN");
    let endpoint = idem_conformance::service_env("IDEM_S3_ENDPOINT");
    common::install_metrics();
    common::log_from_env();
    let (payments, kills) = size();
    let mut broker = Broker::on_s3(bin, endpoint).await;
    let brokers = broker.address();
    let topic = common::unique("broker_crash");
    let dlq = format!("{topic}.dlq");
    common::create_topics(&brokers, &[(topic.as_str(), PARTITIONS), (&dlq, 1)]).await;
    let (ledger_db, ledger) = common::postgres().await;
    let group = common::unique("broker_crash");
    let started = Instant::now();

    let stop = tokio_util::sync::CancellationToken::new();
    let mut runs = Vec::new();
    for instance in 0..CONSUMERS {
        let stop = stop.clone();
        let builder = IdemConsumer::builder(common::consumer_config(&brokers))
            .topics([topic.as_str()])
            .group(group.as_str())
            .commit_interval(Duration::from_millis(200))
            .shutdown(async move { stop.cancelled().await });
        let no_hold = |_: &str| Duration::ZERO;
        let builder = ledger::payer(
            builder, mode, &group, &ledger_db, &ledger, instance, no_hold,
        )
        .await;
        runs.push(tokio::spawn(builder.build().expect("consumer").run()));
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
        mode.label(),
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
