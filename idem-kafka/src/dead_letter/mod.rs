//! Dead letters: the headers idem adds and the reasons it gives; [`write`] sends them,
//! [`read`] reads them back.

pub(crate) mod read;
pub(crate) mod write;

/// Header naming the topic the dead letter came from.
pub const HEADER_TOPIC: &str = "idem-original-topic";
/// Header with the original partition, in decimal.
pub const HEADER_PARTITION: &str = "idem-original-partition";
/// Header with the original offset, in decimal.
pub const HEADER_OFFSET: &str = "idem-original-offset";
/// Header with the idempotency key (`namespace/id`), when one was found.
pub const HEADER_KEY: &str = "idem-key";
/// Header with the idempotency key's namespace alone, next to [`HEADER_KEY`], so that a
/// namespace containing `/` still splits right.
pub const HEADER_NAMESPACE: &str = "idem-key-namespace";
/// Header with why the message was dead-lettered ([`Reason::as_str`]).
pub const HEADER_REASON: &str = "idem-reason";
/// Header with the error text.
pub const HEADER_ERROR: &str = "idem-error";
/// Header with the attempts the handler got, in decimal (0 when it never ran).
pub const HEADER_ATTEMPTS: &str = "idem-attempts";
/// Header of a letter that carries only idem's headers: the whole letter was over the
/// dead-letter producer's size limit (`message.max.bytes`), so the original payload, key
/// and headers were left out. Its value says what was dropped, and where the original
/// stays while its topic retains it. Such a letter cannot be replayed.
pub const HEADER_DROPPED: &str = "idem-dropped";
/// Header a replayed message carries: the dead letter it came from,
/// `<dead-letter topic>/<partition>/<offset>`.
pub const HEADER_REPLAY_OF: &str = "idem-replay-of";

/// The headers idem adds to a dead letter (and takes off again when it replays one).
pub const DEAD_LETTER_HEADERS: &[&str] = &[
    HEADER_TOPIC,
    HEADER_PARTITION,
    HEADER_OFFSET,
    HEADER_KEY,
    HEADER_NAMESPACE,
    HEADER_REASON,
    HEADER_ERROR,
    HEADER_ATTEMPTS,
    HEADER_DROPPED,
    HEADER_REPLAY_OF,
];

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

    /// The reason a [`HEADER_REASON`] value names, if it names one.
    pub fn parse(text: &str) -> Option<Reason> {
        [
            Reason::Poisoned,
            Reason::Mismatch,
            Reason::MissingKey,
            Reason::InvalidKey,
            Reason::MalformedPayload,
        ]
        .into_iter()
        .find(|r| r.as_str() == text)
    }
}
