//! Settling leases (complete, fail, release) with the settle function (`lua/settle.lua`):
//! it checks that each record starts with its lease's fencing prefix and writes the new
//! one around the part the client does not know (fingerprint and attempts), one call per
//! batch per cluster slot. On a standalone server that has compare-and-set, completes try
//! [`crate::cas`] first, and only what it leaves comes here.

use std::time::Duration;

use idem_core::backend::{Settle, Settlement, check_response, millis};
use idem_core::{Error, FailureKind, Lease, Result, Timestamp};
use redis::Value;

use crate::RedisBackend;
use crate::error::bad_reply;
use crate::library::Function;
use crate::record::Fence;

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
