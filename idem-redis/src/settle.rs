//! Settling leases (complete, fail, release) with the settle function (`lua/settle.lua`):
//! it checks that each record starts with its lease's fencing prefix and writes the new
//! one around the part the client does not know (fingerprint and attempts), one call per
//! batch per cluster slot.
//!
//! On a standalone server that has compare-and-set (`SET … IFEQ`: Valkey 8.1, Redis 8.4),
//! completes try it first ([`RedisBackend::swap`]), and only what it leaves goes to the
//! function: then no function runs. The client names the whole record a lease holds
//! (fence, fingerprint, attempts, and the settle's retention as `w`), so a `SET` lands
//! only on the very record that lease's claim wrote; anything else is left to the settle
//! function, which answers exactly as it always does (README, "Compare-and-set").

use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_core::backend::{Settle, Settlement, check_response, millis};
use idem_core::{Error, FailureKind, Lease, Result, Timestamp};
use redis::Value;

use crate::RedisBackend;
use crate::conn::Conn;
use crate::error::{bad_reply, from_redis};
use crate::library::Function;
use crate::record::{Fence, Held};

/// How long a lease must have left, by this client's clock, for its complete to keep the
/// record's expiry (action `k` of `lua/settle.lua`): the clocks of client and server may
/// disagree by less than this without a completed record expiring before its retention.
const KEEP_MARGIN: Duration = Duration::from_secs(1);

/// Whether a complete of `lease` keeps its record's expiry (the `k` action): the lease has
/// more than [`KEEP_MARGIN`] left by this client's clock at `now`.
pub(crate) fn keeps_expiry(lease: &Lease, now: Timestamp) -> bool {
    lease.lease_until.since(now) > KEEP_MARGIN
}

impl RedisBackend {
    /// [`Backend::settle_many`](idem_core::Backend::settle_many). Oversized responses are
    /// refused here and never sent.
    pub(crate) async fn settle_all(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let limit = self.shared.config.max_response_bytes();
        let mut out: Vec<Option<Result<()>>> = items
            .iter()
            .map(|item| check_response(&item.settle, limit).err().map(Err))
            .collect();
        let keys: Vec<String> = items
            .iter()
            .map(|item| self.record_key(&item.lease.key))
            .collect();
        // Completes of keys met once in the batch try compare-and-set first; a key met
        // again goes to the function whole, which answers its items in order.
        if self.can_swap() {
            let met_once = Self::met_once(&keys);
            let once: Vec<usize> = (0..items.len())
                .filter(|&i| out[i].is_none() && met_once[i])
                .collect();
            for (&i, landed) in once
                .iter()
                .zip(self.swap(&keys, items, &once, retention).await?)
            {
                if landed {
                    out[i] = Some(Ok(()));
                }
            }
        }
        let sent = (0..items.len()).filter(|&i| out[i].is_none());
        let groups = self.by_slot(&keys, sent);
        let calls = groups
            .iter()
            .map(|g| self.settle_function(&keys, items, g, retention));
        for (group, done) in groups
            .iter()
            .zip(futures::future::try_join_all(calls).await?)
        {
            for (&i, done) in group.iter().zip(done) {
                out[i] = Some(if done {
                    Ok(())
                } else {
                    Err(Error::fenced(&items[i].lease))
                });
            }
        }
        out.into_iter()
            .map(|a| a.ok_or_else(|| bad_reply("settle", "an item got no answer")))
            .collect()
    }

    /// One settle function call for the items at `group`, all in one slot when in a
    /// cluster: whether each was done (else fenced).
    async fn settle_function(
        &self,
        keys: &[String],
        items: &[Settlement],
        group: &[usize],
        retention: Duration,
    ) -> Result<Vec<bool>> {
        let bytes = group
            .iter()
            .map(|&i| keys[i].len() + items[i].lease.owner.len() + items[i].settle.text_len() + 32)
            .sum::<usize>()
            + self.shared.channel.len()
            + 24;
        let mut cmd =
            self.shared
                .library
                .fcall(Function::Settle, group.len(), 4 * group.len() + 2, bytes);
        for &i in group {
            cmd.arg(&keys[i]);
        }
        cmd.arg(millis(retention)).arg(&self.shared.channel);
        let now = Timestamp::now();
        for &i in group {
            let item = &items[i];
            cmd.arg(Fence(&item.lease));
            match &item.settle {
                Settle::Complete(response) => {
                    let live = keeps_expiry(&item.lease, now);
                    cmd.arg(if live { "k" } else { "c" }).arg(&response[..])
                }
                Settle::Fail { error, kind } => {
                    let action = if *kind == FailureKind::Permanent {
                        "F"
                    } else {
                        "f"
                    };
                    cmd.arg(action).arg(error.as_str())
                }
                Settle::Release => cmd.arg("r").arg(""),
            };
        }
        match self.fcall("settle", cmd).await? {
            Value::Array(answers) if answers.len() == group.len() => answers
                .iter()
                .map(|a| match a {
                    Value::Int(done) => Ok(*done == 1),
                    other => Err(bad_reply("settle", format!("{other:?}"))),
                })
                .collect(),
            other => Err(bad_reply("settle", format!("{other:?}"))),
        }
    }
}

