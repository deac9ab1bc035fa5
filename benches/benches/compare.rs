//! Every configured backend in one report: claim+complete, replay, and each store's raw
//! conditional write through the same client, 16 concurrent calls per iteration.
//!
//! `eval "$(scripts/services up)"; cargo bench -p benches -- compare`
//!
//! It runs every backend registered in `idem_once::drivers()`, each in a place of its own (its
//! driver's isolation) with its driver's raw baseline. A backend whose service is not
//! configured is skipped, with one line saying so.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use futures::future::join_all;
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{Backend, Fingerprint, Key};
use idem_once::backend::driver::{Options, RawWrite, Store};

const RETENTION: Duration = Duration::from_secs(600);
const CONCURRENCY: u64 = 16;
const BODY: &[u8] = br#"{"receipt":"r-000001","amount_cents":1999,"ok":true}"#;

static NEXT: AtomicU64 = AtomicU64::new(0);

fn fresh() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn claim(id: u64) -> Claim {
    Claim {
        key: Key::new("compare", id.to_string()).expect("key"),
        owner: "bench".into(),
        lease_ttl: Duration::from_secs(30),
        fingerprint: Some(Fingerprint::of(BODY)),
        max_attempts: 5,
        retention: RETENTION,
    }
}

struct Subject {
    name: &'static str,
    backend: Arc<dyn Backend>,
    raw: Arc<dyn RawWrite>,
    store: Box<dyn Store>,
}

/// Every registered backend whose test server is configured, each in a place of its own;
/// prints one line for each that is skipped.
async fn subjects() -> Vec<Subject> {
    let mut out = Vec::new();
    for registered in idem_once::drivers() {
        let Some(driver) = registered.driver else {
            println!("compare: {} skipped: not compiled in", registered.name);
            continue;
        };
        let url = match driver.test_url() {
            Ok(url) => url,
            Err(e) => {
                println!("compare: {} skipped: {e}", driver.name());
                continue;
            }
        };
        let options = Options::new()
            .with_connections(32)
            .with_isolation(&format!("compare_{}", std::process::id()));
        let store = driver.open(&url, &options).await.expect("open the store");
        let raw = store.raw().await.expect("the raw baseline");
        out.push(Subject {
            name: driver.name(),
            backend: store.backend(),
            raw,
            store,
        });
    }
    out
}

async fn claim_complete(backend: &dyn Backend) {
    let ClaimOutcome::Acquired(lease) = backend.claim(&claim(fresh())).await.expect("claim") else {
        panic!("fresh key not acquired");
    };
    backend
        .complete(&lease, Bytes::from_static(BODY), RETENTION)
        .await
        .expect("complete");
}

fn compare(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let subjects = rt.block_on(subjects());
    let mut g = c.benchmark_group("compare");
    g.throughput(Throughput::Elements(CONCURRENCY));
    let body = Bytes::from_static(BODY);
    for s in &subjects {
        g.bench_function(BenchmarkId::new("raw", s.name), |b| {
            b.to_async(&rt).iter(|| {
                join_all((0..CONCURRENCY).map(|_| async {
                    let key = [format!("raw-{}", fresh())];
                    s.raw.insert(&key, &body).await.expect("raw insert");
                }))
            })
        });
        g.bench_function(BenchmarkId::new("claim_complete", s.name), |b| {
            b.to_async(&rt)
                .iter(|| join_all((0..CONCURRENCY).map(|_| claim_complete(s.backend.as_ref()))))
        });
        let done = claim(u64::MAX);
        rt.block_on(async {
            if let ClaimOutcome::Acquired(l) = s.backend.claim(&done).await.expect("claim") {
                let body = Bytes::from_static(BODY);
                s.backend
                    .complete(&l, body, RETENTION)
                    .await
                    .expect("complete");
            }
        });
        g.bench_function(BenchmarkId::new("replay", s.name), |b| {
            b.to_async(&rt).iter(|| {
                join_all((0..CONCURRENCY).map(|_| async {
                    let answer = s.backend.claim(&done).await.expect("replay");
                    assert!(matches!(answer, ClaimOutcome::Completed(_)));
                }))
            })
        });
    }
    g.finish();
    for s in subjects {
        rt.block_on(s.store.close())
            .expect("remove the bench's place");
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(20);
    targets = compare
}
criterion_main!(benches);
