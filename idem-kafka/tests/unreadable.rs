//! A partition whose messages cannot be read never stalls in silence (MockCluster): `run()`
//! stops with [`Error::Unreadable`] naming the partition, and the offset where it could not
//! read on, having committed what was settled before it and nothing past it.

mod common;

use std::time::Duration;

use common::wire::produce_undecodable;
use common::{
    Effects, Out, Recorder, builder, committed, memory_engine, mock_topic, produce, unique,
};
use idem_kafka::Error;
use idem_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

/// How long `run()` may take to return once the partition cannot be read: the loop stops
/// as at a shutdown, within its revoke and close.
const STOPS_WITHIN: Duration = Duration::from_secs(20);

fn payments(prefix: &str, n: usize) -> Vec<Out> {
    (0..n)
        .map(|i| Out::keyed(0, &format!("{prefix}{i}"), "payment"))
        .collect()
}

/// Runs the consumer of `topic` on a task of its own, with no shutdown signal.
fn run_until_it_stops(
    brokers: &str,
    topic: &str,
    group: &str,
    effects: &std::sync::Arc<Effects>,
    recorder: &std::sync::Arc<Recorder>,
) -> tokio::task::JoinHandle<idem_kafka::Result<()>> {
    let consumer = builder(brokers, topic, group)
        .engine(memory_engine())
        .handler(effects.by_key())
        .probe(recorder.clone())
        .build()
        .expect("consumer");
    tokio::spawn(consumer.run())
}

/// The error `run()` returned, within [`STOPS_WITHIN`].
async fn stopped(task: tokio::task::JoinHandle<idem_kafka::Result<()>>) -> Error {
    let result = tokio::time::timeout(STOPS_WITHIN, task)
        .await
        .expect("run() returned: the partition did not stall in silence")
        .expect("task");
    result.expect_err("run() stopped with an error")
}

/// Three payments, then a batch whose attributes name `codec` but whose records are not
/// compressed with it, then three more: `run()` stops at the batch.
async fn an_undecodable_batch_stops_the_loop_at_its_offset(codec: i16) {
    let topic = unique("undecodable");
    let group = unique("g");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    produce(&brokers, &topic, &payments("before", 3)).await;
    assert_eq!(produce_undecodable(&brokers, &topic, 0, codec), Ok(3));
    produce(&brokers, &topic, &payments("after", 3)).await;

    let (effects, recorder) = (Effects::new(), Recorder::new());
    let task = run_until_it_stops(&brokers, &topic, &group, &effects, &recorder);
    let error = stopped(task).await;
    let Error::Unreadable {
        topic: t,
        partition,
        offset,
        ..
    } = &error
    else {
        panic!("not Unreadable: {error}");
    };
    assert_eq!(
        (t.as_str(), *partition, *offset),
        (topic.as_str(), 0, Some(3))
    );
    assert!(error.to_string().contains("at offset 3"), "{error}");

    for i in 0..3 {
        assert_eq!(
            effects.runs(&format!("before{i}")),
            1,
            "before{i} handled once"
        );
        assert_eq!(
            effects.runs(&format!("after{i}")),
            0,
            "after{i} not handled"
        );
    }
    // Committed up to the batch, not past it: a restart reads it again.
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_gzip_batch_stops_the_loop_at_its_offset() {
    an_undecodable_batch_stops_the_loop_at_its_offset(1).await;
}

/// What a consumer without a codec meets (librdkafka's own lacked zstd until this build):
/// before, the partition stalled there with only a log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_in_an_unknown_codec_stops_the_loop_at_its_offset() {
    an_undecodable_batch_stops_the_loop_at_its_offset(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authorization_error_on_fetch_stops_the_loop_naming_its_partition() {
    let topic = unique("denied");
    let group = unique("g");
    let (cluster, brokers) = mock_topic(&topic, 1);
    produce(&brokers, &topic, &payments("before", 2)).await;

    let (effects, recorder) = (Effects::new(), Recorder::new());
    let task = run_until_it_stops(&brokers, &topic, &group, &effects, &recorder);
    recorder.wait_settled(2, Duration::from_secs(20)).await;
    // Every fetch from here on is refused (an ACL taken away), for longer than the test.
    let denied = [RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 1000];
    cluster.request_errors(RDKafkaApiKey::Fetch, &denied);
    produce(&brokers, &topic, &payments("after", 2)).await;

    let error = stopped(task).await;
    let Error::Unreadable {
        topic: t,
        partition,
        offset,
        ..
    } = &error
    else {
        panic!("not Unreadable: {error}");
    };
    assert_eq!(
        (t.as_str(), *partition, *offset),
        (topic.as_str(), 0, Some(2))
    );
    assert_eq!(effects.runs("after0"), 0, "nothing read past the refusal");
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![2]);
}
