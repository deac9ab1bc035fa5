//! Transactional mode on a real PostgreSQL: the handler's writes, the record and the
//! offset commit together or not at all.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use idem_core::backend::{Claim, TxFuture};
use idem_core::{Backend, Fingerprint, HandlerError, Key, Outcome, State, Transactional};
use idem_postgres::{OffsetPosition, PgBackend, PgTransaction, StoredOffset};
use sqlx::AssertSqlSafe;

const HOUR: Duration = Duration::from_secs(3600);

/// A backend and a business table `ledger` in its schema.
async fn setup() -> (PgBackend, String) {
    setup_with(common::backend().await).await
}

/// A business table `ledger` in `backend`'s schema.
async fn setup_with(backend: PgBackend) -> (PgBackend, String) {
    let schema = backend.schema().to_owned();
    let ledger = format!("\"{schema}\".ledger");
    let create = format!("CREATE TABLE {ledger} (key text NOT NULL, by_task int NOT NULL)");
    sqlx::query(AssertSqlSafe(create))
        .execute(backend.pool())
        .await
        .expect("create ledger");
    (backend, ledger)
}

fn claim(key: &Key, owner: &str, lease: Duration) -> Claim {
    Claim {
        key: key.clone(),
        owner: owner.into(),
        lease_ttl: lease,
        fingerprint: Some(Fingerprint::of(b"payment")),
        max_attempts: 3,
        retention: HOUR,
    }
}

/// Offset `offset` of partition 0 of `payments`, for group `g`.
fn payments_at(offset: i64) -> OffsetPosition {
    OffsetPosition {
        group: "g".into(),
        topic: "payments".into(),
        partition: 0,
        offset,
    }
}

async fn count(backend: &PgBackend, ledger: &str) -> i64 {
    let q = format!("SELECT count(*) FROM {ledger}");
    sqlx::query_scalar(AssertSqlSafe(q))
        .fetch_one(backend.pool())
        .await
        .expect("count")
}

/// The handler: one business insert through the open transaction.
fn insert(
    ledger: String,
    key: String,
    task: i32,
) -> impl for<'t> FnOnce(&'t mut PgTransaction, idem_core::Lease) -> TxFuture<'t> + Send {
    slow_insert(ledger, key, task, Duration::ZERO)
}

