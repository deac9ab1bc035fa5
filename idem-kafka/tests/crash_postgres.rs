//! The crash test on the real broker (tansu, `IDEM_KAFKA_BROKERS`) over PostgreSQL
//! (`IDEM_POSTGRES_URL`). In transactional mode the side effect is a ledger row written in
//! the handler's transaction, so each payment must be in the ledger exactly once; in lease
//! mode every payment is applied, and any payment applied twice must follow a lapsed lease.

mod common;
mod crash;

use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_postgres_transactional() {
    scenario(crash::Plan::default(), "PostgreSQL, transactional mode").await;
}

/// The same with 32 handlers in flight per partition (key-ordered concurrency).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_postgres_transactional_in_flight_32() {
    let plan = crash::Plan {
        in_flight: 32,
        ..crash::Plan::default()
    };
    scenario(
        plan,
        "PostgreSQL, transactional mode, 32 in flight per partition",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_postgres_lease_mode() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    common::install_metrics();
    common::log_from_env();
    let (backend, _) = common::postgres().await;
    let store = Arc::new(backend.clone());
    crash::lease_mode(
        &brokers,
        "PostgreSQL, lease mode",
        store,
        crash::Plan::default(),
    )
    .await;
    common::drop_schema(&backend).await;
}

async fn scenario(plan: crash::Plan, label: &str) {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    common::install_metrics();
    common::log_from_env();
    let (backend, ledger) = common::postgres().await;
    let store = Arc::new(crash::TransactionalStore {
        backend: backend.clone(),
        ledger,
    });
    let figures = crash::run(&brokers, store, plan).await;
    crash::print(label, &figures);
    assert_eq!(figures.crashes, crash::CRASHES);
    assert_eq!(figures.effects_applied, 2000, "each payment exactly once");
    assert_eq!(figures.double_effects, 0);
    // 400 payments were sent twice. A copy can go unreplayed only when a crash lands
    // between its settle and its probe (then it is skipped, not lost).
    assert!(
        figures.duplicates_replayed >= 400 - 2 * figures.crashes as u64,
        "{figures:?}"
    );
    common::drop_schema(&backend).await;
}
