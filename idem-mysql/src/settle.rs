//! Settles. An oversized response is refused before anything is sent. Completes and
//! fails of distinct keys are fenced updates: one autocommitted `UPDATE … WHERE` the lease
//! holds the record for a single item (its row count is the answer); for a batch, one
//! fenced `INSERT … ON DUPLICATE KEY UPDATE` per 512 items in a transaction that commits
//! only if every item held, and rolls back otherwise, so that no item's answer is guessed.
//! A deadlock or lock wait on either leaves the items to the transaction, which retries.
//! The rest (a release, a key settled twice in one batch, a batch where some lease no
//! longer held) take the locking transaction: the items are decided in order by idem's state machine against the
//! locked records (so a key settled twice sees the first settle's result), and the records
//! that changed are written in one statement. Extends go the same way.

use std::time::Duration;

use idem_core::backend::{Settle, Settlement, check_response, machine, per_item};
use idem_core::{Error, FailureKind, Lease, Result, Timestamp};
use sqlx::AssertSqlSafe;

use crate::backend::MySqlBackend;
use crate::error::{map, retryable};
use crate::locked::{Locked, MyQuery, capped, millis};

/// Items per fenced batch statement (9 parameters each), a power of two: a consumer's poll
/// batch of up to 500 is one statement.
const SETTLE_CHUNK: usize = 512;

impl MySqlBackend {
    /// The body of `settle_many` (see the module docs).
    pub(crate) async fn settle_batch(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let retention = capped(retention);
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
            let settled = match self.settle_fenced(items, &sent, retention).await? {
                Some(settled) => settled,
                None => self.settle_locked_batch(items, &sent, retention).await?,
            };
            for (i, answer) in sent.into_iter().zip(settled) {
                answers[i] = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|a| a.ok_or_else(|| Error::corrupt("a settle was not answered")))
            .collect()
    }

    /// The items at `sent` as fenced updates, or `None` where the locking transaction must
    /// decide them (see the module docs).
    async fn settle_fenced(
        &self,
        items: &[Settlement],
        sent: &[usize],
        retention: Duration,
    ) -> Result<Option<Vec<Result<()>>>> {
        let mut seen = std::collections::HashSet::with_capacity(sent.len());
        let fits = sent.iter().all(|&i| {
            !matches!(items[i].settle, Settle::Release) && seen.insert(&items[i].lease.key)
        });
        if !fits {
            return Ok(None);
        }
        let keep = millis(retention);
        if let [i] = *sent {
            let item = &items[i];
            let query = sqlx::query(AssertSqlSafe(self.tables.settle_one()))
                .bind(keep)
                .bind(keep);
            let query = bind_fence(bind_settle(query, item), &item.lease);
            let done = match self.timed_raw("settle", query.execute(&self.pool)).await? {
                Ok(done) => done,
                Err(e) if retryable(&e) => return Ok(None),
                Err(e) => return Err(map("settle", e)),
            };
            let held = done.rows_affected() == 1;
            return Ok(Some(vec![if held {
                Ok(())
            } else {
                Err(Error::fenced(&item.lease))
            }]));
        }
        if keep == 0 {
            // The batch statement's fence needs the new expiry to be past now.
            return Ok(None);
        }
        let mut order = sent.to_vec();
        order.sort_unstable_by(|&a, &b| items[a].lease.key.cmp(&items[b].lease.key));
        let run = async {
            let mut tx = self.pool.begin().await?;
            let mut held = 0;
            let mut want = 0;
            for run in order.chunks(SETTLE_CHUNK) {
                // Padded to a power of two with the run's last item: a repeat finds the
                // record its first occurrence settled (or left alone) and changes nothing,
                // one row affected each.
                let padded = run.len().next_power_of_two();
                let last = run[run.len() - 1];
                let mut query = sqlx::query(AssertSqlSafe(self.tables.settle_many(padded)));
                for &i in run
                    .iter()
                    .chain(std::iter::repeat_n(&last, padded - run.len()))
                {
                    query = bind_settle(bind_fence(query, &items[i].lease), &items[i]).bind(keep);
                }
                held += query.execute(&mut *tx).await?.rows_affected();
                want += 2 * run.len() as u64 + (padded - run.len()) as u64;
            }
            // Two rows affected per item whose lease held, one per repeat (see
            // `Tables::settle_many`).
            if held == want {
                tx.commit().await?;
                Ok(true)
            } else {
                tx.rollback().await?;
                Ok(false)
            }
        };
        match self.timed_raw("settle", run).await? {
            Ok(true) => Ok(Some(sent.iter().map(|_| Ok(())).collect())),
            Ok(false) => Ok(None),
            Err(e) if retryable(&e) => Ok(None),
            Err(e) => Err(map("settle", e)),
        }
    }

    /// The items at `sent` in the locking transaction.
    async fn settle_locked_batch(
        &self,
        items: &[Settlement],
        sent: &[usize],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let keys: Vec<_> = sent.iter().map(|&i| &items[i].lease.key).collect();
        self.transact("settle", &keys, |locked| {
            sent.iter()
                .map(|&i| settle_locked(locked, &items[i], retention))
                .collect::<Vec<_>>()
        })
        .await
    }

    /// The body of `extend`.
    pub(crate) async fn extend_lease(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        let ttl = capped(ttl);
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

/// Binds a lease's key, token and owner, in that order.
fn bind_fence<'q>(query: MyQuery<'q>, lease: &'q Lease) -> MyQuery<'q> {
    query
        .bind(lease.key.namespace().as_bytes())
        .bind(lease.key.id().as_bytes())
        .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
        .bind(lease.owner.as_bytes())
}

/// Binds what a complete or fail writes: the state, the response, the error text and
/// whether the failure is permanent (a release is not bound here: it takes the locking
/// transaction).
fn bind_settle<'q>(query: MyQuery<'q>, item: &'q Settlement) -> MyQuery<'q> {
    let (state, response, error, permanent) = match &item.settle {
        Settle::Complete(response) => ("completed", Some(&response[..]), None, false),
        Settle::Fail { error, kind } => (
            "failed",
            None,
            Some(error.as_bytes()),
            *kind == FailureKind::Permanent,
        ),
        Settle::Release => ("processing", None, None, false),
    };
    query.bind(state).bind(response).bind(error).bind(permanent)
}
