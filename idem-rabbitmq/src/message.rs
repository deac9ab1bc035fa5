//! The message a handler receives.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use idem_core::Key;
use idem_core::binding::Incoming;
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};

/// One delivery as the handler sees it: its idempotency key, payload, headers and where it
/// came from. Cheap to clone.
#[derive(Clone)]
pub struct Message {
    inner: Arc<Inner>,
}

struct Inner {
    queue: Arc<str>,
    exchange: String,
    routing_key: String,
    redelivered: bool,
    delivery_tag: u64,
    payload: Bytes,
    properties: BasicProperties,
    key: Option<Key>,
}

impl Message {
    /// Takes the payload and properties out of a delivery from `queue`.
    pub(crate) fn from_delivery(queue: Arc<str>, d: Delivery) -> Self {
        Message {
            inner: Arc::new(Inner {
                queue,
                exchange: d.exchange.to_string(),
                routing_key: d.routing_key.to_string(),
                redelivered: d.redelivered,
                delivery_tag: d.delivery_tag,
                payload: Bytes::from(d.data),
                properties: d.properties,
                key: None,
            }),
        }
    }

    /// A message built by hand, as a test of a handler would make one.
    pub fn new(queue: &str, payload: impl Into<Bytes>, properties: BasicProperties) -> Self {
        Message {
            inner: Arc::new(Inner {
                queue: queue.into(),
                exchange: String::new(),
                routing_key: queue.to_owned(),
                redelivered: false,
                delivery_tag: 0,
                payload: payload.into(),
                properties,
                key: None,
            }),
        }
    }

    /// This message with its idempotency key set.
    pub(crate) fn with_key(mut self, key: Key) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.key = Some(key);
            return self;
        }
        let i = &*self.inner;
        Message {
            inner: Arc::new(Inner {
                queue: Arc::clone(&i.queue),
                exchange: i.exchange.clone(),
                routing_key: i.routing_key.clone(),
                redelivered: i.redelivered,
                delivery_tag: i.delivery_tag,
                payload: i.payload.clone(),
                properties: i.properties.clone(),
                key: Some(key),
            }),
        }
    }

    /// The idempotency key, once the key source found one.
    pub fn idempotency_key(&self) -> Option<&Key> {
        self.inner.key.as_ref()
    }

    /// The payload.
    pub fn payload(&self) -> &Bytes {
        &self.inner.payload
    }

    /// The queue it was consumed from.
    pub fn queue(&self) -> &str {
        &self.inner.queue
    }

    /// The exchange it was published to (empty for the default exchange).
    pub fn exchange(&self) -> &str {
        &self.inner.exchange
    }

    /// The routing key it was published with.
    pub fn routing_key(&self) -> &str {
        &self.inner.routing_key
    }

    /// Whether the broker delivered it before (to this or another consumer) without an ack.
    pub fn redelivered(&self) -> bool {
        self.inner.redelivered
    }

    /// The delivery tag on the channel it came on.
    pub fn delivery_tag(&self) -> u64 {
        self.inner.delivery_tag
    }

    /// Its properties (headers, `message-id`, content type, …).
    pub fn properties(&self) -> &BasicProperties {
        &self.inner.properties
    }

    /// The value of the header `name` if it is a string or bytes; a header of another
    /// type (a number, a table) is not read as a key.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        let headers: &FieldTable = self.inner.properties.headers().as_ref()?;
        match headers.inner().get(name)? {
            AMQPValue::LongString(s) => Some(s.as_bytes()),
            AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
            AMQPValue::ByteArray(b) => Some(b.as_slice()),
            _ => None,
        }
    }

    /// The `message-id` property, if set.
    pub fn message_id(&self) -> Option<&str> {
        self.inner
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
    }
}

impl Message {
    /// Its bytes, as the byte budget counts them: the payload, and each header's name and
    /// string or bytes value.
    pub(crate) fn weight(&self) -> usize {
        let headers = self.inner.properties.headers().as_ref().map_or(0, |h| {
            h.inner()
                .iter()
                .map(|(name, value)| {
                    name.as_str().len()
                        + match value {
                            AMQPValue::LongString(s) => s.as_bytes().len(),
                            AMQPValue::ByteArray(b) => b.as_slice().len(),
                            _ => 8,
                        }
                })
                .sum()
        });
        self.inner.payload.len() + headers
    }
}

impl Incoming for Message {
    fn header(&self, name: &str) -> Option<&[u8]> {
        Message::header(self, name)
    }

    fn message_key(&self) -> Option<&[u8]> {
        self.message_id().map(str::as_bytes)
    }

    fn payload(&self) -> &[u8] {
        &self.inner.payload
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &*self.inner;
        f.debug_struct("Message")
            .field("queue", &i.queue)
            .field("delivery_tag", &i.delivery_tag)
            .field("redelivered", &i.redelivered)
            .field("idempotency_key", &i.key)
            .field("payload_len", &i.payload.len())
            .finish()
    }
}
