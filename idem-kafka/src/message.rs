//! The message a handler receives.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use idem_core::Key;
use rdkafka::message::{BorrowedMessage, Headers, Message as _, OwnedHeaders};

use crate::handle::Ticket;

/// One Kafka message as the handler sees it: its idempotency key, payload, headers and
/// position. Cheap to clone.
#[derive(Clone)]
pub struct Message {
    inner: Arc<Inner>,
}

struct Inner {
    topic: Arc<str>,
    partition: i32,
    offset: i64,
    timestamp: Option<i64>,
    message_key: Option<Bytes>,
    payload: Bytes,
    headers: Option<OwnedHeaders>,
    key: Option<Key>,
    /// The message's share of the consumer's byte budget, given back when it is dropped.
    _ticket: Option<Ticket>,
}

impl Message {
    /// Copies what the handler needs out of a consumed message. `topic` is shared by every
    /// message of the partition, so no string is allocated per message; `ticket` counts the
    /// copy against the consumer's byte budget until the message is dropped.
    pub(crate) fn from_borrowed(topic: Arc<str>, m: &BorrowedMessage<'_>, ticket: Ticket) -> Self {
        Message {
            inner: Arc::new(Inner {
                topic,
                partition: m.partition(),
                offset: m.offset(),
                timestamp: m.timestamp().to_millis(),
                message_key: m.key().map(Bytes::copy_from_slice),
                payload: m.payload().map(Bytes::copy_from_slice).unwrap_or_default(),
                headers: m.headers().map(|h| h.detach()),
                key: None,
                _ticket: Some(ticket),
            }),
        }
    }

    /// A message built by hand, for tests of key sources and handlers.
    pub fn new(
        topic: impl Into<Arc<str>>,
        partition: i32,
        offset: i64,
        message_key: Option<Bytes>,
        payload: Bytes,
        headers: &[(&str, &[u8])],
    ) -> Self {
        let headers = (!headers.is_empty()).then(|| {
            headers.iter().fold(OwnedHeaders::new(), |h, (k, v)| {
                h.insert(rdkafka::message::Header {
                    key: k,
                    value: Some(*v),
                })
            })
        });
        Message {
            inner: Arc::new(Inner {
                topic: topic.into(),
                partition,
                offset,
                timestamp: None,
                message_key,
                payload,
                headers,
                key: None,
                _ticket: None,
            }),
        }
    }

    /// The same message carrying its idempotency key. Called once, before anyone else holds
    /// a clone, so it does not copy.
    pub(crate) fn with_key(mut self, key: Key) -> Self {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.key = Some(key),
            None => {
                let i = &self.inner;
                self.inner = Arc::new(Inner {
                    topic: i.topic.clone(),
                    partition: i.partition,
                    offset: i.offset,
                    timestamp: i.timestamp,
                    message_key: i.message_key.clone(),
                    payload: i.payload.clone(),
                    headers: i.headers.clone(),
                    key: Some(key),
                    // The first copy keeps the ticket until it is dropped.
                    _ticket: None,
                });
            }
        }
        self
    }

    /// The idempotency key, or `None` for a message processed without one (see
    /// [`MissingKey::Process`](crate::MissingKey::Process)).
    pub fn key(&self) -> Option<&Key> {
        self.inner.key.as_ref()
    }

    /// The payload (empty if the message had none).
    pub fn payload(&self) -> &Bytes {
        &self.inner.payload
    }

    /// The Kafka message key, if any.
    pub fn message_key(&self) -> Option<&Bytes> {
        self.inner.message_key.as_ref()
    }

    /// The value of the first header named `name`, if any.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.inner
            .headers
            .as_ref()?
            .iter()
            .find(|h| h.key == name)
            .and_then(|h| h.value)
    }

    /// All headers in order, as (name, value) pairs.
    pub fn headers(&self) -> impl Iterator<Item = (&str, Option<&[u8]>)> {
        self.inner
            .headers
            .iter()
            .flat_map(|h| h.iter().map(|h| (h.key, h.value)))
    }

    pub(crate) fn raw_headers(&self) -> Option<&OwnedHeaders> {
        self.inner.headers.as_ref()
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.inner.topic
    }

    /// The partition.
    pub fn partition(&self) -> i32 {
        self.inner.partition
    }

    /// The offset.
    pub fn offset(&self) -> i64 {
        self.inner.offset
    }

    /// The message timestamp in milliseconds since the Unix epoch, if the broker gave one.
    pub fn timestamp(&self) -> Option<i64> {
        self.inner.timestamp
    }
}

/// What a consumed message weighs against the consumer's byte budget: its payload, key and
/// headers (names and values).
pub(crate) fn size(m: &BorrowedMessage<'_>) -> usize {
    let headers = m.headers().map_or(0, |h| {
        h.iter()
            .map(|h| h.key.len() + h.value.map_or(0, <[u8]>::len))
            .sum()
    });
    m.payload_len() + m.key().map_or(0, <[u8]>::len) + headers
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("topic", &self.topic())
            .field("partition", &self.partition())
            .field("offset", &self.offset())
            .field("key", &self.key())
            .field("payload_bytes", &self.payload().len())
            .finish()
    }
}
