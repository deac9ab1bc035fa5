//! `purge_expired` walks the table in chunks (there is no index on the expiry), and
//! `migrate` drops the expiry index an earlier version created.

mod common;

use idem_core::Key;
use idem_core::backend::Backend;
use idem_mysql::{MySqlBackend, MySqlConfig};
use sqlx::AssertSqlSafe;

/// Rows of one namespace, expired and live interleaved, over several chunks of 3: every
/// expired row goes, every live one stays.
#[tokio::test]
async fn a_purge_in_small_chunks_removes_every_expired_row_and_no_live_one() {
    let b = common::backend_with(|c| c.with_max_connections(4).with_purge_batch(3)).await;
    let ns = idem_conformance::unique_namespace();
    let insert = "INSERT INTO idem_records (namespace, id, state, owner, token, attempts, \
         lease_until_ms, expires_at_ms) VALUES (?, ?, 'completed', 'w', 1, 1, NULL, \
         (UNIX_TIMESTAMP() + ?) * 1000)";
    for i in 0..20 {
        // Every third row is live, the others expired an hour ago.
        let offset: i64 = if i % 3 == 0 { 3600 } else { -3600 };
        sqlx::query(AssertSqlSafe(insert))
            .bind(ns.as_bytes())
            .bind(format!("r{i:02}").as_bytes())
            .bind(offset)
            .execute(b.pool())
            .await
            .expect("insert a row");
    }
    let purged = b.purge_expired().await.expect("purge");
    assert!(
        purged >= 13,
        "13 rows of this namespace expired, {purged} purged"
    );
    let left: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT id FROM idem_records WHERE namespace = ? ORDER BY id")
            .bind(ns.as_bytes())
            .fetch_all(b.pool())
            .await
            .expect("read what is left");
    let want: Vec<Vec<u8>> = (0..20)
        .filter(|i| i % 3 == 0)
        .map(|i| format!("r{i:02}").into_bytes())
        .collect();
    assert_eq!(left, want, "the live rows, and only they");
    let key = Key::new(ns, "r00").expect("key");
    assert!(b.get(&key).await.expect("get").is_some());
}

/// A records table with the expiry index of an earlier version: `migrate` drops it, and
/// running it again changes nothing.
#[tokio::test]
async fn migrate_drops_the_old_expiry_index() {
    let schema = format!("idem_old_{}", fastrand::u32(..));
    let config = MySqlConfig::new(common::url()).with_schema(&schema);
    let b = MySqlBackend::connect(config).await.expect("connect");
    b.migrate().await.expect("migrate");
    let table = format!("`{schema}`.idem_records");
    let run = |sql: String| {
        let pool = b.pool().clone();
        async move { sqlx::query(AssertSqlSafe(sql)).execute(&pool).await }
    };
    run(format!(
        "ALTER TABLE {table} ADD KEY idem_records_expiry (expires_at_ms)"
    ))
    .await
    .expect("add the old index");
    let count = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = ? \
             AND TABLE_NAME = 'idem_records' AND INDEX_NAME = 'idem_records_expiry'",
        )
        .bind(&schema)
        .fetch_one(b.pool())
        .await
        .expect("read the indexes")
    };
    assert_eq!(count().await, 1);
    b.migrate().await.expect("migrate over the old table");
    assert_eq!(count().await, 0, "the old index is gone");
    b.migrate().await.expect("migrate again");
    run(format!("DROP DATABASE `{schema}`"))
        .await
        .expect("drop the schema");
}
