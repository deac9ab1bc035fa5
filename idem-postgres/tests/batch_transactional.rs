//! Batch transactional mode on a real PostgreSQL: a poll batch's claims commit first, then
//! the handlers (with no savepoints, or after a failure again each under its own), the
//! completes, the failures and the offset the caller chose commit in one transaction.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::backend::Claim;
use idem_core::{Fingerprint, HandlerError, Key, Lease, Outcome, State, Transactional};
use idem_postgres::{OffsetPosition, PgBackend, PgTransaction, StoredOffset};
use sqlx::AssertSqlSafe;

const HOUR: Duration = Duration::from_secs(3600);
const LONG: Duration = Duration::from_secs(30);

/// A backend (configured by `configure`) and a business table `ledger` in its schema.
async fn setup_with(
    configure: impl FnOnce(idem_postgres::PgConfig) -> idem_postgres::PgConfig,
) -> (PgBackend, String) {
    let backend = common::backend_with(configure).await;
    let ledger = format!("\"{}\".ledger", backend.schema());
    let create = format!("CREATE TABLE {ledger} (key text NOT NULL, token int8 NOT NULL)");
    sqlx::query(AssertSqlSafe(create))
        .execute(backend.pool())
        .await
        .expect("create ledger");
    (backend, ledger)
}

async fn setup() -> (PgBackend, String) {
    setup_with(|c| c.with_max_connections(8)).await
}

fn claims(ids: &[&str], owner: &str, lease: Duration) -> Vec<Claim> {
    ids.iter()
        .map(|id| Claim {
            key: Key::new("btx", *id).expect("key"),
            owner: owner.into(),
            lease_ttl: lease,
            fingerprint: Some(Fingerprint::of(id.as_bytes())),
            max_attempts: 3,
            retention: HOUR,
        })
        .collect()
}

/// The business rows, as (key, token), in key order.
async fn rows(backend: &PgBackend, ledger: &str) -> Vec<(String, i64)> {
    let q = format!("SELECT key, token FROM {ledger} ORDER BY key, token");
    sqlx::query_as(AssertSqlSafe(q))
        .fetch_all(backend.pool())
        .await
        .expect("read ledger")
}

/// Inserts one ledger row for the key, through the batch's transaction.
fn insert<'t>(
    ledger: &str,
    tx: &'t mut PgTransaction,
    lease: Lease,
) -> BoxFuture<'t, Result<Bytes, HandlerError>> {
    let q = format!("INSERT INTO {ledger} (key, token) VALUES ($1, $2)");
    async move {
        let token = i64::try_from(lease.token).unwrap_or(i64::MAX);
        sqlx::query(AssertSqlSafe(q))
            .bind(lease.key.id())
            .bind(token)
            .execute(&mut **tx)
            .await?;
        Ok(Bytes::from(format!("{} done", lease.key.id())))
    }
    .boxed()
}

/// Inserts a ledger row, then answers `ok <i>`, or fails with `error` (retryable) if `i`
/// is `bad`: the failed handler's insert must roll back.
fn insert_but_fail<'t>(
    ledger: &str,
    tx: &'t mut PgTransaction,
    i: usize,
    lease: Lease,
    bad: usize,
    error: &'static str,
) -> BoxFuture<'t, Result<Bytes, HandlerError>> {
    let ledger = ledger.to_owned();
    async move {
        insert(&ledger, tx, lease).await?;
        if i == bad {
            return Err(HandlerError::retry(error));
        }
        Ok(Bytes::from(format!("ok {i}")))
    }
    .boxed()
}

/// The offset closure of a Kafka loop: the batch's messages sit at `first`, `first + 1`,
/// …; store the position of the last message of the longest settled prefix.
fn settled_prefix(first: i64) -> impl FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send {
    move |outcomes| {
        let settled = outcomes
            .iter()
            .take_while(|o| matches!(o, Outcome::Executed(_) | Outcome::Replayed(_)))
            .count();
        let last = i64::try_from(settled).ok()?.checked_sub(1)?;
        Some(OffsetPosition {
            group: "g".into(),
            topic: "payments".into(),
            partition: 0,
            offset: first + last,
        })
    }
}

