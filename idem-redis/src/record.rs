//! Decoding what Redis answers: a record hash (see `lua/record.lua` for its fields) and
//! the claim script's reply. Anything that does not decode is [`Error::Corrupt`].

use bytes::Bytes;
use idem_core::{
    Claim, ClaimKind, ClaimOutcome, Error, Fingerprint, Key, Lease, Record, Result, State,
    Timestamp,
};
use redis::Value;

use crate::error::bad_reply;

/// The record `HGETALL` returned for `key`; `None` when the hash is empty (no record).
pub(crate) fn decode_record(key: &Key, value: Value) -> Result<Option<Record>> {
    let pairs: Vec<(Value, Value)> = match value {
        Value::Nil => return Ok(None),
        Value::ServerError(e) => return Err(crate::error::from_redis("get", e.into())),
        Value::Map(pairs) => pairs,
        Value::Array(flat) if flat.len() % 2 == 0 => {
            let mut it = flat.into_iter();
            std::iter::from_fn(|| Some((it.next()?, it.next()?))).collect()
        }
        other => return Err(bad_reply("get", format!("{other:?}"))),
    };
    if pairs.is_empty() {
        return Ok(None);
    }
    let bad = |why: &str| Error::corrupt(format!("record {key}: {why}"));
    let mut fields = Fields::default();
    for (name, value) in pairs {
        let (Some(name), Some(value)) = (bytes(name), bytes(value)) else {
            return Err(bad("a field is not a string"));
        };
        let slot = match name.as_slice() {
            b"s" => &mut fields.s,
            b"o" => &mut fields.o,
            b"t" => &mut fields.t,
            b"n" => &mut fields.n,
            b"l" => &mut fields.l,
            b"x" => &mut fields.x,
            b"f" => &mut fields.f,
            b"r" => &mut fields.r,
            b"e" => &mut fields.e,
            b"k" => &mut fields.k,
            _ => return Err(bad("unknown field")),
        };
        *slot = Some(value);
    }
    let state = match fields.s.as_deref() {
        Some(b"p") => State::Processing,
        Some(b"c") => State::Completed,
        Some(b"f") => State::Failed,
        _ => return Err(bad("bad state")),
    };
    let text = |v: Vec<u8>, name: &str| {
        String::from_utf8(v).map_err(|_| bad(&format!("field {name} is not UTF-8")))
    };
    let owner = text(fields.o.ok_or_else(|| bad("missing field o"))?, "o")?;
    let fingerprint = match fields.f {
        None => None,
        Some(f) => Some(Fingerprint(
            f.try_into().map_err(|_| bad("bad fingerprint"))?,
        )),
    };
    let permanent = match fields.k.as_deref() {
        None => false,
        Some(b"1") => true,
        Some(_) => return Err(bad("bad permanent flag")),
    };
    let required = |v: Option<Vec<u8>>, name: &str| {
        number(v.as_deref()).ok_or_else(|| bad(&format!("field {name} is not a number")))
    };
    let optional = |v: Option<Vec<u8>>, name: &str| match v {
        None => Ok(None),
        some => required(some, name).map(Some),
    };
    Ok(Some(Record {
        key: key.clone(),
        state,
        owner,
        token: required(fields.t, "t")?,
        attempts: u32::try_from(required(fields.n, "n")?).map_err(|_| bad("too many attempts"))?,
        lease_until: optional(fields.l, "l")?.map(Timestamp::from_millis),
        fingerprint,
        response: fields.r.map(Bytes::from),
        error: fields.e.map(|e| text(e, "e")).transpose()?,
        permanent,
        expires_at: Some(Timestamp::from_millis(required(fields.x, "x")?)),
    }))
}

#[derive(Default)]
struct Fields {
    s: Option<Vec<u8>>,
    o: Option<Vec<u8>>,
    t: Option<Vec<u8>>,
    n: Option<Vec<u8>>,
    l: Option<Vec<u8>>,
    x: Option<Vec<u8>>,
    f: Option<Vec<u8>>,
    r: Option<Vec<u8>>,
    e: Option<Vec<u8>>,
    k: Option<Vec<u8>>,
}

/// A decimal of at most 15 digits, as the scripts accept it.
fn number(text: Option<&[u8]>) -> Option<u64> {
    let text = text?;
    if text.is_empty() || text.len() > 15 || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

fn bytes(value: Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        _ => None,
    }
}

fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

fn millis(value: &Value) -> Option<Timestamp> {
    Some(Timestamp::from_millis(u64::try_from(int(value)?).ok()?))
}

/// One answer of the claim script (see `lua/claim.lua` for its shape).
pub(crate) fn decode_outcome(claim: &Claim, value: Value) -> Result<ClaimOutcome> {
    let shown = format!("{value:?}");
    decode_outcome_inner(claim, value).ok_or_else(|| bad_reply("claim", shown))
}

