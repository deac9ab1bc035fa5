//! Claims. A key with no record is claimed with a plain `SET … NX PX … GET` (pipelined for
//! a batch), which writes the fresh record and its expiry; the server's `TIME`, sent
//! ahead of a batch (after a single key, and after each key in a cluster, its
//! `PEXPIRETIME`), gives the lease's deadline by the server's clock. Where `SET` found a record, a
//! completed or spent one is answered from the value it returned; the rest go to the claim
//! function (`lua/claim.lua`, see `library.rs`), one call per batch per cluster slot.
//!
//! The claim function's reply is decoded here too (see `lua/claim.lua` for its shape).

use bytes::Bytes;
use idem_core::backend::{Claim, ClaimOutcome, machine, millis};
use idem_core::{ClaimKind, Fingerprint, Lease, Result, State, Timestamp};
use redis::Value;

use crate::RedisBackend;
use crate::conn::Conn;
use crate::error::{bad_reply, from_redis};
use crate::library::Function;
use crate::record::{Fresh, bytes, decode_record, int};

impl RedisBackend {
    /// [`Backend::claim`](idem_core::Backend::claim): `claim_all`'s path for one key,
    /// without a batch's bookkeeping (counting repeats, grouping by slot).
    pub(crate) async fn claim_one(&self, claim: &Claim) -> Result<ClaimOutcome> {
        let keys = [self.record_key(&claim.key)];
        let claims = std::slice::from_ref(claim);
        if set_nx_can(claim) {
            if let Some(Some(answer)) = self.set_nx(&keys, claims, &[0]).await?.pop() {
                return Ok(answer);
            }
        }
        self.claim_function(&keys, claims, &[0])
            .await?
            .pop()
            .ok_or_else(|| bad_reply("claim", "a claim got no answer"))
    }

    /// [`Backend::claim_many`](idem_core::Backend::claim_many): each answer as the single
    /// claims in turn would give it.
    pub(crate) async fn claim_all(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        let keys: Vec<String> = claims.iter().map(|c| self.record_key(&c.key)).collect();
        // A key met twice in the batch goes to the function, which answers its items in order.
        let once = Self::met_once(&keys);
        let fast = (0..claims.len()).filter(|&i| once[i] && set_nx_can(&claims[i]));
        let groups = self.by_slot(&keys, fast);
        let calls = groups.iter().map(|g| self.set_nx(&keys, claims, g));
        let mut out: Vec<Option<ClaimOutcome>> = vec![None; claims.len()];
        for (group, answers) in groups
            .iter()
            .zip(futures::future::try_join_all(calls).await?)
        {
            for (&i, answer) in group.iter().zip(answers) {
                out[i] = answer;
            }
        }
        let rest = (0..claims.len()).filter(|&i| out[i].is_none());
        let groups = self.by_slot(&keys, rest);
        let calls = groups.iter().map(|g| self.claim_function(&keys, claims, g));
        for (group, answers) in groups
            .iter()
            .zip(futures::future::try_join_all(calls).await?)
        {
            for (&i, answer) in group.iter().zip(answers) {
                out[i] = Some(answer);
            }
        }
        out.into_iter()
            .map(|a| a.ok_or_else(|| bad_reply("claim", "a claim got no answer")))
            .collect()
    }

    /// One pipeline of `SET key <fresh record> NX PX <lease + retention - 1> GET` for the
    /// claims at `group` (one slot), and the server's clock: each answer, or `None` where
    /// the function must decide. For a batch on one server the clock is one `TIME` ahead
    /// of the `SET`s, so a lease granted ends at that time plus its ttl: never later than
    /// the key's expiry (less the retention) says, which is what decides its lapse. A
    /// single key is followed by its `PEXPIRETIME` instead, and so is each key in a
    /// cluster, where a keyless `TIME` could run on another node, with another clock.
    async fn set_nx(
        &self,
        keys: &[String],
        claims: &[Claim],
        group: &[usize],
    ) -> Result<Vec<Option<ClaimOutcome>>> {
        // One TIME serves a batch; a single key's PEXPIRETIME costs the server the same and
        // the client less (an integer to read, not two strings).
        let one_clock = matches!(self.conn, Conn::Single(_)) && group.len() > 1;
        let mut pipe = redis::Pipeline::with_capacity(2 * group.len());
        if one_clock {
            pipe.cmd("TIME");
        }
        for &i in group {
            let (c, retention) = (&claims[i], millis(claims[i].retention));
            // Sized at once: a command's buffers otherwise grow in steps as arguments come.
            let mut set = redis::Cmd::with_capacity(7, keys[i].len() + c.owner.len() + 96);
            set.arg("SET")
                .arg(&keys[i])
                .arg(Fresh {
                    claim: c,
                    retention_ms: retention,
                })
                .arg("NX")
                .arg("PX")
                .arg(millis(c.lease_ttl) + retention - 1)
                .arg("GET");
            pipe.add_command(set);
            if !one_clock {
                let mut expiry = redis::Cmd::with_capacity(2, keys[i].len() + 11);
                expiry.arg("PEXPIRETIME").arg(&keys[i]);
                pipe.add_command(expiry);
            }
        }
        let mut conn = self.conn.clone();
        let replies = self.call("claim", conn.pipe_on(None, pipe)).await?;
        let expected = if one_clock {
            1 + group.len()
        } else {
            2 * group.len()
        };
        if replies.len() != expected {
            return Err(bad_reply("claim", format!("{replies:?}")));
        }
        let mut replies = replies.into_iter();
        let now = if one_clock {
            Some(server_time(replies.next())?)
        } else {
            None
        };
        let mut out = Vec::with_capacity(group.len());
        for &i in group {
            let c = &claims[i];
            let found = replies.next();
            // The key's PEXPIRETIME, or the earliest it can be: TIME ran before the SET.
            let expire = match now {
                Some(now) => {
                    i64::try_from(now.saturating_add(millis(c.lease_ttl) + millis(c.retention) - 1))
                        .map_err(|_| bad_reply("claim", "an expiry past i64"))?
                }
                None => match replies.next() {
                    Some(Value::ServerError(e)) => return Err(from_redis("claim", e.into())),
                    Some(v) => int(&v).ok_or_else(|| bad_reply("claim", format!("{v:?}")))?,
                    None => return Err(bad_reply("claim", "no reply")),
                },
            };
            out.push(match found {
                Some(Value::Nil) => Some(granted(c, expire)),
                // A value of another type: the function names its type in the error.
                Some(Value::ServerError(e)) if e.code() == "WRONGTYPE" => None,
                Some(Value::ServerError(e)) => return Err(from_redis("claim", e.into())),
                Some(v) => settled(c, &keys[i], v, expire)?,
                None => return Err(bad_reply("claim", "no reply")),
            });
        }
        Ok(out)
    }

