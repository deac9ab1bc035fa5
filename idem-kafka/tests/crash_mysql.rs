//! The crash test on the real broker (tansu, `IDEM_KAFKA_BROKERS`) over MySQL or MariaDB
//! (`IDEM_MYSQL_URL`), as `crash_postgres.rs` runs it over PostgreSQL: the same harness, with
//! the ledger row written in the handler's InnoDB transaction. In transactional mode each
//! payment must be in the ledger exactly once; in lease mode every payment is applied, and
//! any payment applied twice must follow a lapsed lease.

mod common;
mod crash;

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use idem_core::{Backend, ClaimKind, Engine};
use idem_kafka::IdemConsumer;
use idem_mysql::{MySqlBackend, MySqlConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_mysql_transactional() {
    scenario(crash::Plan::default(), "MySQL, transactional mode").await;
}

/// The same with 32 handlers in flight per partition (key-ordered concurrency).
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
    common::install_metrics();
    common::log_from_env();
    let backend = mysql().await;
    crash::lease_mode(
        &brokers,
        "MySQL, lease mode",
        Arc::new(backend),
        crash::Plan::default(),
    )
    .await;
}

/// A migrated backend on `IDEM_MYSQL_URL`.
async fn mysql() -> MySqlBackend {
    let url = idem_conformance::service_env("IDEM_MYSQL_URL");
    let backend = MySqlBackend::connect(MySqlConfig::new(url).with_max_connections(20))
        .await
        .expect("connect to IDEM_MYSQL_URL");
    backend.migrate().await.expect("migrate");
    backend
}

async fn scenario(plan: crash::Plan, label: &str) {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    common::install_metrics();
    common::log_from_env();
    let backend = mysql().await;
    let ledger = format!("ledger_{}", common::unique("t").replace('-', "_"));
    let create = format!(
        "CREATE TABLE {ledger} (payment VARCHAR(64) NOT NULL, token BIGINT NOT NULL, \
         instance INT NOT NULL, kind VARCHAR(16) NOT NULL) ENGINE = InnoDB"
    );
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(backend.pool())
        .await
        .expect("create the ledger");
    let store = Arc::new(Ledger {
        backend: backend.clone(),
        table: ledger.clone(),
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

/// Transactional mode on MySQL: the side effect is a row in a `ledger` table, written
/// through the open InnoDB transaction.
struct Ledger {
    backend: MySqlBackend,
    table: String,
}

impl crash::Store for Ledger {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }

    fn consumer(
        &self,
        builder: idem_kafka::ConsumerBuilder,
        engine: Engine,
        instance: u32,
    ) -> IdemConsumer {
        use futures::FutureExt;
        let table = self.table.clone();
        builder
            .engine(engine)
            .transactional(self.backend.clone(), move |msg, tx, lease| {
                let table = table.clone();
                async move {
                    let id = crash::payment(&msg)?;
                    let q = format!(
                        "INSERT INTO {table} (payment, token, instance, kind) VALUES (?, ?, ?, ?)"
                    );
                    sqlx::query(sqlx::AssertSqlSafe(q))
                        .bind(&id)
                        .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                        .bind(i32::try_from(instance).unwrap_or(i32::MAX))
                        .bind(format!("{:?}", lease.kind))
                        .execute(&mut **tx)
                        .await?;
                    Ok(bytes::Bytes::from(format!("paid {id}")))
                }
                .boxed()
            })
            .build()
            .expect("consumer")
    }

    fn effects(&self) -> BoxFuture<'_, HashMap<String, Vec<crash::Applied>>> {
        Box::pin(async move {
            let q = format!("SELECT payment, token, instance, kind FROM {}", self.table);
            let rows: Vec<(String, i64, i32, String)> = sqlx::query_as(sqlx::AssertSqlSafe(q))
                .fetch_all(self.backend.pool())
                .await
                .expect("read ledger");
            let mut out: HashMap<String, Vec<crash::Applied>> = HashMap::new();
            for (payment, token, instance, kind) in rows {
                let kind = match kind.as_str() {
                    "First" => ClaimKind::First,
                    "Retry" => ClaimKind::Retry,
                    _ => ClaimKind::Takeover,
                };
                out.entry(payment).or_default().push(crash::Applied {
                    token: u64::try_from(token).unwrap_or(0),
                    kind,
                    instance: u32::try_from(instance).unwrap_or(0),
                });
            }
            out
        })
    }

    fn exactly_once(&self) -> bool {
        true
    }
}
