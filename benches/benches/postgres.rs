//! PostgreSQL: claim+complete, replay, contention, claim_many and transactional mode, each
//! beside a raw baseline through the same pool in the same run. Also, for issue 14's
//! single-key cell: claim+complete behind idem-core's `Coalesce`, and two designs on the
//! raw table (`design_two_commits`, `design_async_claim`).
//!
//! `eval "$(scripts/services up postgres)"; cargo bench -p benches --bench postgres`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use futures::FutureExt;
use futures::future::join_all;
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{Backend, Fingerprint, Key, Transactional};
use idem_postgres::{OffsetPosition, PgBackend, PgConfig, PgTransaction};

const HOUR: Duration = Duration::from_secs(3600);
const CONCURRENCY: u64 = 16;

static NEXT: AtomicU64 = AtomicU64::new(0);

fn claim(id: u64) -> Claim {
    Claim {
        key: Key::new("bench", id.to_string()).expect("key"),
        owner: "bench".into(),
        lease_ttl: Duration::from_secs(30),
        fingerprint: Some(Fingerprint::of(b"payload")),
        max_attempts: 5,
        retention: HOUR,
    }
}

fn fresh() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

async fn setup(url: &str) -> PgBackend {
    let config = PgConfig::new(url)
        .with_schema("idem_bench")
        .with_max_connections(32);
    let backend = PgBackend::connect(config).await.expect("connect");
    let pool = backend.pool().clone();
    for stmt in [
        "DROP SCHEMA IF EXISTS idem_bench CASCADE",
        "CREATE SCHEMA idem_bench",
    ] {
        sqlx::query(stmt)
            .execute(&pool)
            .await
            .expect("reset schema");
    }
    backend.migrate().await.expect("migrate");
    for stmt in [
        "CREATE TABLE idem_bench.raw (k text PRIMARY KEY, v bytea)",
        "CREATE TABLE idem_bench.ledger (k text NOT NULL, cents int NOT NULL)",
    ] {
        sqlx::query(stmt)
            .execute(&pool)
            .await
            .expect("create bench tables");
    }
    backend
}

