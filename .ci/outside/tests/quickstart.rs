//! Runs the root README's quickstart (copied verbatim into `src/bin/quickstart.rs` by
//! `.ci/outside.sh`) against a real Redis and a real Kafka-protocol broker: three
//! payments and a copy of one; each payment is charged once, the copy never, and Ctrl-C
//! stops the consumer cleanly.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_once::kafka::rdkafka::ClientConfig;
use idem_once::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_once::kafka::rdkafka::client::DefaultClientContext;
use idem_once::kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_once::kafka::rdkafka::producer::{FutureProducer, FutureRecord};

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run `eval \"$(scripts/services up)\"` in the idem workspace")
    })
}

#[tokio::test]
async fn the_quickstart_charges_each_payment_once() {
    let (redis, brokers) = (env("REDIS_URL"), env("KAFKA_BROKERS"));
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("admin client");
    // The quickstart's topic and its dead-letter topic: `run()` checks both at start. Either
    // may be there from an earlier run: an error for it is fine, a missing topic shows as
    // the quickstart failing below.
    let topics = ["payments", "payments.dlq"].map(|t| NewTopic::new(t, 1, TopicReplication::Fixed(1)));
    let _ = admin.create_topics(&topics, &AdminOptions::new()).await;

    let mut child = Running(
        Command::new(env!("CARGO_BIN_EXE_quickstart"))
            .env("REDIS_URL", &redis)
            .env("KAFKA_BROKERS", &brokers)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the quickstart"),
    );
    let (tx, lines) = mpsc::channel();
    let stdout = child.0.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });

    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("producer");
    for id in ["a", "b", "a", "c"] {
        let key = format!("{run}-{id}");
        let headers = OwnedHeaders::new().insert(Header {
            key: "idempotency-key",
            value: Some(key.as_str()),
        });
        let payment = format!("payment {key}");
        producer
            .send(
                FutureRecord::<(), _>::to("payments")
                    .payload(&payment)
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .expect("produce");
    }

    // One partition, handled in order: once `c` is charged, the copy of `a` before it
    // has been handled too.
    let last = format!("payment {run}-c");
    let mut charged = Vec::new();
    while !charged.iter().any(|l: &String| l.contains(&last)) {
        match lines.recv_timeout(Duration::from_secs(90)) {
            Ok(line) if line.contains(&run.to_string()) => charged.push(line),
            Ok(_) => {}
            Err(e) => panic!("no charge of {last} ({e}); charged so far: {charged:?}"),
        }
    }
    for id in ["a", "b", "c"] {
        let this = format!("payment {run}-{id} ");
        let n = charged.iter().filter(|l| l.contains(&this)).count();
        assert_eq!(n, 1, "{id} charged {n} times: {charged:?}");
    }

    let pid = child.0.id().to_string();
    let sent = Command::new("kill").args(["-INT", &pid]).status();
    assert!(sent.is_ok_and(|s| s.success()), "Ctrl-C to the quickstart");
    let status = child.0.wait().expect("the quickstart exits");
    assert!(status.success(), "the quickstart stopped with {status}");
}

/// The quickstart's process, killed if the test ends before it stopped: a consumer left
/// running would stay in the group and take the next run's partition.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
