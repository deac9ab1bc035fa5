//! The payment scenario: a producer sends payment events, some of them twice (a retry
//! after a lost acknowledgement), one with a card that is declined for good. The consumer
//! charges each payment once, answers the copies from the store, and dead-letters the
//! declined one.
//!
//! ```sh
//! eval "$(scripts/services up kafka)"
//! cargo run -p idem-kafka --example payments
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{Backend, Bytes, Engine, HandlerError, Key, MemoryBackend, State};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::{IdemConsumer, KeySource};

const PAYMENTS: usize = 20;
const DECLINED: &str = "pay-13";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Ok(brokers) = std::env::var("IDEM_KAFKA_BROKERS") else {
        eprintln!("IDEM_KAFKA_BROKERS is not set: run `eval \"$(scripts/services up kafka)\"`");
        std::process::exit(2);
    };
    let topic = format!("payments-{}", std::process::id());
    let group = format!("billing-{}", std::process::id());

    // Topics are created explicitly: some brokers do not create them on demand.
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()?;
    let dlq = format!("{topic}.dlq");
    let topics = [
        NewTopic::new(&topic, 3, TopicReplication::Fixed(1)),
        NewTopic::new(&dlq, 1, TopicReplication::Fixed(1)),
    ];
    for result in admin.create_topics(&topics, &AdminOptions::new()).await? {
        result.map_err(|(t, e)| format!("creating {t}: {e}"))?;
    }

    // The producer: every payment once, every fourth one again.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()?;
    let mut sends = Vec::new();
    for i in (0..PAYMENTS).chain((0..PAYMENTS).step_by(4)) {
        let id = format!("pay-{i}");
        let payload = format!(
            r#"{{"payment_id":"{id}","card":"4242","cents":{}}}"#,
            100 * i
        );
        sends.push((id, payload));
    }
    for (id, payload) in &sends {
        let headers = OwnedHeaders::new().insert(Header {
            key: "idempotency-key",
            value: Some(id.as_str()),
        });
        producer
            .send(
                FutureRecord::to(&topic)
                    .key(id.as_str())
                    .payload(payload.as_str())
                    .headers(headers),
                Duration::from_secs(5),
            )
            .await
            .map_err(|(e, _)| e)?;
    }
    println!("sent {} events for {PAYMENTS} payments", sends.len());

    // The consumer: charges each payment once.
    let backend = Arc::new(MemoryBackend::new());
    let engine = Engine::builder(backend.clone())
        .lease_ttl(Duration::from_secs(10))
        .build()?;
    let charged: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let ledger = charged.clone();
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &brokers)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000");
    let consumer = IdemConsumer::builder(config)
        .topics([topic.clone()])
        .group(group.clone())
        .key_source(KeySource::json_pointer("/payment_id"))
        .engine(engine)
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |msg, ctx| {
            let ledger = ledger.clone();
            async move {
                let id = msg
                    .idempotency_key()
                    .map(|k| k.id().to_owned())
                    .unwrap_or_default();
                if id == DECLINED {
                    return Err(HandlerError::permanent("card declined"));
                }
                let token = ctx.map(|c| c.token()).unwrap_or_default();
                let mut ledger = ledger.lock().unwrap_or_else(|e| e.into_inner());
                *ledger.entry(id.clone()).or_default() += 1;
                println!("charged {id} (fencing token {token})");
                Ok(Bytes::from(format!("receipt {id}")))
            }
        })
        .build()?;
    let running = tokio::spawn(consumer.run());

    // Wait until every payment is settled in the store, then stop.
    let keys: Vec<Key> = (0..PAYMENTS)
        .map(|i| Key::new(group.as_str(), format!("pay-{i}")))
        .collect::<Result<_, _>>()?;
    loop {
        let mut open = 0;
        for key in &keys {
            match backend.get(key).await?.map(|r| r.state) {
                Some(State::Completed) => {}
                Some(State::Failed) if key.id() == DECLINED => {}
                _ => open += 1,
            }
        }
        if open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    running.await??;

    let charged = charged.lock().unwrap_or_else(|e| e.into_inner());
    let twice = charged.values().filter(|n| **n > 1).count();
    println!(
        "{} payments charged, {twice} of them more than once; {} copies answered from the \
         store; {DECLINED} went to {dlq}",
        charged.len(),
        sends.len() - PAYMENTS,
    );
    Ok(())
}