impl RedisBackend {
    /// Whether completes may try compare-and-set: a standalone server not known to lack it.
    pub(crate) fn can_swap(&self) -> bool {
        matches!(self.conn, Conn::Single(_)) && self.shared.compare_and_set.load(Ordering::Relaxed)
    }

    /// Completes the items at `group` by compare-and-set, in one round trip: a `SET … IFEQ`
    /// each, then one `PUBLISH` of their keys (joined by NUL, as the settle function
    /// announces them). Which landed; the rest are for the function: a record other than
    /// the one named (fenced, or one this client cannot name: another retention, a retry
    /// that kept an older fingerprint, a value idem did not write), an item that is not a
    /// complete, a cluster, or a server without `IFEQ` (remembered at its first syntax
    /// error). The caller passes each key once: a key's later item must see its earlier
    /// one's write.
    pub(crate) async fn swap(
        &self,
        keys: &[String],
        items: &[Settlement],
        group: &[usize],
        retention: Duration,
    ) -> Result<Vec<bool>> {
        let mut out = vec![false; group.len()];
        let Conn::Single(conn) = &self.conn else {
            return Ok(out);
        };
        if !self.can_swap() {
            return Ok(out);
        }
        let (retention_ms, now) = (millis(retention), Timestamp::now());
        let mut pipe = redis::pipe();
        let (mut sent, mut announce) = (Vec::with_capacity(group.len()), Vec::new());
        for (j, &i) in group.iter().enumerate() {
            let (lease, Settle::Complete(response)) = (&items[i].lease, &items[i].settle) else {
                continue;
            };
            // The function's rule: keep the expiry under a live lease, else expire a
            // millisecond after `PX` (which takes at least 1); a retention under 2 ms
            // deletes the record, which the function does.
            if retention_ms < 2 {
                continue;
            }
            let keep = keeps_expiry(lease, now);
            pipe.add_command(set_if_held(&keys[i], lease, response, retention_ms, keep));
            if !sent.is_empty() {
                announce.push(0);
            }
            announce.extend_from_slice(keys[i].as_bytes());
            sent.push(j);
        }
        if sent.is_empty() {
            return Ok(out);
        }
        pipe.cmd("PUBLISH")
            .arg(&self.shared.channel)
            .arg(announce)
            .ignore();
        let mut conn = conn.clone();
        let answers = async move {
            // Errors as values: each `SET`'s own answer tells a server without `IFEQ`.
            let answers = pipe.ignore_errors().query_async::<Vec<Value>>(&mut conn);
            answers.await.map_err(|e| from_redis("complete", e))
        };
        let timeout = self.shared.config.timeout();
        let answers = idem_core::layer::within("complete", timeout, Box::pin(answers)).await?;
        if answers.len() != sent.len() {
            return Err(bad_reply("complete", format!("{answers:?}")));
        }
        for (&j, answer) in sent.iter().zip(&answers) {
            match answer {
                Value::Okay | Value::SimpleString(_) => out[j] = true,
                Value::Nil => {}
                // Redis 7 and Valkey 8.0 answer `ERR syntax error`; other refusals (a
                // replica, out of memory) go to the function, which answers them as usual.
                Value::ServerError(e) => {
                    if e.details().is_some_and(|d| d.contains("syntax")) {
                        self.shared.compare_and_set.store(false, Ordering::Relaxed);
                    }
                }
                other => return Err(bad_reply("complete", format!("{other:?}"))),
            }
        }
        Ok(out)
    }
}

/// `SET key <completed record> IFEQ <held record> KEEPTTL` (or `PX retention - 1`).
fn set_if_held(
    key: &str,
    lease: &Lease,
    response: &[u8],
    retention_ms: u64,
    keep: bool,
) -> redis::Cmd {
    let held = |response| Held {
        lease,
        retention_ms,
        response,
    };
    let bytes = 2 * (key.len() + lease.owner.len() + 96) + response.len();
    let mut set = redis::Cmd::with_capacity(6, bytes);
    set.arg("SET")
        .arg(key)
        .arg(held(Some(response)))
        .arg("IFEQ")
        .arg(held(None));
    if keep {
        set.arg("KEEPTTL");
    } else {
        set.arg("PX").arg(retention_ms - 1);
    }
    set
}
