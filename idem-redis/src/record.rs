//! The record layout of `lua/record.lua`, `<S><t>:<#o>:<o><F><n>:<w>;<body>`, with the
//! deadlines in the key's server-side expiry: what the client builds (a fresh claim's
//! record, a lease's fencing prefix) and decoding what Redis answers. Anything that does
//! not decode is [`Error::Corrupt`], naming the Redis key.

use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use idem_core::backend::Claim;
use idem_core::{Error, Fingerprint, Key, Lease, Record, Result, State, Timestamp};
use redis::{RedisWrite, ToRedisArgs, Value};

use crate::error::{bad_reply, from_redis};

/// The front of the record a lease holds: state `P`, its token and its owner. The fencing
/// functions compare it with the record's first bytes; the owner's length makes a match
/// exact. As a command argument it is written straight into the command.
pub(crate) struct Fence<'a>(pub &'a Lease);

impl ToRedisArgs for Fence<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        front(
            &mut out.writer_for_next_arg(),
            b'P',
            self.0.token,
            &self.0.owner,
        );
    }
}

/// The record a claim of a key with none writes: token 1, attempts 1, and `retention_ms`
/// as the time the record outlives the lease (its expiry is set with it). As a command
/// argument it is written straight into the command.
pub(crate) struct Fresh<'a> {
    pub claim: &'a Claim,
    pub retention_ms: u64,
}

impl ToRedisArgs for Fresh<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut out = out.writer_for_next_arg();
        front(&mut out, b'P', 1, &self.claim.owner);
        rest(
            &mut out,
            self.claim.fingerprint.as_ref(),
            1,
            self.retention_ms,
        );
    }
}

/// The whole record a lease's key holds while nobody else changed it (`P`, the fence, the
/// lease's fingerprint and attempts, and `retention_ms` as `w`), or, given a response, the
/// completed record that replaces it (`C`, the same fields, the response). The
/// compare-and-set complete sends both; as command arguments they are written straight
/// into the command.
pub(crate) struct Held<'a> {
    pub lease: &'a Lease,
    pub retention_ms: u64,
    pub response: Option<&'a [u8]>,
}

impl ToRedisArgs for Held<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut out = out.writer_for_next_arg();
        let (lease, response) = (self.lease, self.response);
        let state = if response.is_some() { b'C' } else { b'P' };
        front(&mut out, state, lease.token, &lease.owner);
        rest(
            &mut out,
            lease.fingerprint.as_ref(),
            lease.attempts,
            self.retention_ms,
        );
        let _ = out.write_all(response.unwrap_or_default());
    }
}

/// Writes a record's front, `<state><token>:<#owner>:<owner>` (the fencing prefix with
/// `P`), by hand rather than with `format!`: it runs for every claim and every settle.
/// Writing into a command's buffer cannot fail.
fn front(out: &mut impl Write, state: u8, token: u64, owner: &str) {
    let (mut token_text, mut len_text) = (itoa::Buffer::new(), itoa::Buffer::new());
    let parts: [&[u8]; 6] = [
        &[state],
        token_text.format(token).as_bytes(),
        b":",
        len_text.format(owner.len()).as_bytes(),
        b":",
        owner.as_bytes(),
    ];
    let _ = parts.iter().try_for_each(|part| out.write_all(part));
}

/// Writes what follows the front up to `;`: the fingerprint (`-`, or `#` and its bytes),
/// then `<attempts>:<retention ms>;`.
fn rest(out: &mut impl Write, fingerprint: Option<&Fingerprint>, attempts: u32, w: u64) {
    let _ = match fingerprint {
        Some(f) => out.write_all(b"#").and_then(|()| out.write_all(&f.0)),
        None => out.write_all(b"-"),
    };
    let (mut n, mut w_text) = (itoa::Buffer::new(), itoa::Buffer::new());
    let parts: [&[u8]; 4] = [
        n.format(attempts).as_bytes(),
        b":",
        w_text.format(w).as_bytes(),
        b";",
    ];
    let _ = parts.iter().try_for_each(|part| out.write_all(part));
}

