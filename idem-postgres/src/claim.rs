//! Claims: one statement per batch of distinct keys. A batch of keys that are mostly new
//! tries the plain insert first (`claim_fresh_many.sql`); the rest run `claim.sql`, in rounds
//! of distinct keys, and a key repeated in the batch is answered from the record the
//! statement left where it can be.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use idem_core::backend::{Claim, ClaimOutcome, machine};
use idem_core::{ClaimKind, Error, Key, Lease, Record, Result, Timestamp};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Row};

use crate::backend::{PgBackend, PgQuery, decode, millis, sized};
use crate::error::map;
use crate::sql::ClaimStmt;

impl PgBackend {
    /// One claim, if its key does not exist yet: the insert alone (`claim_fresh.sql`).
    /// `None` when the key exists.
    async fn claim_fresh(&self, stmt: &ClaimStmt, c: &Claim) -> Result<Option<ClaimOutcome>> {
        let query = bind_one(sqlx::query(stmt.fresh.sql()), c);
        let Some(row) = self
            .timed("claim", query.fetch_optional(&self.pool))
            .await?
        else {
            return Ok(None);
        };
        let until: i64 = row.try_get(0).map_err(|e| map("claim", e))?;
        Ok(Some(ClaimOutcome::Acquired(first_lease(c, until))))
    }

    /// The first round of a batch of distinct keys: the keys that do not exist yet are
    /// inserted (`claim_fresh_many.sql`) and answered; the others are `None`, for
    /// `claim.sql` to claim. Keys in `repeated` (claimed again later in the batch) also
    /// get the record the insert wrote, so that their repeats are answered from it.
    async fn claim_fresh_round(
        &self,
        stmt: &ClaimStmt,
        claims: &[&Claim],
        repeated: &HashSet<&Key>,
    ) -> Result<(Vec<Option<ClaimOutcome>>, HashMap<Key, Found>)> {
        let query = bind_many(stmt.fresh_many.sql(), claims);
        let rows = self.timed("claim", query.fetch_all(&self.pool)).await?;
        let mut out: Vec<Option<ClaimOutcome>> = vec![None; claims.len()];
        let mut found = HashMap::new();
        let at: HashMap<(&str, &str), usize> = claims
            .iter()
            .enumerate()
            .map(|(i, c)| ((c.key.namespace(), c.key.id()), i))
            .collect();
        for row in &rows {
            let get = |e: sqlx::Error| map("claim", e);
            let namespace: &str = row.try_get(0).map_err(get)?;
            let id: &str = row.try_get(1).map_err(get)?;
            let until: i64 = row.try_get(2).map_err(get)?;
            let i = *at.get(&(namespace, id)).ok_or_else(|| {
                Error::corrupt(format!("the fresh insert returned a key not claimed: {id}"))
            })?;
            if repeated.contains(&claims[i].key) {
                found.insert(claims[i].key.clone(), Found::first(claims[i], until));
            }
            out[i] = Some(ClaimOutcome::Acquired(first_lease(claims[i], until)));
        }
        Ok((out, found))
    }

    /// The answer to `claim` from its key's record as read now (`claim_read.sql`), or
    /// `None` where the claim could take the record (or found none): a claim statement
    /// must decide that.
    async fn claim_read(&self, claim: &Claim) -> Result<Option<ClaimOutcome>> {
        let query = sqlx::query(self.sql.claim_read.sql())
            .bind(claim.key.namespace())
            .bind(claim.key.id());
        let Some(row) = self
            .timed("claim", query.fetch_optional(&self.pool))
            .await?
        else {
            return Ok(None);
        };
        Ok(Found::from_row(&row, false)?.answer(claim))
    }

    /// One statement for claims of distinct keys. `None` where the key was neither written
    /// nor found (a concurrent first insert committed after this statement's snapshot), or
    /// where the database and the state machine disagreed at a millisecond boundary: the
    /// caller asks again. Also returns each found key's record as the statement left it,
    /// with the database's clock.
    async fn claim_round(
        &self,
        stmt: &ClaimStmt,
        claims: &[&Claim],
    ) -> Result<(Vec<Option<ClaimOutcome>>, HashMap<Key, Found>)> {
        let query = match claims {
            [c] => bind_one(sqlx::query(stmt.one.sql()), c),
            _ => bind_many(stmt.many.sql(), claims),
        };
        let rows = self.timed("claim", query.fetch_all(&self.pool)).await?;
        let mut found = HashMap::with_capacity(rows.len());
        for row in &rows {
            let written = row.try_get("written").map_err(|e| map("claim", e))?;
            let f = Found::from_row(row, written)?;
            found.insert(f.rec.key.clone(), f);
        }
        let mut out = Vec::with_capacity(claims.len());
        for claim in claims {
            out.push(match found.get(&claim.key) {
                None => None,
                Some(f) if f.written => Some(granted(&f.rec, &f.kind)?),
                Some(f) => f.answer(claim),
            });
        }
        Ok((out, found))
    }

