//! Operator commands against a real MySQL or MariaDB (IDEM_MYSQL_URL), in a schema (a
//! database) of their own.

mod common;

use std::sync::Arc;

use common::{offsets_scenario, ok, operator_scenario};
use idem_mysql::{MySqlBackend, MySqlConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_on_mysql() {
    let base = idem_conformance::service_env("IDEM_MYSQL_URL");
    let schema = format!("idemcli_{}_{}", std::process::id(), fastrand::u32(..));
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}schema={schema}");

    let out = ok(&["migrate", "-b", &url, "--yes"]);
    assert!(out.contains("is migrated"), "{out}");
    let backend = MySqlBackend::connect(MySqlConfig::new(base.clone()).with_schema(schema.clone()))
        .await
        .expect("connect to IDEM_MYSQL_URL");
    operator_scenario(&url, Arc::new(backend.clone()), "orders").await;
    offsets_scenario(&url, Arc::new(backend.clone()), "ledger-writer").await;

    let drop = format!("DROP DATABASE `{schema}`");
    sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(backend.pool())
        .await
        .expect("drop the test schema");
}
