//! What a broker binding shares with the others (idem-kafka, idem-rabbitmq): where a
//! message's idempotency key comes from ([`KeySource`]), and why a message is
//! dead-lettered ([`Reason`], with the headers that carry it). A binding implements
//! [`Incoming`] for its message type and re-exports `KeySource<ItsMessage>` under its own
//! name.

mod key;
mod reason;

pub use key::{DEFAULT_KEY_HEADER, Extracted, Incoming, KeyFn, KeySource};
pub use reason::{
    HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_NAMESPACE, HEADER_REASON, Reason,
};
