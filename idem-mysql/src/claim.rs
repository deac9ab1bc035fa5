//! Claims. A key with no row is claimed by one autocommitted `INSERT IGNORE`, with no
//! transaction: one claim carries the server's clock back in the statement's answer
//! (`LAST_INSERT_ID(now)`), a batch names the keys it inserted with `RETURNING` where the
//! server has it (MariaDB 10.5+). The keys that exist (and, on a server without
//! `RETURNING`, every key of a batch) are read without a lock, and a claim whose answer
//! writes nothing (a replay, a live lease) is answered from that read; the rest take the
//! locking transaction: the records of the
//! distinct keys are locked and read in one statement, each claim is answered in order by
//! idem's state machine against the record the earlier claims left (so a key repeated in
//! the batch sees the first claim's lease), the records granted are written in one
//! statement, then COMMIT. After a claim (or a batch) whose keys mostly existed, the next
//! one skips the insert.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

use idem_core::backend::{Claim, ClaimOutcome, machine};
use idem_core::{Result, Timestamp};
use sqlx::{AssertSqlSafe, Row};

use crate::backend::MySqlBackend;
use crate::error::{map, retryable};
use crate::locked::{MyQuery, capped, distinct, millis};

/// The longest owner an `INSERT IGNORE` is given: a `BLOB` column's limit, which an
/// ignoring insert would truncate to rather than refuse.
const MAX_OWNER_BYTES: usize = u16::MAX as usize;

/// Whether `claim` can take the ignoring insert: an owner it would truncate goes to the
/// transaction, whose insert refuses it.
fn fits(claim: &Claim) -> bool {
    claim.owner.len() <= MAX_OWNER_BYTES
}

impl MySqlBackend {
    /// The body of `claim_many` (see the module docs).
    pub(crate) async fn claim_batch(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let over = |d: std::time::Duration| capped(d) != d;
        let within: Vec<Claim>;
        let claims = if claims
            .iter()
            .any(|c| over(c.lease_ttl) || over(c.retention))
        {
            within = claims
                .iter()
                .map(|c| Claim {
                    lease_ttl: capped(c.lease_ttl),
                    retention: capped(c.retention),
                    ..c.clone()
                })
                .collect();
            &within[..]
        } else {
            claims
        };
        let mut answers: Vec<Option<ClaimOutcome>> = vec![None; claims.len()];
        let fresh = self.fresh_batches.load(Ordering::Relaxed);
        if let ([claim], true) = (claims, fresh) {
            answers[0] = self.claim_fresh_one(claim).await?;
            self.fresh_batches
                .store(answers[0].is_some(), Ordering::Relaxed);
        } else if claims.len() > 1 && fresh && self.returning().await? {
            self.claim_fresh_many(claims, &mut answers).await?;
            let new = answers.iter().filter(|a| a.is_some()).count();
            self.fresh_batches
                .store(2 * new >= claims.len(), Ordering::Relaxed);
        } else if !fresh {
            // After claims of keys that existed, the insert is skipped; one claim in sixteen
            // tries it again. (A batch on a server without `RETURNING` leaves the hint to
            // single claims.)
            self.fresh_batches
                .store(fastrand::u8(..16) == 0, Ordering::Relaxed);
        }
        let pending = |answers: &[Option<ClaimOutcome>]| -> Vec<usize> {
            (0..claims.len())
                .filter(|&i| answers[i].is_none())
                .collect()
        };
        let rest = pending(&answers);
        if !rest.is_empty() {
            self.claim_read(claims, &rest, &mut answers).await?;
        }
        let rest = pending(&answers);
        if !rest.is_empty() {
            let locked = self.claim_locked(claims, &rest).await?;
            for (i, answer) in rest.into_iter().zip(locked) {
                answers[i] = Some(answer);
            }
        }
        Ok(answers.into_iter().flatten().collect())
    }

    /// One claim of a key with no row: the insert alone. `None` when a row exists (live
    /// or expired), for the transaction to decide.
    async fn claim_fresh_one(&self, claim: &Claim) -> Result<Option<ClaimOutcome>> {
        if !fits(claim) {
            return Ok(None);
        }
        let sql = self.tables.claim_fresh(1, false);
        let query = bind_fresh(sqlx::query(AssertSqlSafe(sql)), claim);
        let done = match self.timed_raw("claim", query.execute(&self.pool)).await? {
            Ok(done) => done,
            // A deadlock or lock wait (the key's row held by another transaction): the
            // transaction, which retries, decides.
            Err(e) if retryable(&e) => return Ok(None),
            Err(e) => return Err(map("claim", e)),
        };
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        let now = Timestamp::from_millis(done.last_insert_id());
        Ok(Some(ClaimOutcome::Acquired(machine::first(claim, now).0)))
    }

