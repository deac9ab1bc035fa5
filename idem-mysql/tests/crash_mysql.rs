//! The crash test on the real broker (tansu, `IDEM_KAFKA_BROKERS`) over MySQL or MariaDB
//! (`IDEM_MYSQL_URL`), as idem-kafka's `crash_postgres.rs` runs it over PostgreSQL. In
//! transactional mode the side effect is a ledger row written in the handler's InnoDB
//! transaction, so each payment must be in the ledger exactly once; in lease mode every
//! payment is applied, and any payment applied twice must follow a lapsed lease.

mod common;
mod crash;
mod kafka;

use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_mysql_transactional() {
    scenario(crash::Plan::default(), "MySQL, transactional mode").await;
}

/// The same with 32 handlers in flight per partition (key-ordered concurrency), which
/// runs each chunk of a poll batch in one transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_mysql_transactional_in_flight_32() {
    let plan = crash::Plan {
        in_flight: 32,
        ..crash::Plan::default()
    };
    scenario(
        plan,
        "MySQL, transactional mode, 32 in flight per partition",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_mysql_lease_mode() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    kafka::install_metrics();
    kafka::log_from_env();
    let backend = common::backend().await;
    crash::lease_mode(
        &brokers,
        "MySQL, lease mode",
        Arc::new(backend),
        crash::Plan::default(),
    )
    .await;
}

async fn scenario(plan: crash::Plan, label: &str) {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    kafka::install_metrics();
    kafka::log_from_env();
    let backend = common::backend().await;
    let ledger = format!("ledger_{}", kafka::unique("t").replace('-', "_"));
    let create = format!(
        "CREATE TABLE {ledger} (payment VARCHAR(64) NOT NULL, token BIGINT NOT NULL, \
         instance INT NOT NULL, kind VARCHAR(16) NOT NULL) ENGINE = InnoDB"
    );
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(backend.pool())
        .await
        .expect("create the ledger");
    let store = Arc::new(crash::TransactionalStore {
        backend: backend.clone(),
        ledger: ledger.clone(),
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
    let drop = format!("DROP TABLE IF EXISTS {ledger}");
    let _ = sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(backend.pool())
        .await;
}
