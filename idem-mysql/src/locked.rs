//! The one write path: lock the records of a batch's keys (`SELECT … FOR UPDATE`, which
//! also reads the server's clock), apply idem's state machine
//! (`idem_core::backend::machine`) to them in order, and write back the records it changed,
//! in one InnoDB transaction. MySQL has no `UPDATE … RETURNING`, so the answers are
//! decided here, under the row locks, rather than by the statement; the clock that decides
//! is still the server's (`NOW(6)`, read by the locking statement).

use std::collections::HashMap;
use std::time::Duration;

use idem_core::{Error, Key, Record, Result, Timestamp};
use sqlx::mysql::MySqlArguments;
use sqlx::{AssertSqlSafe, MySql, MySqlConnection, Row};

use crate::backend::MySqlBackend;
use crate::error::{map, retryable};
use crate::row::decode;

/// A statement with its arguments.
pub(crate) type MyQuery<'q> = sqlx::query::Query<'q, MySql, MySqlArguments>;

/// How often a transaction that met a deadlock or a concurrent first insert runs again
/// before the call answers `Unavailable`.
const TRIES: u32 = 64;
/// Keys per lock statement (2 parameters each, well under MySQL's 65,535), a power of two.
const LOCK_CHUNK: usize = 2048;
/// Rows per write statement (12 parameters each), a power of two.
const WRITE_CHUNK: usize = 256;

// Statement sizes. sqlx keeps a connection's prepared statements in a cache of 100, by
// text, and a multi-row statement's text changes with its row count: with a size per batch
// length, the cache churned, and an evicted statement's close (a packet with no answer)
// went out just before the next prepare. sqlx 0.9.0 leaves Nagle's algorithm on
// (launchbadge/sqlx#4335), so that prepare waited for the server's delayed ACK: 40 ms a
// statement. Measured in the Kafka loop bench, once the cache was full: 1.4k msg/s against
// 27-35k. So a lock statement is padded to a power of two (a key repeated in `IN` changes
// nothing), and writes are cut into power-of-two runs: at most 12 + 2 × 9 texts.

/// `items` cut into runs whose lengths are powers of two, at most `max`, longest first.
fn power_of_two_runs<T>(items: &[T], max: usize) -> impl Iterator<Item = &[T]> {
    let mut rest = items;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let n = 1 << rest.len().min(max).ilog2();
        let (run, after) = rest.split_at(n);
        rest = after;
        Some(run)
    })
}

/// The records of a batch's keys, locked by the open transaction, and the server's clock.
pub(crate) struct Locked {
    /// The server's clock when the records were locked.
    pub now: Timestamp,
    slots: HashMap<Key, Slot>,
}

struct Slot {
    /// A row exists (live or expired): a write updates it; otherwise it inserts one.
    exists: bool,
    record: Option<Record>,
    dirty: bool,
}

impl Locked {
    /// The record of `key` as the batch has left it so far (`None`: no row; an expired row
    /// is given as it is, and the state machine treats it as absent).
    pub fn get(&self, key: &Key) -> Option<&Record> {
        self.slots.get(key).and_then(|s| s.record.as_ref())
    }

    /// Replaces the record of its key, to be written at the end of the transaction.
    pub fn set(&mut self, record: Record) {
        let slot = self.slots.entry(record.key.clone()).or_insert(Slot {
            exists: false,
            record: None,
            dirty: false,
        });
        slot.record = Some(record);
        slot.dirty = true;
    }
}

