//! The layers on the in-memory backend: each does what its docs say, and nothing else.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use idem_core::backend::{Claim, ClaimOutcome, Settlement};
use idem_core::layer::{
    Around, BackendExt, Call, ChaosLayer, Fault, Layered, ObserveLayer, RetryLayer, TimeoutLayer,
};
use idem_core::{Backend, Error, FailureKind, Key, Lease, MemoryBackend, State};

const HOUR: Duration = Duration::from_secs(3600);

fn claim(id: &str) -> Claim {
    Claim {
        key: Key::new("layers", id).expect("key"),
        owner: "w1".into(),
        lease_ttl: Duration::from_secs(30),
        fingerprint: None,
        max_attempts: 3,
        retention: HOUR,
    }
}

async fn acquire(backend: &impl Backend, id: &str) -> Lease {
    match backend.claim(&claim(id)).await.expect("claim") {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("{id}: expected Acquired, got {other:?}"),
    }
}

/// Retries fast, so the tests do not wait on backoff.
fn retry() -> RetryLayer {
    RetryLayer::new()
        .with_tries(3)
        .with_first_backoff(Duration::from_millis(1))
}

#[tokio::test(start_paused = true)]
async fn timeout_answers_unavailable_and_a_fast_call_passes() {
    let chaos = ChaosLayer::new().with_delay(Duration::from_millis(200));
    let slow = MemoryBackend::new()
        .layer(chaos)
        .layer(TimeoutLayer::new(Duration::from_millis(50)));
    let started = tokio::time::Instant::now();
    match slow.claim(&claim("slow")).await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(
                message.contains("claim: no answer within 50ms"),
                "{message}"
            )
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::from_millis(50));
    let fast = MemoryBackend::new().layer(TimeoutLayer::new(Duration::from_millis(50)));
    acquire(&fast, "fast").await;
}

#[tokio::test]
async fn switched_faults_refuse_only_their_calls() {
    let chaos = ChaosLayer::new();
    let backend = MemoryBackend::new().layer(chaos.clone());
    let lease = acquire(&backend, "k").await;
    chaos.set(Fault::Complete, true);
    let done = backend
        .complete(&lease, Bytes::from_static(b"r"), HOUR)
        .await;
    assert!(matches!(done, Err(Error::Unavailable { .. })), "{done:?}");
    let batch = [Settlement::complete(
        lease.clone(),
        Bytes::from_static(b"r"),
    )];
    let done = backend.settle_many(&batch, HOUR).await;
    assert!(matches!(done, Err(Error::Unavailable { .. })), "{done:?}");
    // Reads and extends are not switched: they reach the store, which never saw a complete.
    let record = backend.get(&lease.key).await.expect("get").expect("record");
    assert_eq!(record.state, State::Processing);
    backend
        .extend(&lease, Duration::from_secs(30))
        .await
        .expect("extend");
    chaos.set(Fault::Complete, false);
    backend
        .complete(&lease, Bytes::from_static(b"r"), HOUR)
        .await
        .expect("complete once the fault is off");
}

#[tokio::test]
async fn a_lost_answer_is_unavailable_though_the_write_landed() {
    let chaos = ChaosLayer::new();
    let backend = MemoryBackend::new().layer(chaos.clone());
    let lease = acquire(&backend, "k").await;
    chaos.lose_next_answers(1);
    let done = backend
        .complete(&lease, Bytes::from_static(b"r"), HOUR)
        .await;
    assert!(matches!(done, Err(Error::Unavailable { .. })), "{done:?}");
    let record = backend
        .inner()
        .get(&lease.key)
        .await
        .expect("get")
        .expect("record");
    assert_eq!(record.state, State::Completed);
}

