//! The claim function's reply (see `lua/claim.lua` for its shape).

use bytes::Bytes;
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{ClaimKind, Fingerprint, Lease, Result, Timestamp};
use redis::Value;

use crate::error::bad_reply;

pub(crate) fn bytes(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

pub(crate) fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

fn millis(value: &Value) -> Option<Timestamp> {
    Some(Timestamp::from_millis(u64::try_from(int(value)?).ok()?))
}

/// One answer of the claim function (see `lua/claim.lua` for its shape).
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
            let (token, attempts, until, kind, fingerprint) = (
                items.next()?,
                items.next()?,
                items.next()?,
                items.next()?,
                items.next()?,
            );
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
                // What the record holds: a retry keeps the stored fingerprint.
                fingerprint: match bytes(fingerprint)? {
                    [] => None,
                    f => Some(Fingerprint(f.try_into().ok()?)),
                },
            })
        }
        2 => ClaimOutcome::Completed(Bytes::copy_from_slice(bytes(items.next()?)?)),
        3 => {
            let owner = String::from_utf8(bytes(items.next()?)?.to_vec()).ok()?;
            let lease_until = millis(items.next()?)?;
            ClaimOutcome::InProgress {
                owner: owner.into(),
                lease_until,
            }
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
    use idem_core::{ClaimKind, Error, Key};

    fn key() -> Key {
        Key::new("ns", "id").unwrap()
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
            Value::BulkString(vec![7; 32]),
        ]);
        match decode_outcome(&claim, acquired).unwrap() {
            ClaimOutcome::Acquired(l) => {
                assert_eq!((l.token, l.attempts, l.kind), (4, 2, ClaimKind::Takeover));
                assert_eq!(l.lease_until, Timestamp::from_millis(99));
                // The record's fingerprint, kept from before, though this claim has none.
                assert_eq!(l.fingerprint, Some(Fingerprint([7; 32])));
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
