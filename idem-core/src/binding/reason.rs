//! Why a message is dead-lettered, and the headers every binding's dead letter carries.

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

/// Why a message was dead-lettered.
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