impl MySqlBackend {
    /// Runs `apply` over the locked records of `keys` in a transaction of its own, writes
    /// what it changed and commits; runs it all again after a deadlock or a concurrent
    /// first insert of one of the keys. The whole call is bounded by the query timeout.
    pub(crate) async fn transact<T, F>(&self, what: &str, keys: &[&Key], mut apply: F) -> Result<T>
    where
        F: FnMut(&mut Locked) -> T + Send,
        T: Send,
    {
        let keys = distinct(keys);
        let run = async {
            let mut tries = 0;
            loop {
                tries += 1;
                let mut tx = self.pool.begin().await.map_err(|e| map(what, e))?;
                match self.lock_apply_write(&mut tx, &keys, &mut apply).await {
                    Ok(Ok(answer)) => {
                        tx.commit().await.map_err(|e| map(what, e))?;
                        return Ok(answer);
                    }
                    Ok(Err(e)) => {
                        let _ = tx.rollback().await;
                        return Err(e);
                    }
                    Err(e) if retryable(&e) && tries < TRIES => {
                        let _ = tx.rollback().await;
                        let pause = fastrand::u64(0..=u64::from(tries.min(10)));
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                    }
                    Err(e) => {
                        let _ = tx.rollback().await;
                        return Err(map(what, e));
                    }
                }
            }
        };
        idem_core::layer::within(what, self.timeout, Box::pin(run)).await
    }

    /// Inside an open transaction: locks and reads `keys`, applies `apply`, writes what it
    /// changed. A server error is the outer `Err` (the caller may run it all again); a
    /// record that does not decode is the inner one.
    pub(crate) async fn lock_apply_write<T, F>(
        &self,
        conn: &mut MySqlConnection,
        keys: &[&Key],
        apply: &mut F,
    ) -> std::result::Result<Result<T>, sqlx::Error>
    where
        F: FnMut(&mut Locked) -> T + Send,
    {
        let mut locked = match self.lock(conn, keys).await? {
            Ok(locked) => locked,
            Err(e) => return Ok(Err(e)),
        };
        let answer = apply(&mut locked);
        if let Err(e) = self.write(conn, &locked).await? {
            return Ok(Err(e));
        }
        Ok(Ok(answer))
    }

    /// Locks and reads the records of `keys` (distinct), with the server's clock.
    pub(crate) async fn lock(
        &self,
        conn: &mut MySqlConnection,
        keys: &[&Key],
    ) -> std::result::Result<Result<Locked>, sqlx::Error> {
        self.read(conn, keys, true).await
    }

    /// Reads the records of `keys` (distinct), with the server's clock, locking them
    /// where `for_update` (otherwise the result is a snapshot, not to be written back).
    pub(crate) async fn read(
        &self,
        conn: &mut MySqlConnection,
        keys: &[&Key],
        for_update: bool,
    ) -> std::result::Result<Result<Locked>, sqlx::Error> {
        let mut slots = HashMap::with_capacity(keys.len());
        let mut now = None;
        for chunk in keys.chunks(LOCK_CHUNK) {
            let padded = chunk.len().next_power_of_two();
            let sql = if for_update {
                self.tables.lock(padded)
            } else {
                self.tables.read(padded)
            };
            let mut query = sqlx::query(AssertSqlSafe(sql));
            let last = chunk[chunk.len() - 1];
            for key in chunk
                .iter()
                .chain(std::iter::repeat_n(&last, padded - chunk.len()))
            {
                query = query
                    .bind(key.namespace().as_bytes())
                    .bind(key.id().as_bytes());
            }
            let rows = query.fetch_all(&mut *conn).await?;
            for row in &rows {
                let ms: i64 = row.try_get("now_ms")?;
                now = Some(Timestamp::from_millis(u64::try_from(ms).unwrap_or(0)));
                let present: Option<Vec<u8>> = row.try_get("namespace")?;
                if present.is_none() {
                    continue;
                }
                let record = match decode(row) {
                    Ok(record) => record,
                    Err(e) => return Ok(Err(e)),
                };
                let slot = Slot {
                    exists: true,
                    record: Some(record.clone()),
                    dirty: false,
                };
                slots.insert(record.key, slot);
            }
        }
        let Some(now) = now else {
            return Ok(Err(Error::corrupt("the lock statement returned no clock")));
        };
        for key in keys {
            slots.entry((*key).clone()).or_insert(Slot {
                exists: false,
                record: None,
                dirty: false,
            });
        }
        Ok(Ok(Locked { now, slots }))
    }

