//! Operator commands against a real PostgreSQL (IDEM_POSTGRES_URL), each run in a schema
//! of its own.

mod common;

use std::sync::Arc;

use common::{fails, offsets_scenario, ok, operator_scenario};
use idem_postgres::{PgBackend, PgConfig};

fn fresh_schema() -> String {
    format!("idemcli_{}_{}", std::process::id(), fastrand::u32(..))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_on_postgres() {
    let base = idem_conformance::service_env("IDEM_POSTGRES_URL");
    let schema = fresh_schema();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}schema={schema}");

    // migrate: refused without --yes, then creates the tables (twice is harmless).
    let err = fails(&["migrate", "-b", &url], 2);
    assert!(err.contains("refusing to migrate"), "{err}");
    for _ in 0..2 {
        let out = ok(&["migrate", "-b", &url, "--yes"]);
        assert!(
            out.contains(&format!("schema {schema} is migrated")),
            "{out}"
        );
    }

    let backend = PgBackend::connect(PgConfig::new(base.clone()).with_schema(schema.clone()))
        .await
        .expect("connect to IDEM_POSTGRES_URL");
    operator_scenario(&url, Arc::new(backend.clone()), "orders").await;
    offsets_scenario(&url, Arc::new(backend.clone()), "ledger-writer").await;

    let drop = format!("DROP SCHEMA \"{schema}\" CASCADE");
    sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(backend.pool())
        .await
        .expect("drop the test schema");
}

#[test]
fn an_unreachable_server_is_one_line() {
    let err = fails(
        &[
            "inspect",
            "-b",
            "postgres://nobody:s3cret@127.0.0.1:1/x",
            "ns",
            "id",
        ],
        1,
    );
    assert!(
        err.contains("connect to postgres://nobody:***@127.0.0.1:1/x"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "{err}");
}
