//! The message a handler receives.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use bytes::Bytes;
use idem_core::Key;
use rdkafka::message::{
    BorrowedHeaders, BorrowedMessage, Header, Headers, Message as _, OwnedHeaders,
};
use smallvec::SmallVec;

use crate::budget::Ticket;

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
    headers: HeaderBuf,
    /// The headers as the broker gave them, kept only when a name could not be read, so
    /// that a dead letter still carries every one.
    unreadable: Option<OwnedHeaders>,
    key: Option<Key>,
    /// The message's share of the consumer's byte budget, given back when it is dropped.
    _ticket: Option<Ticket>,
}

impl Message {
    /// Copies what the handler needs out of a consumed message. `topic` is shared by every
    /// message of the partition, so no string is allocated per message. `hold` is given the
    /// copy's weight (payload, key, header names and values) and returns the ticket that
    /// counts it against the consumer's byte budget until the message is dropped.
    pub(crate) fn from_borrowed(
        topic: Arc<str>,
        m: &BorrowedMessage<'_>,
        hold: impl FnOnce(usize) -> Ticket,
    ) -> Self {
        let mut headers = HeaderBuf::default();
        let mut unreadable = None;
        if let Some(h) = m.headers() {
            if each_header(h, |name, value| headers.push(name, value)) > 0 {
                unreadable = Some(h.detach());
            }
        }
        let message_key = m.key().map(Bytes::copy_from_slice);
        let payload = m.payload().map(Bytes::copy_from_slice).unwrap_or_default();
        let weight = payload.len() + message_key.as_ref().map_or(0, Bytes::len) + headers.weight();
        Message {
            inner: Arc::new(Inner {
                topic,
                partition: m.partition(),
                offset: m.offset(),
                timestamp: m.timestamp().to_millis(),
                message_key,
                payload,
                headers,
                unreadable,
                key: None,
                _ticket: Some(hold(weight)),
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
        let mut buf = HeaderBuf::default();
        for (name, value) in headers {
            buf.push(name, Some(value));
        }
        Message {
            inner: Arc::new(Inner {
                topic: topic.into(),
                partition,
                offset,
                timestamp: None,
                message_key,
                payload,
                headers: buf,
                unreadable: None,
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
                    unreadable: i.unreadable.clone(),
                    key: Some(key),
                    // The first copy keeps the ticket until it is dropped.
                    _ticket: None,
                });
            }
        }
        self
    }

    /// The idempotency key (not the Kafka key: that is [`message_key`](Message::message_key)),
    /// or `None` for a message processed without one (see
    /// [`MissingKey::Process`](crate::MissingKey::Process)).
    pub fn idempotency_key(&self) -> Option<&Key> {
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

    /// The value of the first header named `name`, if any. A header whose name is not
    /// UTF-8 is not among the headers a handler sees (rdkafka cannot read it), but a dead
    /// letter of the message keeps it.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.inner
            .headers
            .entries()
            .find(|(n, _)| *n == name.as_bytes())
            .and_then(|(_, v)| v)
    }

    /// All headers in order, as (name, value) pairs.
    pub fn headers(&self) -> impl Iterator<Item = (&str, Option<&[u8]>)> {
        // Every name was a `&str` when it went in.
        (self.inner.headers.entries()).filter_map(|(n, v)| Some((std::str::from_utf8(n).ok()?, v)))
    }

    /// The headers for a dead letter of this message: all it came with.
    pub(crate) fn headers_to_forward(&self) -> OwnedHeaders {
        if let Some(raw) = &self.inner.unreadable {
            return raw.clone();
        }
        self.headers().fold(OwnedHeaders::new(), |h, (key, value)| {
            h.insert(Header { key, value })
        })
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

/// Reads each header of `h` in order into `f`, and returns how many could not be read.
/// rdkafka panics on a header name that is not UTF-8; that panic is caught here, and the
/// header is skipped. (The process's panic hook still reports it.)
pub(crate) fn each_header(h: &BorrowedHeaders, mut f: impl FnMut(&str, Option<&[u8]>)) -> usize {
    let mut unreadable = 0;
    for idx in 0..h.count() {
        match std::panic::catch_unwind(AssertUnwindSafe(|| h.try_get(idx))) {
            Ok(Some(header)) => f(header.key, header.value),
            Ok(None) => {}
            Err(_) => unreadable += 1,
        }
    }
    unreadable
}

/// A message's headers, copied into one buffer. Each header is its name's length and its
/// value's length (`u32::MAX` for no value), little-endian, then the name and the value.
/// Up to [`INLINE_HEADERS`] bytes live in the message itself, with no allocation of their
/// own: enough for an `idempotency-key` header holding a UUID.
#[derive(Clone, Default)]
struct HeaderBuf(SmallVec<[u8; INLINE_HEADERS]>);

const INLINE_HEADERS: usize = 64;

const NO_VALUE: u32 = u32::MAX;

impl HeaderBuf {
    fn push(&mut self, name: &str, value: Option<&[u8]>) {
        // A name or value of 4 GiB is beyond any Kafka message; it would be cut, not wrapped.
        let cut = |b: &'_ [u8]| -> (u32, usize) {
            let n = u32::try_from(b.len())
                .unwrap_or(NO_VALUE - 1)
                .min(NO_VALUE - 1);
            (n, n as usize)
        };
        let (name_len, name_end) = cut(name.as_bytes());
        let (value_len, value) = match value {
            Some(v) => {
                let (n, end) = cut(v);
                (n, &v[..end])
            }
            None => (NO_VALUE, &[][..]),
        };
        self.0.reserve(8 + name_end + value.len());
        self.0.extend_from_slice(&name_len.to_le_bytes());
        self.0.extend_from_slice(&value_len.to_le_bytes());
        self.0.extend_from_slice(&name.as_bytes()[..name_end]);
        self.0.extend_from_slice(value);
    }

    /// The bytes of names and values.
    fn weight(&self) -> usize {
        self.0.len() - 8 * self.entries().count()
    }

    fn entries(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        let mut rest = self.0.as_slice();
        std::iter::from_fn(move || {
            let (lens, tail) = rest.split_at_checked(8)?;
            let name_len = u32::from_le_bytes(lens[..4].try_into().ok()?) as usize;
            let value_len = u32::from_le_bytes(lens[4..].try_into().ok()?);
            let (name, tail) = tail.split_at_checked(name_len)?;
            let (value, tail) = match value_len {
                NO_VALUE => (None, tail),
                n => {
                    let (v, t) = tail.split_at_checked(n as usize)?;
                    (Some(v), t)
                }
            };
            rest = tail;
            Some((name, value))
        })
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("topic", &self.topic())
            .field("partition", &self.partition())
            .field("offset", &self.offset())
            .field("idempotency_key", &self.idempotency_key())
            .field("payload_bytes", &self.payload().len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_read_back_in_order_with_their_weight() {
        let mut buf = HeaderBuf::default();
        buf.push("idempotency-key", Some(b"k-1"));
        buf.push("empty", Some(b""));
        buf.push("none", None);
        buf.push("idempotency-key", Some(b"second"));
        let got: Vec<_> = buf.entries().collect();
        assert_eq!(
            got,
            [
                (&b"idempotency-key"[..], Some(&b"k-1"[..])),
                (&b"empty"[..], Some(&b""[..])),
                (&b"none"[..], None),
                (&b"idempotency-key"[..], Some(&b"second"[..])),
            ]
        );
        assert_eq!(buf.weight(), 15 + 3 + 5 + 4 + 15 + 6);

        let m = Message::new("t", 0, 0, None, Bytes::new(), &[("a", b"1"), ("a", b"2")]);
        assert_eq!(m.header("a"), Some(&b"1"[..]));
        assert_eq!(m.header("b"), None);
        let all: Vec<_> = m.headers().collect();
        assert_eq!(all, [("a", Some(&b"1"[..])), ("a", Some(&b"2"[..]))]);
        assert_eq!(m.headers_to_forward().count(), 2);
    }
}