    /// One claim function call for the claims at `group`, all in one slot when in a
    /// cluster.
    async fn claim_function(
        &self,
        keys: &[String],
        claims: &[Claim],
        group: &[usize],
    ) -> Result<Vec<ClaimOutcome>> {
        let bytes = group
            .iter()
            .map(|&i| keys[i].len() + claims[i].owner.len() + 96)
            .sum();
        let mut cmd =
            self.shared
                .library
                .fcall(Function::Claim, group.len(), 6 * group.len(), bytes);
        for &i in group {
            cmd.arg(&keys[i]);
        }
        for &i in group {
            let c = &claims[i];
            let fingerprint = c.fingerprint.as_ref().map_or(&[][..], |f| &f.0[..]);
            cmd.arg(c.owner.as_bytes())
                .arg(millis(c.lease_ttl))
                .arg(fingerprint)
                .arg(c.max_attempts)
                .arg(millis(c.retention));
        }
        let answers = match self.fcall("claim", cmd).await? {
            Value::Array(answers) if answers.len() == group.len() => answers,
            other => return Err(bad_reply("claim", format!("{other:?}"))),
        };
        group
            .iter()
            .zip(answers)
            .map(|(&i, answer)| decode_outcome(&claims[i], answer))
            .collect()
    }
}

/// Whether `SET NX` can claim for `c`: its record must live at least 2 ms (`PX` takes at
/// least 1, and the record expires 1 ms after it).
fn set_nx_can(c: &Claim) -> bool {
    millis(c.lease_ttl) + millis(c.retention) >= 2
}

/// The lease `SET NX` granted: token 1, ending where the record's expiry (`expire`, its
/// `PEXPIRETIME`) says, less the retention it carries. Should the key be gone already (a
/// lease shorter than the round trip, then an expiry or a delete), the client's estimate.
fn granted(claim: &Claim, expire: i64) -> ClaimOutcome {
    let now = match u64::try_from(expire) {
        Ok(at) => Timestamp::from_millis(
            (at + 1).saturating_sub(millis(claim.retention) + millis(claim.lease_ttl)),
        ),
        Err(_) => Timestamp::now(),
    };
    ClaimOutcome::Acquired(machine::first(claim, now).0)
}

/// The server's clock in milliseconds, from the reply to `TIME` (seconds and microseconds).
fn server_time(reply: Option<Value>) -> Result<u64> {
    let part = |v: &Value| match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse::<u64>().ok(),
        _ => None,
    };
    match &reply {
        Some(Value::Array(parts)) => match &parts[..] {
            [secs, micros] => part(secs)
                .zip(part(micros))
                .map(|(s, us)| s.saturating_mul(1000).saturating_add(us / 1000)),
            _ => None,
        },
        _ => None,
    }
    .ok_or_else(|| bad_reply("claim", format!("TIME: {reply:?}")))
}

/// The answer to `claim` from the record `SET NX` found, where it needs neither the clock
/// nor a write: a completed or failed record's `Completed`, `Poisoned` or `Mismatch`.
/// `None` (the function decides) for a `Processing` record, a retry, or a record gone.
fn settled(claim: &Claim, at: &str, found: Value, expire: i64) -> Result<Option<ClaimOutcome>> {
    let Some(rec) = decode_record(&claim.key, at, found, expire)? else {
        return Ok(None);
    };
    if rec.state == State::Processing {
        return Ok(None);
    }
    // Redis returned the record, so it is live: any time before its expiry decides alike.
    let (answer, write) = machine::claim(Some(&rec), claim, Timestamp::from_millis(0));
    Ok(write.is_none().then_some(answer))
}

fn timestamp(value: &Value) -> Option<Timestamp> {
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
                lease_until: timestamp(until)?,
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
            let lease_until = timestamp(items.next()?)?;
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
