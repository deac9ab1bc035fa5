//! Idempotency keys and payload fingerprints.

use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, LazyLock};

use sha2::{Digest, Sha256};

use crate::Error;

/// The longest id a [`Key`] accepts, in bytes.
pub const MAX_ID_BYTES: usize = 512;
/// The longest namespace a [`Key`] accepts, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 128;

/// An idempotency key: a namespace (one per service or consumer group) plus an id.
///
/// Both parts are valid UTF-8, non-empty and free of NUL bytes; the id is at most
/// [`MAX_ID_BYTES`] bytes and the namespace at most [`MAX_NAMESPACE_BYTES`]. Anything else
/// is refused with [`Error::InvalidKey`] naming the reason. Use [`Key::hashed`] for
/// business ids that may be long.
#[derive(Clone)]
pub struct Key {
    /// The namespace followed by the id, in one shared allocation: a clone (claims, leases
    /// and records each hold one) copies no bytes.
    text: Arc<str>,
    /// Where the id starts in `text`.
    split: usize,
    /// The text hashed once, when the key is made: a key is looked up in several maps on
    /// its way (the running keys, the in-memory store's shard and then the shard's map),
    /// and each now hashes these eight bytes instead of the whole text.
    hash: u64,
}

/// The seed of every key's hash: random per process, so keys from outside cannot be
/// chosen to collide.
static SEED: LazyLock<foldhash::fast::RandomState> = LazyLock::new(Default::default);

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.split == other.split && self.text == other.text
    }
}

impl Eq for Key {}

/// Writes the hash made with the key: equal keys have equal text, so equal hashes.
impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl Key {
    /// Builds a key, validating both parts.
    pub fn new(namespace: impl AsRef<str>, id: impl AsRef<str>) -> Result<Self, Error> {
        let (namespace, id) = (namespace.as_ref(), id.as_ref());
        check("namespace", namespace, MAX_NAMESPACE_BYTES)?;
        check("id", id, MAX_ID_BYTES)?;
        // Joined on the stack, then copied once into the shared allocation: one heap
        // allocation per key, not a `String` and then its copy.
        let mut joined = [0u8; MAX_NAMESPACE_BYTES + MAX_ID_BYTES];
        let (split, len) = (namespace.len(), namespace.len() + id.len());
        joined[..split].copy_from_slice(namespace.as_bytes());
        joined[split..len].copy_from_slice(id.as_bytes());
        // Two UTF-8 strings joined are UTF-8: this check never fails.
        let text = std::str::from_utf8(&joined[..len])
            .map_err(|_| Error::invalid_key("namespace and id do not join as UTF-8"))?;
        // The split is hashed too: ("ab", "c") and ("a", "bc") are different keys.
        let hash = SEED.hash_one((text, split));
        Ok(Key {
            text: Arc::from(text),
            split,
            hash,
        })
    }

    /// Builds a key from raw bytes, as they arrive in a Kafka header or message key.
    ///
    /// Bytes that are not UTF-8 are refused with [`Error::InvalidKey`].
    pub fn from_bytes(namespace: impl AsRef<str>, id: &[u8]) -> Result<Self, Error> {
        let id = std::str::from_utf8(id).map_err(|e| {
            Error::invalid_key(format!(
                "id is not valid UTF-8 (at byte {})",
                e.valid_up_to()
            ))
        })?;
        Key::new(namespace, id)
    }

    /// Builds a key whose id is the SHA-256 hex of `id`, so any business id, however long
    /// or binary, becomes a 64-character id. An empty `id` is still refused.
    pub fn hashed(namespace: impl AsRef<str>, id: impl AsRef<[u8]>) -> Result<Self, Error> {
        let id = id.as_ref();
        if id.is_empty() {
            return Err(Error::invalid_key("id is empty"));
        }
        Key::new(namespace, hex::encode(Sha256::digest(id)))
    }

    /// The namespace part.
    pub fn namespace(&self) -> &str {
        &self.text[..self.split]
    }

    /// The id part.
    pub fn id(&self) -> &str {
        &self.text[self.split..]
    }
}