    /// Claims with `stmt` (a claim statement), in rounds of distinct keys.
    pub(crate) async fn claim_with(
        &self,
        stmt: &ClaimStmt,
        claims: &[Claim],
    ) -> Result<Vec<ClaimOutcome>> {
        if let [claim] = claims {
            if let Some(lease) = self.claim_fresh(stmt, claim).await? {
                return Ok(vec![lease]);
            }
            if let Some(answer) = self.claim_read(claim).await? {
                return Ok(vec![answer]);
            }
        }
        let mut answers: Vec<Option<ClaimOutcome>> = vec![None; claims.len()];
        let mut pending: Vec<usize> = (0..claims.len()).collect();
        // A single claim tried its insert above already.
        let mut first = claims.len() > 1;
        let mut try_insert = first && self.fresh_batches.load(Ordering::Relaxed);
        for _ in 0..claims.len() + 16 {
            if pending.is_empty() {
                break;
            }
            let (round, mut rest) = distinct_round(&pending, |i| &claims[i].key);
            let batch: Vec<&Claim> = round.iter().map(|&i| &claims[i]).collect();
            // The first round inserts the keys that do not exist yet, and nothing else,
            // unless the last batch was mostly keys that exist; the rounds after it run the
            // claim statement.
            let (round_answers, found) = if std::mem::take(&mut try_insert) {
                let repeated: HashSet<&Key> = rest.iter().map(|&i| &claims[i].key).collect();
                self.claim_fresh_round(stmt, &batch, &repeated).await?
            } else {
                self.claim_round(stmt, &batch).await?
            };
            if std::mem::take(&mut first) {
                let new = round_answers
                    .iter()
                    .filter(|a| {
                        matches!(a, Some(ClaimOutcome::Acquired(l)) if l.kind == ClaimKind::First)
                    })
                    .count();
                self.fresh_batches
                    .store(2 * new >= batch.len(), Ordering::Relaxed);
            }
            for (i, answer) in round.into_iter().zip(round_answers) {
                match answer {
                    Some(answer) => answers[i] = Some(answer),
                    None => rest.push(i),
                }
            }
            rest.sort_unstable();
            // A repeated key whose record this round left unclaimable to it (a lease just
            // granted, a stored response) gets the answer a claim made next would get, with
            // no statement; one it could claim waits for the next round, with every later
            // repetition of its key.
            let mut blocked = HashSet::new();
            rest.retain(|&i| {
                let c = &claims[i];
                let answer = match found.get(&c.key) {
                    Some(f) if !blocked.contains(&c.key) => f.answer(c),
                    _ => None,
                };
                if answer.is_none() {
                    blocked.insert(&c.key);
                }
                answers[i] = answer;
                answers[i].is_none()
            });
            pending = rest;
        }
        answers
            .into_iter()
            .map(|a| {
                a.ok_or_else(|| Error::Unavailable {
                    message: "claim kept racing with concurrent first inserts; retry".into(),
                    source: None,
                })
            })
            .collect()
    }
}

/// A record a claim statement returned: as the statement left it, whether the statement
/// wrote it, how it was granted, and the database's clock.
struct Found {
    rec: Record,
    written: bool,
    kind: String,
    now: Timestamp,
}

impl Found {
    /// A row of record columns with the database's clock (`now_ms`).
    fn from_row(row: &PgRow, written: bool) -> Result<Found> {
        let rec = decode(row)?;
        let now: i64 = row.try_get("now_ms").map_err(|e| map("claim", e))?;
        let kind = row.try_get("claim_kind").map_err(|e| map("claim", e))?;
        let now = Timestamp::from_millis(u64::try_from(now).unwrap_or(0));
        Ok(Found {
            rec,
            written,
            kind,
            now,
        })
    }

    /// The record a first claim (`claim_fresh_many.sql`) wrote for `claim`, given the
    /// deadline the database gave its lease.
    fn first(claim: &Claim, until_ms: i64) -> Found {
        let now = inserted_at(claim, until_ms);
        Found {
            rec: machine::first(claim, now).1,
            written: true,
            kind: "first".to_owned(),
            now,
        }
    }

