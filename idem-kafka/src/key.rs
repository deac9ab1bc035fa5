//! Where a message's idempotency key comes from.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use idem_core::Key;
use serde_json::Value;

use crate::Message;

/// The header [`KeySource::default`] reads.
pub const DEFAULT_KEY_HEADER: &str = "idempotency-key";

/// A closure that finds a message's key: `Ok(Some(id))`, `Ok(None)` when the message has
/// none, or `Err(reason)` when the payload cannot be read (it is then dead-lettered as
/// malformed).
pub type KeyFn = Arc<dyn Fn(&Message) -> Result<Option<String>, String> + Send + Sync>;

/// Where the idempotency key of a message comes from. The id found is put in the
/// consumer's namespace to make the [`Key`].
#[derive(Clone)]
#[non_exhaustive]
pub enum KeySource {
    /// The value of this header (the default: `idempotency-key`).
    Header(String),
    /// The Kafka message key.
    MessageKey,
    /// A JSON pointer (RFC 6901, like `/payment/id`) into a JSON payload. A string or a
    /// number there is the id; a payload that is not JSON is malformed.
    JsonPointer(String),
    /// A closure.
    Custom(KeyFn),
}

impl KeySource {
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
        f: impl Fn(&Message) -> Result<Option<String>, String> + Send + Sync + 'static,
    ) -> Self {
        KeySource::Custom(Arc::new(f))
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        match self {
            KeySource::Header(name) if name.is_empty() => Err("key header name is empty".into()),
            KeySource::JsonPointer(p) if !p.is_empty() && !p.starts_with('/') => Err(format!(
                "JSON pointer {p:?} must be empty or start with '/'"
            )),
            _ => Ok(()),
        }
    }

    /// Finds the key of `message` in `namespace`.
    pub(crate) fn extract(&self, namespace: &str, message: &Message) -> Extracted {
        // The id is read in place: the key is its only copy.
        let found = |id: Option<&[u8]>| match id {
            None => Extracted::Missing,
            Some([]) => Extracted::Missing,
            Some(id) => to_key(namespace, id),
        };
        match self {
            KeySource::Header(name) => found(message.header(name)),
            KeySource::MessageKey => found(message.message_key().map(|k| &k[..])),
            KeySource::JsonPointer(pointer) => from_json(namespace, pointer, message.payload()),
            KeySource::Custom(f) => match catch_unwind(AssertUnwindSafe(|| f(message))) {
                Err(panic) => Extracted::Malformed(format!(
                    "the key function panicked: {}",
                    idem_core::backend::panic_text(&*panic)
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

impl Default for KeySource {
    fn default() -> Self {
        KeySource::Header(DEFAULT_KEY_HEADER.to_owned())
    }
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(h) => write!(f, "Header({h:?})"),
            KeySource::MessageKey => f.write_str("MessageKey"),
            KeySource::JsonPointer(p) => write!(f, "JsonPointer({p:?})"),
            KeySource::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// What a key source found in one message.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Extracted {
    Key(Key),
    Missing,
    Invalid(String),
    Malformed(String),
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn msg(key: Option<&str>, payload: &str, headers: &[(&str, &[u8])]) -> Message {
        Message::new(
            "t",
            0,
            7,
            key.map(|k| Bytes::copy_from_slice(k.as_bytes())),
            Bytes::copy_from_slice(payload.as_bytes()),
            headers,
        )
    }

    fn key(id: &str) -> Extracted {
        Extracted::Key(Key::new("ns", id).unwrap())
    }

    #[test]
    fn header_is_the_default() {
        let m = msg(Some("mk"), "{}", &[("idempotency-key", b"pay-1")]);
        assert_eq!(KeySource::default().extract("ns", &m), key("pay-1"));
        let none = msg(Some("mk"), "{}", &[("other", b"x")]);
        assert_eq!(
            KeySource::default().extract("ns", &none),
            Extracted::Missing
        );
        let empty = msg(None, "{}", &[("idempotency-key", b"")]);
        assert_eq!(
            KeySource::default().extract("ns", &empty),
            Extracted::Missing
        );
        let binary = msg(None, "{}", &[("idempotency-key", &[0xff, 0xfe])]);
        assert!(matches!(
            KeySource::default().extract("ns", &binary),
            Extracted::Invalid(r) if r.contains("UTF-8")
        ));
    }

    #[test]
    fn message_key() {
        let m = msg(Some("mk-9"), "x", &[]);
        assert_eq!(KeySource::MessageKey.extract("ns", &m), key("mk-9"));
        let none = msg(None, "x", &[]);
        assert_eq!(
            KeySource::MessageKey.extract("ns", &none),
            Extracted::Missing
        );
    }

    #[test]
    fn json_pointer() {
        let src = KeySource::json_pointer("/payment/id");
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
        assert!(KeySource::json_pointer("payment").check().is_err());
        assert!(KeySource::json_pointer("/payment").check().is_ok());
    }

    #[test]
    fn custom_closure() {
        let src = KeySource::custom(|m| {
            let text = std::str::from_utf8(m.payload()).map_err(|e| e.to_string())?;
            Ok(text.split(':').nth(1).map(str::to_owned))
        });
        assert_eq!(src.extract("ns", &msg(None, "pay:77", &[])), key("77"));
        assert_eq!(
            src.extract("ns", &msg(None, "pay", &[])),
            Extracted::Missing
        );
        let bad = Message::new("t", 0, 0, None, Bytes::from_static(&[0xff]), &[]);
        assert!(matches!(src.extract("ns", &bad), Extracted::Malformed(_)));
    }

    #[test]
    fn too_long_id_is_invalid() {
        let long = "a".repeat(idem_core::MAX_ID_BYTES + 1);
        let m = msg(None, "{}", &[("idempotency-key", long.as_bytes())]);
        assert!(matches!(
            KeySource::default().extract("ns", &m),
            Extracted::Invalid(r) if r.contains("over the limit")
        ));
    }
}
