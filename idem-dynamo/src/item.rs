//! The item a record is stored as, and back.
//!
//! | attribute | type | meaning |
//! |---|---|---|
//! | `pk` | S | partition key: the namespace (`%` and `/` escaped), `/`, the id |
//! | `st` | S | `processing`, `completed` or `failed` |
//! | `owner` | S | the lease holder, or last holder |
//! | `tok` | N | fencing token |
//! | `att` | N | attempts granted |
//! | `lease_ms` | N | `processing` only: lease deadline, ms since the epoch |
//! | `ret_ms`, `ret_s` | N | `processing` only: retention after the lease, in ms and whole seconds (rounded up), so that `extend` can move the expiry in one write |
//! | `exp_ms` | N | when the record expires, ms since the epoch: the deadline reads and claims use |
//! | `expires_at` | N | the same in whole seconds, rounded up: the table's TTL attribute |
//! | `fp` | B | payload fingerprint (32 bytes), if one was given |
//! | `resp` | B | `completed` only: the response |
//! | `err` | S | `failed` only: the last error text |
//! | `perm` | BOOL | present and true when the failure was permanent |
//! | `v` | N | a random version, new at every write, for compare-and-set |

use std::collections::HashMap;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use bytes::Bytes;
use idem_core::{Error, Fingerprint, Key, Record, Result, State, Timestamp};

/// An item as the SDK carries it.
pub(crate) type Item = HashMap<String, AttributeValue>;

pub(crate) const PK: &str = "pk";
pub(crate) const ST: &str = "st";
pub(crate) const OWNER: &str = "owner";
pub(crate) const TOK: &str = "tok";
pub(crate) const ATT: &str = "att";
pub(crate) const LEASE: &str = "lease_ms";
pub(crate) const RET: &str = "ret_ms";
pub(crate) const RET_S: &str = "ret_s";
pub(crate) const EXP: &str = "exp_ms";
pub(crate) const TTL: &str = "expires_at";
pub(crate) const FP: &str = "fp";
pub(crate) const RESP: &str = "resp";
pub(crate) const ERR: &str = "err";
pub(crate) const PERM: &str = "perm";
pub(crate) const VER: &str = "v";

/// The partition key of `key`: the namespace with `%` and `/` escaped, `/`, the id. The
/// namespace cannot contain an unescaped `/`, so distinct keys never share a partition key,
/// and a namespace's keys share the prefix [`namespace_prefix`].
pub(crate) fn partition_key(key: &Key) -> String {
    let mut pk = namespace_prefix(key.namespace());
    pk.push_str(key.id());
    pk
}

/// The prefix every partition key in `namespace` starts with.
pub(crate) fn namespace_prefix(namespace: &str) -> String {
    let mut out = String::with_capacity(namespace.len() + 1);
    for c in namespace.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            c => out.push(c),
        }
    }
    out.push('/');
    out
}

/// The key a partition key names.
pub(crate) fn parse_partition_key(pk: &str) -> Result<Key> {
    let bad = |why: &str| Error::corrupt(format!("partition key {pk:?} {why}"));
    let (escaped, id) = pk.split_once('/').ok_or_else(|| bad("has no '/'"))?;
    let namespace = escaped.replace("%2F", "/").replace("%25", "%");
    if namespace_prefix(&namespace) != format!("{escaped}/") {
        return Err(bad("has a badly escaped namespace"));
    }
    Key::new(namespace, id).map_err(|e| bad(&format!("is not a valid key ({e})")))
}

/// Whole seconds from ms, rounded up: a TTL never fires before the deadline it stands for.
pub(crate) fn secs_ceil(millis: u64) -> u64 {
    millis.div_ceil(1000)
}

pub(crate) fn n(value: u64) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

pub(crate) fn s(value: impl Into<String>) -> AttributeValue {
    AttributeValue::S(value.into())
}

pub(crate) fn b(value: impl Into<Vec<u8>>) -> AttributeValue {
    AttributeValue::B(Blob::new(value))
}

