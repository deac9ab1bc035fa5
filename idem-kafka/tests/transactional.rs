//! Transactional mode on MockCluster with a real PostgreSQL: the handler's row, the record
//! and the offset commit together, and an assigned partition starts from the offset
//! stored in PostgreSQL, not Kafka's.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Out, Recorder, builder, committed, consumer_config, mock, produce, start, unique};
use futures::FutureExt;
use idem_core::{Backend, HandlerError, Key, State};
use idem_kafka::{IdemConsumer, MissingKey};
use idem_postgres::OffsetPosition;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_record_and_offset_commit_together_and_assign_seeks_to_postgres() {
    let (pg, ledger) = common::postgres().await;
    let topic = unique("tx");
    let dlq = format!("{topic}.dlq");
    let cluster = mock(1, &[(&topic, 1), (&dlq, 1)]);
    let brokers = cluster.bootstrap_servers();
    let mut msgs: Vec<Out> = (0..10)
        .map(|i| Out::keyed(0, &format!("p{i}"), "x"))
        .collect();
    msgs.push(Out::keyed(0, "p5", "x")); // offset 10: a duplicate
    msgs.push(Out::keyed(0, "poison", "x")); // offset 11
    msgs.push(Out::keyed(0, "p12", "x")); // offset 12
    produce(&brokers, &topic, &msgs).await;
    let group = unique("g");
    // PostgreSQL says the group is at offset 3; Kafka has nothing committed.
    let at = OffsetPosition {
        group: group.clone(),
        topic: topic.clone(),
        partition: 0,
        offset: 2,
    };
    pg.store_offset(&at).await.unwrap();

    let recorder = Recorder::new();
    let table = ledger.clone();
    let running = start(
        builder(&brokers, &topic, &group)
            .commit_interval(Duration::from_millis(100))
            .transactional(pg.clone(), move |msg, tx, lease| {
                let table = table.clone();
                async move {
                    let id = msg.key().map(Key::id).unwrap_or_default().to_owned();
                    if id == "poison" {
                        return Err(HandlerError::permanent("bad payment"));
                    }
                    let q = format!(
                        "INSERT INTO {table} (payment, token, instance) VALUES ($1, $2, 0)"
                    );
                    sqlx::query(sqlx::AssertSqlSafe(q))
                        .bind(&id)
                        .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                        .execute(&mut **tx)
                        .await?;
                    Ok(Bytes::from(id))
                }
                .boxed()
            }),
        &recorder,
    );
    recorder.wait_settled(10, WAIT).await;
    running.stop().await;

    assert_eq!(
        recorder.settled_on(0).into_iter().collect::<Vec<_>>(),
        (3..13).collect::<Vec<i64>>(),
        "started at PostgreSQL's offset 3"
    );
    let rows = common::ledger_counts(&pg, &ledger).await;
    let mut ids: Vec<&String> = rows.keys().collect();
    ids.sort();
    assert_eq!(rows.len(), 8, "p3..p9 and p12: {rows:?}");
    assert!(rows.values().all(|n| *n == 1), "{rows:?}");
    let p5 = pg
        .get(&Key::new(group.as_str(), "p5").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p5.state, State::Completed);
    assert!(
        pg.get(&Key::new(group.as_str(), "p1").unwrap())
            .await
            .unwrap()
            .is_none()
    );
    let stored = pg.stored_offsets(&group).await.unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(
        stored[0].next_offset, 13,
        "past the dead letter and the last payment"
    );
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![13]);
    let letters = common::read_all(&brokers, &dlq, 1, 1, WAIT);
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].headers["idem-original-offset"], "11");
    common::drop_schema(&pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_mode_refuses_keyless_processing() {
    let (pg, _) = common::postgres().await;
    let err = IdemConsumer::builder(consumer_config("127.0.0.1:1"))
        .topics(["t"])
        .group("g")
        .missing_key(MissingKey::Process)
        .transactional(pg.clone(), |_, _, _| async { Ok(Bytes::new()) }.boxed())
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("needs a key"), "{err}");
    common::drop_schema(&pg).await;
}
