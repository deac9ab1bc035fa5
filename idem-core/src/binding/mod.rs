//! What a broker binding shares with the others (idem-kafka, idem-rabbitmq): where a
//! message's idempotency key comes from ([`KeySource`]), and why a message is
//! dead-lettered ([`Reason`], with the headers that carry it), the byte budget of what
//! it holds ([`Budget`]), the waits between retries ([`Backoff`]), and a cheap one-way
//! [`Signal`]. A binding implements
//! [`Incoming`] for its message type and re-exports `KeySource<ItsMessage>` under its own
//! name.

mod backoff;
mod budget;
mod key;
mod lanes;
mod reason;
mod signal;

use bytes::Bytes;

use crate::HandlerError;

pub use backoff::Backoff;
pub use budget::{Budget, BudgetTicket};
pub use lanes::{distinct_prefix, lanes};
pub use signal::Signal;

pub use key::{DEFAULT_KEY_HEADER, Extracted, Incoming, KeyFn, KeySource, MissingKey};
pub use reason::{
    HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_NAMESPACE, HEADER_REASON, Reason,
};

/// What a handler's future resolves to: the response bytes stored for duplicates, or a
/// retryable or permanent [`HandlerError`].
pub type HandlerResult = std::result::Result<Bytes, HandlerError>;
