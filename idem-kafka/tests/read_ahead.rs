//! While every partition has a few batches waiting, the poll thread leaves what the client
//! fetched in the client's prefetch: a partition whose handler is stuck holds a few batches
//! in the consumer, not its whole backlog. On MockCluster, with a global metrics recorder
//! (so this binary holds one test).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    Out, Recorder, builder, counter_by, gauge, install_metrics, memory_engine, mock_topic, produce,
    start, unique,
};
use idem_kafka::metrics as names;
use tokio::sync::Semaphore;

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
    let recorder = Recorder::new();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(memory_engine())
            .batch_size(BATCH)
            .handler({
                let gate = gate.clone();
                move |msg, _| {
                    let gate = gate.clone();
                    async move {
                        if msg.key().is_some_and(|k| k.id() == "m0000") {
                            let _ = gate.acquire().await;
                        }
                        Ok(Bytes::from_static(b"ok"))
                    }
                }
            }),
        &recorder,
    );

    // The poll thread stops copying once the partition holds `batch_size` × 4 messages.
    let deadline = Instant::now() + Duration::from_secs(30);
    while counter_by(names::READ_AHEAD_WAITS, "group", &group) == 0 {
        assert!(
            Instant::now() < deadline,
            "the poll thread never waited for its worker"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Each message weighs its payload, its header's name and value.
    let weight = (PAYLOAD + "idempotency-key".len() + "m0000".len()) as f64;
    let held = gauge(names::BUFFERED_BYTES, &topic, 0) / weight;
    // Four batches, then at most 64 more before the check, and one a poll interval (50 ms)
    // since; the whole backlog is 3,000.
    let most = (4 * BATCH + 64 + 40) as f64;
    assert!(
        (4 * BATCH) as f64 <= held && held <= most,
        "the consumer holds {held} messages; between {} and {most} expected",
        4 * BATCH
    );

    gate.add_permits(1);
    recorder
        .wait_settled(MESSAGES, Duration::from_secs(60))
        .await;
    assert_eq!(recorder.settled_count(), MESSAGES);
    running.stop().await;
}
