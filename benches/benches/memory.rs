//! The in-memory backend and the engine: claim+complete, replay, contention.
//!
//! `cargo bench -p benches --bench memory`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{Backend, Engine, Fingerprint, Key, MemoryBackend};

const HOUR: Duration = Duration::from_secs(3600);

fn claim(id: u64, owner: &str) -> Claim {
    Claim {
        key: Key::new("bench", id.to_string()).expect("key"),
        owner: owner.into(),
        lease_ttl: Duration::from_secs(30),
        fingerprint: Some(Fingerprint::of(b"payload")),
        max_attempts: 5,
        retention: HOUR,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn memory(c: &mut Criterion) {
    let rt = runtime();
    let backend = MemoryBackend::new();
    let next = AtomicU64::new(0);
    let response = Bytes::from_static(b"{\"ok\":true}");
    let mut g = c.benchmark_group("memory");
    g.throughput(Throughput::Elements(1));

    g.bench_function("claim_complete", |b| {
        b.to_async(&rt).iter(|| async {
            let c = claim(next.fetch_add(1, Ordering::Relaxed), "w");
            let ClaimOutcome::Acquired(lease) = backend.claim(&c).await.expect("claim") else {
                panic!("fresh key not acquired");
            };
            backend
                .complete(&lease, response.clone(), HOUR)
                .await
                .expect("complete");
        })
    });

    let done = claim(u64::MAX, "w");
    rt.block_on(async {
        if let ClaimOutcome::Acquired(lease) = backend.claim(&done).await.expect("claim") {
            backend
                .complete(&lease, response.clone(), HOUR)
                .await
                .expect("complete");
        }
    });
    g.bench_function("replay", |b| {
        b.to_async(&rt).iter(|| async {
            let answer = backend.claim(&done).await.expect("claim");
            assert!(matches!(answer, ClaimOutcome::Completed(_)));
        })
    });

    let shared = Arc::new(backend.clone());
    g.throughput(Throughput::Elements(64));
    g.bench_function("contention_64_tasks_one_key", |b| {
        b.to_async(&rt).iter(|| {
            let shared = Arc::clone(&shared);
            let id = next.fetch_add(1, Ordering::Relaxed);
            async move {
                let tasks: Vec<_> = (0..64)
                    .map(|i| {
                        let shared = Arc::clone(&shared);
                        tokio::spawn(
                            async move { shared.claim(&claim(id, &format!("w{i}"))).await },
                        )
                    })
                    .collect();
                let mut won = 0;
                for t in tasks {
                    if let Ok(Ok(ClaimOutcome::Acquired(_))) = t.await {
                        won += 1;
                    }
                }
                assert_eq!(won, 1);
            }
        })
    });
    g.finish();

    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(1));
    let dyn_backend: Arc<dyn Backend> = Arc::new(backend.clone());
    let engine = Engine::builder(dyn_backend).build().expect("engine");
    g.bench_function("execute_new_key", |b| {
        b.to_async(&rt).iter(|| async {
            let key =
                Key::new("engine", next.fetch_add(1, Ordering::Relaxed).to_string()).expect("key");
            engine
                .execute(&key, b"payload", |_| async {
                    Ok(Bytes::from_static(b"ok"))
                })
                .await
                .expect("execute");
        })
    });
    let key = Key::new("engine", "replayed").expect("key");
    g.bench_function("execute_replay", |b| {
        b.to_async(&rt).iter(|| async {
            engine
                .execute(&key, b"payload", |_| async {
                    Ok(Bytes::from_static(b"ok"))
                })
                .await
                .expect("execute");
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    targets = memory
}
criterion_main!(benches);
