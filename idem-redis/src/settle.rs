//! Settling leases (complete, fail, release) with the settle function (`lua/settle.lua`):
//! it checks that each record starts with its lease's fencing prefix and writes the new
//! one around the part the client does not know (fingerprint and attempts), one call per
//! batch per cluster slot. A single complete on a standalone server that has
//! compare-and-set (`SET … IFEQ`: Valkey 8.1, Redis 8.4) runs no function: it names the
//! whole record the lease holds, and only a record that differs goes to the function.

use std::time::Duration;

use std::sync::atomic::Ordering;

use idem_core::{Error, FailureKind, Lease, Result, Settle, Settlement, Timestamp};
use redis::Value;

use crate::RedisBackend;
use crate::backend::millis;
use crate::conn::Conn;
use crate::error::{bad_reply, from_redis};
use crate::library::Function;
use crate::record::{Fence, Held};

/// How long a lease must have left, by this client's clock, for its complete to keep the
/// record's expiry (action `k` of `lua/settle.lua`): the clocks of client and server may
/// disagree by less than this without a completed record expiring before its retention.
const KEEP_MARGIN: Duration = Duration::from_secs(1);

impl RedisBackend {
    /// [`Backend::settle_many`](idem_core::Backend::settle_many). Oversized responses are
    /// refused here and never sent.
    pub(crate) async fn settle_all(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let mut out: Vec<Option<Result<()>>> = items
            .iter()
            .map(|item| self.check_size(&item.settle).err().map(Err))
            .collect();
        let keys: Vec<String> = items
            .iter()
            .map(|item| self.record_key(&item.lease.key))
            .collect();
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
                out[i] = Some(if done { Ok(()) } else { Err(fenced(&items[i])) });
            }
        }
        out.into_iter()
            .map(|a| a.ok_or_else(|| bad_reply("settle", "an item got no answer")))
            .collect()
    }

    /// A single settle: `Ok`, [`Error::TooLarge`] or [`Error::Fenced`]. `settle_all`'s
    /// path for one item, without a batch's bookkeeping.
    pub(crate) async fn settle_one(&self, item: Settlement, retention: Duration) -> Result<()> {
        self.check_size(&item.settle)?;
        let keys = [self.record_key(&item.lease.key)];
        if let Settle::Complete(response) = &item.settle {
            if self
                .swap_complete(&keys[0], &item.lease, response, retention)
                .await?
            {
                return Ok(());
            }
        }
        let items = std::slice::from_ref(&item);
        match self.settle_function(&keys, items, &[0], retention).await?[..] {
            [true] => Ok(()),
            [false] => Err(fenced(&item)),
            _ => Err(bad_reply("settle", "an item got no answer")),
        }
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
                    let live = item.lease.lease_until.since(now) > KEEP_MARGIN;
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

    /// A complete by compare-and-set, on a standalone server that has it: `SET key
    /// <completed record> IFEQ <the record the lease holds> KEEPTTL` (or `PX` retention, as
    /// the function chooses), and the key announced as the function announces it, in one
    /// round trip. The held record is named whole (fence, fingerprint, attempts and `w` =
    /// this retention), so the `SET` lands only on the very record this lease's claim
    /// wrote. True if it landed; false where the settle function must answer: any other
    /// record (fenced, or one this client cannot name: another retention, a retry that kept
    /// an older fingerprint, the first layout), a cluster, or a server without `IFEQ`
    /// (remembered after its first syntax error).
    async fn swap_complete(
        &self,
        key: &str,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<bool> {
        let Conn::Single(conn) = &self.conn else {
            return Ok(false);
        };
        if !self.shared.compare_and_set.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let retention_ms = millis(retention);
        // The function's rule: keep the expiry under a live lease, else expire a
        // millisecond after `PX` (which takes at least 1); a retention under 2 ms deletes.
        let keep = lease.lease_until.since(Timestamp::now()) > KEEP_MARGIN;
        if !keep && retention_ms < 2 {
            return Ok(false);
        }
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
        let mut pipe = redis::pipe();
        pipe.add_command(set)
            .cmd("PUBLISH")
            .arg(&self.shared.channel)
            .arg(key)
            .ignore();
        let mut conn = conn.clone();
        let sent = async move {
            // Errors as values: the `SET`'s own answer tells a server without `IFEQ`.
            let answer = pipe
                .ignore_errors()
                .query_async::<Vec<Value>>(&mut conn)
                .await;
            match answer.map_err(|e| from_redis("complete", e))?.as_slice() {
                [Value::Okay | Value::SimpleString(_)] => Ok(Swap::Landed),
                [Value::Nil] => Ok(Swap::NotHeld),
                // Redis 7 and Valkey 8.0 answer `ERR syntax error`; other refusals (a
                // replica, out of memory) go to the function, which answers them as usual.
                [Value::ServerError(e)] => {
                    let syntax = e.details().is_some_and(|d| d.contains("syntax"));
                    Ok(if syntax { Swap::Unknown } else { Swap::NotHeld })
                }
                other => Err(bad_reply("complete", format!("{other:?}"))),
            }
        };
        let timeout = self.shared.config.timeout();
        match idem_core::layer::within("complete", timeout, Box::pin(sent)).await? {
            Swap::Landed => Ok(true),
            Swap::NotHeld => Ok(false),
            Swap::Unknown => {
                self.shared.compare_and_set.store(false, Ordering::Relaxed);
                Ok(false)
            }
        }
    }

    /// [`Error::TooLarge`] for a response over the configured limit.
    fn check_size(&self, settle: &Settle) -> Result<()> {
        let limit = self.shared.config.max_response_bytes();
        match settle {
            Settle::Complete(response) if response.len() > limit => Err(Error::TooLarge {
                what: "response",
                size: response.len(),
                limit,
            }),
            _ => Ok(()),
        }
    }
}

/// What a compare-and-set complete found.
enum Swap {
    /// The completed record replaced the held one.
    Landed,
    /// The key holds another record (or none), or the server refused the write: the
    /// settle function decides.
    NotHeld,
    /// The server does not know `IFEQ`.
    Unknown,
}

/// The error of a settle whose lease no longer holds the record.
fn fenced(item: &Settlement) -> Error {
    Error::Fenced {
        key: item.lease.key.clone(),
        token: item.lease.token,
    }
}
