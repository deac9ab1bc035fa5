//! `migrate` from several processes at once, as replicas starting together on a new
//! database call it: every call succeeds, and the schema ends migrated once.

// Only the URL and schema helpers of the shared module are used here.
#[allow(dead_code)]
mod common;

use idem_postgres::{PgBackend, PgConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_of_a_new_schema_all_succeed() {
    let schema = common::fresh_schema();
    // Connected first, then released together, so that the migrations overlap.
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(8));
    let mut replicas = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let config = PgConfig::new(common::url())
            .with_schema(schema.clone())
            .with_max_connections(1);
        let backend = PgBackend::connect(config).await.expect("connect");
        let start = start.clone();
        replicas.spawn(async move {
            start.wait().await;
            backend.migrate().await
        });
    }
    let mut failures = Vec::new();
    while let Some(done) = replicas.join_next().await {
        if let Err(e) = done.expect("the replica's task") {
            failures.push(e.to_string());
        }
    }
    assert!(
        failures.is_empty(),
        "concurrent migrate failed: {failures:?}"
    );

    let backend = PgBackend::connect(PgConfig::new(common::url()).with_schema(schema.clone()))
        .await
        .expect("connect");
    let applied: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {schema}._sqlx_migrations"
    )))
    .fetch_one(backend.pool())
    .await
    .expect("the migrations table");
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .expect("migrations/")
        .count();
    assert_eq!(applied as usize, files, "each migration applied once");
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(backend.pool())
        .await
        .expect("drop the schema");
}