    /// Writes the records `locked` changed: one insert for keys with no row (a concurrent
    /// first insert makes it fail with `ER_DUP_ENTRY`, and the caller runs again), one
    /// upsert for rows this transaction holds locked.
    async fn write(
        &self,
        conn: &mut MySqlConnection,
        locked: &Locked,
    ) -> std::result::Result<Result<()>, sqlx::Error> {
        let mut fresh = Vec::new();
        let mut held = Vec::new();
        for slot in locked.slots.values().filter(|s| s.dirty) {
            if let Some(record) = &slot.record {
                if let Err(e) = checked(record) {
                    return Ok(Err(e));
                }
                if slot.exists {
                    held.push(record);
                } else {
                    fresh.push(record);
                }
            }
        }
        for chunk in power_of_two_runs(&fresh, WRITE_CHUNK) {
            let query = bind_records(self.tables.insert(chunk.len()), chunk);
            query.execute(&mut *conn).await?;
        }
        for chunk in power_of_two_runs(&held, WRITE_CHUNK) {
            let query = bind_records(self.tables.upsert(chunk.len()), chunk);
            query.execute(&mut *conn).await?;
        }
        Ok(Ok(()))
    }
}

/// `keys` without repeats, in their first order.
pub(crate) fn distinct<'k>(keys: &[&'k Key]) -> Vec<&'k Key> {
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    keys.iter().copied().filter(|k| seen.insert(*k)).collect()
}

/// A record's numbers as the columns hold them: a token past `i64::MAX` cannot be stored.
fn checked(record: &Record) -> Result<()> {
    if i64::try_from(record.token).is_err() {
        return Err(Error::corrupt(format!(
            "token of {} is past the largest a record can hold",
            record.key
        )));
    }
    Ok(())
}

/// `d` capped as every store caps durations ([`idem_core::backend::millis`]), so that
/// every path stores the deadline its lease names and no sum on the server overflows.
pub(crate) fn capped(d: Duration) -> Duration {
    Duration::from_millis(idem_core::backend::millis(d))
}

/// A duration in whole milliseconds, as the columns hold them (at most
/// [`idem_core::backend::MAX_MILLIS`]).
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(idem_core::backend::millis(d)).unwrap_or(i64::MAX)
}

fn ms(t: Option<Timestamp>) -> Option<i64> {
    t.map(|t| i64::try_from(t.as_millis()).unwrap_or(i64::MAX))
}

/// `sql` (an insert of `records.len()` rows) with every record's columns bound.
fn bind_records<'q>(sql: String, records: &[&'q Record]) -> MyQuery<'q> {
    let mut query = sqlx::query(AssertSqlSafe(sql));
    for r in records {
        query = query
            .bind(r.key.namespace().as_bytes())
            .bind(r.key.id().as_bytes())
            .bind(r.state.as_str())
            .bind(r.owner.as_bytes())
            .bind(i64::try_from(r.token).unwrap_or(i64::MAX))
            .bind(i64::from(r.attempts))
            .bind(ms(r.lease_until))
            .bind(r.fingerprint.as_ref().map(|f| &f.0[..]))
            .bind(r.response.as_deref())
            .bind(r.error.as_deref().map(str::as_bytes))
            .bind(r.permanent)
            .bind(ms(r.expires_at));
    }
    query
}

#[cfg(test)]
mod tests {
    use super::power_of_two_runs;

    #[test]
    fn runs_are_powers_of_two_and_cover_everything_in_order() {
        for n in [0usize, 1, 3, 255, 256, 300, 500, 1000] {
            let items: Vec<usize> = (0..n).collect();
            let runs: Vec<&[usize]> = power_of_two_runs(&items, 256).collect();
            assert!(
                runs.iter()
                    .all(|r| r.len().is_power_of_two() && r.len() <= 256)
            );
            assert_eq!(runs.concat(), items, "n = {n}");
        }
        let lens: Vec<usize> = power_of_two_runs(&[0u8; 300], 256)
            .map(<[u8]>::len)
            .collect();
        assert_eq!(lens, [256, 32, 8, 4]);
    }
}