/// The bytes of a string reply.
pub(crate) fn bytes(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

/// The number of an integer reply.
pub(crate) fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

/// The record `GET` returned for `key` (at the Redis key `at`), given the key's
/// `PEXPIRETIME` read with it; `None` when there is none.
pub(crate) fn decode_record(
    key: &Key,
    at: &str,
    value: Value,
    expire: i64,
) -> Result<Option<Record>> {
    match value {
        Value::Nil => Ok(None),
        Value::BulkString(raw) => decode_string(key, &raw, expire).map_err(|why| corrupt(at, why)),
        Value::ServerError(e) => Err(from_redis("get", e.into())),
        other => Err(bad_reply("get", format!("{other:?}"))),
    }
}

/// The record a string value of `key` holds (`None`: the key went away), or why it is not
/// an idem record.
pub(crate) fn decode_string(
    key: &Key,
    raw: &[u8],
    expire: i64,
) -> Result<Option<Record>, &'static str> {
    match raw.first() {
        Some(b'P' | b'C' | b'F') => decode(key, raw, expire),
        _ => Err("not an idem record"),
    }
}

/// [`Error::Corrupt`] for the value at the Redis key `at`, which is not an idem record.
pub(crate) fn corrupt(at: &str, why: impl std::fmt::Display) -> Error {
    Error::corrupt(format!("{at}: {why}"))
}

/// A decimal of at most 15 digits, as the Lua functions accept it.
fn number(text: &[u8]) -> Option<u64> {
    if text.is_empty() || text.len() > 15 || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

/// The bytes of a record, read front to back.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if n > self.0.len() {
            return Err("bad length");
        }
        let (part, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(part)
    }

    /// A decimal ended by `end`.
    fn number(&mut self, end: u8) -> Result<u64, &'static str> {
        let at = self
            .0
            .iter()
            .position(|&b| b == end)
            .ok_or("not an idem record")?;
        let n = number(&self.0[..at]).ok_or("a field is not a number")?;
        self.0 = &self.0[at + 1..];
        Ok(n)
    }
}

fn decode(key: &Key, raw: &[u8], expire: i64) -> Result<Option<Record>, &'static str> {
    // The key went away between the reads (`list` reads without a snapshot).
    if expire == -2 {
        return Ok(None);
    }
    let expires_at = u64::try_from(expire)
        .map_err(|_| "no expiry")?
        .saturating_add(1);
    let (&state, rest) = raw.split_first().ok_or("not an idem record")?;
    let state = match state {
        b'P' => State::Processing,
        b'C' => State::Completed,
        _ => State::Failed,
    };
    let mut f = Fields(rest);
    let token = f.number(b':')?;
    let owner_len = usize::try_from(f.number(b':')?).map_err(|_| "bad length")?;
    let owner: Arc<str> = std::str::from_utf8(f.take(owner_len)?)
        .map_err(|_| "owner is not UTF-8")?
        .into();
    let fingerprint = match f.take(1)? {
        b"-" => None,
        b"#" => Some(Fingerprint(
            f.take(32)?.try_into().map_err(|_| "bad length")?,
        )),
        _ => return Err("bad fingerprint"),
    };
    let attempts = u32::try_from(f.number(b':')?).map_err(|_| "too many attempts")?;
    let retention = f.number(b';')?;
    let body = f.0;
    let (mut response, mut error, mut permanent, mut lease_until) = (None, None, false, None);
    match state {
        State::Completed => response = Some(Bytes::copy_from_slice(body)),
        State::Failed => {
            let (&flag, text) = body.split_first().ok_or("bad permanent flag")?;
            permanent = match flag {
                b'0' => false,
                b'1' => true,
                _ => return Err("bad permanent flag"),
            };
            error = Some(String::from_utf8(text.to_vec()).map_err(|_| "error is not UTF-8")?);
        }
        State::Processing if body.is_empty() => {
            lease_until = Some(Timestamp::from_millis(expires_at.saturating_sub(retention)));
        }
        State::Processing => return Err("bad length"),
    }
    Ok(Some(Record {
        key: key.clone(),
        state,
        owner,
        token,
        attempts,
        lease_until,
        fingerprint,
        response,
        error,
        permanent,
        expires_at: Some(Timestamp::from_millis(expires_at)),
    }))
}

#[cfg(test)]
mod tests {
    use idem_core::ClaimKind;

    use super::*;

    fn key() -> Key {
        Key::new("ns", "id").unwrap()
    }

    fn string(raw: &[u8]) -> Value {
        Value::BulkString(raw.to_vec())
    }

