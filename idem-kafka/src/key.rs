//! Where a message's idempotency key comes from: idem-core's [`binding::KeySource`] over
//! this crate's [`Message`].
//!
//! [`binding::KeySource`]: idem_core::binding::KeySource

use idem_core::binding::{self, Incoming};

use crate::Message;

pub use idem_core::binding::DEFAULT_KEY_HEADER;
pub(crate) use idem_core::binding::Extracted;

/// Where the idempotency key of a message comes from: a header (the default,
/// [`DEFAULT_KEY_HEADER`]), the Kafka message key, a JSON pointer into the payload, or a
/// closure. The id found is put in the consumer's namespace to make the key.
pub type KeySource = binding::KeySource<Message>;

/// A closure that finds a message's key: `Ok(Some(id))`, `Ok(None)` when the message has
/// none, or `Err(reason)` when the payload cannot be read (it is then dead-lettered as
/// malformed).
pub type KeyFn = binding::KeyFn<Message>;

impl Incoming for Message {
    fn header(&self, name: &str) -> Option<&[u8]> {
        Message::header(self, name)
    }

    fn message_key(&self) -> Option<&[u8]> {
        Message::message_key(self).map(|k| &k[..])
    }

    fn payload(&self) -> &[u8] {
        Message::payload(self)
    }
}
