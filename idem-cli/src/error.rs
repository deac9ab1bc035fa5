//! What the `idem` command can fail with; each prints as one line.

/// A failure of one `idem` command.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The backend URL does not parse or names no known backend.
    #[error("{url:?} is not a backend URL: {reason} (expected {expected})")]
    BadUrl {
        /// The URL, password hidden.
        url: String,
        /// What is wrong with it.
        reason: String,
        /// The URL forms of the backends compiled in.
        expected: String,
    },
    /// The URL names a backend, or the command needs a part, this build does not include.
    #[error(
        "{what} needs the cargo feature `{feature}`, which this build of idem lacks: rebuild with `cargo install idem-cli --features {feature}` (in the workspace: `cargo build -p idem-cli --features {feature}`)"
    )]
    FeatureMissing {
        /// What needs it (`the redis backend`, `idem demo`).
        what: String,
        /// The idem-cli feature that adds it.
        feature: &'static str,
    },
    /// A changing command was not confirmed.
    #[error("refusing to {action} without confirmation: {why}")]
    NotConfirmed {
        /// What would have changed.
        action: String,
        /// Why no confirmation was had.
        why: &'static str,
    },
    /// The command's arguments do not make sense together, or one of them is not valid
    /// (a key, a number out of range): a usage error, as clap's own.
    #[error("{0}")]
    Usage(String),
    /// There is no record for the key the command is about.
    #[error("no record for {key} (never claimed, deleted, or expired){then}")]
    NotFound {
        /// The key.
        key: String,
        /// What follows for the command (`: nothing to release`), or nothing.
        then: &'static str,
    },
    /// The store or the record refused what the command asked (the record is not in a
    /// state the command acts on, the store cannot do it), or something it needs failed.
    #[error("{0}")]
    Refused(String),
    /// The store answered with an error.
    #[error("{context}: {source}")]
    Store {
        /// What was being done.
        context: String,
        /// The backend's error.
        #[source]
        source: idem_core::Error,
    },
    /// Kafka refused or did not answer.
    #[cfg(feature = "kafka")]
    #[error("{context}: {source}")]
    Kafka {
        /// What was being done.
        context: String,
        /// The error (boxed: the consumer's errors name topics and brokers).
        #[source]
        source: Box<idem_kafka::Error>,
    },
    /// Reading or writing a local file or the terminal failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The demo found a payment charged twice on the idem side.
    #[error("the idem consumer charged {0} payment(s) more than once")]
    DoubleCharge(u64),
}

/// A result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Adds what was being done to a store error.
pub trait StoreContext<T> {
    /// Wraps the error with `context`.
    fn store(self, context: impl Into<String>) -> Result<T>;
}

impl<T> StoreContext<T> for Result<T, idem_core::Error> {
    fn store(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|source| Error::Store {
            context: context.into(),
            source,
        })
    }
}

impl Error {
    /// The same error, its context led by `place` (where it happened: a store and a bench
    /// cell, say), so a run over several stores says which one failed.
    pub fn within(self, place: &str) -> Self {
        match self {
            Error::Store { context, source } => Error::Store {
                context: format!("{place}: {context}"),
                source,
            },
            Error::Io { context, source } => Error::Io {
                context: format!("{place}: {context}"),
                source,
            },
            Error::Refused(why) => Error::Refused(format!("{place}: {why}")),
            other => other,
        }
    }

    /// An [`Error::Io`].
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The process exit code: 2 for usage (a bad URL, a missing feature, arguments that
    /// do not go together, no confirmation), 3 for a double charge in the demo, 4 for no
    /// record for the key, 1 otherwise (the store or the record refused, or failed).
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::BadUrl { .. }
            | Error::FeatureMissing { .. }
            | Error::NotConfirmed { .. }
            | Error::Usage(_) => 2,
            Error::DoubleCharge(_) => 3,
            Error::NotFound { .. } => 4,
            _ => 1,
        }
    }

    /// An [`Error::NotFound`] for `key`, `then` saying what the command does not do.
    pub fn not_found(key: &impl std::fmt::Display, then: &'static str) -> Self {
        Error::NotFound {
            key: key.to_string(),
            then,
        }
    }
}
