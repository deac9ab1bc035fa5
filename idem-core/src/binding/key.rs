//! Where a message's idempotency key comes from, for any broker's message type.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use serde_json::Value;

use crate::Key;

/// A received message as a key source reads it. Each binding implements it for its own
/// message type.
pub trait Incoming {
    /// The value of the first header named `name`, if any.
    fn header(&self, name: &str) -> Option<&[u8]>;
    /// The broker's own key of the message, if any: Kafka's message key, AMQP's
    /// `message-id` property.
    fn message_key(&self) -> Option<&[u8]>;
    /// The payload.
    fn payload(&self) -> &[u8];
}

/// The header [`KeySource::default`] reads.
pub const DEFAULT_KEY_HEADER: &str = "idempotency-key";

/// A closure that finds a message's key: `Ok(Some(id))`, `Ok(None)` when the message has
/// none, or `Err(reason)` when the payload cannot be read (it is then dead-lettered as
/// malformed).
pub type KeyFn<M> = Arc<dyn Fn(&M) -> Result<Option<String>, String> + Send + Sync>;

/// Where the idempotency key of a message comes from. The id found is put in the
/// consumer's namespace to make the [`Key`].
#[non_exhaustive]
pub enum KeySource<M> {
    /// The value of this header (the default: `idempotency-key`).
    Header(String),
    /// The broker's own key of the message ([`Incoming::message_key`]): Kafka's message
    /// key, AMQP's `message-id` property.
    MessageKey,
    /// A JSON pointer (RFC 6901, like `/payment/id`) into a JSON payload. A string or a
    /// number there is the id; a payload that is not JSON is malformed.
    JsonPointer(String),
    /// A closure.
    Custom(KeyFn<M>),
}

impl<M> Clone for KeySource<M> {
    fn clone(&self) -> Self {
        match self {
            KeySource::Header(h) => KeySource::Header(h.clone()),
            KeySource::MessageKey => KeySource::MessageKey,
            KeySource::JsonPointer(p) => KeySource::JsonPointer(p.clone()),
            KeySource::Custom(f) => KeySource::Custom(Arc::clone(f)),
        }
    }
}

impl<M: Incoming> KeySource<M> {
    /// The header `name`.
    pub fn header(name: impl Into<String>) -> Self {
        KeySource::Header(name.into())
    }

    /// A JSON pointer into the payload, like `/payment/id`.
    pub fn json_pointer(pointer: impl Into<String>) -> Self {
        KeySource::JsonPointer(pointer.into())
    }

    /// A closure; see [`KeyFn`].
    pub fn custom(
        f: impl Fn(&M) -> Result<Option<String>, String> + Send + Sync + 'static,
    ) -> Self {
        KeySource::Custom(Arc::new(f))
    }

    /// Why this source cannot work (an empty header name, a JSON pointer not starting
    /// with `/`), checked when a consumer is built.
    pub fn check(&self) -> Result<(), String> {
        match self {
            KeySource::Header(name) if name.is_empty() => Err("key header name is empty".into()),
            KeySource::JsonPointer(p) if !p.is_empty() && !p.starts_with('/') => Err(format!(
                "JSON pointer {p:?} must be empty or start with '/'"
            )),
            _ => Ok(()),
        }
    }

    /// Finds the key of `message` in `namespace`.
    pub fn extract(&self, namespace: &str, message: &M) -> Extracted {
        // The id is read in place: the key is its only copy.
        let found = |id: Option<&[u8]>| match id {
            None => Extracted::Missing,
            Some([]) => Extracted::Missing,
            Some(id) => to_key(namespace, id),
        };
        match self {
            KeySource::Header(name) => found(message.header(name)),
            KeySource::MessageKey => found(message.message_key()),
            KeySource::JsonPointer(pointer) => from_json(namespace, pointer, message.payload()),
            KeySource::Custom(f) => match catch_unwind(AssertUnwindSafe(|| f(message))) {
                Err(panic) => Extracted::Malformed(format!(
                    "the key function panicked: {}",
                    crate::backend::panic_text(&*panic)
                )),
                Ok(Err(reason)) => Extracted::Malformed(reason),
                Ok(Ok(id)) => found(id.as_deref().map(str::as_bytes)),
            },
        }
    }
}

