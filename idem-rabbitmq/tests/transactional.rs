//! Transactional mode on a real RabbitMQ and PostgreSQL (`IDEM_RABBITMQ_URL`,
//! `IDEM_POSTGRES_URL`): a crash before the commit rolls the handler's write back, a crash
//! between the commit and the ack redelivers and the store replays, and each payment's
//! ledger row is written once.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Queue, Watch};
use futures::FutureExt;
use idem_core::Engine;
use idem_postgres::PgBackend;
use idem_rabbitmq::{IdemConsumer, Point};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const WITHIN: Duration = Duration::from_secs(30);

async fn store() -> PgBackend {
    common::ledger_store(&format!("idem_rabbit_{}", std::process::id())).await
}

/// A transactional consumer whose handler writes one ledger row per run.
fn consumer(
    queue: &str,
    pg: &PgBackend,
    watch: &Arc<Watch>,
    stop: &CancellationToken,
) -> IdemConsumer {
    let insert = format!(
        "INSERT INTO \"{}\".ledger (payment, token) VALUES ($1, $2)",
        pg.schema()
    );
    let engine = Engine::builder(Arc::new(pg.clone()))
        .lease_ttl(Duration::from_secs(1))
        .build()
        .expect("engine");
    IdemConsumer::builder(common::url())
        .queue(queue)
        .engine(engine)
        .probe(watch.clone())
        .backoff(Duration::from_millis(10), Duration::from_millis(200))
        .shutdown(stop.clone().cancelled_owned())
        .transactional(pg.clone(), move |msg, tx, lease| {
            let insert = insert.clone();
            async move {
                let payment = msg
                    .idempotency_key()
                    .map(|k| k.id().to_owned())
                    .unwrap_or_default();
                sqlx::query(AssertSqlSafe(insert))
                    .bind(payment)
                    .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                    .execute(&mut **tx)
                    .await
                    .map_err(idem_core::HandlerError::retry)?;
                Ok(Bytes::from_static(b"booked"))
            }
            .boxed()
        })
        .build()
        .expect("build")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_before_the_commit_and_before_the_ack_leave_one_row_per_payment() {
    let pg = store().await;
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "tx").await;
    for copy in 0..2 {
        for k in 0..10 {
            q.publish(
                Some(format!("pay-{k}").as_bytes()),
                format!("charge {k}").as_bytes(),
            )
            .await;
        }
        let _ = copy;
    }

    // Dies with pay-3's row written but not committed.
    let (first, stop) = (Watch::new(), CancellationToken::new());
    first.crash_at(Point::AfterEffect, b"charge 3");
    tokio::time::timeout(WITHIN, consumer(&q.name, &pg, &first, &stop).run())
        .await
        .expect("returns")
        .expect("run");
    assert_eq!(first.acks(), 3);

    // Dies with pay-6 committed but not acked.
    let (second, stop) = (Watch::new(), CancellationToken::new());
    second.crash_at(Point::AfterSettle, b"charge 6");
    tokio::time::timeout(WITHIN, consumer(&q.name, &pg, &second, &stop).run())
        .await
        .expect("returns")
        .expect("run");

    // Drains the rest: every copy acked.
    let (third, stop) = (Watch::new(), CancellationToken::new());
    let run = tokio::spawn(consumer(&q.name, &pg, &third, &stop).run());
    third.acked(20 - first.acks() - second.acks(), WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    assert_eq!(q.ready(&q.name).await, 0, "every delivery acked");
    let acked = third.acked.lock().expect("lock").clone();
    assert!(
        acked.contains(&("pay-6".to_owned(), true)),
        "pay-6 came back: {acked:?}"
    );

    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT payment, count(*) FROM \"{}\".ledger GROUP BY payment ORDER BY payment",
        pg.schema()
    )))
    .fetch_all(pg.pool())
    .await
    .expect("ledger");
    let want: Vec<(String, i64)> = (0..10).map(|k| (format!("pay-{k}"), 1)).collect();
    let mut want = want;
    want.sort();
    assert_eq!(rows, want, "one ledger row per payment");
    q.delete().await;
}