#[tokio::test]
async fn retry_recovers_refused_calls_and_gives_up_after_its_tries() {
    let chaos = ChaosLayer::new();
    let backend = MemoryBackend::new().layer(chaos.clone()).layer(retry());
    chaos.refuse_next(2);
    acquire(&backend, "twice refused").await;
    chaos.refuse_next(3);
    let answer = backend.claim(&claim("thrice refused")).await;
    assert!(
        matches!(answer, Err(Error::Unavailable { .. })),
        "{answer:?}"
    );
}

/// Counts the calls that reach the backend inside it.
#[derive(Clone, Default)]
struct Count(Arc<AtomicU32>);

impl Around for Count {
    fn around<'a, T: Send + 'a>(
        &'a self,
        _call: Call<'a>,
        next: BoxFuture<'a, idem_core::Result<T>>,
    ) -> BoxFuture<'a, idem_core::Result<T>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        next
    }
}

#[tokio::test]
async fn retry_never_retries_a_final_answer() {
    let count = Count::default();
    let backend = Layered::new(MemoryBackend::new(), count.clone()).layer(retry());
    let stale = acquire(&backend, "k").await;
    backend
        .complete(&stale, Bytes::from_static(b"r"), HOUR)
        .await
        .expect("complete");
    let before = count.0.load(Ordering::SeqCst);
    let done = backend
        .complete(&stale, Bytes::from_static(b"x"), HOUR)
        .await;
    assert!(matches!(done, Err(Error::Fenced { .. })), "{done:?}");
    assert_eq!(
        count.0.load(Ordering::SeqCst) - before,
        1,
        "a fenced complete was retried"
    );
}

#[tokio::test]
async fn retry_answers_ok_where_its_lost_write_landed() {
    let chaos = ChaosLayer::new();
    let backend = MemoryBackend::new().layer(chaos.clone()).layer(retry());

    let lease = acquire(&backend, "complete").await;
    chaos.lose_next_answers(1);
    let done = backend
        .complete(&lease, Bytes::from_static(b"r"), HOUR)
        .await;
    assert!(
        done.is_ok(),
        "a retried complete meeting its own write: {done:?}"
    );

    let lease = acquire(&backend, "fail").await;
    chaos.lose_next_answers(1);
    let done = backend.fail(&lease, "boom", FailureKind::Retry, HOUR).await;
    assert!(
        done.is_ok(),
        "a retried fail meeting its own write: {done:?}"
    );

    let lease = acquire(&backend, "release").await;
    chaos.lose_next_answers(1);
    backend
        .release(&lease)
        .await
        .expect("a retried release meeting its own write");
    acquire(&backend, "release").await; // handed back: taken over at once

    let a = acquire(&backend, "batch-a").await;
    let b = acquire(&backend, "batch-b").await;
    let items = [
        Settlement::complete(a, Bytes::from_static(b"ra")),
        Settlement::complete(b.clone(), Bytes::from_static(b"rb")),
    ];
    chaos.lose_next_answers(1);
    let answers = backend
        .settle_many(&items, HOUR)
        .await
        .expect("settle_many");
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");

    // A write that did not land stays fenced after a retry: another worker's lease.
    backend
        .inner()
        .complete(&b, Bytes::from_static(b"rb"), HOUR)
        .await
        .expect_err("already completed");
    let mut foreign = acquire(&backend, "foreign").await;
    foreign.token += 1;
    chaos.lose_next_answers(1);
    let done = backend
        .complete(&foreign, Bytes::from_static(b"r"), HOUR)
        .await;
    assert!(matches!(done, Err(Error::Fenced { .. })), "{done:?}");
}

#[tokio::test]
async fn a_retried_claim_after_a_lost_grant_answers_in_progress() {
    // What RetryLayer documents for claims: the retry answers InProgress, never a lease.
    let chaos = ChaosLayer::new();
    let backend = MemoryBackend::new().layer(chaos.clone()).layer(retry());
    chaos.lose_next_answers(1);
    match backend.claim(&claim("k")).await.expect("claim") {
        ClaimOutcome::InProgress { owner, .. } => assert_eq!(&*owner, "w1"),
        other => panic!("expected InProgress by its own owner, got {other:?}"),
    }
}

