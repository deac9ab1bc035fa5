//! Dead letters: where they go, the headers idem adds, and the publish that must be
//! confirmed before the original is acked.

use idem_core::binding::{
    HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_NAMESPACE, HEADER_REASON, Reason,
};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel};

use crate::Message;

/// Header with the queue the dead letter was consumed from.
pub const HEADER_QUEUE: &str = "idem-original-queue";
/// Header with the exchange it was published to (empty: the default exchange).
pub const HEADER_EXCHANGE: &str = "idem-original-exchange";
/// Header with the routing key it was published with.
pub const HEADER_ROUTING_KEY: &str = "idem-original-routing-key";

/// Where dead letters go. Each is published persistent, with publisher confirms, and the
/// original is acked only once the server confirmed its letter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetters {
    /// A durable queue named `<queue>.dlq`, declared by the consumer (the default).
    #[default]
    Suffix,
    /// A durable queue of this name, declared by the consumer.
    Queue(String),
    /// An exchange and a routing key; the topology behind them is yours. A letter the
    /// exchange cannot route is not confirmed: the original stays unacked and is retried.
    Exchange {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
}

impl DeadLetters {
    /// The exchange and routing key letters of `queue` are published with, and the queue
    /// to declare, if any.
    pub(crate) fn target(&self, queue: &str) -> (String, String, Option<String>) {
        match self {
            DeadLetters::Suffix => {
                let q = format!("{queue}.dlq");
                (String::new(), q.clone(), Some(q))
            }
            DeadLetters::Queue(q) => (String::new(), q.clone(), Some(q.clone())),
            DeadLetters::Exchange {
                exchange,
                routing_key,
            } => (exchange.clone(), routing_key.clone(), None),
        }
    }
}

/// Declares the dead-letter queue, if idem owns it.
pub(crate) async fn declare(channel: &Channel, queue: Option<&str>) -> lapin::Result<()> {
    if let Some(q) = queue {
        let options = QueueDeclareOptions::durable();
        channel
            .queue_declare(q.into(), options, FieldTable::default())
            .await?;
    }
    Ok(())
}

/// One dead letter to publish.
pub(crate) struct Letter<'a> {
    pub message: &'a Message,
    pub reason: Reason,
    pub error: &'a str,
    pub attempts: u32,
}

impl Letter<'_> {
    /// The original's properties, persistent, with its headers and idem's.
    fn properties(&self) -> BasicProperties {
        let m = self.message;
        let mut headers = m.properties().headers().clone().unwrap_or_default();
        let mut put = |name: &str, value: &str| {
            headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
        };
        put(HEADER_QUEUE, m.queue());
        put(HEADER_EXCHANGE, m.exchange());
        put(HEADER_ROUTING_KEY, m.routing_key());
        put(HEADER_REASON, self.reason.as_str());
        put(HEADER_ERROR, self.error);
        put(HEADER_ATTEMPTS, &self.attempts.to_string());
        if let Some(key) = m.idempotency_key() {
            put(HEADER_KEY, &key.to_string());
            put(HEADER_NAMESPACE, key.namespace());
        }
        m.properties()
            .clone()
            .with_headers(headers)
            .with_delivery_mode(2)
    }

    /// Publishes the letter and waits for the server's confirm; the reason it was not
    /// confirmed otherwise.
    pub async fn publish(
        &self,
        channel: &Channel,
        exchange: &str,
        routing_key: &str,
    ) -> Result<(), String> {
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let confirm = channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                options,
                self.message.payload(),
                self.properties(),
            )
            .await
            .map_err(|e| format!("publish: {e}"))?
            .await
            .map_err(|e| format!("confirm: {e}"))?;
        if !confirm.is_ack() {
            return Err("the server refused the letter (nack)".into());
        }
        if let Some(returned) = confirm.take_message() {
            return Err(format!(
                "the letter could not be routed: {}",
                returned.reply_text
            ));
        }
        Ok(())
    }
}
