//! Shared set-up: a connection to the test server, a fresh queue per test, publishing
//! with a key header, and a probe that counts what the consumer acked.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_rabbitmq::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use idem_rabbitmq::lapin::types::{AMQPValue, FieldTable, LongString};
use idem_rabbitmq::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idem_rabbitmq::{Message, Point, Probe, Verdict};
use tokio::sync::Notify;

/// The test server's URL, or a failure naming the command that starts it.
pub fn url() -> String {
    idem_conformance::service_env("IDEM_RABBITMQ_URL")
}

/// A connection to the test server.
pub async fn connect() -> Connection {
    Connection::connect(&url(), ConnectionProperties::default())
        .await
        .expect("connect to IDEM_RABBITMQ_URL")
}

/// A queue of the test's own (and its dead-letter queue, `<queue>.dlq`), deleted when the
/// value is dropped... by [`Queue::delete`], which each test calls at its end.
pub struct Queue {
    pub name: String,
    pub channel: Channel,
}

impl Queue {
    /// Declares a fresh durable queue; the channel publishes with confirms.
    pub async fn fresh(conn: &Connection, what: &str) -> Queue {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "idem-test-{what}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let channel = conn.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm.select");
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .expect("declare the queue");
        Queue { name, channel }
    }

    /// Publishes `payload` with the `idempotency-key` header `key` (a string, or raw
    /// bytes when not UTF-8), waiting for the server's confirm.
    pub async fn publish(&self, key: Option<&[u8]>, payload: &[u8]) {
        let mut headers = FieldTable::default();
        if let Some(key) = key {
            let value = match std::str::from_utf8(key) {
                Ok(s) => AMQPValue::LongString(LongString::from(s)),
                Err(_) => AMQPValue::ByteArray(key.to_vec().into()),
            };
            headers.insert("idempotency-key".into(), value);
        }
        let props = BasicProperties::default()
            .with_headers(headers)
            .with_delivery_mode(2);
        self.publish_with(props, payload).await;
    }

    /// Publishes `payload` with `props`, waiting for the server's confirm.
    pub async fn publish_with(&self, props: BasicProperties, payload: &[u8]) {
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                self.name.as_str().into(),
                BasicPublishOptions::default(),
                payload,
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "the server refused a test message");
    }

    /// Messages ready in `queue` (not delivered, or delivered and requeued).
    pub async fn ready(&self, queue: &str) -> u32 {
        let options = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        self.channel
            .queue_declare(queue.into(), options, FieldTable::default())
            .await
            .expect("passive declare")
            .message_count()
    }

    /// Takes every message ready in `queue` (acked), with its headers.
    pub async fn take_all(&self, queue: &str) -> Vec<(Vec<u8>, HashMap<String, String>)> {
        let mut out = Vec::new();
        while let Some(got) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
        {
            let headers = got
                .delivery
                .properties
                .headers()
                .as_ref()
                .map(|h| {
                    h.inner()
                        .iter()
                        .filter_map(|(k, v)| match v {
                            AMQPValue::LongString(s) => Some((
                                k.to_string(),
                                String::from_utf8_lossy(s.as_bytes()).into_owned(),
                            )),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push((got.delivery.data.clone(), headers));
        }
        out
    }

    /// Deletes the queue and its dead-letter queue.
    pub async fn delete(self) {
        for q in [self.name.clone(), format!("{}.dlq", self.name)] {
            let _ = self
                .channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
}

/// A probe that records each ack (the key's id, or the payload when keyless, and whether
/// it was a redelivery), and crashes at a point for one payload if asked.
#[derive(Default)]
pub struct Watch {
    pub acked: Mutex<Vec<(String, bool)>>,
    pub claims: AtomicU64,
    pub crash_at: Mutex<Option<(Point, Vec<u8>)>>,
    changed: Notify,
}

impl Watch {
    pub fn new() -> Arc<Watch> {
        Arc::new(Watch::default())
    }

    /// Crash the consumer at `point` for the message with `payload`.
    pub fn crash_at(&self, point: Point, payload: &[u8]) {
        *self.crash_at.lock().expect("lock") = Some((point, payload.to_vec()));
    }

    /// Crash no more.
    pub fn no_crash(&self) {
        *self.crash_at.lock().expect("lock") = None;
    }

    /// How many acks so far.
    pub fn acks(&self) -> usize {
        self.acked.lock().expect("lock").len()
    }

    /// Waits until at least `n` messages were acked, failing after `within`.
    pub async fn acked(&self, n: usize, within: Duration) {
        let waited = tokio::time::timeout(within, async {
            loop {
                let notified = self.changed.notified();
                if self.acks() >= n {
                    return;
                }
                notified.await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "{} of {n} messages acked within {within:?}",
            self.acks()
        );
    }

    /// Waits until messages of at least `n` distinct ids were acked (an ack a lost
    /// connection swallowed is made again on the redelivery), failing after `within`.
    pub async fn acked_ids(&self, n: usize, within: Duration) {
        let distinct = || {
            let acked = self.acked.lock().expect("lock");
            acked
                .iter()
                .map(|(id, _)| id)
                .collect::<std::collections::HashSet<_>>()
                .len()
        };
        let waited = tokio::time::timeout(within, async {
            loop {
                let notified = self.changed.notified();
                if distinct() >= n {
                    return;
                }
                notified.await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "{} of {n} ids acked within {within:?}",
            distinct()
        );
    }

    /// Waits until at least `n` claims were made, failing after `within`.
    pub async fn claimed(&self, n: u64, within: Duration) {
        let waited = tokio::time::timeout(within, async {
            loop {
                let notified = self.changed.notified();
                if self.claims.load(Ordering::SeqCst) >= n {
                    return;
                }
                notified.await;
            }
        })
        .await;
        assert!(waited.is_ok(), "{n} claims not made within {within:?}");
    }
}

impl Probe for Watch {
    fn reached(&self, point: Point, m: &Message) -> Verdict {
        let crash = {
            let crash = self.crash_at.lock().expect("lock");
            matches!(&*crash, Some((p, payload)) if *p == point && m.payload()[..] == payload[..])
        };
        // A crash after the ack still counts the ack: the server has it.
        if crash && point != Point::AfterAck {
            return Verdict::Crash;
        }
        match point {
            Point::AfterAck => {
                let id = m.idempotency_key().map_or_else(
                    || String::from_utf8_lossy(m.payload()).into_owned(),
                    |k| k.id().to_owned(),
                );
                self.acked.lock().expect("lock").push((id, m.redelivered()));
                self.changed.notify_waiters();
            }
            Point::BeforeClaim => {
                self.claims.fetch_add(1, Ordering::SeqCst);
                self.changed.notify_waiters();
            }
            _ => {}
        }
        if crash {
            return Verdict::Crash;
        }
        Verdict::Continue
    }
}

/// Counts the handler's runs per key id (or payload when keyless).
#[derive(Clone, Default)]
pub struct Effects(Arc<Mutex<HashMap<String, u32>>>);

impl Effects {
    pub fn record(&self, m: &Message) {
        let id = m.idempotency_key().map_or_else(
            || String::from_utf8_lossy(m.payload()).into_owned(),
            |k| k.id().to_owned(),
        );
        *self.0.lock().expect("lock").entry(id).or_default() += 1;
    }

    pub fn of(&self, id: &str) -> u32 {
        self.0.lock().expect("lock").get(id).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u32 {
        self.0.lock().expect("lock").values().sum()
    }
}

/// A migrated PostgreSQL store (`IDEM_POSTGRES_URL`) in the schema `schema`, emptied first,
/// with the table `<schema>.ledger (payment, token, instance)` that handlers write their
/// effects to.
pub async fn ledger_store(schema: &str) -> idem_postgres::PgBackend {
    use idem_postgres::{PgBackend, PgConfig};
    use sqlx::AssertSqlSafe;

    let url = idem_conformance::service_env("IDEM_POSTGRES_URL");
    let pg = PgBackend::connect(PgConfig::new(url).with_schema(schema))
        .await
        .expect("connect to IDEM_POSTGRES_URL");
    for statement in [
        format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"),
        format!("CREATE SCHEMA \"{schema}\""),
        format!(
            "CREATE TABLE \"{schema}\".ledger (payment text NOT NULL, token bigint, instance int)"
        ),
    ] {
        sqlx::query(AssertSqlSafe(statement))
            .execute(pg.pool())
            .await
            .expect("the ledger schema");
    }
    pg.migrate().await.expect("migrate");
    pg
}
