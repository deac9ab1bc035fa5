//! A consumer on the real broker (tansu, `IDEM_KAFKA_BROKERS`) whose store is reached only
//! over TLS, its certificate verified against the test CA (`IDEM_TLS_CA`): lease mode on
//! the TLS-only PostgreSQL (`IDEM_POSTGRES_TLS_URL`, `sslmode=verify-full`) and
//! transactional mode on the TLS-only MariaDB (`IDEM_MYSQL_TLS_URL`,
//! `ssl-mode=VERIFY_IDENTITY`), and lease mode on the TLS-only Redis with AUTH
//! (`IDEM_REDIS_TLS_URL`, `rediss://`). 30 payments on two partitions, every third sent twice:
//! each payment's effect (a ledger row in the TLS database) happens once, every message
//! settles, and the group's offsets are committed to the end.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Out, Recorder, builder, create_topics, produce, start, unique, wait_committed};
use futures::FutureExt;
use idem_core::{Key, State, Transactional};
use idem_mysql::{MySqlBackend, MySqlConfig};
use idem_postgres::{PgBackend, PgConfig};

const PAYMENTS: usize = 30;
const PARTITIONS: i32 = 2;
const WAIT: Duration = Duration::from_secs(60);

/// `var`'s URL with the TLS parameters `params` and the test CA (`ca=<path>` appended).
fn tls_url(var: &str, params: &str) -> String {
    let base = idem_conformance::service_env(var);
    let ca = idem_conformance::service_env("IDEM_TLS_CA");
    format!("{base}?{params}{ca}")
}

/// Makes the topic (and its dead-letter topic) and produces the payments: `p0`..`p29`,
/// every third twice, the copy on the other partition. Answers each partition's end.
async fn payments(brokers: &str, topic: &str) -> Vec<i64> {
    create_topics(
        brokers,
        &[(topic, PARTITIONS), (&format!("{topic}.dlq"), 1)],
    )
    .await;
    let mut msgs = Vec::new();
    for i in 0..PAYMENTS {
        let partition = i32::try_from(i).expect("small") % PARTITIONS;
        msgs.push(Out::keyed(partition, &format!("p{i}"), "pay"));
        if i % 3 == 0 {
            msgs.push(Out::keyed(1 - partition, &format!("p{i}"), "pay"));
        }
    }
    let mut ends = vec![0; PARTITIONS as usize];
    for (partition, offset) in produce(brokers, topic, &msgs).await {
        let end = &mut ends[usize::try_from(partition).expect("partition")];
        *end = (*end).max(offset + 1);
    }
    ends
}