/// Runs `batch` with the insert handler and the settled prefix of messages from `first`.
async fn run_batch(backend: &PgBackend, ledger: &str, batch: &[Claim], first: i64) -> Vec<Outcome> {
    backend
        .execute_batch_in_transaction(
            batch,
            HOUR,
            |tx, _, lease| insert(ledger, tx, lease),
            settled_prefix(first),
        )
        .await
        .expect("batch")
}

async fn next_offset(backend: &PgBackend) -> Option<i64> {
    let stored = backend.stored_offsets("g").await.expect("offsets");
    match stored.as_slice() {
        [] => None,
        [StoredOffset { next_offset, .. }] => Some(*next_offset),
        more => panic!("one partition only: {more:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_handler_rolls_back_alone_and_the_offset_is_the_closures_choice() {
    let (backend, ledger) = setup().await;
    let batch = claims(&["a", "b", "c", "d"], "w", LONG);
    let out = backend
        .execute_batch_in_transaction(
            &batch,
            HOUR,
            |tx, i, lease| insert_but_fail(&ledger, tx, i, lease, 1, "card declined"),
            settled_prefix(100),
        )
        .await
        .expect("batch");
    assert_eq!(
        out,
        vec![
            Outcome::Executed(Bytes::from("ok 0")),
            Outcome::Failed {
                attempts: 1,
                error: "card declined".into()
            },
            Outcome::Executed(Bytes::from("ok 2")),
            Outcome::Executed(Bytes::from("ok 3")),
        ]
    );
    assert_eq!(
        rows(&backend, &ledger).await,
        vec![("a".into(), 1), ("c".into(), 1), ("d".into(), 1)],
        "the failed handler's insert rolled back, the others committed"
    );
    let b = idem_core::Backend::get(&backend, &batch[1].key)
        .await
        .expect("get")
        .expect("record");
    assert_eq!(
        (b.state, b.attempts, b.error.as_deref()),
        (State::Failed, 1, Some("card declined"))
    );
    assert_eq!(
        next_offset(&backend).await,
        Some(101),
        "only the prefix before the failure"
    );

    // The redelivered batch: three replays and a retry that succeeds now.
    let out = run_batch(&backend, &ledger, &batch, 100).await;
    assert_eq!(out[0], Outcome::Replayed(Bytes::from("ok 0")));
    assert_eq!(out[1], Outcome::Executed(Bytes::from("b done")));
    assert_eq!(out[3], Outcome::Replayed(Bytes::from("ok 3")));
    assert_eq!(
        rows(&backend, &ledger).await.len(),
        4,
        "b once, the rest not again"
    );
    assert_eq!(next_offset(&backend).await, Some(104), "the whole batch");
}

/// How many transactions wrote the ledger's rows: each savepoint a handler wrote under
/// is a subtransaction of its own, with its own id in the rows' `xmin`.
async fn writers(backend: &PgBackend, ledger: &str) -> i64 {
    let q = format!("SELECT count(DISTINCT xmin::text)::int8 FROM {ledger}");
    sqlx::query_scalar(AssertSqlSafe(q))
        .fetch_one(backend.pool())
        .await
        .expect("count writers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_run_without_savepoints_until_one_fails_then_the_batch_runs_again_with_them() {
    let (backend, ledger) = setup().await;
    let calls = std::sync::Mutex::new(Vec::new());
    let batch = claims(&["s0", "s1", "s2"], "w", LONG);
    let out = backend
        .execute_batch_in_transaction(
            &batch,
            HOUR,
            |tx, i, lease| {
                calls.lock().expect("calls").push(i);
                insert(&ledger, tx, lease)
            },
            settled_prefix(0),
        )
        .await
        .expect("batch");
    assert!(
        out.iter().all(|o| matches!(o, Outcome::Executed(_))),
        "{out:?}"
    );
    assert_eq!(
        *calls.lock().expect("calls"),
        vec![0, 1, 2],
        "each handler once"
    );
    assert_eq!(
        writers(&backend, &ledger).await,
        1,
        "no failure: every row written by the one transaction, under no savepoint"
    );

    let (backend, ledger) = setup().await;
    let calls = std::sync::Mutex::new(Vec::new());
    let batch = claims(&["f0", "f1", "f2", "f3"], "w", LONG);
    let out = backend
        .execute_batch_in_transaction(
            &batch,
            HOUR,
            |tx, i, lease| {
                calls.lock().expect("calls").push(i);
                insert_but_fail(&ledger, tx, i, lease, 1, "declined")
            },
            settled_prefix(0),
        )
        .await
        .expect("batch");
    assert_eq!(
        out[1],
        Outcome::Failed {
            attempts: 1,
            error: "declined".into()
        }
    );
    assert_eq!(
        *calls.lock().expect("calls"),
        vec![0, 1, 0, 1, 2, 3],
        "the optimistic pass stops at the failure; the careful pass runs every handler"
    );
    assert_eq!(
        rows(&backend, &ledger).await,
        vec![("f0".into(), 1), ("f2".into(), 1), ("f3".into(), 1)],
        "the first pass left nothing; each success committed once"
    );
    assert_eq!(
        writers(&backend, &ledger).await,
        3,
        "the careful pass wrote each row under a savepoint of its own"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_middle_of_a_batch_fails_that_message_only() {
    let (backend, ledger) = setup().await;
    let batch = claims(&["p0", "p1", "p2"], "w", LONG);
    let mut chosen = Vec::new();
    let out = backend
        .execute_batch_in_transaction(
            &batch,
            HOUR,
            |tx, i, lease| {
                let ledger = ledger.clone();
                async move {
                    let response = insert(&ledger, tx, lease).await?;
                    assert!(i != 1, "bug in the handler");
                    Ok(response)
                }
                .boxed()
            },
            |outcomes: &[Outcome]| {
                chosen = outcomes.to_vec();
                None
            },
        )
        .await
        .expect("batch");
    assert_eq!(out, chosen, "the closure saw the outcomes returned");
    assert!(
        matches!(
            &out[1],
            Outcome::Failed { attempts: 1, error } if error.contains("bug in the handler")
        ),
        "{out:?}"
    );
    assert!(
        matches!(out[0], Outcome::Executed(_)) && matches!(out[2], Outcome::Executed(_)),
        "{out:?}"
    );
    assert_eq!(
        rows(&backend, &ledger).await,
        vec![("p0".into(), 1), ("p2".into(), 1)]
    );
    assert_eq!(
        next_offset(&backend).await,
        None,
        "the closure stored nothing"
    );
}

/// Whether a connection of `application` waits for a lock.
async fn waits_for_a_lock(backend: &PgBackend, application: &str) -> bool {
    sqlx::query_scalar(
        "SELECT count(*) > 0 FROM pg_stat_activity \
         WHERE application_name = $1 AND wait_event_type = 'Lock'",
    )
    .bind(application)
    .fetch_one(backend.pool())
    .await
    .expect("read pg_stat_activity")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_taken_over_before_the_batch_locks_it_is_fenced_and_never_runs() {
    let app = format!("btx-fence-{}", std::process::id());
    let (backend, ledger) =
        setup_with(|c| c.with_max_connections(4).with_application_name(app.clone())).await;
    let backend = Arc::new(backend);
    let short = Duration::from_millis(300);
    // "a-block" exists and can be retried; another transaction holds it FOR KEY SHARE, which
    // lets the batch's claim update it but stops the batch's FOR UPDATE at it, before it
    // reaches "b-fence" (locks are taken in key order).
    let block = &claims(&["a-block"], "old", LONG)[0];
    let old = idem_conformance::acquire(&*backend, block).await;
    idem_core::Backend::fail(
        &*backend,
        &old,
        "try again",
        idem_core::FailureKind::Retry,
        HOUR,
    )
    .await
    .expect("fail");
    let other = common::backend().await;
    let mut holder = other.pool().begin().await.expect("begin");
    let q = format!(
        "SELECT 1 FROM \"{}\".idem_records WHERE id = 'a-block' FOR KEY SHARE",
        backend.schema()
    );
    sqlx::query(AssertSqlSafe(q))
        .execute(&mut *holder)
        .await
        .expect("key share");

    let mut batch = claims(&["a-block", "b-fence"], "w", LONG);
    batch[1].lease_ttl = short;
    let run = tokio::spawn({
        let (backend, ledger, batch) = (Arc::clone(&backend), ledger.clone(), batch.clone());
        async move {
            backend
                .execute_batch_in_transaction(
                    &batch,
                    HOUR,
                    |tx, _, lease| insert(&ledger, tx, lease),
                    settled_prefix(0),
                )
                .await
        }
    });
    while !waits_for_a_lock(&other, &app).await {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(short).await; // b-fence's lease lapses
    let thief = idem_conformance::acquire(&*backend, &claims(&["b-fence"], "thief", LONG)[0]).await;
    holder.rollback().await.expect("release the key share lock");
    let out = run.await.expect("task").expect("batch");
    assert_eq!(
        out,
        vec![
            Outcome::Executed(Bytes::from("a-block done")),
            Outcome::Fenced
        ]
    );
    assert_eq!(
        rows(&backend, &ledger).await,
        vec![("a-block".into(), 2)],
        "the fenced handler never ran"
    );
    let rec = idem_core::Backend::get(&*backend, &thief.key)
        .await
        .expect("get")
        .expect("record");
    assert_eq!(
        (rec.state, &*rec.owner, rec.token),
        (State::Processing, "thief", thief.token)
    );
    assert_eq!(
        next_offset(&backend).await,
        Some(1),
        "up to the fenced message"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_killed_midway_is_redone_with_each_effect_once() {
    let (backend, ledger) = setup().await;
    let backend = Arc::new(backend);
    let lease = Duration::from_millis(300);
    let batch = claims(&["k0", "k1", "k2", "k3"], "doomed", lease);
    let (reached_tx, reached) = tokio::sync::oneshot::channel();
    let mut reached_tx = Some(reached_tx);
    let task = tokio::spawn({
        let (backend, ledger, batch) = (Arc::clone(&backend), ledger.clone(), batch.clone());
        async move {
            backend
                .execute_batch_in_transaction(
                    &batch,
                    HOUR,
                    move |tx, i, lease| {
                        let ledger = ledger.clone();
                        let signal = if i == 2 { reached_tx.take() } else { None };
                        async move {
                            let response = insert(&ledger, tx, lease).await?;
                            if let Some(signal) = signal {
                                let _ = signal.send(());
                                futures::future::pending::<()>().await;
                            }
                            Ok(response)
                        }
                        .boxed()
                    },
                    settled_prefix(10),
                )
                .await
        }
    });
    reached.await.expect("the third handler inserted");
    task.abort();
    assert!(task.await.expect_err("killed").is_cancelled());
    assert_eq!(
        rows(&backend, &ledger).await,
        vec![],
        "nothing of the batch committed"
    );
    assert_eq!(next_offset(&backend).await, None);

    tokio::time::sleep(lease * 2).await; // the dead worker's leases lapse
    let again = claims(&["k0", "k1", "k2", "k3"], "next", lease);
    let out = run_batch(&backend, &ledger, &again, 10).await;
    assert!(
        out.iter().all(|o| matches!(o, Outcome::Executed(_))),
        "{out:?}"
    );
    assert_eq!(
        rows(&backend, &ledger).await,
        ["k0", "k1", "k2", "k3"].map(|k| (k.to_owned(), 2)).to_vec(),
        "each effect once, under the takeover's token"
    );
    assert_eq!(next_offset(&backend).await, Some(14));
    let k0 = idem_core::Backend::get(&*backend, &again[0].key)
        .await
        .expect("get")
        .expect("record");
    assert_eq!(
        (k0.state, k0.attempts),
        (State::Completed, 2),
        "the killed attempt counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_nothing_to_run_stores_the_offset_alone() {
    let (backend, ledger) = setup().await;
    let batch = claims(&["r0", "r1"], "w", LONG);
    run_batch(&backend, &ledger, &batch, 0).await;
    assert_eq!(next_offset(&backend).await, Some(2));
    let out = run_batch(&backend, &ledger, &batch, 2).await;
    assert!(
        out.iter().all(|o| matches!(o, Outcome::Replayed(_))),
        "{out:?}"
    );
    assert_eq!(
        next_offset(&backend).await,
        Some(4),
        "replays move the offset"
    );
    assert_eq!(rows(&backend, &ledger).await.len(), 2);
}