/// The item storing `record`, with version `version`.
pub(crate) fn encode(record: &Record, version: u64) -> Item {
    let mut item = Item::new();
    item.insert(PK.into(), s(partition_key(&record.key)));
    item.insert(ST.into(), s(record.state.as_str()));
    item.insert(OWNER.into(), s(&*record.owner));
    item.insert(TOK.into(), n(record.token));
    item.insert(ATT.into(), n(u64::from(record.attempts)));
    item.insert(VER.into(), n(version));
    if let Some(until) = record.lease_until {
        item.insert(LEASE.into(), n(until.as_millis()));
    }
    if let Some(at) = record.expires_at {
        item.insert(EXP.into(), n(at.as_millis()));
        item.insert(TTL.into(), n(secs_ceil(at.as_millis())));
        if let (State::Processing, Some(until)) = (record.state, record.lease_until) {
            let keep = at.as_millis().saturating_sub(until.as_millis());
            item.insert(RET.into(), n(keep));
            item.insert(RET_S.into(), n(secs_ceil(keep)));
        }
    }
    if let Some(fp) = record.fingerprint {
        item.insert(FP.into(), b(fp.0.to_vec()));
    }
    if let Some(resp) = &record.response {
        item.insert(RESP.into(), b(resp.to_vec()));
    }
    if let Some(err) = &record.error {
        item.insert(ERR.into(), s(err.clone()));
    }
    if record.permanent {
        item.insert(PERM.into(), AttributeValue::Bool(true));
    }
    item
}

/// Reads attributes of one item, naming it in every error.
struct Reader<'a> {
    item: &'a Item,
    pk: &'a str,
}

impl<'a> Reader<'a> {
    fn new(item: &'a Item) -> Result<Self> {
        match item.get(PK) {
            Some(AttributeValue::S(pk)) => Ok(Reader { item, pk }),
            _ => Err(Error::corrupt("item has no string partition key `pk`")),
        }
    }

    fn bad(&self, name: &str, why: &str) -> Error {
        Error::corrupt(format!("item {:?}: attribute `{name}` {why}", self.pk))
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>> {
        match self.item.get(name) {
            None => Ok(None),
            Some(AttributeValue::S(v)) => Ok(Some(v)),
            Some(_) => Err(self.bad(name, "is not a string")),
        }
    }

    fn number(&self, name: &str) -> Result<Option<u64>> {
        match self.item.get(name) {
            None => Ok(None),
            Some(AttributeValue::N(v)) => v
                .parse()
                .map(Some)
                .map_err(|_| self.bad(name, &format!("is {v:?}, not a whole number"))),
            Some(_) => Err(self.bad(name, "is not a number")),
        }
    }

    fn bytes(&self, name: &str) -> Result<Option<&'a [u8]>> {
        match self.item.get(name) {
            None => Ok(None),
            Some(AttributeValue::B(v)) => Ok(Some(v.as_ref())),
            Some(_) => Err(self.bad(name, "is not binary")),
        }
    }

    fn required<T>(&self, name: &str, value: Result<Option<T>>) -> Result<T> {
        value?.ok_or_else(|| self.bad(name, "is missing"))
    }
}

/// The partition key of `item`, to name an item that does not decode (`?` without one).
pub(crate) fn name(item: &Item) -> String {
    match item.get(PK) {
        Some(AttributeValue::S(pk)) => pk.clone(),
        _ => "?".to_owned(),
    }
}