fn from_json(namespace: &str, pointer: &str, payload: &[u8]) -> Extracted {
    let value: Value = match serde_json::from_slice(payload) {
        Ok(v) => v,
        Err(e) => return Extracted::Malformed(format!("payload is not JSON: {e}")),
    };
    match value.pointer(pointer) {
        None | Some(Value::Null) => Extracted::Missing,
        Some(Value::String(s)) if s.is_empty() => Extracted::Missing,
        Some(Value::String(s)) => to_key(namespace, s.as_bytes()),
        Some(Value::Number(n)) => to_key(namespace, n.to_string().as_bytes()),
        Some(other) => Extracted::Invalid(format!(
            "value at JSON pointer {pointer:?} is {}, not a string or number",
            kind(other)
        )),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn to_key(namespace: &str, id: &[u8]) -> Extracted {
    match Key::from_bytes(namespace, id) {
        Ok(key) => Extracted::Key(key),
        Err(e) => Extracted::Invalid(e.to_string()),
    }
}

impl<M> Default for KeySource<M> {
    fn default() -> Self {
        KeySource::Header(DEFAULT_KEY_HEADER.to_owned())
    }
}

impl<M> fmt::Debug for KeySource<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(h) => write!(f, "Header({h:?})"),
            KeySource::MessageKey => f.write_str("MessageKey"),
            KeySource::JsonPointer(p) => write!(f, "JsonPointer({p:?})"),
            KeySource::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// What to do with a message whose key source finds no key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Dead-letter it (the default).
    #[default]
    DeadLetter,
    /// Run the handler without a claim: no deduplication, no lease (`Context` is `None`),
    /// logged at `warn`. A retryable error is retried in place, up to the engine's attempts;
    /// a permanent one, or the last retry, dead-letters it.
    Process,
}

/// What a key source found in one message.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Extracted {
    /// The key.
    Key(Key),
    /// No key (no such header, an empty value, nothing at the pointer).
    Missing,
    /// An id that is no valid key (not UTF-8, too long), with the reason.
    Invalid(String),
    /// A payload the source cannot read (not JSON, the closure's error or panic).
    Malformed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message with a key, a payload and headers, as a binding's would be.
    struct Msg {
        key: Option<Vec<u8>>,
        payload: Vec<u8>,
        headers: Vec<(String, Vec<u8>)>,
    }

    impl Incoming for Msg {
        fn header(&self, name: &str) -> Option<&[u8]> {
            self.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| &v[..])
        }
        fn message_key(&self) -> Option<&[u8]> {
            self.key.as_deref()
        }
        fn payload(&self) -> &[u8] {
            &self.payload
        }
    }

    fn msg(key: Option<&str>, payload: &str, headers: &[(&str, &[u8])]) -> Msg {
        Msg {
            key: key.map(|k| k.as_bytes().to_vec()),
            payload: payload.as_bytes().to_vec(),
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
                .collect(),
        }
    }

    fn key(id: &str) -> Extracted {
        Extracted::Key(Key::new("ns", id).unwrap())
    }

    #[test]
    fn header_is_the_default() {
        let m = msg(Some("mk"), "{}", &[("idempotency-key", b"pay-1")]);
        assert_eq!(KeySource::<Msg>::default().extract("ns", &m), key("pay-1"));
        let none = msg(Some("mk"), "{}", &[("other", b"x")]);
        assert_eq!(
            KeySource::<Msg>::default().extract("ns", &none),
            Extracted::Missing
        );
        let empty = msg(None, "{}", &[("idempotency-key", b"")]);
        assert_eq!(
            KeySource::<Msg>::default().extract("ns", &empty),
            Extracted::Missing
        );
        let binary = msg(None, "{}", &[("idempotency-key", &[0xff, 0xfe])]);
        assert!(matches!(
            KeySource::<Msg>::default().extract("ns", &binary),
            Extracted::Invalid(r) if r.contains("UTF-8")
        ));
    }

    #[test]
    fn message_key() {
        let m = msg(Some("mk-9"), "x", &[]);
        assert_eq!(KeySource::<Msg>::MessageKey.extract("ns", &m), key("mk-9"));
        let none = msg(None, "x", &[]);
        assert_eq!(
            KeySource::<Msg>::MessageKey.extract("ns", &none),
            Extracted::Missing
        );
    }

    #[test]
    fn json_pointer() {
        let src = KeySource::<Msg>::json_pointer("/payment/id");
        let m = msg(None, r#"{"payment":{"id":"p-3"}}"#, &[]);
        assert_eq!(src.extract("ns", &m), key("p-3"));
        let num = msg(None, r#"{"payment":{"id":42}}"#, &[]);
        assert_eq!(src.extract("ns", &num), key("42"));
        let missing = msg(None, r#"{"payment":{}}"#, &[]);
        assert_eq!(src.extract("ns", &missing), Extracted::Missing);
        let obj = msg(None, r#"{"payment":{"id":{}}}"#, &[]);
        assert!(
            matches!(src.extract("ns", &obj), Extracted::Invalid(r) if r.contains("an object"))
        );
        let garbage = msg(None, "not json", &[]);
        assert!(matches!(
            src.extract("ns", &garbage),
            Extracted::Malformed(r) if r.contains("not JSON")
        ));
        assert!(KeySource::<Msg>::json_pointer("payment").check().is_err());
        assert!(KeySource::<Msg>::json_pointer("/payment").check().is_ok());
    }

    #[test]
    fn custom_closure() {
        let src = KeySource::custom(|m: &Msg| {
            let text = std::str::from_utf8(m.payload()).map_err(|e| e.to_string())?;
            Ok(text.split(':').nth(1).map(str::to_owned))
        });
        assert_eq!(src.extract("ns", &msg(None, "pay:77", &[])), key("77"));
        assert_eq!(
            src.extract("ns", &msg(None, "pay", &[])),
            Extracted::Missing
        );
        let bad = Msg {
            key: None,
            payload: vec![0xff],
            headers: Vec::new(),
        };
        assert!(matches!(src.extract("ns", &bad), Extracted::Malformed(_)));
    }

    #[test]
    fn too_long_id_is_invalid() {
        let long = "a".repeat(crate::MAX_ID_BYTES + 1);
        let m = msg(None, "{}", &[("idempotency-key", long.as_bytes())]);
        assert!(matches!(
            KeySource::<Msg>::default().extract("ns", &m),
            Extracted::Invalid(r) if r.contains("over the limit")
        ));
    }
}