/// `insert`, after `delay` of other work.
fn slow_insert(
    ledger: String,
    key: String,
    task: i32,
    delay: Duration,
) -> impl for<'t> FnOnce(&'t mut PgTransaction, idem_core::Lease) -> TxFuture<'t> + Send {
    move |tx, lease| {
        async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let q = format!("INSERT INTO {ledger} (key, by_task) VALUES ($1, $2)");
            sqlx::query(AssertSqlSafe(q))
                .bind(key)
                .bind(task)
                .execute(&mut **tx)
                .await?;
            Ok(Bytes::from(format!("task {task} token {}", lease.token)))
        }
        .boxed()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_tasks_on_one_key_leave_exactly_one_row() {
    let (backend, ledger) = setup().await;
    let backend = Arc::new(backend);
    let key = Key::new("tx", "order-1").expect("key");
    let mut tasks = Vec::new();
    for task in 0..32 {
        let (backend, ledger, key) = (Arc::clone(&backend), ledger.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let c = claim(&key, &format!("w{task}"), Duration::from_secs(10));
            loop {
                let h = insert(ledger.clone(), key.id().to_owned(), task);
                match backend.execute_in_transaction(&c, HOUR, None, h).await {
                    Ok(Outcome::InProgress { .. }) => tokio::task::yield_now().await,
                    other => return other.expect("execute"),
                }
            }
        }));
    }
    let mut executed = Vec::new();
    let mut replayed = Vec::new();
    for t in tasks {
        match t.await.expect("task") {
            Outcome::Executed(b) => executed.push(b),
            Outcome::Replayed(b) => replayed.push(b),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(executed.len(), 1, "one transaction committed");
    assert!(replayed.iter().all(|b| *b == executed[0]), "replays agree");
    assert_eq!(
        count(&backend, &ledger).await,
        1,
        "exactly one business row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_error_leaves_no_row_no_completion_and_no_offset() {
    let (backend, ledger) = setup().await;
    let key = Key::new("tx", "declined").expect("key");
    let at = payments_at(41);
    let out = backend
        .execute_in_transaction(
            &claim(&key, "a", Duration::from_secs(10)),
            HOUR,
            Some(&at),
            |tx, _| {
                let ledger = ledger.clone();
                async move {
                    let q = format!("INSERT INTO {ledger} (key, by_task) VALUES ('declined', 1)");
                    sqlx::query(AssertSqlSafe(q)).execute(&mut **tx).await?;
                    Err(HandlerError::retry("card declined"))
                }
                .boxed()
            },
        )
        .await
        .expect("execute");
    assert_eq!(
        out,
        Outcome::Failed {
            attempts: 1,
            error: "card declined".into()
        }
    );
    assert_eq!(count(&backend, &ledger).await, 0, "the insert rolled back");
    assert_eq!(backend.stored_offsets("g").await.expect("offsets"), vec![]);
    let rec = backend
        .get(&key)
        .await
        .expect("get")
        .expect("attempt recorded");
    assert_eq!((rec.state, rec.attempts), (State::Failed, 1));
    assert_eq!(rec.error.as_deref(), Some("card declined"));
}

/// A response over `max_response_bytes` is a permanent failure: the handler's writes roll
/// back, the key is poisoned with the reason, and no offset is stored.
#[tokio::test]
async fn an_oversized_response_rolls_back_and_poisons_with_the_reason() {
    let backend = common::backend_with(|c| c.with_max_response_bytes(10)).await;
    let (backend, ledger) = setup_with(backend).await;
    let key = Key::new("tx", "oversized").expect("key");
    let at = payments_at(7);
    let out = backend
        .execute_in_transaction(
            &claim(&key, "a", Duration::from_secs(10)),
            HOUR,
            Some(&at),
            insert(ledger.clone(), "oversized".into(), 1),
        )
        .await
        .expect("execute");
    let Outcome::Poisoned { attempts, error } = &out else {
        panic!("expected Poisoned, got {out:?}");
    };
    assert_eq!(*attempts, 1);
    assert!(error.contains("10"), "the reason names the limit: {error}");
    assert_eq!(count(&backend, &ledger).await, 0, "the insert rolled back");
    assert_eq!(backend.stored_offsets("g").await.expect("offsets"), vec![]);
    let rec = backend.get(&key).await.expect("get").expect("record");
    assert_eq!((rec.state, rec.permanent), (State::Failed, true));
    assert_eq!(rec.response, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_future_rolls_back_and_the_key_is_taken_over_later() {
    let (backend, ledger) = setup().await;
    let backend = Arc::new(backend);
    let key = Key::new("tx", "dropped").expect("key");
    let lease = Duration::from_millis(300);
    let at = OffsetPosition {
        group: "g".into(),
        topic: "payments".into(),
        partition: 3,
        offset: 7,
    };
    run_and_kill(
        &backend,
        &ledger,
        claim(&key, "doomed", lease),
        Some(at.clone()),
    )
    .await;
    assert_eq!(count(&backend, &ledger).await, 0, "no business row");
    assert_eq!(backend.stored_offsets("g").await.expect("offsets"), vec![]);
    let rec = backend
        .get(&key)
        .await
        .expect("get")
        .expect("attempt counted");
    assert_eq!(
        (rec.state, rec.attempts),
        (State::Processing, 1),
        "not completed"
    );

    tokio::time::sleep(lease * 2).await; // the dead worker's lease must lapse
    let out = backend
        .execute_in_transaction(
            &claim(&key, "next", lease),
            HOUR,
            Some(&at),
            insert(ledger.clone(), "dropped".into(), 2),
        )
        .await
        .expect("execute");
    assert_eq!(out, Outcome::Executed(Bytes::from("task 2 token 2")));
    assert_eq!(count(&backend, &ledger).await, 1);
    let stored = backend.stored_offsets("g").await.expect("offsets");
    assert_eq!(
        stored,
        vec![StoredOffset {
            topic: "payments".into(),
            partition: 3,
            next_offset: 8
        }]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stored_offset_is_the_one_after_the_last_committed_message() {
    let (backend, ledger) = setup().await;
    let at = |offset: i64| OffsetPosition {
        group: "orders".into(),
        topic: "payments".into(),
        partition: 1,
        offset,
    };
    let run = |id: &str, offset: i64, fail: bool| {
        let (backend, ledger) = (&backend, ledger.clone());
        let key = Key::new("tx", id).expect("key");
        async move {
            let c = claim(&key, "a", Duration::from_secs(10));
            let at = at(offset);
            if fail {
                backend
                    .execute_in_transaction(&c, HOUR, Some(&at), decline)
                    .await
            } else {
                let h = insert(
                    ledger,
                    key.id().to_owned(),
                    i32::try_from(offset).unwrap_or(0),
                );
                backend.execute_in_transaction(&c, HOUR, Some(&at), h).await
            }
        }
    };
    for offset in 0..5 {
        let out = run(&format!("m{offset}"), offset, false)
            .await
            .expect("run");
        assert!(matches!(out, Outcome::Executed(_)), "{out:?}");
    }
    let next = |n| {
        vec![StoredOffset {
            topic: "payments".into(),
            partition: 1,
            next_offset: n,
        }]
    };
    assert_eq!(
        backend.stored_offsets("orders").await.expect("offsets"),
        next(5)
    );
    let out = run("m5", 5, true).await.expect("run");
    assert!(matches!(out, Outcome::Failed { .. }), "{out:?}");
    assert_eq!(
        backend.stored_offsets("orders").await.expect("offsets"),
        next(5),
        "a failure does not move it"
    );
    let out = run("m2", 6, false).await.expect("run"); // a duplicate of offset 2, redelivered at 6
    assert!(matches!(out, Outcome::Replayed(_)), "{out:?}");
    assert_eq!(
        backend.stored_offsets("orders").await.expect("offsets"),
        next(7),
        "a replay moves it"
    );
    assert_eq!(count(&backend, &ledger).await, 5);
    assert_eq!(
        backend
            .stored_offsets("other group")
            .await
            .expect("offsets"),
        vec![]
    );
}

fn decline(
    _: &mut PgTransaction,
    _: idem_core::Lease,
) -> futures::future::BoxFuture<'_, Result<Bytes, HandlerError>> {
    async { Err(HandlerError::retry("no")) }.boxed()
}

/// Starts a transactional run (storing `at` if given) whose handler inserts, then never
/// returns; kills it (drops the future, as a killed process would) once the insert is done.
async fn run_and_kill(
    backend: &Arc<PgBackend>,
    ledger: &str,
    c: Claim,
    at: Option<OffsetPosition>,
) {
    let (inserted_tx, inserted) = tokio::sync::oneshot::channel();
    let task = tokio::spawn({
        let (backend, ledger) = (Arc::clone(backend), ledger.to_owned());
        async move {
            backend
                .execute_in_transaction(&c, HOUR, at.as_ref(), |tx, _| {
                    async move {
                        let q = format!("INSERT INTO {ledger} (key, by_task) VALUES ('k', 0)");
                        sqlx::query(AssertSqlSafe(q)).execute(&mut **tx).await?;
                        let _ = inserted_tx.send(());
                        futures::future::pending::<()>().await;
                        Ok(Bytes::new())
                    }
                    .boxed()
                })
                .await
        }
    });
    inserted.await.expect("the handler inserted");
    task.abort();
    assert!(task.await.expect_err("killed").is_cancelled());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_stays_bounded_by_max_attempts() {
    let (backend, ledger) = setup().await;
    let backend = Arc::new(backend);
    let key = Key::new("tx", "crash-loop").expect("key");
    let lease = Duration::from_millis(200);
    for attempt in 1..=3 {
        run_and_kill(
            &backend,
            &ledger,
            claim(&key, &format!("w{attempt}"), lease),
            None,
        )
        .await;
        let rec = backend.get(&key).await.expect("get").expect("record");
        assert_eq!(rec.attempts, attempt, "each killed attempt counted");
        tokio::time::sleep(lease + Duration::from_millis(50)).await; // let the lease lapse
    }
    let c = claim(&key, "last", lease);
    let out = backend
        .execute_in_transaction(&c, HOUR, None, insert(ledger.clone(), "k".into(), 9))
        .await
        .expect("execute");
    assert_eq!(
        out,
        Outcome::Poisoned {
            attempts: 3,
            error: idem_core::backend::machine::lapsed_error(3)
        }
    );
    assert_eq!(
        count(&backend, &ledger).await,
        0,
        "no killed attempt left a row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_rolls_back_and_counts_as_a_failure() {
    let (backend, ledger) = setup().await;
    let key = Key::new("tx", "panic").expect("key");
    let out = backend
        .execute_in_transaction(
            &claim(&key, "a", Duration::from_secs(10)),
            HOUR,
            None,
            |tx, _| {
                let ledger = ledger.clone();
                async move {
                    let q = format!("INSERT INTO {ledger} (key, by_task) VALUES ('panic', 1)");
                    sqlx::query(AssertSqlSafe(q)).execute(&mut **tx).await?;
                    panic!("bug in the handler");
                }
                .boxed()
            },
        )
        .await
        .expect("execute");
    match out {
        Outcome::Failed { attempts: 1, error } => assert!(error.contains("bug in the handler")),
        other => panic!("expected Failed, got {other:?}"),
    }
    assert_eq!(count(&backend, &ledger).await, 0);
}

/// Layers wrap transactional mode too. The chaos layer refuses a transaction before it
/// reaches the store (nothing commits, not even the claim); a timeout layer lets through
/// a transaction whose handler outlasts its limit (the store bounds its statements, the
/// lease the handler); the retry layer passes outcomes and offsets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_wrap_transactions_and_leave_their_length_to_the_lease() {
    use idem_core::layer::{BackendExt, ChaosLayer, Fault, RetryLayer, TimeoutLayer};
    let (backend, ledger) = setup().await;
    let chaos = ChaosLayer::new();
    let limit = Duration::from_millis(20);
    let layered = backend
        .clone()
        .layer(chaos.clone())
        .layer(TimeoutLayer::new(limit))
        .layer(RetryLayer::new().with_tries(1));
    let key = Key::new("tx", "layered").expect("key");
    let c = claim(&key, "w", Duration::from_secs(10));

    chaos.set(Fault::Claim, true);
    let refused = layered
        .execute_in_transaction(
            &c,
            HOUR,
            Some(&payments_at(0)),
            insert(ledger.clone(), "k".into(), 1),
        )
        .await;
    assert!(
        matches!(refused, Err(idem_core::Error::Unavailable { .. })),
        "{refused:?}"
    );
    assert_eq!(backend.get(&key).await.expect("get"), None);
    chaos.set(Fault::Claim, false);

    // Work that takes longer than the timeout layer's limit.
    let slow = slow_insert(ledger.clone(), "k".into(), 2, limit * 5);
    let outcome = layered
        .execute_in_transaction(&c, HOUR, Some(&payments_at(0)), slow)
        .await
        .expect("a transaction longer than the limit");
    assert!(matches!(outcome, Outcome::Executed(_)), "{outcome:?}");
    assert_eq!(count(&backend, &ledger).await, 1);
    assert_eq!(
        layered.stored_offsets("g").await.expect("offsets"),
        vec![StoredOffset {
            topic: "payments".into(),
            partition: 0,
            next_offset: 1,
        }]
    );
}
