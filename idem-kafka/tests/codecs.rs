//! Every Kafka codec on the real broker (tansu, `IDEM_KAFKA_BROKERS`), a test each: batches
//! compressed with gzip, snappy, lz4 or zstd, between uncompressed ones, are each handled
//! once and committed.

mod common;

use std::time::Duration;

use common::{Effects, Out, Recorder, builder, create_topics, memory_engine, plain, unique};
use idem_kafka::rdkafka::producer::FutureProducer;

const PARTITIONS: i32 = 2;
/// Messages per batch: one producer's run before the next codec's.
const PER_BATCH: usize = 25;

fn producer(brokers: &str, codec: &str) -> FutureProducer {
    plain(brokers)
        .set("compression.type", codec)
        .set("linger.ms", "5")
        .create()
        .unwrap_or_else(|e| panic!("a producer with compression.type={codec}: {e}"))
}

/// Batches in `codec` between uncompressed ones, on both partitions: every payment handled
/// once, the offsets committed to the end.
async fn handled_once_and_committed(codec: &str) {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let topic = unique(&format!("codec-{codec}"));
    let group = unique("g");
    create_topics(
        &brokers,
        &[(&topic, PARTITIONS), (&format!("{topic}.dlq"), 1)],
    )
    .await;

    let order = ["none", codec, "none", codec, "none"];
    let mut next = [0i64; PARTITIONS as usize];
    let mut sent = 0;
    let mut ids = Vec::new();
    for codec in order {
        let p = producer(&brokers, codec);
        let batch: Vec<Out> = (0..PER_BATCH)
            .map(|i| {
                let n = sent + i;
                let partition = i32::try_from(n).expect("n") % PARTITIONS;
                // Repetitive enough that every codec shrinks the batch: librdkafka sends
                // a batch uncompressed when compressing would not make it smaller.
                let payment = format!("payment {n} {}", "x".repeat(200));
                Out::keyed(partition, &format!("{codec}-{n}"), &payment)
            })
            .collect();
        ids.extend((sent..sent + PER_BATCH).map(|n| format!("{codec}-{n}")));
        for (partition, offset) in common::produce_with(&p, &topic, &batch).await {
            let at = &mut next[usize::try_from(partition).expect("partition")];
            *at = (*at).max(offset + 1);
        }
        sent += PER_BATCH;
    }

    let effects = Effects::new();
    let recorder = Recorder::new();
    let running = common::start(
        builder(&brokers, &topic, &group)
            .engine(memory_engine())
            .handler(effects.by_key()),
        &recorder,
    );
    recorder.wait_settled(sent, Duration::from_secs(30)).await;
    common::wait_committed(&brokers, &group, &topic, &next, Duration::from_secs(10)).await;
    running.stop().await;

    for id in &ids {
        assert_eq!(effects.runs(id), 1, "payment {id} handled once");
    }
    assert_eq!(effects.distinct(), sent, "nothing else handled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_batches_are_handled_once_and_committed() {
    handled_once_and_committed("gzip").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snappy_batches_are_handled_once_and_committed() {
    handled_once_and_committed("snappy").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lz4_batches_are_handled_once_and_committed() {
    handled_once_and_committed("lz4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_batches_are_handled_once_and_committed() {
    handled_once_and_committed("zstd").await;
}