/// Every payment `p0`..`p29` exactly once in `rows` (payment, count).
fn once_each(rows: HashMap<String, i64>) {
    assert_eq!(rows.len(), PAYMENTS, "every payment applied: {rows:?}");
    assert!(rows.values().all(|n| *n == 1), "none twice: {rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_mode_on_postgres_verify_full_applies_each_payment_once() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let url = tls_url("IDEM_POSTGRES_TLS_URL", "sslmode=verify-full&sslrootcert=");
    let schema = format!("kafkatls_{}_{}", std::process::id(), fastrand::u32(..));
    let app = schema.clone();
    let config = PgConfig::new(url)
        .with_schema(schema.clone())
        .with_application_name(app.clone())
        .with_max_connections(8);
    let pg = PgBackend::connect(config).await.expect("connect over TLS");
    pg.migrate().await.expect("migrate");
    let ledger = format!("\"{schema}\".ledger");
    let create = format!("CREATE TABLE {ledger} (payment text NOT NULL, token bigint NOT NULL)");
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(pg.pool())
        .await
        .expect("create ledger");

    let topic = unique("store-tls-pg");
    let group = unique("g");
    let ends = payments(&brokers, &topic).await;
    let recorder = Recorder::new();
    let engine = common::engine(Arc::new(pg.clone()), "w1", Duration::from_secs(10));
    let (pool, table) = (pg.pool().clone(), ledger.clone());
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(engine)
            .handler(move |msg, ctx| {
                let (pool, table) = (pool.clone(), table.clone());
                async move {
                    let id = msg
                        .idempotency_key()
                        .map(Key::id)
                        .unwrap_or_default()
                        .to_owned();
                    let token = ctx.map_or(0, |c| i64::try_from(c.token()).unwrap_or(i64::MAX));
                    let q = format!("INSERT INTO {table} (payment, token) VALUES ($1, $2)");
                    sqlx::query(sqlx::AssertSqlSafe(q))
                        .bind(&id)
                        .bind(token)
                        .execute(&pool)
                        .await?;
                    Ok(Bytes::from(id))
                }
            }),
        &recorder,
    );
    recorder
        .wait_settled(ends.iter().sum::<i64>() as usize, WAIT)
        .await;
    wait_committed(&brokers, &group, &topic, &ends, WAIT).await;
    running.stop().await;

    once_each(common::ledger_counts(&pg, &ledger).await);
    let record = idem_core::Backend::get(&pg, &Key::new(group.as_str(), "p3").expect("key"))
        .await
        .expect("get")
        .expect("a record");
    assert_eq!(record.state, State::Completed);
    // The server says every connection of this backend was encrypted.
    let (all_tls, n): (Option<bool>, i64) = sqlx::query_as(
        "SELECT bool_and(s.ssl), count(*) FROM pg_stat_ssl s \
         JOIN pg_stat_activity a USING (pid) WHERE a.application_name = $1",
    )
    .bind(&app)
    .fetch_one(pg.pool())
    .await
    .expect("read pg_stat_ssl");
    assert!(
        n > 0 && all_tls == Some(true),
        "{n} connections, TLS: {all_tls:?}"
    );
    common::drop_schema(&pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_mode_on_mysql_verify_identity_applies_each_payment_once() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let url = tls_url("IDEM_MYSQL_TLS_URL", "ssl-mode=VERIFY_IDENTITY&ssl-ca=");
    let my = MySqlBackend::connect(MySqlConfig::new(url).with_max_connections(8))
        .await
        .expect("connect over TLS");
    my.migrate().await.expect("migrate");
    let ledger = format!("ledger_{}", unique("tls").replace('-', "_"));
    let create = format!(
        "CREATE TABLE {ledger} (payment VARCHAR(64) NOT NULL, cipher TEXT NOT NULL) \
         ENGINE = InnoDB"
    );
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(my.pool())
        .await
        .expect("create ledger");

    let topic = unique("store-tls-mysql");
    let group = unique("g");
    let ends = payments(&brokers, &topic).await;
    let recorder = Recorder::new();
    let table = ledger.clone();
    let running = start(
        builder(&brokers, &topic, &group).transactional(my.clone(), move |msg, tx, _| {
            // The row names the cipher of the transaction's own session.
            let insert = format!(
                "INSERT INTO {table} (payment, cipher) SELECT ?, VARIABLE_VALUE \
                 FROM information_schema.SESSION_STATUS WHERE VARIABLE_NAME = 'SSL_CIPHER'"
            );
            async move {
                let id = msg
                    .idempotency_key()
                    .map(Key::id)
                    .unwrap_or_default()
                    .to_owned();
                sqlx::query(sqlx::AssertSqlSafe(insert))
                    .bind(&id)
                    .execute(&mut **tx)
                    .await?;
                Ok(Bytes::from(id))
            }
            .boxed()
        }),
        &recorder,
    );
    recorder
        .wait_settled(ends.iter().sum::<i64>() as usize, WAIT)
        .await;
    wait_committed(&brokers, &group, &topic, &ends, WAIT).await;
    running.stop().await;

    let q = format!("SELECT payment, cipher FROM {ledger}");
    let rows: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(q))
        .fetch_all(my.pool())
        .await
        .expect("read ledger");
    let drop = format!("DROP TABLE IF EXISTS {ledger}");
    let _ = sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(my.pool())
        .await;
    assert!(
        rows.iter().all(|(_, cipher)| !cipher.is_empty()),
        "every write over TLS: {rows:?}"
    );
    let mut counts = HashMap::new();
    for (payment, _) in rows {
        *counts.entry(payment).or_insert(0) += 1;
    }
    once_each(counts);
    let stored = my.stored_offsets(&group).await.expect("stored offsets");
    let mut next: Vec<i64> = vec![0; PARTITIONS as usize];
    for s in stored {
        next[usize::try_from(s.partition).expect("partition")] = s.next_offset;
    }
    assert_eq!(next, ends, "MariaDB holds the offsets past every message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_mode_on_rediss_with_auth_applies_each_payment_once() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let ca = std::fs::read(idem_conformance::service_env("IDEM_TLS_CA")).expect("read the CA");
    let config = idem_redis::RedisConfig::new(idem_conformance::service_env("IDEM_REDIS_TLS_URL"))
        .with_tls_root_cert(ca);
    let redis = idem_redis::RedisBackend::connect(config)
        .await
        .expect("connect over TLS");

    let topic = unique("store-tls-redis");
    let group = unique("g");
    let ends = payments(&brokers, &topic).await;
    let recorder = Recorder::new();
    let effects: Arc<std::sync::Mutex<HashMap<String, i64>>> = Arc::default();
    let engine = common::engine(Arc::new(redis.clone()), "w1", Duration::from_secs(10));
    let seen = effects.clone();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(engine)
            .handler(move |msg, _ctx| {
                let seen = seen.clone();
                async move {
                    let id = msg
                        .idempotency_key()
                        .map(Key::id)
                        .unwrap_or_default()
                        .to_owned();
                    *seen
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(id.clone())
                        .or_default() += 1;
                    Ok(Bytes::from(id))
                }
            }),
        &recorder,
    );
    recorder
        .wait_settled(ends.iter().sum::<i64>() as usize, WAIT)
        .await;
    wait_committed(&brokers, &group, &topic, &ends, WAIT).await;
    running.stop().await;

    once_each(effects.lock().unwrap_or_else(|e| e.into_inner()).clone());
    let record = idem_core::Backend::get(&redis, &Key::new(group.as_str(), "p3").expect("key"))
        .await
        .expect("get over TLS")
        .expect("a record");
    assert_eq!(record.state, State::Completed);
}
