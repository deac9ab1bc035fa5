//! Claims. A key with no record is claimed with a plain `SET … NX PX … GET` (pipelined for
//! a batch), one command, which writes the fresh record and its expiry by the server's
//! clock; the lease's reported deadline is the client's estimate, taken before it is sent.
//! Where `SET` found a record, a completed or spent one is answered from the value it
//! returned; the rest go to the claim function (`lua/claim.lua`, see `library.rs`), one
//! call per batch per cluster slot, which reads a held key's deadline on the server.

use std::collections::HashMap;
use std::time::Duration;

use idem_core::{Claim, ClaimKind, ClaimOutcome, Lease, Result, State, Timestamp, machine};
use redis::Value;

use crate::RedisBackend;
use crate::backend::millis;
use crate::error::{bad_reply, from_redis};
use crate::library::Function;
use crate::record::{decode_record, fresh};
use crate::reply::decode_outcome;

impl RedisBackend {
    /// [`Backend::claim_many`](idem_core::Backend::claim_many): each answer as the single
    /// claims in turn would give it.
    pub(crate) async fn claim_all(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        let keys: Vec<String> = claims.iter().map(|c| self.record_key(&c.key)).collect();
        let mut count: HashMap<&str, usize> = HashMap::new();
        for k in &keys {
            *count.entry(k.as_str()).or_default() += 1;
        }
        // A key met twice in the batch goes to the function, which answers its items in order.
        let fast = (0..claims.len()).filter(|&i| {
            let c = &claims[i];
            count[keys[i].as_str()] == 1 && millis(c.lease_ttl) + millis(c.retention) >= 2
        });
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
    /// claims at `group` (one slot): each answer, or `None` where the function must decide.
    async fn set_nx(
        &self,
        keys: &[String],
        claims: &[Claim],
        group: &[usize],
    ) -> Result<Vec<Option<ClaimOutcome>>> {
        let mut pipe = redis::pipe();
        // Before anything is sent: the server sets each expiry after it receives the
        // command, so by the same clock no granted lease ends before `sent + lease_ttl`.
        let sent = Timestamp::now();
        for &i in group {
            let (c, retention) = (&claims[i], millis(claims[i].retention));
            pipe.cmd("SET")
                .arg(&keys[i])
                .arg(fresh(c, retention))
                .arg("NX")
                .arg("PX")
                .arg(millis(c.lease_ttl) + retention - 1)
                .arg("GET");
        }
        let mut conn = self.conn.clone();
        let replies = self.call("claim", conn.pipe_on(None, pipe)).await?;
        if replies.len() != group.len() {
            return Err(bad_reply("claim", format!("{replies:?}")));
        }
        let mut out = Vec::with_capacity(group.len());
        for (&i, found) in group.iter().zip(replies) {
            out.push(match found {
                Value::Nil => Some(granted(&claims[i], sent)),
                Value::ServerError(e) => return Err(from_redis("claim", e.into())),
                v => settled(&claims[i], v)?,
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
        let mut cmd = self.shared.library.fcall(Function::Claim, group.len());
        for &i in group {
            cmd.arg(&keys[i]);
        }
        for &i in group {
            let c = &claims[i];
            let fingerprint = c.fingerprint.as_ref().map_or(&[][..], |f| &f.0[..]);
            cmd.arg(&c.owner)
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

/// The lease `SET NX` granted: token 1, its deadline the client's estimate, `lease_ttl`
/// from `sent` (the client's clock just before the command went out). The server's lease
/// ends `lease_ttl` after it received the command (the key's expiry less the retention),
/// so no earlier while the clocks agree; that expiry, not this estimate, decides lapse.
fn granted(claim: &Claim, sent: Timestamp) -> ClaimOutcome {
    let lease_until = sent.saturating_add(Duration::from_millis(millis(claim.lease_ttl)));
    ClaimOutcome::Acquired(Lease {
        key: claim.key.clone(),
        owner: claim.owner.clone(),
        token: 1,
        attempts: 1,
        lease_until,
        kind: ClaimKind::First,
    })
}

/// The answer to `claim` from the record `SET NX` found, where it needs neither the clock
/// nor a write: a completed or failed record's `Completed`, `Poisoned` or `Mismatch`.
/// `None` (the function decides) for a `Processing` record, a retry, or a record gone.
/// (`SET … GET` reads no expiry: the record's deadlines stay unknown, and none is needed.)
fn settled(claim: &Claim, found: Value) -> Result<Option<ClaimOutcome>> {
    let Some(rec) = decode_record(&claim.key, found, None)? else {
        return Ok(None);
    };
    if rec.state == State::Processing {
        return Ok(None);
    }
    // Redis returned the record, so it is live: any time before its expiry decides alike.
    let (answer, write) = machine::claim(Some(&rec), claim, Timestamp::from_millis(0));
    Ok(write.is_none().then_some(answer))
}