fn decode_outcome_inner(claim: &Claim, value: Value) -> Option<ClaimOutcome> {
    let Value::Array(items) = value else {
        return None;
    };
    let mut items = items.into_iter();
    let tag = int(&items.next()?)?;
    let out = match tag {
        1 => {
            let (token, attempts, until, kind) =
                (items.next()?, items.next()?, items.next()?, items.next()?);
            ClaimOutcome::Acquired(Lease {
                key: claim.key.clone(),
                owner: claim.owner.clone(),
                token: u64::try_from(int(&token)?).ok()?,
                attempts: u32::try_from(int(&attempts)?).ok()?,
                lease_until: millis(&until)?,
                kind: match int(&kind)? {
                    0 => ClaimKind::First,
                    1 => ClaimKind::Retry,
                    2 => ClaimKind::Takeover,
                    _ => return None,
                },
            })
        }
        2 => ClaimOutcome::Completed(Bytes::from(bytes(items.next()?)?)),
        3 => {
            let owner = String::from_utf8(bytes(items.next()?)?).ok()?;
            let lease_until = millis(&items.next()?)?;
            ClaimOutcome::InProgress { owner, lease_until }
        }
        4 => {
            let attempts = u32::try_from(int(&items.next()?)?).ok()?;
            let error = String::from_utf8(bytes(items.next()?)?).ok()?;
            ClaimOutcome::Poisoned { attempts, error }
        }
        5 => ClaimOutcome::Mismatch,
        _ => return None,
    };
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key::new("ns", "id").unwrap()
    }

    fn hash(fields: &[(&str, &[u8])]) -> Value {
        Value::Array(
            fields
                .iter()
                .flat_map(|(k, v)| {
                    [
                        Value::BulkString(k.as_bytes().to_vec()),
                        Value::BulkString(v.to_vec()),
                    ]
                })
                .collect(),
        )
    }

    #[test]
    fn decodes_a_completed_record() {
        let rec = decode_record(
            &key(),
            hash(&[
                ("s", b"c"),
                ("o", b"w"),
                ("t", b"3"),
                ("n", b"2"),
                ("x", b"1700000000000"),
                ("r", b"\xff\x00"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(rec.state, State::Completed);
        assert_eq!((rec.token, rec.attempts), (3, 2));
        assert_eq!(rec.response, Some(Bytes::from_static(b"\xff\x00")));
        assert_eq!(rec.lease_until, None);
        assert_eq!(decode_record(&key(), Value::Array(vec![])).unwrap(), None);
    }

    #[test]
    fn refuses_what_does_not_decode() {
        let good: &[(&str, &[u8])] = &[("s", b"p"), ("o", b"w"), ("t", b"1"), ("n", b"1")];
        for bad in [
            hash(good), // no x
            hash(&[
                ("s", b"z"),
                ("o", b"w"),
                ("t", b"1"),
                ("n", b"1"),
                ("x", b"5"),
            ]),
            hash(&[
                ("s", b"p"),
                ("o", b"w"),
                ("t", b"+1"),
                ("n", b"1"),
                ("x", b"5"),
            ]),
            hash(&[
                ("s", b"p"),
                ("o", b"w"),
                ("t", b"1"),
                ("n", b"1"),
                ("x", b"5"),
                ("f", b"short"),
            ]),
            hash(&[
                ("s", b"p"),
                ("o", b"w"),
                ("t", b"1"),
                ("n", b"1"),
                ("x", b"5"),
                ("zz", b"1"),
            ]),
            Value::Int(5),
            Value::Array(vec![Value::Int(1)]),
        ] {
            let res = decode_record(&key(), bad.clone());
            assert!(
                matches!(res, Err(Error::Corrupt { .. })),
                "{bad:?}: {res:?}"
            );
        }
    }

    #[test]
    fn decodes_claim_replies() {
        let claim = Claim {
            key: key(),
            owner: "w".into(),
            lease_ttl: std::time::Duration::from_secs(1),
            fingerprint: None,
            max_attempts: 3,
            retention: std::time::Duration::from_secs(1),
        };
        let acquired = Value::Array(vec![
            Value::Int(1),
            Value::Int(4),
            Value::Int(2),
            Value::Int(99),
            Value::Int(2),
        ]);
        match decode_outcome(&claim, acquired).unwrap() {
            ClaimOutcome::Acquired(l) => {
                assert_eq!((l.token, l.attempts, l.kind), (4, 2, ClaimKind::Takeover));
                assert_eq!(l.lease_until, Timestamp::from_millis(99));
            }
            other => panic!("{other:?}"),
        }
        let mismatch = Value::Array(vec![Value::Int(5)]);
        assert_eq!(
            decode_outcome(&claim, mismatch).unwrap(),
            ClaimOutcome::Mismatch
        );
        let res = decode_outcome(&claim, Value::Array(vec![Value::Int(9)]));
        assert!(matches!(res, Err(Error::Corrupt { .. })));
    }
}