fn postgres(c: &mut Criterion) {
    let Ok(url) = std::env::var("IDEM_POSTGRES_URL") else {
        println!(
            "postgres bench skipped: IDEM_POSTGRES_URL is not set (eval \"$(scripts/services up)\")"
        );
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let backend = Arc::new(rt.block_on(setup(&url)));
    let pool = backend.pool().clone();
    let body = Bytes::from_static(b"{\"receipt\":\"r-1\",\"ok\":true}");

    let mut g = c.benchmark_group("postgres");
    g.throughput(Throughput::Elements(CONCURRENCY));
    g.bench_function("raw_insert_on_conflict", |b| {
        b.to_async(&rt).iter(|| {
            join_all((0..CONCURRENCY).map(|_| {
                sqlx::query(
                    "INSERT INTO idem_bench.raw (k, v) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                )
                .bind(fresh().to_string())
                .bind(body.as_ref())
                .execute(&pool)
                .map(|r| r.expect("raw insert"))
            }))
        })
    });
    // `_coalesced`: the same calls joined by idem-core's `Coalesce` layer: claims made
    // while one is in flight go out as one `claim_many`, completes as one `settle_many`.
    let coalesced = idem_core::layer::Coalesce::new((*backend).clone());
    let subjects: [(&str, Arc<dyn Backend>); 2] = [
        ("claim_complete", Arc::clone(&backend) as Arc<dyn Backend>),
        ("claim_complete_coalesced", Arc::new(coalesced)),
    ];
    for (name, subject) in subjects {
        g.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                join_all((0..CONCURRENCY).map(|_| {
                    let (backend, body) = (Arc::clone(&subject), body.clone());
                    async move {
                        let ClaimOutcome::Acquired(l) =
                            backend.claim(&claim(fresh())).await.expect("claim")
                        else {
                            panic!("fresh key not acquired");
                        };
                        backend.complete(&l, body, HOUR).await.expect("complete");
                    }
                }))
            })
        });
    }
    // Two designs the backend does not use (issue 14), on the raw table: what any
    // claim+complete costs that commits its claim durably (two plain statements, two
    // synchronous commits), and the same with the claim's commit asynchronous (as
    // transactional mode's claim commits; in lease mode a server crash could then lose a
    // claim whose side effect has run).
    for (name, insert) in [
        (
            "design_two_commits",
            "INSERT INTO idem_bench.raw (k, v) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1",
        ),
        (
            "design_async_claim",
            "INSERT INTO idem_bench.raw (k, v) VALUES ($1, $2) ON CONFLICT DO NOTHING \
             RETURNING set_config('synchronous_commit', 'off', true)",
        ),
    ] {
        g.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                join_all((0..CONCURRENCY).map(|_| {
                    let (pool, body, k) = (pool.clone(), body.clone(), fresh().to_string());
                    async move {
                        let claimed = sqlx::query(insert)
                            .bind(&k)
                            .bind(&b"processing"[..])
                            .fetch_optional(&pool)
                            .await
                            .expect("claim insert");
                        assert!(claimed.is_some(), "fresh key taken");
                        sqlx::query("UPDATE idem_bench.raw SET v = $2 WHERE k = $1")
                            .bind(&k)
                            .bind(body.as_ref())
                            .execute(&pool)
                            .await
                            .expect("complete update");
                    }
                }))
            })
        });
    }
    let done = claim(u64::MAX);
    rt.block_on(async {
        if let ClaimOutcome::Acquired(l) = backend.claim(&done).await.expect("claim") {
            backend
                .complete(&l, body.clone(), HOUR)
                .await
                .expect("complete");
        }
    });
    g.bench_function("replay", |b| {
        b.to_async(&rt).iter(|| {
            join_all((0..CONCURRENCY).map(|_| backend.claim(&done).map(|r| r.expect("replay"))))
        })
    });
    g.bench_function("contention_one_key", |b| {
        b.to_async(&rt).iter(|| {
            let id = fresh();
            let backend = &backend;
            join_all((0..CONCURRENCY).map(move |_| {
                let backend = Arc::clone(backend);
                async move { backend.claim(&claim(id)).await.expect("claim") }
            }))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("postgres_claim_many");
    for batch in [1u64, 16, 128] {
        g.throughput(Throughput::Elements(batch * 4));
        g.bench_with_input(BenchmarkId::from_parameter(batch), &batch, |b, &batch| {
            b.to_async(&rt).iter(|| {
                join_all((0..4).map(|_| {
                    let claims: Vec<Claim> = (0..batch).map(|_| claim(fresh())).collect();
                    let backend = Arc::clone(&backend);
                    async move { backend.claim_many(&claims).await.expect("claim_many") }
                }))
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("postgres_transactional");
    g.throughput(Throughput::Elements(CONCURRENCY));
    g.bench_function("raw_transaction", |b| {
        b.to_async(&rt).iter(|| {
            join_all((0..CONCURRENCY).map(|p| {
                let pool = pool.clone();
                async move {
                    let k = fresh().to_string();
                    let partition = i32::try_from(p).unwrap_or(0);
                    let mut tx = pool.begin().await.expect("begin");
                    sqlx::query("INSERT INTO idem_bench.ledger (k, cents) VALUES ($1, 1999)")
                        .bind(&k)
                        .execute(&mut *tx)
                        .await
                        .expect("business insert");
                    sqlx::query("INSERT INTO idem_bench.raw (k, v) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                        .bind(&k)
                        .bind(&b"ok"[..])
                        .execute(&mut *tx)
                        .await
                        .expect("record insert");
                    sqlx::query(
                        "INSERT INTO idem_bench.idem_offsets (consumer_group, topic, partition, next_offset) \
                         VALUES ('raw', 't', $1, 2) ON CONFLICT (consumer_group, topic, partition) \
                         DO UPDATE SET next_offset = excluded.next_offset",
                    )
                    .bind(partition)
                    .execute(&mut *tx)
                    .await
                    .expect("offset");
                    tx.commit().await.expect("commit");
                }
            }))
        })
    });
    g.bench_function("execute_in_transaction", |b| {
        b.to_async(&rt).iter(|| {
            join_all((0..CONCURRENCY).map(|p| {
                let backend = Arc::clone(&backend);
                async move {
                    let c = claim(fresh());
                    let at = OffsetPosition {
                        group: "bench".into(),
                        topic: "t".into(),
                        partition: i32::try_from(p).unwrap_or(0),
                        offset: 1,
                    };
                    let out = backend
                        .execute_in_transaction(&c, HOUR, Some(&at), |tx, _| {
                            async move {
                                sqlx::query(
                                    "INSERT INTO idem_bench.ledger (k, cents) VALUES ('x', 1999)",
                                )
                                .execute(&mut **tx)
                                .await?;
                                Ok(Bytes::from_static(b"ok"))
                            }
                            .boxed()
                        })
                        .await
                        .expect("transactional");
                    assert!(matches!(out, idem_core::Outcome::Executed(_)));
                }
            }))
        })
    });
    g.finish();

    // A poll batch per transaction against one message per transaction, at the same
    // concurrency: PARTITIONS partitions at once, each a batch of `batch` messages with one
    // business insert each. The raw baseline is the hand-rolled consumer: per batch, BEGIN,
    // the business inserts, the offset upsert, COMMIT (no idempotency records).
    let mut g = c.benchmark_group("postgres_transactional_batch");
    for batch in [1u64, 16, 64] {
        g.throughput(Throughput::Elements(batch * PARTITIONS));
        g.bench_with_input(BenchmarkId::new("raw", batch), &batch, |b, &batch| {
            b.to_async(&rt)
                .iter(|| join_all((0..PARTITIONS).map(|p| raw_batch(pool.clone(), p, batch))))
        });
        g.bench_with_input(
            BenchmarkId::new("one_per_transaction", batch),
            &batch,
            |b, &batch| {
                b.to_async(&rt).iter(|| {
                    join_all((0..PARTITIONS).map(|p| {
                        let backend = Arc::clone(&backend);
                        async move {
                            for offset in 0..batch {
                                let at = position(p, offset);
                                let out = backend
                                    .execute_in_transaction(
                                        &claim(fresh()),
                                        HOUR,
                                        Some(&at),
                                        |tx, _| ledger_insert(tx),
                                    )
                                    .await
                                    .expect("transactional");
                                assert!(matches!(out, idem_core::Outcome::Executed(_)));
                            }
                        }
                    }))
                })
            },
        );
        g.bench_with_input(BenchmarkId::new("batch", batch), &batch, |b, &batch| {
            b.to_async(&rt).iter(|| {
                join_all((0..PARTITIONS).map(|p| {
                    let backend = Arc::clone(&backend);
                    async move {
                        let claims: Vec<Claim> = (0..batch).map(|_| claim(fresh())).collect();
                        let out = backend
                            .execute_batch_in_transaction(
                                &claims,
                                HOUR,
                                |tx, _, _| ledger_insert(tx),
                                |outcomes| {
                                    let n = i64::try_from(outcomes.len()).ok()?;
                                    Some(position(p, n - 1))
                                },
                            )
                            .await
                            .expect("batch");
                        assert!(
                            out.iter()
                                .all(|o| matches!(o, idem_core::Outcome::Executed(_)))
                        );
                    }
                }))
            })
        });
    }
    g.finish();
}

/// Partitions handled at once in the batch transactional group.
const PARTITIONS: u64 = 4;

fn position(partition: u64, offset: impl TryInto<i64>) -> OffsetPosition {
    OffsetPosition {
        group: "bench".into(),
        topic: "batch".into(),
        partition: i32::try_from(partition).unwrap_or(0),
        offset: offset.try_into().unwrap_or(0),
    }
}

/// The handler: one business insert through the open transaction.
fn ledger_insert(
    tx: &mut PgTransaction,
) -> futures::future::BoxFuture<'_, Result<Bytes, idem_core::HandlerError>> {
    async move {
        sqlx::query("INSERT INTO idem_bench.ledger (k, cents) VALUES ('x', 1999)")
            .execute(&mut **tx)
            .await?;
        Ok(Bytes::from_static(b"ok"))
    }
    .boxed()
}

/// One poll batch of the hand-rolled consumer: the business inserts and the offset upsert
/// in one transaction.
async fn raw_batch(pool: sqlx::PgPool, partition: u64, batch: u64) {
    let mut tx = pool.begin().await.expect("begin");
    for _ in 0..batch {
        sqlx::query("INSERT INTO idem_bench.ledger (k, cents) VALUES ($1, 1999)")
            .bind(fresh().to_string())
            .execute(&mut *tx)
            .await
            .expect("business insert");
    }
    sqlx::query(
        "INSERT INTO idem_bench.idem_offsets (consumer_group, topic, partition, next_offset) \
         VALUES ('raw', 'batch', $1, $2) ON CONFLICT (consumer_group, topic, partition) \
         DO UPDATE SET next_offset = excluded.next_offset",
    )
    .bind(i32::try_from(partition).unwrap_or(0))
    .bind(i64::try_from(batch).unwrap_or(0))
    .execute(&mut *tx)
    .await
    .expect("offset");
    tx.commit().await.expect("commit");
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(20);
    targets = postgres
}
criterion_main!(benches);
