//! How soon a waiting engine ([`WaitPolicy::Wait`], 10 ms poll) returns the holder's
//! response after the holder's `complete`, woken by the store's notification against
//! polling, on Redis (`IDEM_REDIS_URL`) and PostgreSQL (`IDEM_POSTGRES_URL`), in one run.
//!
//! Each sample: a holder claims a fresh key; a waiter's engine claims it, is answered
//! `InProgress` and waits; after a random 0 to 10 ms (so a poll is caught anywhere in its
//! interval) the holder completes; the sample is the time from `complete`'s return to the
//! waiter's return (0 when the waiter returned first: PostgreSQL notifies at the commit,
//! before the answer reaches the holder). "poll" is the same engine with every
//! notification dropped (`idem_core::layer::Fault::Notify`): it reads again every 10 ms.
//!
//! Target: notify p50 ≤ 2 ms and below half the poll interval.
//!
//! `cargo bench -p benches --bench wake`

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_conformance::CallLog;
use idem_core::backend::ClaimOutcome;
use idem_core::layer::{BackendExt, ChaosLayer, Fault};
use idem_core::{Backend, Engine, Key, Outcome, WaitPolicy};
use idem_postgres::{PgBackend, PgConfig};
use idem_redis::{RedisBackend, RedisConfig};

const SAMPLES: usize = 300;
const POLL: Duration = Duration::from_millis(10);

/// Milliseconds from `complete`'s return to the waiter's return, one per sample, and the
/// median time `complete` itself took.
async fn samples(backend: Arc<dyn Backend>, notify: bool, run: &str) -> (Vec<f64>, f64) {
    let chaos = ChaosLayer::new();
    chaos.set(Fault::Notify, !notify);
    let faulty = Arc::clone(&backend).layer(chaos);
    let mut out = Vec::with_capacity(SAMPLES);
    let mut completes = Vec::with_capacity(SAMPLES);
    let holder = Engine::builder(Arc::clone(&backend))
        .owner("holder")
        .build()
        .expect("holder");
    for i in 0..SAMPLES {
        let key = Key::new(run, format!("{}-{i}", if notify { "n" } else { "p" })).expect("key");
        let ClaimOutcome::Acquired(lease) = backend
            .claim(&holder.claim_for(&key, b"p"))
            .await
            .expect("claim")
        else {
            panic!("the holder's claim of a fresh key was not granted");
        };
        let log = CallLog::new();
        let tap = Arc::new(faulty.clone().layer(log.clone()));
        let waiter = Engine::builder(tap.clone())
            .owner("waiter")
            .wait(WaitPolicy::Wait {
                poll: POLL,
                max: Duration::from_secs(10),
            })
            .build()
            .expect("waiter");
        let task = tokio::spawn(async move {
            let outcome = waiter
                .execute(&key, b"p", |_| async { Ok(Bytes::from_static(b"waiter")) })
                .await;
            (outcome, Instant::now())
        });
        log.claims_answered(1).await;
        tokio::time::sleep(Duration::from_micros(fastrand::u64(0..10_000))).await;
        let started = Instant::now();
        backend
            .complete(
                &lease,
                Bytes::from_static(b"holder"),
                Duration::from_secs(600),
            )
            .await
            .expect("complete");
        let completed = Instant::now();
        let (outcome, returned) = task.await.expect("waiter task");
        assert_eq!(
            outcome.expect("execute"),
            Outcome::Replayed(Bytes::from_static(b"holder"))
        );
        out.push(ms(returned.saturating_duration_since(completed)));
        completes.push(ms(completed - started));
    }
    completes.sort_by(f64::total_cmp);
    (out, completes[completes.len() / 2])
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or(0.0)
}

async fn report(name: &str, backend: Arc<dyn Backend>, run: &str) {
    for notify in [true, false] {
        let (mut v, complete) = samples(Arc::clone(&backend), notify, run).await;
        v.sort_by(f64::total_cmp);
        println!(
            "{name:<10} {:<6} p50 {:>6.2} ms  p99 {:>6.2} ms  max {:>6.2} ms  (complete p50 {complete:.2} ms, {} samples)",
            if notify { "notify" } else { "poll" },
            percentile(&v, 0.50),
            percentile(&v, 0.99),
            v.last().copied().unwrap_or(0.0),
            v.len(),
        );
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let run = format!("wake-{}-{}", std::process::id(), fastrand::u32(..));
    println!("wake: complete → waiter return, poll {POLL:?}, {SAMPLES} samples each");
    rt.block_on(async {
        match std::env::var("IDEM_REDIS_URL") {
            Ok(url) => {
                let config = RedisConfig::new(&url).with_prefix("idem:wake:");
                let backend = RedisBackend::connect(config).await.expect("redis");
                report("redis", Arc::new(backend), &run).await;
            }
            Err(_) => println!("redis skipped: IDEM_REDIS_URL is not set"),
        }
        match std::env::var("IDEM_POSTGRES_URL") {
            Ok(url) => {
                let config = PgConfig::new(url)
                    .with_schema("idem_wake")
                    .with_max_connections(8);
                let backend = PgBackend::connect(config).await.expect("postgres");
                backend.migrate().await.expect("migrate");
                report("postgres", Arc::new(backend), &run).await;
            }
            Err(_) => println!("postgres skipped: IDEM_POSTGRES_URL is not set"),
        }
    });
}