    /// The first claim of each distinct key of a batch, inserted where the key has no row,
    /// sorted by key (so that concurrent batches take their locks in one order), in runs of
    /// up to [`FRESH_CHUNK`]: answers those inserted. A run that meets a deadlock leaves its
    /// keys to the transaction.
    async fn claim_fresh_many(
        &self,
        claims: &[Claim],
        answers: &mut [Option<ClaimOutcome>],
    ) -> Result<()> {
        let mut seen = HashSet::with_capacity(claims.len());
        let mut firsts: Vec<usize> = (0..claims.len())
            .filter(|&i| seen.insert(&claims[i].key))
            .filter(|&i| fits(&claims[i]))
            .collect();
        firsts.sort_unstable_by(|&a, &b| claims[a].key.cmp(&claims[b].key));
        for run in firsts.chunks(FRESH_CHUNK) {
            // Padded to a power of two with the run's last claim, whose repeats are ignored
            // as duplicates of its own row: one statement, one commit, and a text the
            // statement cache has (see `locked.rs`).
            let padded = run.len().next_power_of_two();
            let sql = self.tables.claim_fresh(padded, true);
            let mut query = sqlx::query(AssertSqlSafe(sql));
            let last = run[run.len() - 1];
            for &i in run
                .iter()
                .chain(std::iter::repeat_n(&last, padded - run.len()))
            {
                query = bind_fresh(query, &claims[i]);
            }
            let rows = match self.timed_raw("claim", query.fetch_all(&self.pool)).await? {
                Ok(rows) => rows,
                Err(e) if retryable(&e) => continue,
                Err(e) => return Err(map("claim", e)),
            };
            let at: HashMap<(&[u8], &[u8]), usize> = run
                .iter()
                .map(|&i| {
                    let key = &claims[i].key;
                    ((key.namespace().as_bytes(), key.id().as_bytes()), i)
                })
                .collect();
            for row in &rows {
                let get = |e: sqlx::Error| map("claim", e);
                let namespace: &[u8] = row.try_get(0).map_err(get)?;
                let id: &[u8] = row.try_get(1).map_err(get)?;
                let until: i64 = row.try_get(2).map_err(get)?;
                let Some(&i) = at.get(&(namespace, id)) else {
                    return Err(idem_core::Error::corrupt(
                        "the fresh insert returned a key that was not claimed",
                    ));
                };
                let now = inserted_at(&claims[i], until);
                answers[i] = Some(ClaimOutcome::Acquired(machine::first(&claims[i], now).0));
            }
        }
        Ok(())
    }

    /// Answers from one plain read (no lock, no transaction, the server's clock) the
    /// claims at `rest` whose answer writes nothing: a stored response, a live lease, a
    /// payload mismatch, poisoned. Each is true of the record as committed when read. A
    /// claim that would write, and every later claim of its key, is left for the
    /// transaction.
    async fn claim_read(
        &self,
        claims: &[Claim],
        rest: &[usize],
        answers: &mut [Option<ClaimOutcome>],
    ) -> Result<()> {
        let keys: Vec<_> = rest.iter().map(|&i| &claims[i].key).collect();
        let keys = distinct(&keys);
        let read = async {
            let mut conn = self.pool.acquire().await?;
            self.read(&mut conn, &keys, false).await
        };
        let snapshot = match self.timed_raw("claim", read).await? {
            Ok(snapshot) => snapshot?,
            Err(e) => return Err(map("claim", e)),
        };
        let mut blocked = HashSet::new();
        for &i in rest {
            let key = &claims[i].key;
            if blocked.contains(key) {
                continue;
            }
            match machine::claim(snapshot.get(key), &claims[i], snapshot.now) {
                (answer, None) => answers[i] = Some(answer),
                (_, Some(_)) => {
                    blocked.insert(key);
                }
            }
        }
        Ok(())
    }

    /// The claims at `rest` (positions in `claims`, in order) in one locking transaction.
    async fn claim_locked(&self, claims: &[Claim], rest: &[usize]) -> Result<Vec<ClaimOutcome>> {
        let keys: Vec<_> = rest.iter().map(|&i| &claims[i].key).collect();
        self.transact("claim", &keys, |locked| {
            let now = locked.now;
            rest.iter()
                .map(|&i| {
                    let (answer, write) =
                        machine::claim(locked.get(&claims[i].key), &claims[i], now);
                    if let Some(record) = write {
                        locked.set(record);
                    }
                    answer
                })
                .collect()
        })
        .await
    }
}

/// Claims per fresh insert (6 parameters each), a power of two: a consumer's poll batch
/// of up to 500 is one statement.
const FRESH_CHUNK: usize = 512;

/// Binds one claim's values to a fresh insert (`Tables::claim_fresh`).
fn bind_fresh<'q>(query: MyQuery<'q>, claim: &'q Claim) -> MyQuery<'q> {
    let ttl = millis(claim.lease_ttl);
    query
        .bind(claim.key.namespace().as_bytes())
        .bind(claim.key.id().as_bytes())
        .bind(claim.owner.as_bytes())
        .bind(ttl)
        .bind(claim.fingerprint.as_ref().map(|f| &f.0[..]))
        .bind(ttl.saturating_add(millis(claim.retention)))
}

/// The server's clock when `claim` was inserted with the lease deadline `until_ms`.
fn inserted_at(claim: &Claim, until_ms: i64) -> Timestamp {
    let now = until_ms.saturating_sub(millis(claim.lease_ttl));
    Timestamp::from_millis(u64::try_from(now).unwrap_or(0))
}
