//! The scenario: which payment events the producer sends, in which order, and how they
//! are written to the broker; and the ledger both consumers charge.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};

use crate::error::{Error, Result};

use idem_kafka::DEFAULT_KEY_HEADER as KEY_HEADER;

/// The source topic.
pub const TOPIC: &str = "payments";
/// Where idem dead-letters (idem-kafka's default `<topic>.dlq`).
pub const DLQ: &str = "payments.dlq";
/// Partitions of the source topic.
pub const PARTITIONS: i32 = 4;

/// One message the producer sends.
#[derive(Clone, Debug)]
pub struct Event {
    /// The payment id: the Kafka key and the idempotency key.
    pub id: String,
    /// The payload.
    pub payload: String,
}

/// What was sent.
#[derive(Debug)]
pub struct Plan {
    /// Every message, in send order.
    pub events: Vec<Event>,
    /// Distinct payments (poison excluded).
    pub payments: u32,
    /// Payments sent twice.
    pub duplicates: u32,
    /// Messages that are not payments.
    pub poison: u32,
}

impl Plan {
    /// `payments` events, `duplicates` of them sent again a little later (as a producer
    /// retry does), and a few poison messages (not JSON), from a fixed seed.
    pub fn new(payments: u32, duplicates: u32) -> Self {
        let mut rng = fastrand::Rng::with_seed(0x1de0);
        let mut events: Vec<Event> = (0..payments)
            .map(|i| {
                let cents = rng.u32(100..100_000);
                let id = format!("pay-{i:05}");
                let payload = format!(r#"{{"payment":"{id}","cents":{cents}}}"#);
                Event { id, payload }
            })
            .collect();
        let duplicates = duplicates.min(payments);
        let mut picked: Vec<usize> = (0..payments as usize).collect();
        rng.shuffle(&mut picked);
        picked.truncate(duplicates as usize);
        picked.sort_unstable_by(|a, b| b.cmp(a));
        for i in picked {
            let copy = events[i].clone();
            let at = (i + 1 + rng.usize(..50)).min(events.len());
            events.insert(at, copy);
        }
        let poison = (payments / 400).max(1);
        for n in 0..poison {
            let at = rng.usize(..=events.len());
            events.insert(
                at,
                Event {
                    id: format!("poison-{n}"),
                    payload: format!("{{not json: truncated event {n}"),
                },
            );
        }
        Plan {
            events,
            payments,
            duplicates,
            poison,
        }
    }

    /// Sends every event to `brokers`, keyed by payment id (so a payment's copies share a
    /// partition) with the id in the `idempotency-key` header; returns each partition's
    /// end offset.
    pub async fn produce(&self, brokers: &str) -> Result<HashMap<i32, i64>> {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("linger.ms", "5")
            .create()
            .map_err(|e| Error::Refused(format!("demo producer: {e}")))?;
        let sends = self.events.iter().map(|e| {
            let headers = OwnedHeaders::new().insert(Header {
                key: KEY_HEADER,
                value: Some(e.id.as_bytes()),
            });
            let record = FutureRecord::to(TOPIC)
                .key(&e.id)
                .payload(&e.payload)
                .headers(headers);
            producer.send(record, Duration::from_secs(10))
        });
        let mut ends = HashMap::new();
        for sent in futures::future::join_all(sends).await {
            let delivery = sent.map_err(|(e, _)| Error::Refused(format!("demo producer: {e}")))?;
            let end = ends.entry(delivery.partition).or_insert(0);
            *end = (*end).max(delivery.offset + 1);
        }
        Ok(ends)
    }
}

/// Where both consumers run and when they crash.
#[derive(Debug)]
pub struct Stage {
    /// The broker list.
    pub brokers: String,
    /// Each partition's end offset, once everything is produced.
    pub ends: HashMap<i32, i64>,
    /// Instance `i` crashes once it has charged `crash_after[i]` payments; the instance
    /// after the last crash runs to the end.
    pub crash_after: Vec<u64>,
    /// Messages per commit (naive) and per claimed batch (idem).
    pub commit_every: u64,
}

impl Stage {
    /// Whether `next` (next offset to read, per partition) is past every partition's end.
    pub fn caught_up(&self, next: &HashMap<i32, i64>) -> bool {
        self.ends
            .iter()
            .all(|(p, end)| next.get(p).copied().unwrap_or(0) >= *end)
    }
}

/// Parses a payment payload: its id and amount, or why it is not a payment.
pub fn parse(payload: &[u8]) -> Result<(String, u64), String> {
    let v: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("not a payment: {e}"))?;
    let id = v["payment"].as_str().ok_or("not a payment: no id")?;
    let cents = v["cents"].as_u64().ok_or("not a payment: no amount")?;
    Ok((id.to_owned(), cents))
}

/// How long one charge takes at the card processor (a network call in real life); both
/// consumers pay it.
pub const CHARGE_TIME: Duration = Duration::from_millis(1);

/// The card processor: how many times each payment was charged.
#[derive(Debug, Default)]
pub struct Ledger {
    charges: Mutex<HashMap<String, u32>>,
}

impl Ledger {
    /// Charges `id` once more, taking [`CHARGE_TIME`].
    pub async fn charge(&self, id: &str) {
        tokio::time::sleep(CHARGE_TIME).await;
        let mut charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
        *charges.entry(id.to_owned()).or_default() += 1;
    }

    /// (payments charged at least once, charges in all, payments charged more than once).
    pub fn totals(&self) -> (u32, u32, u32) {
        let charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
        let distinct = charges.len() as u32;
        let total = charges.values().sum();
        let twice = charges.values().filter(|&&n| n > 1).count() as u32;
        (distinct, total, twice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_holds_what_it_says() {
        let plan = Plan::new(1000, 100);
        assert_eq!(plan.events.len(), 1000 + 100 + 2);
        let mut seen: HashMap<&str, u32> = HashMap::new();
        for e in &plan.events {
            *seen.entry(&e.id).or_default() += 1;
        }
        assert_eq!(seen.values().filter(|&&n| n == 2).count(), 100);
        let poison: Vec<_> = plan
            .events
            .iter()
            .filter(|e| parse(e.payload.as_bytes()).is_err())
            .collect();
        assert_eq!(poison.len(), 2);
        let first = &plan
            .events
            .iter()
            .find(|e| e.id == "pay-00007")
            .unwrap()
            .payload;
        assert_eq!(parse(first.as_bytes()).unwrap().0, "pay-00007");
    }

    #[tokio::test]
    async fn the_ledger_counts_double_charges() {
        let l = Ledger::default();
        for id in ["a", "b", "a", "c", "a"] {
            l.charge(id).await;
        }
        assert_eq!(l.totals(), (3, 5, 1));
    }
}