#[test]
fn observe_counts_calls_by_operation_and_outcome() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let backend = MemoryBackend::new().layer(ObserveLayer::new());
            let lease = acquire(&backend, "k").await;
            backend
                .complete(&lease, Bytes::from_static(b"r"), HOUR)
                .await
                .expect("complete");
            let again = backend
                .complete(&lease, Bytes::from_static(b"r"), HOUR)
                .await;
            assert!(matches!(again, Err(Error::Fenced { .. })));
        });
    });
    let mut seen = Vec::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        if key.name() != "idem_store_calls_total" {
            continue;
        }
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        if let DebugValue::Counter(n) = value {
            seen.push((labels.join(","), n));
        }
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            ("op=claim,outcome=ok".to_owned(), 1),
            ("op=complete,outcome=fenced".to_owned(), 1),
            ("op=complete,outcome=ok".to_owned(), 1),
        ]
    );
}

/// Records each call the inner backend gets, holds call number `hold` (from 1) until
/// opened, and answers call number `fail` with a store error.
struct Gate {
    calls: std::sync::Mutex<Vec<(idem_core::layer::Op, usize)>>,
    entered: tokio::sync::Notify,
    open: tokio::sync::Semaphore,
    hold: usize,
    fail: Option<usize>,
}

impl Gate {
    fn new(hold: usize, fail: Option<usize>) -> Arc<Self> {
        Arc::new(Gate {
            calls: std::sync::Mutex::default(),
            entered: tokio::sync::Notify::new(),
            open: tokio::sync::Semaphore::new(0),
            hold,
            fail,
        })
    }
}

#[derive(Clone)]
struct GateRef(Arc<Gate>);

impl Around for GateRef {
    fn around<'a, T: Send + 'a>(
        &'a self,
        call: Call<'a>,
        next: BoxFuture<'a, idem_core::Result<T>>,
    ) -> BoxFuture<'a, idem_core::Result<T>> {
        let gate = &self.0;
        let number = {
            let mut calls = gate.calls.lock().expect("calls");
            calls.push((call.op, call.items));
            calls.len()
        };
        Box::pin(async move {
            if number == gate.hold {
                gate.entered.notify_one();
                gate.open.acquire().await.expect("gate").forget();
            }
            if gate.fail == Some(number) {
                return Err(Error::unavailable("the gate fails this call", "test"));
            }
            next.await
        })
    }
}

/// Single claims made while one is in flight go out together as one `claim_many`, each
/// answered as alone (a key claimed twice in the batch: the second finds it in progress),
/// and completes go out as `settle_many`: the inner backend sees no single call.
#[tokio::test]
async fn coalesce_joins_single_calls_made_while_one_is_in_flight() {
    use idem_core::layer::{Coalesce, Op};
    let gate = Gate::new(1, None);
    let backend = Coalesce::new(Layered::new(
        MemoryBackend::new(),
        GateRef(Arc::clone(&gate)),
    ));
    let backend = &backend;

    let k0 = claim("k0");
    let mut first = Box::pin(backend.claim(&k0));
    assert!(futures::poll!(&mut first).is_pending());
    gate.entered.notified().await;
    let mut rest: Vec<_> = (1..9)
        .map(|i| claim(&format!("k{i}")))
        .chain([Claim {
            owner: "w2".into(),
            ..claim("k1")
        }])
        .map(|c| Box::pin(async move { backend.claim(&c).await }))
        .collect();
    for f in &mut rest {
        assert!(futures::poll!(f).is_pending());
    }
    gate.open.add_permits(1);
    let first = first.await.expect("claim k0");
    let answers = futures::future::join_all(rest).await;

    let mut leases = vec![match first {
        ClaimOutcome::Acquired(l) => l,
        other => panic!("k0: {other:?}"),
    }];
    for (i, answer) in answers.into_iter().enumerate() {
        match (i, answer.expect("claim")) {
            (8, ClaimOutcome::InProgress { owner, .. }) => assert_eq!(&*owner, "w1"),
            (i, ClaimOutcome::Acquired(l)) if i < 8 => leases.push(l),
            (i, other) => panic!("claim {i}: {other:?}"),
        }
    }
    let completes = leases
        .iter()
        .map(|l| backend.complete(l, Bytes::from_static(b"r"), HOUR));
    for done in futures::future::join_all(completes).await {
        done.expect("complete");
    }
    for lease in &leases {
        let record = backend.get(&lease.key).await.expect("get").expect("record");
        assert_eq!(record.state, State::Completed);
    }

    let calls = gate.calls.lock().expect("calls").clone();
    let claims: Vec<_> = calls
        .iter()
        .filter(|(op, _)| *op == Op::ClaimMany)
        .collect();
    assert_eq!(claims, [&(Op::ClaimMany, 1), &(Op::ClaimMany, 9)]);
    let settled: usize = calls
        .iter()
        .filter(|(op, _)| *op == Op::SettleMany)
        .map(|(_, n)| n)
        .sum();
    assert_eq!(settled, 9);
    assert!(
        calls
            .iter()
            .all(|(op, _)| matches!(op, Op::ClaimMany | Op::SettleMany | Op::Get)),
        "{calls:?}"
    );
}

