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
}

impl Error {
    pub(crate) fn kafka(context: &'static str, source: KafkaError) -> Self {
        Error::Kafka { context, source }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
