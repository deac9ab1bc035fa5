//! The consumer's memory stays bounded under a backlog of large messages, on the real broker
//! (tansu, `IDEM_KAFKA_BROKERS`). The consumer runs in a process of its own (the `backlog`
//! example), so its peak resident memory is its own and not this process's producer.

mod common;

use std::process::Command;

use common::{committed, create_topics, unique};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};

const PARTITIONS: i32 = 4;
const MESSAGES: usize = 5_200;
const SIZE: usize = 100 * 1024;
/// The consumer's byte bound (`max_buffered_bytes`): 80 messages.
const BOUND: f64 = (8 << 20) as f64;
/// Each partition queue's prefetch (`queued.max.messages.kbytes`): twice the bound, so a
/// worker finds more waiting than the bound lets it take.
const QUEUED_KB: u64 = 16 * 1024;
const LIMIT_KB: u64 = 150 * 1024;

/// Produces `MESSAGES` messages of `SIZE` bytes, spread over the partitions, each with its
/// own `idempotency-key` header.
async fn produce_backlog(brokers: &str, topic: &str) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "20")
        .create()
        .expect("producer");
    let payload = vec![b'x'; SIZE];
    let mut pending = Vec::with_capacity(MESSAGES);
    for i in 0..MESSAGES {
        let id = format!("m{i}");
        let headers = OwnedHeaders::new().insert(Header {
            key: "idempotency-key",
            value: Some(id.as_bytes()),
        });
        let partition = i32::try_from(i).expect("index") % PARTITIONS;
        let record = FutureRecord::<[u8], [u8]>::to(topic)
            .payload(&payload)
            .headers(headers)
            .partition(partition);
        let delivery = producer
            .send_result(record)
            .map_err(|(e, _)| e)
            .expect("enqueue message");
        pending.push(delivery);
    }
    for d in pending {
        d.await.expect("delivery future").expect("delivered");
    }
}

/// The value of `name=` in the example's output line.
fn field(out: &str, name: &str) -> f64 {
    out.split_whitespace()
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {out:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_large_messages_stays_within_the_byte_bound() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let topic = unique("memory");
    let group = unique("g");
    let dlq = format!("{topic}.dlq");
    create_topics(&brokers, &[(&topic, PARTITIONS), (&dlq, 1)]).await;
    let example = idem_conformance::process::build_workspace_example(
        concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
        "backlog",
    );
    let began = std::time::Instant::now();
    produce_backlog(&brokers, &topic).await;
    eprintln!(
        "produced {MESSAGES} messages to {topic} in {:?}",
        began.elapsed()
    );

    // 532 MB wait on the broker; each partition runs a 20 ms handler per message. The
    // client prefetches up to 16 MiB per partition while the handlers run, and the workers
    // take from it only while they hold less than the bound.
    let (bound, queued) = (BOUND.to_string(), QUEUED_KB.to_string());
    let args = [&brokers, &topic, &group, &MESSAGES.to_string(), "20", "0"];
    let out = Command::new(example.path())
        .args(args)
        .args([&bound, &queued])
        .output()
        .expect("run the backlog example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the example failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{stdout}");
    let all = MESSAGES as f64;
    assert_eq!(field(&stdout, "settled"), all, "every message settled");
    assert_eq!(field(&stdout, "distinct"), all, "every key ran");
    assert_eq!(field(&stdout, "runs"), all, "each key ran once");
    // The gauge reached the bound (more waited than it lets the workers take) and passed it
    // by at most one message per partition: a worker stops taking once the consumer is past
    // the bound, and one holding nothing takes one message.
    let peak = field(&stdout, "peak_buffered");
    let slack = (PARTITIONS as usize * (SIZE + 64)) as f64;
    assert!(
        peak >= BOUND && peak <= BOUND + slack,
        "peak bytes held {peak}, bound {BOUND}"
    );
    let hwm = field(&stdout, "vmhwm_kb");
    assert!(
        hwm < LIMIT_KB as f64,
        "peak resident memory {hwm} KiB, limit {LIMIT_KB} KiB"
    );
    let per = i64::try_from(MESSAGES).expect("count") / i64::from(PARTITIONS);
    assert_eq!(
        committed(&brokers, &group, &topic, PARTITIONS),
        vec![per; PARTITIONS as usize],
        "every offset committed"
    );
}