    /// The answer `claim` gets from this record without writing, or `None` where the
    /// claim writes (it takes the record, or turns a lapsed lease with no attempts left
    /// failed): a statement must do that.
    fn answer(&self, claim: &Claim) -> Option<ClaimOutcome> {
        match machine::claim(Some(&self.rec), claim, self.now) {
            (answer, None) => Some(answer),
            (_, Some(_)) => None,
        }
    }
}

/// Splits `pending` into the first occurrence of each key, in order, and the rest, in
/// order.
pub(crate) fn distinct_round<'k>(
    pending: &[usize],
    key: impl Fn(usize) -> &'k Key,
) -> (Vec<usize>, Vec<usize>) {
    let mut seen: HashSet<&Key, foldhash::fast::FixedState> =
        HashSet::with_capacity_and_hasher(pending.len(), Default::default());
    pending.iter().copied().partition(|&i| seen.insert(key(i)))
}

/// The parameters of one claim, `$1` to `$7` of `claim_fresh.sql` and of `claim.sql`'s
/// single input.
fn bind_one<'q>(query: PgQuery<'q>, c: &'q Claim) -> PgQuery<'q> {
    query
        .bind(c.key.namespace())
        .bind(c.key.id())
        .bind(&*c.owner)
        .bind(millis(c.lease_ttl))
        .bind(c.fingerprint.map(|f| f.0.to_vec()))
        .bind(i32::try_from(c.max_attempts).unwrap_or(i32::MAX))
        .bind(millis(c.retention))
}

/// The parameters of a batch of claims as arrays, one element per claim: `$1` to `$7` of
/// `claim_fresh_many.sql` and of `claim.sql`'s batch input.
fn bind_many<'q>(sql: AssertSqlSafe<Arc<str>>, claims: &[&'q Claim]) -> PgQuery<'q> {
    let text: usize = claims
        .iter()
        .map(|c| c.key.namespace().len() + c.key.id().len() + c.owner.len())
        .sum();
    let query = sized(sql, 7, text + 96 * claims.len());
    let mut ns = Vec::with_capacity(claims.len());
    let (mut ids, mut owners, mut ttls) = (Vec::new(), Vec::new(), Vec::new());
    let (mut fps, mut maxes, mut retentions) = (Vec::new(), Vec::new(), Vec::new());
    for c in claims {
        ns.push(c.key.namespace());
        ids.push(c.key.id());
        owners.push(&*c.owner);
        ttls.push(millis(c.lease_ttl));
        fps.push(c.fingerprint.as_ref().map(|f| &f.0[..]));
        maxes.push(i32::try_from(c.max_attempts).unwrap_or(i32::MAX));
        retentions.push(millis(c.retention));
    }
    query
        .bind(ns)
        .bind(ids)
        .bind(owners)
        .bind(ttls)
        .bind(fps)
        .bind(maxes)
        .bind(retentions)
}

/// The lease of a first claim of `c` (token 1, attempt 1), lasting until `until_ms`.
fn first_lease(c: &Claim, until_ms: i64) -> Lease {
    machine::first(c, inserted_at(c, until_ms)).0
}

/// The database's clock when it inserted the first record of `c`, whose lease it gave
/// deadline `until_ms`: the deadline less the lease's length.
fn inserted_at(c: &Claim, until_ms: i64) -> Timestamp {
    let until = u64::try_from(until_ms).unwrap_or(0);
    Timestamp::from_millis(until.saturating_sub(u64::try_from(millis(c.lease_ttl)).unwrap_or(0)))
}

/// The answer for a row the claim statement wrote.
fn granted(rec: &Record, kind: &str) -> Result<ClaimOutcome> {
    let kind = match kind {
        "first" => ClaimKind::First,
        "retry" => ClaimKind::Retry,
        "takeover" => ClaimKind::Takeover,
        "poisoned" => {
            return Ok(ClaimOutcome::Poisoned {
                attempts: rec.attempts,
                error: rec.error.clone().unwrap_or_default(),
            });
        }
        other => {
            return Err(Error::corrupt(format!(
                "claim_kind {other:?} of {}",
                rec.key
            )));
        }
    };
    let lease_until = rec
        .lease_until
        .ok_or_else(|| Error::corrupt(format!("claimed {} has no lease_until", rec.key)))?;
    Ok(ClaimOutcome::Acquired(Lease {
        key: rec.key.clone(),
        owner: rec.owner.clone(),
        token: rec.token,
        attempts: rec.attempts,
        lease_until,
        kind,
        fingerprint: rec.fingerprint,
    }))
}
