//! Decoding what Redis answers: a record (the string format of `lua/record.lua`) and the
//! claim script's reply. Anything that does not decode is [`Error::Corrupt`].

use bytes::Bytes;
use idem_core::{
    Claim, ClaimKind, ClaimOutcome, Error, Fingerprint, Key, Lease, Record, Result, State,
    Timestamp,
};
use redis::Value;

use crate::error::{bad_reply, from_redis};

/// The record `GET` returned for `key`; `None` when there is none.
pub(crate) fn decode_record(key: &Key, value: Value) -> Result<Option<Record>> {
    match value {
        Value::Nil => Ok(None),
        Value::BulkString(raw) => decode(key, &raw)
            .map(Some)
            .map_err(|why| Error::corrupt(format!("record {key}: {why}"))),
        Value::ServerError(e) => Err(from_redis("get", e.into())),
        other => Err(bad_reply("get", format!("{other:?}"))),
    }
}

/// `<s><t>,<n>,<l>,<x>,<k>,<#o>,<#f>,<#r>,<#e>;<o><f><r><e>`, as `lua/record.lua` writes it.
fn decode(key: &Key, raw: &[u8]) -> Result<Record, &'static str> {
    let end = raw
        .iter()
        .position(|&b| b == b';')
        .ok_or("not an idem record")?;
    let (head, mut body) = (&raw[..end], &raw[end + 1..]);
    let (&state, head) = head.split_first().ok_or("not an idem record")?;
    let state = match state {
        b'p' => State::Processing,
        b'c' => State::Completed,
        b'f' => State::Failed,
        _ => return Err("bad state"),
    };
    let parts: Vec<&[u8]> = head.split(|&b| b == b',').collect();
    let [t, n, l, x, k, lo, lf, lr, le] = parts.as_slice() else {
        return Err("not an idem record");
    };
    let num = |text: &[u8]| number(text).ok_or("a field is not a number");
    let opt = |text: &[u8]| {
        if text.is_empty() {
            Ok(None)
        } else {
            num(text).map(Some)
        }
    };
    let len = |n: u64| usize::try_from(n).map_err(|_| "bad length");
    let permanent = match *k {
        b"0" => false,
        b"1" => true,
        _ => return Err("bad permanent flag"),
    };
    let owner_len = len(num(lo)?)?;
    let fp_len = len(num(lf)?)?;
    let resp_len = opt(lr)?.map(len).transpose()?;
    let err_len = opt(le)?.map(len).transpose()?;
    if fp_len != 0 && fp_len != 32 {
        return Err("bad fingerprint length");
    }
    let total = owner_len + fp_len + resp_len.unwrap_or(0) + err_len.unwrap_or(0);
    if total != body.len() {
        return Err("bad length");
    }
    let mut take = |n: usize| {
        let (part, rest) = body.split_at(n);
        body = rest;
        part
    };
    let owner = String::from_utf8(take(owner_len).to_vec()).map_err(|_| "owner is not UTF-8")?;
    let fingerprint = match take(fp_len).try_into() {
        Ok(f) => Some(Fingerprint(f)),
        Err(_) => None, // length 0
    };
    let response = resp_len.map(|n| Bytes::copy_from_slice(take(n)));
    let error = match err_len {
        None => None,
        Some(n) => Some(String::from_utf8(take(n).to_vec()).map_err(|_| "error is not UTF-8")?),
    };
    Ok(Record {
        key: key.clone(),
        state,
        owner,
        token: num(t)?,
        attempts: u32::try_from(num(n)?).map_err(|_| "too many attempts")?,
        lease_until: opt(l)?.map(Timestamp::from_millis),
        fingerprint,
        response,
        error,
        permanent,
        expires_at: Some(Timestamp::from_millis(num(x)?)),
    })
}

/// A decimal of at most 15 digits, as the scripts accept it.
fn number(text: &[u8]) -> Option<u64> {
    if text.is_empty() || text.len() > 15 || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

fn bytes(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
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
    decode_outcome_inner(claim, &value).ok_or_else(|| bad_reply("claim", format!("{value:?}")))
}

fn decode_outcome_inner(claim: &Claim, value: &Value) -> Option<ClaimOutcome> {
    let Value::Array(items) = value else {
        return None;
    };
    let mut items = items.iter();
    let tag = int(items.next()?)?;
    let out = match tag {
        1 => {
            let (token, attempts, until, kind) =
                (items.next()?, items.next()?, items.next()?, items.next()?);
            ClaimOutcome::Acquired(Lease {
                key: claim.key.clone(),
                owner: claim.owner.clone(),
                token: u64::try_from(int(token)?).ok()?,
                attempts: u32::try_from(int(attempts)?).ok()?,
                lease_until: millis(until)?,
                kind: match int(kind)? {
                    0 => ClaimKind::First,
                    1 => ClaimKind::Retry,
                    2 => ClaimKind::Takeover,
                    _ => return None,
                },
            })
        }
        2 => ClaimOutcome::Completed(Bytes::copy_from_slice(bytes(items.next()?)?)),
        3 => {
            let owner = String::from_utf8(bytes(items.next()?)?.to_vec()).ok()?;
            let lease_until = millis(items.next()?)?;
            ClaimOutcome::InProgress { owner, lease_until }
        }
        4 => {
            let attempts = u32::try_from(int(items.next()?)?).ok()?;
            let error = String::from_utf8(bytes(items.next()?)?.to_vec()).ok()?;
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

    fn string(raw: &[u8]) -> Value {
        Value::BulkString(raw.to_vec())
    }

    #[test]
    fn decodes_records() {
        let rec = decode_record(&key(), string(b"c3,2,,1700000000000,0,1,0,2,;w\xff\x00"))
            .unwrap()
            .unwrap();
        assert_eq!(rec.state, State::Completed);
        assert_eq!((rec.owner.as_str(), rec.token, rec.attempts), ("w", 3, 2));
        assert_eq!(rec.response, Some(Bytes::from_static(b"\xff\x00")));
        assert_eq!(
            (rec.lease_until, rec.error, rec.fingerprint),
            (None, None, None)
        );
        let fp = [7u8; 32];
        let mut raw = b"f1,1,,99,1,2,32,,3;a;".to_vec();
        raw.extend_from_slice(&fp);
        raw.extend_from_slice(b"e,r");
        let rec = decode_record(&key(), string(&raw)).unwrap().unwrap();
        assert_eq!(rec.owner, "a;");
        assert_eq!(rec.fingerprint, Some(Fingerprint(fp)));
        assert_eq!((rec.error.as_deref(), rec.permanent), (Some("e,r"), true));
        assert_eq!(decode_record(&key(), Value::Nil).unwrap(), None);
    }

    #[test]
    fn refuses_what_does_not_decode() {
        for bad in [
            string(b"hello"),
            string(b"z1,1,,5,0,1,0,,;w"),
            string(b"p1,1,,5,0,2,0,,;w"),
            string(b"p+1,1,,5,0,1,0,,;w"),
            string(b"p1,1,,5,2,1,0,,;w"),
            string(b"p1,1,,5,0,1,3,,;wabc"),
            string(b"p1,1,,9999999999999999,0,1,0,,;w"),
            string(b"p1,1,,5,0,1,0,,,;w"),
            Value::Int(5),
            Value::Array(vec![]),
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
