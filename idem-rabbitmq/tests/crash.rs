//! A crash at each point of a delivery's path (`idem_rabbitmq::Point`), twice, in lease mode
//! on Redis and in transactional mode on PostgreSQL (`IDEM_RABBITMQ_URL`,
//! `IDEM_REDIS_URL`, `IDEM_POSTGRES_URL`): a consumer dies at that point on the fifth and
//! then on the twelfth payment, a new one takes over, and the last drains the queue. Nothing
//! is lost; transactional mode applies each payment once; lease mode repeats effects only
//! for a crash after an effect and before the settle: those its batch ran.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Effects, Queue, Watch};
use futures::FutureExt;
use idem_core::{Backend, Engine};
use idem_postgres::PgBackend;
use idem_rabbitmq::{IdemConsumer, Point};
use idem_redis::{RedisBackend, RedisConfig};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const PAYMENTS: usize = 20;
const WITHIN: Duration = Duration::from_secs(30);
const POINTS: [Point; 4] = [
    Point::BeforeClaim,
    Point::AfterEffect,
    Point::AfterSettle,
    Point::AfterAck,
];

/// How a consumer applies a payment.
#[derive(Clone)]
enum Mode {
    /// On a Redis store; the effect is counted in memory.
    Lease(Arc<dyn Backend>),
    /// On PostgreSQL; the effect is a ledger row in the handler's transaction.
    Transactional(PgBackend),
}

fn consumer(
    queue: &str,
    mode: &Mode,
    effects: &Effects,
    watch: &Arc<Watch>,
    stop: &CancellationToken,
) -> IdemConsumer {
    let store: Arc<dyn Backend> = match mode {
        Mode::Lease(store) => store.clone(),
        Mode::Transactional(pg) => Arc::new(pg.clone()),
    };
    let engine = Engine::builder(store)
        .lease_ttl(Duration::from_millis(500))
        .build()
        .expect("engine");
    let builder = IdemConsumer::builder(common::url())
        .queue(queue)
        .engine(engine)
        .prefetch(4)
        .probe(watch.clone())
        .backoff(Duration::from_millis(10), Duration::from_millis(100))
        .shutdown(stop.clone().cancelled_owned());
    let effects = effects.clone();
    match mode {
        Mode::Lease(_) => builder.handler(move |m, _| {
            let effects = effects.clone();
            async move {
                effects.record(&m);
                Ok(Bytes::from_static(b"charged"))
            }
        }),
        Mode::Transactional(pg) => {
            let insert = format!(
                "INSERT INTO \"{}\".ledger (payment) VALUES ($1)",
                pg.schema()
            );
            builder.transactional(pg.clone(), move |m, tx, _| {
                let insert = insert.clone();
                async move {
                    let id = m
                        .idempotency_key()
                        .map(|k| k.id().to_owned())
                        .unwrap_or_default();
                    sqlx::query(AssertSqlSafe(insert))
                        .bind(id)
                        .execute(&mut **tx)
                        .await
                        .map_err(idem_core::HandlerError::retry)?;
                    Ok(Bytes::from_static(b"booked"))
                }
                .boxed()
            })
        }
    }
    .build()
    .expect("build")
}

/// Crashes at `point` on the fifth, then the twelfth payment; returns each payment's
/// effects (lease mode) or ledger rows (transactional mode).
async fn crash_at(point: Point, mode: &Mode) -> Vec<u32> {
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "crash").await;
    for k in 0..PAYMENTS {
        q.publish(
            Some(format!("pay-{k}").as_bytes()),
            format!("charge {k}").as_bytes(),
        )
        .await;
    }
    let effects = Effects::default();
    // One watch for every consumer of the run: it sees each payment acked, by any of them.
    let watch = Watch::new();
    for victim in ["charge 4", "charge 11"] {
        let stop = CancellationToken::new();
        watch.crash_at(point, victim.as_bytes());
        tokio::time::timeout(
            WITHIN,
            consumer(&q.name, mode, &effects, &watch, &stop).run(),
        )
        .await
        .unwrap_or_else(|_| panic!("{point:?}: the consumer did not crash on {victim:?}"))
        .expect("run");
    }
    watch.no_crash();
    let stop = CancellationToken::new();
    let run = tokio::spawn(consumer(&q.name, mode, &effects, &watch, &stop).run());
    watch.acked_ids(PAYMENTS, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    assert_eq!(q.ready(&q.name).await, 0, "{point:?}: every delivery acked");
    q.delete().await;
    match mode {
        Mode::Lease(_) => (0..PAYMENTS)
            .map(|k| effects.of(&format!("pay-{k}")))
            .collect(),
        Mode::Transactional(pg) => {
            let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT payment, count(*) FROM \"{}\".ledger GROUP BY payment",
                pg.schema()
            )))
            .fetch_all(pg.pool())
            .await
            .expect("ledger");
            sqlx::query(AssertSqlSafe(format!(
                "TRUNCATE \"{}\".ledger",
                pg.schema()
            )))
            .execute(pg.pool())
            .await
            .expect("truncate");
            (0..PAYMENTS)
                .map(|k| {
                    let id = format!("pay-{k}");
                    rows.iter()
                        .find(|(p, _)| *p == id)
                        .map_or(0, |(_, n)| *n as u32)
                })
                .collect()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_test_redis_lease_mode() {
    let url = idem_conformance::service_env("IDEM_REDIS_URL");
    let prefix = format!("idem-rabbit-crash-{}:", std::process::id());
    for point in POINTS {
        let config = RedisConfig::new(&url).with_prefix(format!("{prefix}{point:?}:"));
        let store = RedisBackend::connect(config)
            .await
            .expect("connect to IDEM_REDIS_URL");
        let effects = crash_at(point, &Mode::Lease(Arc::new(store))).await;
        assert!(
            effects.iter().all(|&n| n >= 1),
            "{point:?}: a payment was lost: {effects:?}"
        );
        let doubles: u32 = effects.iter().map(|n| n - 1).sum();
        // A crash after an effect repeats the effects its batch ran before the settle: at
        // most the prefetch (4) per crash.
        let allowed = if point == Point::AfterEffect {
            2 * 4
        } else {
            0
        };
        assert!(
            doubles <= allowed,
            "{point:?}: {doubles} doubles: {effects:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_test_postgres_transactional() {
    for (i, point) in POINTS.into_iter().enumerate() {
        // A store, and a pool, of its own per point: a crashed consumer's transaction may
        // stay open in its pool (a real crash would close the connection), and a TRUNCATE
        // of a shared table then waited for its locks forever.
        let schema = format!("idem_rabbit_crash_{}_{i}", std::process::id());
        let pg = common::ledger_store(&schema).await;
        let rows = crash_at(point, &Mode::Transactional(pg.clone())).await;
        assert!(
            rows.iter().all(|&n| n == 1),
            "{point:?}: ledger rows per payment: {rows:?}"
        );
        pg.pool().close().await;
        let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
        let url = idem_conformance::service_env("IDEM_POSTGRES_URL");
        let admin = sqlx::PgPool::connect(&url).await.expect("connect");
        let _ = sqlx::query(AssertSqlSafe(drop)).execute(&admin).await;
        admin.close().await;
    }
}
