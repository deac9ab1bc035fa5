//! Completes by compare-and-set, on a standalone server that has it (`SET … IFEQ`: Valkey
//! 8.1, Redis 8.4): no function runs. The client names the whole record a lease holds
//! (fence, fingerprint, attempts, and the settle's retention as `w`), so a `SET` lands
//! only on the very record that lease's claim wrote; anything else is left to the settle
//! function, which answers exactly as it always does (README, "Compare-and-set").

use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_core::backend::{Settle, Settlement};
use idem_core::{Lease, Result, Timestamp};
use redis::Value;

use crate::RedisBackend;
use crate::conn::Conn;
use crate::error::{bad_reply, from_redis};
use crate::record::Held;
use crate::settle::keeps_expiry;
use idem_core::backend::millis;

impl RedisBackend {
    /// Whether completes may try compare-and-set: a standalone server not known to lack it.
    pub(crate) fn can_swap(&self) -> bool {
        matches!(self.conn, Conn::Single(_)) && self.shared.compare_and_set.load(Ordering::Relaxed)
    }

    /// Completes the items at `group` by compare-and-set, in one round trip: a `SET … IFEQ`
    /// each, then one `PUBLISH` of their keys (joined by NUL, as the settle function
    /// announces them). Which landed; the rest are for the function: a record other than
    /// the one named (fenced, or one this client cannot name: another retention, a retry
    /// that kept an older fingerprint, the first layout), an item that is not a complete,
    /// a cluster, or a server without `IFEQ` (remembered at its first syntax error). The
    /// caller passes each key once: a key's later item must see its earlier one's write.
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
