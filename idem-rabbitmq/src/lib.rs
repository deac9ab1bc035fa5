#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod batch;
mod builder;
mod connect;
mod consumer;
mod dead_letter;
mod error;
mod handle;
mod message;
mod probe;
mod settings;
mod tx;

use idem_core::binding;

pub use builder::ConsumerBuilder;
pub use connect::ConnectFailure;
pub use consumer::IdemConsumer;
pub use dead_letter::{DeadLetters, HEADER_EXCHANGE, HEADER_QUEUE, HEADER_ROUTING_KEY};
pub use error::{Error, Result};
pub use idem_core::binding::{
    DEFAULT_KEY_HEADER, HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_NAMESPACE, HEADER_REASON,
    HandlerResult, MissingKey, Reason,
};
pub use message::Message;
pub use probe::{Point, Probe, Verdict};

pub use lapin;

/// Where the idempotency key of a message comes from: a header (the default,
/// [`DEFAULT_KEY_HEADER`]), the `message-id` property ([`KeySource::MessageKey`]), a JSON
/// pointer into the payload, or a closure. The id found is put in the consumer's namespace
/// to make the key.
pub type KeySource = binding::KeySource<Message>;

/// A closure that finds a message's key: `Ok(Some(id))`, `Ok(None)` when the message has
/// none, or `Err(reason)` when the payload cannot be read (it is then dead-lettered as
/// malformed).
pub type KeyFn = binding::KeyFn<Message>;
