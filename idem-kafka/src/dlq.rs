//! The dead-letter producer.

use std::time::Duration;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, ClientContext};

use crate::{DeadLetterTopic, Error, Message, Result};

/// Header naming the topic the dead letter came from.
pub const HEADER_TOPIC: &str = "idem-original-topic";
/// Header with the original partition, in decimal.
pub const HEADER_PARTITION: &str = "idem-original-partition";
/// Header with the original offset, in decimal.
pub const HEADER_OFFSET: &str = "idem-original-offset";
/// Header with the idempotency key (`namespace/id`), when one was found.
pub const HEADER_KEY: &str = "idem-key";
/// Header with why the message was dead-lettered ([`Reason::as_str`]).
pub const HEADER_REASON: &str = "idem-reason";
/// Header with the error text.
pub const HEADER_ERROR: &str = "idem-error";
/// Header with the attempts the handler got, in decimal (0 when it never ran).
pub const HEADER_ATTEMPTS: &str = "idem-attempts";

/// Why a message went to the dead-letter topic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// The key's attempts are spent, or its handler failed permanently.
    Poisoned,
    /// The key is known with another payload.
    Mismatch,
    /// The key source found no key (and the policy is to dead-letter).
    MissingKey,
    /// The key found is not a valid idempotency key.
    InvalidKey,
    /// The payload could not be read by the key source.
    MalformedPayload,
}

impl Reason {
    /// The value of the [`HEADER_REASON`] header.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Poisoned => "poisoned",
            Reason::Mismatch => "mismatch",
            Reason::MissingKey => "missing-key",
            Reason::InvalidKey => "invalid-key",
            Reason::MalformedPayload => "malformed-payload",
        }
    }
}

/// One dead letter to write.
pub(crate) struct Letter<'a> {
    pub message: &'a Message,
    pub reason: Reason,
    pub error: &'a str,
    pub attempts: u32,
}

/// Sends the producer's log lines to `tracing`.
pub(crate) struct LogContext;

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        crate::consumer::log_to_tracing(level, fac, message);
    }
}

pub(crate) struct DeadLetters {
    producer: FutureProducer<LogContext>,
    topic: DeadLetterTopic,
}

impl DeadLetters {
    pub fn new(config: &ClientConfig, topic: DeadLetterTopic) -> Result<Self> {
        let mut config = config.clone();
        if config.get("message.timeout.ms").is_none() {
            config.set("message.timeout.ms", "30000");
        }
        let producer = config
            .create_with_context(LogContext)
            .map_err(|e| Error::kafka("creating the dead-letter producer", e))?;
        Ok(DeadLetters { producer, topic })
    }

    /// Writes the letter and waits for the broker's acknowledgement.
    pub async fn send(&self, letter: &Letter<'_>) -> Result<(), KafkaError> {
        let m = letter.message;
        let topic = self.topic.for_topic(m.topic());
        let partition = m.partition().to_string();
        let offset = m.offset().to_string();
        let attempts = letter.attempts.to_string();
        let key = m.key().map(ToString::to_string);
        let mut headers = m.raw_headers().cloned().unwrap_or_else(OwnedHeaders::new);
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
        if let Some(key) = &key {
            add(HEADER_KEY, key);
        }
        add(HEADER_REASON, letter.reason.as_str());
        add(HEADER_ERROR, letter.error);
        add(HEADER_ATTEMPTS, &attempts);
        let mut record = FutureRecord::to(&topic)
            .payload(m.payload().as_ref())
            .headers(headers);
        if let Some(k) = m.message_key() {
            record = record.key(k.as_ref());
        }
        self.producer
            .send(record, Duration::from_secs(5))
            .await
            .map(|_| ())
            .map_err(|(e, _)| e)
    }
}
