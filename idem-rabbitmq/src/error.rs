//! Errors of the consumer.

/// Why the consumer could not be built or stopped running. Per-message trouble (a store
/// outage, a handler error, a failed dead-letter publish) never ends the loop: the message
/// stays unacked and is retried; a lost connection is made again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is missing or makes no sense.
    #[error("configuration: {0}")]
    Config(String),
    /// The queue to consume does not exist on the server.
    #[error("queue {0:?} does not exist")]
    UnknownQueue(String),
    /// The AMQP client failed: connecting, opening a channel, consuming, acking.
    #[error("amqp: {context}: {source}")]
    Amqp {
        /// What was being done.
        context: &'static str,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },
    /// Connecting to the server failed: `failure` says why (an untrusted certificate, a
    /// refused login, TLS to a plain port or the reverse, no server there).
    #[error("cannot connect to {server}: {failure}: {source}")]
    Connect {
        /// The server, `host:port`.
        server: String,
        /// Why, as far as the client can tell.
        failure: crate::ConnectFailure,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },
    /// The connection or channel was lost, or the server ended the subscription.
    #[error("lost: {0}")]
    Lost(String),
    /// The idem engine or backend refused something at start-up.
    #[error(transparent)]
    Core(#[from] idem_core::Error),
}

impl Error {
    pub(crate) fn amqp(context: &'static str) -> impl FnOnce(lapin::Error) -> Error {
        move |source| Error::Amqp { context, source }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
