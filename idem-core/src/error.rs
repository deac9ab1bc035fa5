//! The error type shared by every backend.

use crate::{Key, Lease};

/// A boxed error kept as the source of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What can go wrong talking to a backend. Each variant is something a caller can act on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lease is no longer held: its token was superseded (a takeover, a completion) or
    /// its record is gone. Nothing was changed.
    #[error("fenced: the lease on {key} with token {token} is no longer held")]
    Fenced {
        /// The key whose lease was lost.
        key: Key,
        /// The token the caller presented.
        token: u64,
    },
    /// The store did not answer, or answered with a transient failure (timeout, refused
    /// connection, throttling, serialization conflict). Retry later.
    #[error("store unavailable: {message}")]
    Unavailable {
        /// What failed.
        message: String,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
    /// The key is not acceptable.
    #[error("invalid key: {reason}")]
    InvalidKey {
        /// Why it was refused.
        reason: String,
    },
    /// A record in the store does not decode as an idem record.
    #[error("corrupt record: {message}")]
    Corrupt {
        /// What did not decode.
        message: String,
        /// The decoder's error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// A value is larger than the backend or the configuration allows.
    #[error("{what} is {size} bytes, over the limit of {limit}")]
    TooLarge {
        /// What was too large (for example "response").
        what: &'static str,
        /// Its size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// The configuration does not parse or does not make sense.
    #[error("configuration: {message}")]
    Config {
        /// What is wrong.
        message: String,
        /// The parser's error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// The backend cannot do this operation.
    #[error("unsupported: {operation}")]
    Unsupported {
        /// The operation.
        operation: &'static str,
    },
    /// The server refused the connection because a setting is wrong: the same settings
    /// fail the same way, so this is not retried.
    #[error("{server} refused the connection: {why}: {message}")]
    Refused {
        /// The server, as `host:port`.
        server: String,
        /// Which setting is wrong.
        why: Refusal,
        /// What the server or the TLS library said.
        message: String,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
}

/// Why a server refused a connection ([`Error::Refused`]). The broker bindings' own
/// `ConnectFailure` names the same kinds (and adds an unreachable broker).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Refusal {
    /// The user, password or token was not accepted.
    Authentication,
    /// The server's certificate is not signed by a trusted CA or does not name the host
    /// (or the server did not accept the client's certificate).
    UntrustedCertificate,
    /// One side speaks TLS and the other plaintext.
    TlsMismatch,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refusal::Authentication => "wrong user or password",
            Refusal::UntrustedCertificate => "untrusted certificate",
            Refusal::TlsMismatch => "TLS/plaintext mismatch",
        })
    }
}

impl Error {
    /// An [`Error::InvalidKey`].
    pub fn invalid_key(reason: impl Into<String>) -> Self {
        Error::InvalidKey {
            reason: reason.into(),
        }
    }

    /// An [`Error::Corrupt`] with no source.
    pub fn corrupt(message: impl Into<String>) -> Self {
        Error::Corrupt {
            message: message.into(),
            source: None,
        }
    }

    /// An [`Error::Refused`] of `server` (`host:port`), keeping `source`.
    pub fn refused(
        server: impl Into<String>,
        why: Refusal,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::Refused {
            server: server.into(),
            why,
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// An [`Error::Unavailable`] keeping `source`.
    pub fn unavailable(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::Unavailable {
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// The [`Error::Fenced`] of `lease`: what a settle or an extend answers when the lease
    /// no longer holds its record.
    pub fn fenced(lease: &Lease) -> Self {
        Error::Fenced {
            key: lease.key.clone(),
            token: lease.token,
        }
    }

    /// An [`Error::Config`] with no source.
    pub fn config(message: impl Into<String>) -> Self {
        Error::Config {
            message: message.into(),
            source: None,
        }
    }

    /// Whether the same call may succeed later ([`Error::Unavailable`]).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }

    /// Whether this is [`Error::Fenced`].
    pub fn is_fenced(&self) -> bool {
        matches!(self, Error::Fenced { .. })
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
