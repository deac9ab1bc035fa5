//! The DynamoDB backend against the raw store, measured in the same run: claim+complete,
//! first claim, replay, lost race and contention, each next to a conditional `PutItem` of
//! the same size. Prints the ratios and the round trips per path at the end.
//!
//! `eval "$(scripts/services up dynamo)" && cargo bench -p benches --bench dynamo`
//! (skipped, with one line, when `IDEM_DYNAMO_ENDPOINT` is unset).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValuesOnConditionCheckFailure};
use bytes::Bytes;
use criterion::{Criterion, Throughput};
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{Backend, Fingerprint, Key};
use idem_dynamo::{DynamoBackend, DynamoConfig};

const TABLE: &str = "idem_bench";
const HOUR: Duration = Duration::from_secs(3600);
const RESPONSE: &[u8] = b"{\"ok\":true,\"receipt\":\"r-000000000000\"}";
const RACERS: usize = 64;

struct Bench {
    backend: DynamoBackend,
    raw: Client,
    namespace: String,
    next: AtomicU64,
}

impl Bench {
    fn key(&self) -> Key {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        Key::new(self.namespace.clone(), format!("order-{id:012}")).expect("key")
    }

    fn claim(&self, key: &Key, owner: &str) -> Claim {
        Claim {
            key: key.clone(),
            owner: owner.into(),
            lease_ttl: Duration::from_secs(30),
            fingerprint: Some(Fingerprint::of(b"payload")),
            max_attempts: 5,
            retention: HOUR,
        }
    }

    /// The raw baseline: one conditional `PutItem` (create if absent, `ALL_OLD` on failure)
    /// of an item the size of a completed record.
    async fn raw_put(&self, key: &Key) -> bool {
        let now = idem_core::Timestamp::now().as_millis();
        let n = |v: u64| AttributeValue::N(v.to_string());
        let item = HashMap::from([
            (
                "pk".to_owned(),
                AttributeValue::S(format!("{}/{}", key.namespace(), key.id())),
            ),
            ("st".to_owned(), AttributeValue::S("completed".into())),
            ("owner".to_owned(), AttributeValue::S("w".into())),
            ("tok".to_owned(), n(1)),
            ("att".to_owned(), n(1)),
            ("exp_ms".to_owned(), n(now + 3_600_000)),
            ("expires_at".to_owned(), n(now / 1000 + 3600)),
            ("fp".to_owned(), AttributeValue::B(Blob::new(vec![7u8; 32]))),
            ("resp".to_owned(), AttributeValue::B(Blob::new(RESPONSE))),
            ("v".to_owned(), n(fastrand::u64(..))),
        ]);
        let sent = self
            .raw
            .put_item()
            .table_name(TABLE)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(pk)")
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match sent {
            Ok(_) => true,
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_conditional_check_failed_exception()) =>
            {
                false
            }
            Err(e) => panic!("raw put: {e:?}"),
        }
    }

    async fn claim_complete(&self, key: &Key) {
        let ClaimOutcome::Acquired(lease) = self
            .backend
            .claim(&self.claim(key, "w"))
            .await
            .expect("claim")
        else {
            panic!("fresh key not acquired");
        };
        self.backend
            .complete(&lease, Bytes::from_static(RESPONSE), HOUR)
            .await
            .expect("complete");
    }

    /// Requests sent by `f`, for the round-trip table.
    async fn trips<F: Future<Output = ()>>(&self, f: F) -> u64 {
        let before = self.backend.requests_sent();
        f.await;
        self.backend.requests_sent() - before
    }
}