    fn lease() -> Lease {
        Lease {
            key: key(),
            owner: "w:1".into(),
            token: 12,
            attempts: 1,
            lease_until: Timestamp::from_millis(0),
            kind: ClaimKind::First,
            fingerprint: None,
        }
    }

    #[test]
    fn a_fresh_record_decodes_with_its_deadlines_from_the_expiry() {
        let claim = Claim {
            key: key(),
            owner: "w:1".into(),
            lease_ttl: std::time::Duration::from_secs(1),
            fingerprint: Some(Fingerprint([b';'; 32])),
            max_attempts: 3,
            retention: std::time::Duration::from_secs(1),
        };
        let raw = Fresh {
            claim: &claim,
            retention_ms: 500,
        }
        .to_redis_args()
        .concat();
        assert!(raw.starts_with(b"P1:3:w:1#"));
        let rec = decode_record(&key(), "k", string(&raw), 10_999)
            .unwrap()
            .unwrap();
        assert_eq!(rec.state, State::Processing);
        assert_eq!((rec.token, rec.attempts, &*rec.owner), (1, 1, "w:1"));
        assert_eq!(rec.expires_at, Some(Timestamp::from_millis(11_000)));
        assert_eq!(rec.lease_until, Some(Timestamp::from_millis(10_500)));
        assert_eq!(rec.fingerprint, claim.fingerprint);
        assert_eq!(decode_record(&key(), "k", string(&raw), -2).unwrap(), None);
    }

    #[test]
    fn the_fencing_prefix_is_the_front_of_a_held_record() {
        assert_eq!(Fence(&lease()).to_redis_args(), [b"P12:3:w:1"]);
        let rec = decode_record(&key(), "k", string(b"C12:3:w:1-2:0;\x00ok"), 99)
            .unwrap()
            .unwrap();
        assert_eq!(rec.response, Some(Bytes::from_static(b"\x00ok")));
        assert_eq!((rec.lease_until, rec.attempts), (None, 2));
        let rec = decode_record(&key(), "k", string(b"F2:1:a-1:0;1boom"), 99)
            .unwrap()
            .unwrap();
        assert_eq!((rec.error.as_deref(), rec.permanent), (Some("boom"), true));
    }

    #[test]
    fn refuses_what_does_not_decode() {
        for (bad, expire) in [
            (string(b"P1:1:w-1:0;extra"), 5),
            (string(b"P1:9:w-1:0;"), 5),
            (string(b"P1:1:w*1:0;"), 5),
            (string(b"P1:1:w#short1:0;"), 5),
            (string(b"Px:1:w-1:0;"), 5),
            (string(b"F1:1:w-1:0;2e"), 5),
            (string(b"C1:1:w-1:0;"), -1),
            (Value::Int(5), 5),
        ] {
            let res = decode_record(&key(), "k", bad.clone(), expire);
            assert!(
                matches!(res, Err(Error::Corrupt { .. })),
                "{bad:?}: {res:?}"
            );
        }
    }

    /// A value in the first layout (lowercase state, deadlines inside), which idem wrote
    /// before it had a release and no longer reads: not an idem record, naming the key.
    #[test]
    fn a_value_in_the_first_layout_is_not_a_record() {
        for old in [
            &b"c3,2,,1700000000000,0,1,0,2,;wok"[..],
            b"p1,1,5,5,0,1,0,,;w",
            b"hello",
            b"",
        ] {
            let res = decode_record(&key(), "idem:{2:ns:id}", string(old), 5);
            let Err(Error::Corrupt { message, .. }) = res else {
                panic!("{old:?}: {res:?}");
            };
            assert_eq!(message, "idem:{2:ns:id}: not an idem record");
        }
        assert_eq!(decode_record(&key(), "k", Value::Nil, 5).unwrap(), None);
        let res = decode_record(&key(), "k", Value::Array(vec![]), 5);
        assert!(matches!(res, Err(Error::Corrupt { .. })), "{res:?}");
    }

    #[test]
    fn numbers_are_at_most_fifteen_digits() {
        assert_eq!(number(b"123456789012345"), Some(123_456_789_012_345));
        for bad in [&b""[..], b"1234567890123456", b"+1", b"1 ", b"-1"] {
            assert_eq!(number(bad), None, "{bad:?}");
        }
    }
}
