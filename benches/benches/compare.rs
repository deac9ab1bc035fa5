//! Every configured backend in one report: claim+complete, replay, and each store's raw
//! conditional write through the same client, 16 concurrent calls per iteration.
//!
//! `eval "$(scripts/services up)"; cargo bench -p benches -- compare`
//!
//! A backend whose service is not configured is skipped, with one line saying so.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use futures::future::join_all;
use idem_core::{Backend, Claim, ClaimOutcome, Fingerprint, Key, MemoryBackend};

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

/// The store's own write-if-absent, through the backend's client.
enum Raw {
    Map(Mutex<HashMap<String, Bytes>>),
    Redis(redis::aio::ConnectionManager),
    Dynamo(aws_sdk_dynamodb::Client),
    Postgres(sqlx::PgPool),
}

impl Raw {
    async fn insert(&self, k: String) {
        match self {
            Raw::Map(map) => {
                let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
                map.entry(k).or_insert_with(|| Bytes::from_static(BODY));
            }
            Raw::Redis(conn) => {
                let mut conn = conn.clone();
                redis::cmd("SET")
                    .arg(format!("idem:compare:{k}"))
                    .arg(BODY)
                    .arg("NX")
                    .arg("PX")
                    .arg(RETENTION.as_millis() as u64)
                    .query_async::<redis::Value>(&mut conn)
                    .await
                    .expect("SET NX PX");
            }
            Raw::Dynamo(client) => {
                use aws_sdk_dynamodb::primitives::Blob;
                use aws_sdk_dynamodb::types::AttributeValue;
                client
                    .put_item()
                    .table_name(DYNAMO_TABLE)
                    .item("pk", AttributeValue::S(format!("raw/{k}")))
                    .item("v", AttributeValue::B(Blob::new(BODY)))
                    .condition_expression("attribute_not_exists(pk)")
                    .send()
                    .await
                    .expect("conditional PutItem");
            }
            Raw::Postgres(pool) => {
                sqlx::query(
                    "INSERT INTO idem_compare.raw (k, v) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                )
                .bind(k)
                .bind(BODY)
                .execute(pool)
                .await
                .expect("raw insert");
            }
        }
    }
}

struct Subject {
    name: &'static str,
    backend: Arc<dyn Backend>,
    raw: Raw,
}

/// The configured backends; prints one line for each that is skipped.
async fn subjects() -> Vec<Subject> {
    let mut out = vec![Subject {
        name: "memory",
        backend: Arc::new(MemoryBackend::new()),
        raw: Raw::Map(Mutex::default()),
    }];
    match std::env::var("IDEM_REDIS_URL") {
        Ok(url) => out.push(redis_subject(&url).await),
        Err(_) => println!(
            "compare: redis skipped: IDEM_REDIS_URL is not set (eval \"$(scripts/services up)\")"
        ),
    }
    match std::env::var("IDEM_DYNAMO_ENDPOINT") {
        Ok(endpoint) => out.push(dynamo_subject(&endpoint).await),
        Err(_) => println!(
            "compare: dynamodb skipped: IDEM_DYNAMO_ENDPOINT is not set (eval \"$(scripts/services up)\")"
        ),
    }
    match std::env::var("IDEM_POSTGRES_URL") {
        Ok(url) => out.push(postgres(&url).await),
        Err(_) => println!(
            "compare: postgres skipped: IDEM_POSTGRES_URL is not set (eval \"$(scripts/services up)\")"
        ),
    }
    out
}

async fn redis_subject(url: &str) -> Subject {
    use idem_redis::{RedisBackend, RedisConfig};
    let config = RedisConfig::from_urls(url).with_prefix("idem:compare:");
    let backend = RedisBackend::connect(config).await.expect("connect");
    let client = redis::Client::open(url).expect("redis URL");
    let raw = redis::aio::ConnectionManager::new(client)
        .await
        .expect("connect");
    Subject {
        name: "redis",
        backend: Arc::new(backend),
        raw: Raw::Redis(raw),
    }
}

const DYNAMO_TABLE: &str = "idem-compare";

async fn dynamo_subject(endpoint: &str) -> Subject {
    use idem_dynamo::{DynamoBackend, DynamoConfig};
    let config = DynamoConfig::local(endpoint, DYNAMO_TABLE);
    let backend = DynamoBackend::connect(config).await.expect("connect");
    backend.create_table().await.expect("create table");
    Subject {
        name: "dynamodb",
        raw: Raw::Dynamo(backend.client().clone()),
        backend: Arc::new(backend),
    }
}

async fn postgres(url: &str) -> Subject {
    use idem_postgres::{PgBackend, PgConfig};
    let config = PgConfig::new(url)
        .with_schema("idem_compare")
        .with_max_connections(32);
    let backend = PgBackend::connect(config).await.expect("connect");
    let pool = backend.pool().clone();
    for stmt in [
        "DROP SCHEMA IF EXISTS idem_compare CASCADE",
        "CREATE SCHEMA idem_compare",
    ] {
        sqlx::query(stmt)
            .execute(&pool)
            .await
            .expect("reset schema");
    }
    backend.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE idem_compare.raw (k text PRIMARY KEY, v bytea NOT NULL)")
        .execute(&pool)
        .await
        .expect("create the raw table");
    Subject {
        name: "postgres",
        backend: Arc::new(backend),
        raw: Raw::Postgres(pool),
    }
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
    for s in &subjects {
        g.bench_function(BenchmarkId::new("raw", s.name), |b| {
            b.to_async(&rt).iter(|| {
                join_all((0..CONCURRENCY).map(|_| s.raw.insert(format!("raw-{}", fresh()))))
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
