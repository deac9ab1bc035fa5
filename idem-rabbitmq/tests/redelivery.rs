//! Redeliveries on a real RabbitMQ (`IDEM_RABBITMQ_URL`): a storm of requeues from other
//! consumers of the same queue leaves each effect once; on a quorum queue with a delivery
//! limit, a message that crashes its consumer every time is dead-lettered by the server
//! after the limit, and the others run once (with prefetch 1: a dying consumer returns
//! every delivery it held unacked, and each return counts one delivery).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Effects, Queue, Watch};
use futures::StreamExt;
use idem_core::{Engine, MemoryBackend};
use idem_rabbitmq::lapin::options::{
    BasicConsumeOptions, BasicQosOptions, BasicRejectOptions, QueueDeclareOptions,
};
use idem_rabbitmq::lapin::types::{AMQPValue, FieldTable, LongString};
use idem_rabbitmq::{IdemConsumer, Point};
use tokio_util::sync::CancellationToken;

const WITHIN: Duration = Duration::from_secs(60);

fn consumer(
    queue: &str,
    prefetch: u16,
    engine: Engine,
    effects: &Effects,
    watch: &Arc<Watch>,
    stop: &CancellationToken,
) -> IdemConsumer {
    let effects = effects.clone();
    IdemConsumer::builder(common::url())
        .queue(queue)
        .engine(engine)
        .prefetch(prefetch)
        .probe(watch.clone())
        .backoff(Duration::from_millis(10), Duration::from_millis(100))
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |m, _| {
            let effects = effects.clone();
            async move {
                effects.record(&m);
                Ok(Bytes::from_static(b"done"))
            }
        })
        .build()
        .expect("build")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_requeues_leaves_each_effect_once() {
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "storm").await;
    for copy in 0..2 {
        for k in 0..30 {
            q.publish(Some(format!("pay-{k}").as_bytes()), b"charge")
                .await;
        }
        let _ = copy;
    }
    // Two consumers of the same queue that reject everything with requeue.
    let rejected = Arc::new(AtomicU64::new(0));
    let mut rogues = Vec::new();
    for _ in 0..2 {
        let ch = conn.create_channel().await.expect("channel");
        ch.basic_qos(8, BasicQosOptions::default())
            .await
            .expect("qos");
        let mut deliveries = ch
            .basic_consume(
                q.name.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let rejected = rejected.clone();
        rogues.push(tokio::spawn(async move {
            while let Some(Ok(d)) = deliveries.next().await {
                rejected.fetch_add(1, Ordering::Relaxed);
                let requeue = BasicRejectOptions { requeue: true };
                if d.reject(requeue).await.is_err() {
                    break;
                }
            }
            drop(ch);
        }));
    }
    let engine = Engine::builder(Arc::new(MemoryBackend::new()))
        .build()
        .expect("engine");
    let (effects, watch, stop) = (Effects::default(), Watch::new(), CancellationToken::new());
    let run = tokio::spawn(consumer(&q.name, 4, engine, &effects, &watch, &stop).run());
    watch.acked(60, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    for rogue in rogues {
        rogue.abort();
    }
    let acked = watch.acked.lock().expect("lock").clone();
    assert!(
        acked.iter().any(|(_, redelivered)| *redelivered),
        "idem saw redeliveries among the requeues"
    );
    assert!(rejected.load(Ordering::Relaxed) > 0, "the storm happened");
    for k in 0..30 {
        assert_eq!(effects.of(&format!("pay-{k}")), 1, "pay-{k}");
    }
    q.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_dead_letters_a_message_that_crashes_every_consumer() {
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "quorum-holder").await;
    let name = format!("{}-quorum", q.name);
    let limit_dlq = format!("{name}.limit");
    let ch = &q.channel;
    ch.queue_declare(
        limit_dlq.as_str().into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await
    .expect("declare the server's dead-letter queue");
    let mut args = FieldTable::default();
    let text = |s: &str| AMQPValue::LongString(LongString::from(s));
    args.insert("x-queue-type".into(), text("quorum"));
    args.insert("x-delivery-limit".into(), AMQPValue::LongInt(2));
    args.insert("x-dead-letter-exchange".into(), text(""));
    args.insert("x-dead-letter-routing-key".into(), text(&limit_dlq));
    ch.queue_declare(name.as_str().into(), QueueDeclareOptions::durable(), args)
        .await
        .expect("declare a quorum queue");
    let publish = |key: String, payload: &'static [u8]| {
        let q = &q;
        let name = name.clone();
        async move {
            let mut headers = FieldTable::default();
            headers.insert(
                "idempotency-key".into(),
                AMQPValue::LongString(LongString::from(key.as_str())),
            );
            let props = idem_rabbitmq::lapin::BasicProperties::default().with_headers(headers);
            let confirm = q
                .channel
                .basic_publish(
                    "".into(),
                    name.as_str().into(),
                    Default::default(),
                    payload,
                    props,
                )
                .await
                .expect("publish")
                .await
                .expect("confirm");
            assert!(confirm.is_ack());
        }
    };
    publish("boom".into(), b"boom").await;
    for k in 0..5 {
        publish(format!("pay-{k}"), b"charge").await;
    }

    // Each consumer dies on "boom" after its effect; the server counts the deliveries.
    let store = Arc::new(MemoryBackend::new());
    let effects = Effects::default();
    let mut crashes = 0;
    for _ in 0..6 {
        let engine = Engine::builder(store.clone())
            .lease_ttl(Duration::from_millis(200))
            .max_attempts(10)
            .build()
            .expect("engine");
        let (watch, stop) = (Watch::new(), CancellationToken::new());
        watch.crash_at(Point::AfterEffect, b"boom");
        let run = tokio::spawn(consumer(&name, 1, engine, &effects, &watch, &stop).run());
        // Either it dies on "boom", or "boom" is gone and it acks the rest. Prefetch 1: a
        // consumer that dies returns what it was sent unacked, and each return counts a
        // delivery, so messages prefetched behind "boom" would reach the limit with it.
        let mut run = run;
        tokio::select! {
            result = &mut run => { result.expect("join").expect("run"); crashes += 1; continue }
            () = watch.acked_ids(5, WITHIN) => {}
        }
        stop.cancel();
        run.await.expect("join").expect("run");
        break;
    }
    let letters = q.take_all(&limit_dlq).await;
    assert_eq!(letters.len(), 1, "the server dead-lettered one message");
    assert_eq!(letters[0].0, b"boom");
    assert!(
        (2..=3).contains(&crashes),
        "{crashes} consumers died on it before the limit"
    );
    for k in 0..5 {
        assert_eq!(effects.of(&format!("pay-{k}")), 1, "pay-{k}");
    }
    for queue in [name.as_str(), limit_dlq.as_str()] {
        let _ = ch.queue_delete(queue.into(), Default::default()).await;
    }
    q.delete().await;
}