/// Keys order by namespace, then id.
impl Ord for Key {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.namespace(), self.id()).cmp(&(other.namespace(), other.id()))
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

fn check(part: &str, value: &str, max: usize) -> Result<(), Error> {
    if value.is_empty() {
        return Err(Error::invalid_key(format!("{part} is empty")));
    }
    if value.len() > max {
        return Err(Error::invalid_key(format!(
            "{part} is {} bytes, over the limit of {max}",
            value.len()
        )));
    }
    if let Some(at) = value.bytes().position(|b| b == 0) {
        return Err(Error::invalid_key(format!("{part} has a NUL byte at {at}")));
    }
    Ok(())
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace(), self.id())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({self})")
    }
}

/// A SHA-256 digest of a payload, fixed at the first claim of a key so that a different
/// payload under the same key is answered [`Mismatch`](crate::backend::ClaimOutcome::Mismatch).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The fingerprint of `payload`.
    pub fn of(payload: &[u8]) -> Self {
        Fingerprint(Sha256::digest(payload).into())
    }

    /// Lower-case hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses the 64-character hex form; anything else is [`Error::Corrupt`].
    pub fn from_hex(text: &str) -> Result<Self, Error> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(text, &mut out)
            .map_err(|e| Error::corrupt(format!("bad fingerprint {text:?}: {e}")))?;
        Ok(Fingerprint(out))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..12])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(e: Error) -> String {
        match e {
            Error::InvalidKey { reason } => reason,
            other => panic!("expected InvalidKey, got {other:?}"),
        }
    }

    #[test]
    fn refuses_bad_ids_with_a_reason() {
        assert!(reason(Key::new("ns", "").unwrap_err()).contains("id is empty"));
        assert!(reason(Key::new("", "x").unwrap_err()).contains("namespace is empty"));
        let long = "a".repeat(MAX_ID_BYTES + 1);
        assert!(reason(Key::new("ns", long).unwrap_err()).contains("513 bytes"));
        assert!(reason(Key::new("ns", "a\0b").unwrap_err()).contains("NUL byte at 1"));
        assert!(reason(Key::from_bytes("ns", &[0x66, 0xff]).unwrap_err()).contains("UTF-8"));
        assert!(Key::new("ns", "a".repeat(MAX_ID_BYTES)).is_ok());
    }

    #[test]
    fn parts_compare_and_order_as_a_pair() {
        let k = |ns: &str, id: &str| Key::new(ns, id).unwrap();
        assert_ne!(k("ab", "c"), k("a", "bc"));
        assert!(k("a", "z") < k("ab", "a"));
        assert_eq!(k("ns", "id").to_string(), "ns/id");
        assert_eq!(
            (k("ns", "id").namespace(), k("ns", "id").id()),
            ("ns", "id")
        );
    }

    #[test]
    fn hashed_keeps_long_ids_short_and_stable() {
        let long = vec![7u8; 10_000];
        let a = Key::hashed("ns", &long).unwrap();
        assert_eq!(a.id().len(), 64);
        assert_eq!(a, Key::hashed("ns", &long).unwrap());
        assert_ne!(a, Key::hashed("ns", b"other").unwrap());
        assert_eq!(a.namespace(), "ns");
        assert!(Key::hashed("ns", b"").is_err());
    }

    #[test]
    fn fingerprint_hex_round_trips() {
        let f = Fingerprint::of(b"payload");
        assert_eq!(Fingerprint::from_hex(&f.to_hex()).unwrap(), f);
        assert_ne!(f, Fingerprint::of(b"payload2"));
        assert!(matches!(
            Fingerprint::from_hex("zz"),
            Err(Error::Corrupt { .. })
        ));
    }
}
