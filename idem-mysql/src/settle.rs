//! Settles: one transaction per batch, like claims. An oversized response is refused
//! before anything is sent; the other items are decided in order by idem's state machine
//! against the locked records (so a key settled twice sees the first settle's result), and
//! the records that changed are written in one statement. Extends go the same way.

use std::time::Duration;

use idem_core::backend::{Settlement, check_response, machine, per_item};
use idem_core::{Error, Lease, Result, Timestamp};

use crate::backend::MySqlBackend;
use crate::locked::Locked;

impl MySqlBackend {
    /// The body of `settle_many` (see the module docs).
    pub(crate) async fn settle_batch(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let limit = self.max_response_bytes;
        let mut answers: Vec<Option<Result<()>>> = Vec::with_capacity(items.len());
        let mut sent = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match check_response(&item.settle, limit) {
                Ok(()) => {
                    answers.push(None);
                    sent.push(i);
                }
                Err(e) => answers.push(Some(per_item(Err(e))?)),
            }
        }
        if !sent.is_empty() {
            let keys: Vec<_> = sent.iter().map(|&i| &items[i].lease.key).collect();
            let settled = self
                .transact("settle", &keys, |locked| {
                    sent.iter()
                        .map(|&i| settle_locked(locked, &items[i], retention))
                        .collect::<Vec<_>>()
                })
                .await?;
            for (i, answer) in sent.into_iter().zip(settled) {
                answers[i] = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|a| a.ok_or_else(|| Error::corrupt("a settle was not answered")))
            .collect()
    }

    /// The body of `extend`.
    pub(crate) async fn extend_lease(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        self.transact("extend", &[&lease.key], |locked| {
            let record = machine::extend(locked.get(&lease.key), lease, ttl, locked.now)?;
            let until = record.lease_until;
            locked.set(record);
            until
        })
        .await?
        .ok_or_else(|| Error::fenced(lease))
    }
}

/// Settles `item` against the locked records: `Ok`, or `Fenced` with nothing changed.
pub(crate) fn settle_locked(
    locked: &mut Locked,
    item: &Settlement,
    retention: Duration,
) -> Result<()> {
    let now = locked.now;
    match machine::settle(
        locked.get(&item.lease.key),
        &item.lease,
        &item.settle,
        retention,
        now,
    ) {
        Some(record) => {
            locked.set(record);
            Ok(())
        }
        None => Err(Error::fenced(&item.lease)),
    }
}