/// Settles queued behind one in flight go out as one `settle_many` per retention; when
/// the second run fails, the first run's answers stand and only the second run's calls
/// see the error.
#[tokio::test]
async fn coalesce_splits_settles_by_retention_and_keeps_earlier_answers() {
    use idem_core::layer::{Coalesce, Op};
    // Calls 1-3 claim, call 4 (a's complete) is held, then b's run and c's run go out:
    // call 6, c's, fails.
    let gate = Gate::new(4, Some(6));
    let backend = Coalesce::new(Layered::new(
        MemoryBackend::new(),
        GateRef(Arc::clone(&gate)),
    ));
    let (a, b, c) = (
        acquire(&backend, "a").await,
        acquire(&backend, "b").await,
        acquire(&backend, "c").await,
    );
    let r = || Bytes::from_static(b"r");
    let mut first = Box::pin(backend.complete(&a, r(), HOUR));
    assert!(futures::poll!(&mut first).is_pending());
    gate.entered.notified().await;
    let mut second = Box::pin(backend.complete(&b, r(), HOUR));
    let mut third = Box::pin(backend.complete(&c, r(), 2 * HOUR));
    assert!(futures::poll!(&mut second).is_pending());
    assert!(futures::poll!(&mut third).is_pending());
    gate.open.add_permits(1);

    first.await.expect("a completes");
    second
        .await
        .expect("b completes in the run before the failing one");
    match third.await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("the gate fails"), "{message}")
        }
        other => panic!("c: expected the run's error, got {other:?}"),
    }
    for (lease, state) in [
        (&a, State::Completed),
        (&b, State::Completed),
        (&c, State::Processing),
    ] {
        let record = backend.get(&lease.key).await.expect("get").expect("record");
        assert_eq!(record.state, state, "{}", lease.key);
    }
    let calls = gate.calls.lock().expect("calls").clone();
    assert_eq!(
        calls[3..6],
        [
            (Op::SettleMany, 1),
            (Op::SettleMany, 1),
            (Op::SettleMany, 1)
        ]
    );
}

/// Outside a Tokio runtime the first caller sends the batch itself.
#[test]
fn coalesce_works_outside_a_tokio_runtime() {
    let backend = idem_core::layer::Coalesce::new(MemoryBackend::new());
    futures::executor::block_on(async {
        let lease = acquire(&backend, "outside").await;
        backend
            .complete(&lease, Bytes::from_static(b"r"), HOUR)
            .await
            .expect("complete");
        let record = backend.get(&lease.key).await.expect("get").expect("record");
        assert_eq!(record.state, State::Completed);
    });
}
