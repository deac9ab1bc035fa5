//! Errors of the consumer loop.

use rdkafka::error::KafkaError;

/// Why the consumer could not be built or stopped running. Per-message trouble (a store
/// outage, a handler error, a failed dead-letter write) never ends the loop: it stalls the
/// partition and is retried.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is missing or makes no sense.
    #[error("configuration: {0}")]
    Config(String),
    /// The Kafka client failed: creating it, subscribing, or a fatal consumer error.
    #[error("kafka: {context}: {source}")]
    Kafka {
        /// What was being done.
        context: &'static str,
        /// The client's error.
        #[source]
        source: KafkaError,
    },
    /// The topic does not exist on the broker.
    #[error("topic {0:?} does not exist")]
    UnknownTopic(String),
    /// Found at start, before joining the group: topics the consumer needs do not exist
    /// (or this client may not see them). Skipped by
    /// [`skip_topic_check`](crate::ConsumerBuilder::skip_topic_check).
    #[error("{}", missing_topics(sources, dead_letter))]
    MissingTopics {
        /// Source topics that do not exist.
        sources: Vec<String>,
        /// Dead-letter topics that do not exist.
        dead_letter: Vec<String>,
    },
    /// Found at start: no broker answered, and the client said why (see
    /// [`ConnectFailure`](crate::ConnectFailure)).
    #[error("kafka broker {broker}: {failure}: {detail}")]
    Connect {
        /// The broker, as the client named it (`ssl://host:port/id`), or the bootstrap
        /// servers if it named none.
        broker: String,
        /// Which of the failures it is.
        failure: crate::ConnectFailure,
        /// The client's own words.
        detail: String,
    },
    /// The idem engine or backend refused something at start-up.
    #[error(transparent)]
    Core(#[from] idem_core::Error),
    /// The poll thread could not be started or ended without reporting.
    #[error("consumer thread: {0}")]
    Thread(String),
    /// A partition's worker panicked (a bug in idem, or in a [`Probe`](crate::Probe)): the
    /// loop stops as at a shutdown, committing what was settled, rather than leave that
    /// partition stalled without a word.
    #[error("{0}")]
    Worker(String),
    /// A partition's messages could not be read on: a batch that does not decode (corrupt,
    /// or compressed with a codec this client lacks), or a fetch the broker refuses (no
    /// authorization for the topic, a message too large to fetch). The loop stops as at a
    /// shutdown, committing what was settled before it and nothing past it, rather than
    /// leave the partition stuck; a restart reads from there again. Errors librdkafka
    /// retries by itself (a broker or the network down, a leader moving) never stop it.
    #[error("kafka: {topic}/{partition} cannot be read {}: {source}", at_offset(*.offset))]
    Unreadable {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// The first offset not read: the one after the last message this consumer read
        /// from the partition; `None` if it read none, when it is the offset the partition
        /// started from (rdkafka does not pass on librdkafka's own).
        offset: Option<i64>,
        /// The client's error (boxed, so that every `Result` of this crate stays small).
        #[source]
        source: Box<KafkaError>,
    },
}

impl Error {
    pub(crate) fn kafka(context: &'static str, source: KafkaError) -> Self {
        Error::Kafka { context, source }
    }
}

/// The message of [`Error::MissingTopics`].
fn missing_topics(sources: &[String], dead_letter: &[String]) -> String {
    let mut parts = Vec::new();
    if !sources.is_empty() {
        parts.push(format!("source topics {sources:?}"));
    }
    if !dead_letter.is_empty() {
        parts.push(format!("dead-letter topics {dead_letter:?}"));
    }
    format!("{} do not exist", parts.join(" and "))
}

/// Where [`Error::Unreadable`] stopped, in its message.
fn at_offset(offset: Option<i64>) -> String {
    match offset {
        Some(o) => format!("at offset {o}"),
        None => "at the offset it started from".to_owned(),
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
