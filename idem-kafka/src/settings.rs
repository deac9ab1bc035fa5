//! The checked settings of a consumer: plain data, read by every part of the loop.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Engine;
use idem_core::binding::MissingKey;
use rdkafka::ClientConfig;

use crate::handler::DynHandler;
use crate::{Error, KeySource, Probe, Result};

/// How messages are run: under a lease through the engine, or in a transaction of a
/// [`Transactional`](idem_core::Transactional) store with the offset.
pub(crate) enum Mode {
    Lease(DynHandler),
    Transactional(Arc<dyn crate::tx::TxStore>),
}

impl Mode {
    pub fn is_transactional(&self) -> bool {
        !matches!(self, Mode::Lease(_))
    }
}

/// Where dead letters go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterTopic {
    /// `<topic>.dlq` for each source topic (the default).
    #[default]
    Suffix,
    /// One topic for all.
    Fixed(String),
}

impl DeadLetterTopic {
    pub(crate) fn for_topic(&self, topic: &str) -> String {
        match self {
            DeadLetterTopic::Suffix => format!("{topic}.dlq"),
            DeadLetterTopic::Fixed(t) => t.clone(),
        }
    }
}

/// The most messages [`ConsumerBuilder::batch_size`](crate::ConsumerBuilder::batch_size) takes.
pub const MAX_BATCH_SIZE: usize = 1 << 16;

/// The longest topic name Kafka accepts.
const MAX_TOPIC_BYTES: usize = 249;

/// A topic name the client can pass on: 1 to 249 bytes, no NUL (librdkafka takes names as
/// C strings and rejects longer ones, where rdkafka panics).
pub(crate) fn check_topic(topic: &str) -> Result<()> {
    if topic.is_empty() || topic.len() > MAX_TOPIC_BYTES || topic.contains('\0') {
        return Err(Error::Config(format!(
            "topic {topic:?}: a topic name is 1 to {MAX_TOPIC_BYTES} bytes without NUL"
        )));
    }
    Ok(())
}

/// The checked settings of an [`IdemConsumer`].
pub(crate) struct Settings {
    pub consumer_config: ClientConfig,
    pub dead_letter_config: ClientConfig,
    pub topics: Vec<String>,
    pub group: String,
    pub namespace: String,
    pub key_source: KeySource,
    pub engine: Engine,
    pub mode: Mode,
    pub dead_letter: DeadLetterTopic,
    pub missing_key: MissingKey,
    pub partition_concurrency: Option<usize>,
    pub in_flight: usize,
    pub order_by: crate::OrderBy,
    pub batch_size: usize,
    /// Lease mode: the most handlers of one partition whose effects may have run without
    /// being settled (a crash repeats at most this many); `batch_size` unless set.
    pub max_unsettled: usize,
    /// The longest a chunk's results should wait for their settle, as handlers are timed.
    pub settle_within: Duration,
    pub max_buffered: usize,
    pub max_buffered_bytes: usize,
    pub commit_interval: Duration,
    pub revoke_timeout: Duration,
    pub retry_backoff: (Duration, Duration),
    pub probe: Option<Arc<dyn Probe>>,
    /// Whether `run` fails at start on a missing source or dead-letter topic.
    pub topic_check: bool,
    /// How long the checks at start wait for the brokers' metadata.
    pub start_timeout: Duration,
}

impl Settings {
    /// How many messages a partition holds (waiting or running) before the poll thread
    /// may stop copying messages out of the client: four batches, so a worker always has
    /// its next one waiting; at most `max_buffered`.
    pub fn read_ahead(&self) -> usize {
        self.batch_size.saturating_mul(4).min(self.max_buffered)
    }
}
