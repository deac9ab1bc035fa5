//! The dead-letter producer.

use std::time::Duration;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, ClientContext};

use crate::dead_letter::{
    HEADER_ATTEMPTS, HEADER_DROPPED, HEADER_ERROR, HEADER_KEY, HEADER_NAMESPACE, HEADER_OFFSET,
    HEADER_PARTITION, HEADER_REASON, HEADER_TOPIC, Reason,
};
use crate::settings::DeadLetterTopic;
use crate::{Error, Message, Result};

/// One dead letter to write.
pub(crate) struct Outgoing<'a> {
    pub message: &'a Message,
    pub reason: Reason,
    pub error: &'a str,
    pub attempts: u32,
}

/// Sends the producer's log lines to `tracing`.
pub(crate) struct LogContext;

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        crate::client::log_to_tracing(level, fac, message);
    }
}

/// The dead-letter reader (`read_letters`) assigns partitions itself: no rebalances.
impl ConsumerContext for LogContext {}

/// A producer with the config's settings, whose deliveries give up after 30 s unless
/// `message.timeout.ms` says otherwise (librdkafka's own default is 5 minutes).
pub(crate) fn producer(
    config: &ClientConfig,
    context: &'static str,
) -> Result<FutureProducer<LogContext>> {
    let mut config = config.clone();
    if config.get("message.timeout.ms").is_none() {
        config.set("message.timeout.ms", "30000");
    }
    config
        .create_with_context(LogContext)
        .map_err(|e| Error::kafka(context, e))
}

pub(crate) struct Writer {
    producer: FutureProducer<LogContext>,
    topic: DeadLetterTopic,
}

impl Writer {
    pub fn new(config: &ClientConfig, topic: DeadLetterTopic) -> Result<Self> {
        let producer = producer(config, "creating the dead-letter producer")?;
        Ok(Writer { producer, topic })
    }

    /// Writes the letter and waits for the broker's acknowledgement. A letter over the
    /// producer's size limit is written again without the original payload, key and
    /// headers (see [`HEADER_DROPPED`]): a retry of the whole could never succeed, and the
    /// partition would stall for good.
    pub async fn send(&self, letter: &Outgoing<'_>) -> Result<(), KafkaError> {
        match self.send_as(letter, None).await {
            Err(e) if too_large(&e) => {
                let m = letter.message;
                let dropped = format!(
                    "payload ({} bytes), message key ({} bytes), headers and all but {} \
                     bytes of the error: the letter was over the dead-letter producer's size \
                     limit ({e}); the original stays at {}/{}/{} while its topic retains it",
                    m.payload().len(),
                    m.message_key().map_or(0, |k| k.len()),
                    MAX_LEAN_ERROR,
                    m.topic(),
                    m.partition(),
                    m.offset(),
                );
                tracing::warn!(%dropped, "dead letter written without the original");
                self.send_as(letter, Some(&dropped)).await
            }
            sent => sent,
        }
    }

    /// Writes the letter whole, or, with `dropped`, only idem's headers and that note.
    async fn send_as(
        &self,
        letter: &Outgoing<'_>,
        dropped: Option<&str>,
    ) -> Result<(), KafkaError> {
        let m = letter.message;
        let topic = self.topic.for_topic(m.topic());
        let partition = m.partition().to_string();
        let offset = m.offset().to_string();
        let attempts = letter.attempts.to_string();
        let key = m.idempotency_key().map(|k| (k.to_string(), k.namespace()));
        let mut headers = match dropped {
            None => m.headers_to_forward(),
            Some(_) => OwnedHeaders::new(),
        };
        let mut add = |name: &str, value: &str| {
            let h = std::mem::replace(&mut headers, OwnedHeaders::new());
            headers = h.insert(Header {
                key: name,
                value: Some(value),
            });
        };
        add(HEADER_TOPIC, m.topic());
        add(HEADER_PARTITION, &partition);
        add(HEADER_OFFSET, &offset);
        if let Some((key, namespace)) = &key {
            add(HEADER_KEY, key);
            add(HEADER_NAMESPACE, namespace);
        }
        add(HEADER_REASON, letter.reason.as_str());
        add(
            HEADER_ERROR,
            match dropped {
                None => letter.error,
                // The error text may hold the payload too: the lean letter keeps its start.
                Some(_) => cut(letter.error, MAX_LEAN_ERROR),
            },
        );
        add(HEADER_ATTEMPTS, &attempts);
        if let Some(dropped) = dropped {
            add(HEADER_DROPPED, dropped);
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(&topic).headers(headers);
        if dropped.is_none() {
            record = record.payload(m.payload().as_ref());
            if let Some(k) = m.message_key() {
                record = record.key(k.as_ref());
            }
        }
        self.producer
            .send(record, Duration::from_secs(5))
            .await
            .map(|_| ())
            .map_err(|(e, _)| e)
    }
}

/// The most bytes of the error text a letter without the original keeps.
const MAX_LEAN_ERROR: usize = 256;

/// `text` cut to at most `max` bytes, at a character boundary.
fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Whether `e` says the message is over a size limit (the producer's, or the broker's).
fn too_large(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::MessageBatchTooLarge)
    )
}
