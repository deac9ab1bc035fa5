//! A partition whose handler is stuck holds its current batch and the next one in the
//! consumer, not its whole backlog: the rest waits in the partition's own queue in the
//! client, fetched but not copied. On MockCluster, with a global metrics recorder (so this
//! binary holds one test).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    Out, Recorder, builder, counter_by, gauge, install_metrics, memory_engine, mock_topic, produce,
    start, unique,
};
use idem_kafka::metrics as names;
use tokio::sync::{Notify, Semaphore};

const MESSAGES: usize = 3_000;
const BATCH: usize = 8;
const PAYLOAD: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_partition_holds_a_few_batches_not_its_whole_backlog() {
    install_metrics();
    let topic = unique("ahead");
    let group = unique("ahead-group");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let payload = "x".repeat(PAYLOAD);
    let msgs: Vec<Out> = (0..MESSAGES)
        .map(|i| Out::keyed(0, &format!("m{i:04}"), &payload))
        .collect();
    produce(&brokers, &topic, &msgs).await;

    // The first message's handler waits until the gate opens; the others answer at once.
    let gate = Arc::new(Semaphore::new(0));
    let stuck = Arc::new(Notify::new());
    let recorder = Recorder::new();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(memory_engine())
            .batch_size(BATCH)
            .handler({
                let (gate, stuck) = (gate.clone(), stuck.clone());
                move |msg, _| {
                    let (gate, stuck) = (gate.clone(), stuck.clone());
                    async move {
                        if msg.idempotency_key().is_some_and(|k| k.id() == "m0000") {
                            stuck.notify_one();
                            let _ = gate.acquire().await;
                        }
                        Ok(Bytes::from_static(b"ok"))
                    }
                }
            }),
        &recorder,
    );

    // The handler is stuck on the first message. The worker took that batch and the next
    // one; for the next second, while the client has the whole backlog (about 400 kB,
    // fetched by MockCluster in milliseconds), the consumer holds no more.
    tokio::time::timeout(Duration::from_secs(30), stuck.notified())
        .await
        .expect("the first handler never started");
    // Each message weighs its payload, its header's name and value.
    let weight = (PAYLOAD + "idempotency-key".len() + "m0000".len()) as f64;
    let until = Instant::now() + Duration::from_secs(1);
    let mut most = 0f64;
    while Instant::now() < until {
        most = most.max(gauge(names::BUFFERED_BYTES, &topic, 0) / weight);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        1.0 <= most && most <= (2 * BATCH) as f64,
        "the consumer held up to {most} messages; between 1 and {} expected",
        2 * BATCH
    );
    assert_eq!(
        counter_by(names::READ_AHEAD_WAITS, "group", &group),
        0,
        "no message went through the poll thread, so it never waited for the worker"
    );

    gate.add_permits(1);
    recorder
        .wait_settled(MESSAGES, Duration::from_secs(60))
        .await;
    assert_eq!(recorder.settled_count(), MESSAGES);
    running.stop().await;
}