/// The record `item` stores, or [`Error::Corrupt`] naming what does not decode.
pub(crate) fn decode(item: &Item) -> Result<Record> {
    let r = Reader::new(item)?;
    let key = parse_partition_key(r.pk)?;
    let state = r.required(ST, r.string(ST))?;
    let state = State::parse(state).ok_or_else(|| r.bad(ST, &format!("is {state:?}")))?;
    let attempts = r.required(ATT, r.number(ATT))?;
    let attempts = u32::try_from(attempts).map_err(|_| r.bad(ATT, "is out of range"))?;
    let fingerprint = match r.bytes(FP)? {
        None => None,
        Some(raw) => Some(Fingerprint(
            raw.try_into().map_err(|_| r.bad(FP, "is not 32 bytes"))?,
        )),
    };
    // Tokens idem writes stay far below this (as PostgreSQL's bigint): the next claim adds
    // one, so a larger one is not idem's and must not wrap.
    let token = r.required(TOK, r.number(TOK))?;
    if i64::try_from(token).is_err() {
        return Err(r.bad(TOK, "is out of range"));
    }
    let permanent = match item.get(PERM) {
        None => false,
        Some(AttributeValue::Bool(p)) => *p,
        Some(_) => return Err(r.bad(PERM, "is not a boolean")),
    };
    Ok(Record {
        key,
        state,
        owner: r.required(OWNER, r.string(OWNER))?.into(),
        token,
        attempts,
        lease_until: r.number(LEASE)?.map(Timestamp::from_millis),
        fingerprint,
        response: r.bytes(RESP)?.map(Bytes::copy_from_slice),
        error: r.string(ERR)?.map(str::to_owned),
        permanent,
        expires_at: r.number(EXP)?.map(Timestamp::from_millis),
    })
}

/// The version of a decodable item, for compare-and-set.
pub(crate) fn version(item: &Item) -> Result<u64> {
    let r = Reader::new(item)?;
    r.required(VER, r.number(VER))
}

/// A fresh random version.
pub(crate) fn new_version() -> u64 {
    fastrand::u64(..)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        Record {
            key: Key::new("pay/ments%", "order/1").expect("key"),
            state: State::Processing,
            owner: "w1".into(),
            token: 7,
            attempts: 2,
            lease_until: Some(Timestamp::from_millis(10_500)),
            fingerprint: Some(Fingerprint::of(b"p")),
            response: None,
            error: None,
            permanent: false,
            expires_at: Some(Timestamp::from_millis(3_610_500)),
        }
    }

    #[test]
    fn records_round_trip() {
        let processing = record();
        let item = encode(&processing, 42);
        assert_eq!(decode(&item).expect("decode"), processing);
        assert_eq!(version(&item).expect("version"), 42);
        assert_eq!(item.get(RET), Some(&n(3_600_000)));
        assert_eq!(item.get(TTL), Some(&n(3_611)));
        let failed = Record {
            state: State::Failed,
            lease_until: None,
            error: Some(String::new()),
            permanent: true,
            response: Some(Bytes::from_static(&[0, 0xff])),
            fingerprint: None,
            ..record()
        };
        assert_eq!(decode(&encode(&failed, 1)).expect("decode"), failed);
    }

    #[test]
    fn partition_keys_are_injective_and_prefixed() {
        let a = Key::new("a/b", "c").expect("key");
        let b = Key::new("a", "b/c").expect("key");
        assert_ne!(partition_key(&a), partition_key(&b));
        for key in [a, b, Key::new("%2F", "%").expect("key")] {
            let pk = partition_key(&key);
            assert!(pk.starts_with(&namespace_prefix(key.namespace())));
            assert_eq!(parse_partition_key(&pk).expect("parse"), key);
        }
        assert!(parse_partition_key("no-slash").is_err());
        assert!(parse_partition_key("a%2f/x").is_err());
    }

    #[test]
    fn garbage_is_corrupt_naming_the_attribute() {
        let mut item = encode(&record(), 1);
        item.insert(TOK.into(), s("seven"));
        let err = decode(&item).expect_err("corrupt");
        assert!(err.to_string().contains("`tok`"), "{err}");
        // A token the next claim could not add one to is not idem's: corrupt, not a wrap.
        item.insert(TOK.into(), n(u64::MAX));
        let err = decode(&item).expect_err("corrupt");
        assert!(
            matches!(err, Error::Corrupt { .. }) && err.to_string().contains("`tok`"),
            "{err}"
        );
        item.insert(TOK.into(), n(7));
        item.insert(ST.into(), s("dancing"));
        assert!(matches!(decode(&item), Err(Error::Corrupt { .. })));
        item.insert(ST.into(), s("failed"));
        item.insert(FP.into(), b(vec![1, 2, 3]));
        assert!(
            decode(&item)
                .expect_err("corrupt")
                .to_string()
                .contains("32")
        );
        assert!(decode(&Item::new()).is_err());
    }
}