/// Runs `RACERS` tasks made by `racer` at once; how many of them won.
async fn winners<F, Fut>(racer: F) -> usize
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = bool> + Send + 'static,
{
    let tasks: Vec<_> = (0..RACERS).map(|i| tokio::spawn(racer(i))).collect();
    let mut won = 0;
    for t in tasks {
        if t.await.expect("racer") {
            won += 1;
        }
    }
    won
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn setup(endpoint: String) -> Bench {
    let config = DynamoConfig::local(endpoint, TABLE);
    let backend = DynamoBackend::connect(config).await.expect("connect");
    backend.create_table().await.expect("create table");
    Bench {
        raw: backend.client().clone(),
        backend,
        namespace: format!("bench-{}", fastrand::u64(..)),
        next: AtomicU64::new(0),
    }
}

fn dynamo(c: &mut Criterion, rt: &tokio::runtime::Runtime, bench: &Arc<Bench>) {
    let mut g = c.benchmark_group("dynamo");
    g.throughput(Throughput::Elements(1));
    let b = bench.as_ref();

    g.bench_function("raw_conditional_put", |t| {
        t.to_async(rt)
            .iter(|| async { assert!(b.raw_put(&b.key()).await) })
    });
    g.bench_function("first_claim", |t| {
        t.to_async(rt).iter(|| async {
            let answer = b
                .backend
                .claim(&b.claim(&b.key(), "w"))
                .await
                .expect("claim");
            assert!(matches!(answer, ClaimOutcome::Acquired(_)));
        })
    });
    g.bench_function("claim_complete", |t| {
        t.to_async(rt)
            .iter(|| async { b.claim_complete(&b.key()).await })
    });

    g.bench_function("complete", |t| {
        t.to_async(rt).iter_custom(|iters| async move {
            let mut leases = Vec::new();
            for _ in 0..iters {
                let claim = b.claim(&b.key(), "w");
                match b.backend.claim(&claim).await.expect("claim") {
                    ClaimOutcome::Acquired(lease) => leases.push(lease),
                    other => panic!("fresh key not acquired: {other:?}"),
                }
            }
            let start = std::time::Instant::now();
            for lease in &leases {
                let body = Bytes::from_static(RESPONSE);
                b.backend
                    .complete(lease, body, HOUR)
                    .await
                    .expect("complete");
            }
            start.elapsed()
        })
    });

    let done = b.key();
    rt.block_on(b.claim_complete(&done));
    g.bench_function("replay", |t| {
        t.to_async(rt).iter(|| async {
            let answer = b
                .backend
                .claim(&b.claim(&done, "dup"))
                .await
                .expect("claim");
            assert!(matches!(answer, ClaimOutcome::Completed(_)));
        })
    });

    let held = b.key();
    rt.block_on(async {
        b.backend
            .claim(&b.claim(&held, "holder"))
            .await
            .expect("claim")
    });
    g.bench_function("lost_race", |t| {
        t.to_async(rt).iter(|| async {
            let answer = b
                .backend
                .claim(&b.claim(&held, "loser"))
                .await
                .expect("claim");
            assert!(matches!(answer, ClaimOutcome::InProgress { .. }));
        })
    });
    let taken = b.key();
    rt.block_on(async { assert!(b.raw_put(&taken).await) });
    g.bench_function("raw_conditional_put_refused", |t| {
        t.to_async(rt)
            .iter(|| async { assert!(!b.raw_put(&taken).await) })
    });

    g.throughput(Throughput::Elements(RACERS as u64));
    g.bench_function("contention_64_claims_one_key", |t| {
        t.to_async(rt).iter(|| {
            let bench = Arc::clone(bench);
            async move {
                let key = bench.key();
                let won = winners(|i| {
                    let (bench, key) = (Arc::clone(&bench), key.clone());
                    async move {
                        let claim = bench.claim(&key, &format!("w{i}"));
                        let answer = bench.backend.claim(&claim).await.expect("claim");
                        matches!(answer, ClaimOutcome::Acquired(_))
                    }
                })
                .await;
                assert_eq!(won, 1);
            }
        })
    });
    g.bench_function("raw_contention_64_puts_one_key", |t| {
        t.to_async(rt).iter(|| {
            let bench = Arc::clone(bench);
            async move {
                let key = bench.key();
                let won = winners(|_| {
                    let (bench, key) = (Arc::clone(&bench), key.clone());
                    async move { bench.raw_put(&key).await }
                })
                .await;
                assert_eq!(won, 1);
            }
        })
    });
    g.finish();
}

/// Requests per message on each path, counted on the wire.
fn round_trips(rt: &tokio::runtime::Runtime, b: &Bench) {
    rt.block_on(async {
        let key = b.key();
        let first = b
            .trips(async {
                let a = b.backend.claim(&b.claim(&key, "w")).await.expect("claim");
                assert!(matches!(a, ClaimOutcome::Acquired(_)));
            })
            .await;
        let lost = b
            .trips(async {
                let a = b.backend.claim(&b.claim(&key, "x")).await.expect("claim");
                assert!(matches!(a, ClaimOutcome::InProgress { .. }));
            })
            .await;
        let done = b.key();
        let full = b.trips(b.claim_complete(&done)).await;
        let dup = b
            .trips(async {
                let a = b.backend.claim(&b.claim(&done, "y")).await.expect("claim");
                assert!(matches!(a, ClaimOutcome::Completed(_)));
            })
            .await;
        println!(
            "round trips per message: first claim {first}, claim+complete {full}, \
             duplicate {dup}, lost race {lost}"
        );
    });
}

/// A finished benchmark's time per iteration, from criterion's estimates, in ns.
fn mean_ns(id: &str) -> Option<f64> {
    let root = std::env::var_os("CRITERION_HOME")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("CARGO_TARGET_DIR").map(|d| PathBuf::from(d).join("criterion"))
        })
        .unwrap_or_else(|| PathBuf::from("../target/criterion"));
    let text =
        std::fs::read_to_string(root.join("dynamo").join(id).join("new/estimates.json")).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    // The figure criterion prints: the slope where it fits one, else the mean.
    let slope = json["slope"]["point_estimate"].as_f64();
    slope.or_else(|| json["mean"]["point_estimate"].as_f64())
}

fn ratios() {
    let pairs = [
        ("first_claim", "raw_conditional_put"),
        ("complete", "raw_conditional_put"),
        ("claim_complete", "raw_conditional_put"),
        ("replay", "raw_conditional_put_refused"),
        ("lost_race", "raw_conditional_put_refused"),
        (
            "contention_64_claims_one_key",
            "raw_contention_64_puts_one_key",
        ),
    ];
    for (ours, raw) in pairs {
        match (mean_ns(ours), mean_ns(raw)) {
            (Some(a), Some(b)) => println!(
                "ratio {ours} / {raw}: {:.2} ({:.0} us vs {:.0} us)",
                a / b,
                a / 1000.0,
                b / 1000.0
            ),
            _ => println!("ratio {ours} / {raw}: no estimates found"),
        }
    }
}

fn main() {
    let Ok(endpoint) = std::env::var("IDEM_DYNAMO_ENDPOINT") else {
        println!(
            "dynamo bench skipped: IDEM_DYNAMO_ENDPOINT is unset (eval \"$(scripts/services up dynamo)\")"
        );
        return;
    };
    let rt = runtime();
    let bench = Arc::new(rt.block_on(setup(endpoint)));
    let mut c = Criterion::default()
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(2))
        .configure_from_args();
    dynamo(&mut c, &rt, &bench);
    c.final_summary();
    round_trips(&rt, &bench);
    // `--test` runs each benchmark once and measures nothing: no ratios to show.
    if !std::env::args().any(|a| a == "--test") {
        ratios();
    }
}
