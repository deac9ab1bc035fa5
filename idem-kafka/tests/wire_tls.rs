//! The consumer over TLS (`scripts/services up kafka-tls`): on the `SSL` wire, with the
//! broker verified against the test CA and a client certificate, it handles real payments
//! once and commits them through the same wire.

mod common;

use std::time::Duration;

use common::{Effects, Out, Recorder, builder_with, consumer_config, memory_engine, unique};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::producer::FutureProducer;

const PARTITIONS: i32 = 2;
const MESSAGES: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ssl_wire_with_a_client_certificate_settles_and_commits() {
    let mut wire = ClientConfig::new();
    let brokers = common::secure::ssl(&mut wire);
    let topic = unique("ssl");
    let group = unique("g");
    common::create_topics_on(&wire, &[(&topic, PARTITIONS), (&format!("{topic}.dlq"), 1)]).await;
    let producer: FutureProducer = wire.create().expect("producer over SSL");
    let payments: Vec<Out> = (0..MESSAGES)
        .map(|n| {
            let partition = i32::try_from(n).expect("n") % PARTITIONS;
            Out::keyed(partition, &format!("p{n}"), &format!("payment {n}"))
        })
        .collect();
    let mut next = [0i64; PARTITIONS as usize];
    for (partition, offset) in common::produce_with(&producer, &topic, &payments).await {
        let at = &mut next[usize::try_from(partition).expect("partition")];
        *at = (*at).max(offset + 1);
    }

    let mut config = consumer_config(&brokers);
    common::secure::ssl(&mut config);
    let effects = Effects::new();
    let recorder = Recorder::new();
    let running = common::start(
        builder_with(config, &topic, &group)
            .engine(memory_engine())
            .handler(effects.by_key()),
        &recorder,
    );
    recorder
        .wait_settled(MESSAGES, Duration::from_secs(30))
        .await;
    common::wait_committed_on(&wire, &group, &topic, &next, Duration::from_secs(10)).await;
    running.stop().await;

    for n in 0..MESSAGES {
        assert_eq!(
            effects.runs(&format!("p{n}")),
            1,
            "payment p{n} handled once"
        );
    }
    assert_eq!(effects.distinct(), MESSAGES, "nothing else handled");
}
