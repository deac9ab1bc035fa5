//! Transactional mode: the handler's writes, the `Completed` record and the Kafka offset
//! commit in one InnoDB transaction. The claim commits first, on its own (so an attempt
//! counts even when what follows rolls back); the record is locked again in the handler's
//! transaction when it completes, and its token checked under that lock, so a worker whose
//! lease was taken over meanwhile is `Fenced` and rolls back. In batch mode a poll batch's
//! claims commit in one transaction, then its handlers, completes, failures and offset
//! commit in one: first with no savepoints, and after a handler failure once more with a
//! savepoint per handler.

use std::time::Duration;

use idem_core::backend::tx::{self, Savepoint, TxStore};
use idem_core::backend::{Claim, OffsetPosition, Settlement, StoredOffset, TxFuture, machine};
use idem_core::{Lease, Offsets, Outcome, Result, Transactional};
use sqlx::{AssertSqlSafe, MySql, Row};

use crate::backend::MySqlBackend;
use crate::error::map;
use crate::settle::settle_locked;

/// The open transaction a transactional handler writes through.
pub type MySqlTransaction = sqlx::Transaction<'static, MySql>;

impl MySqlBackend {
    fn offset_query<'q>(
        &self,
        at: &'q OffsetPosition,
    ) -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments> {
        sqlx::query(AssertSqlSafe(self.tables.store_offset()))
            .bind(at.group.as_str())
            .bind(at.topic.as_str())
            .bind(at.partition)
            .bind(at.offset.saturating_add(1))
    }
}

/// Transactional mode's steps on MySQL; `idem_core::backend::tx` runs them. The claims
/// are `claim_many`'s own transaction (the default `claim_for_tx`), and a single message
/// completes through `settle_in` (the default `complete_in`).
#[async_trait::async_trait]
impl TxStore for MySqlBackend {
    async fn begin(&self) -> Result<MySqlTransaction> {
        self.timed("begin", self.pool.begin()).await
    }

    /// One `SELECT … FOR UPDATE` of the batch's records: a lease that no longer holds its
    /// record (by the server's clock, read by the same statement) is not held.
    async fn begin_locked(
        &self,
        leases: &[Lease],
        _savepoints: bool,
    ) -> Result<(MySqlTransaction, Vec<bool>)> {
        let mut tx = self.timed("begin", self.pool.begin()).await?;
        let keys: Vec<_> = leases.iter().map(|l| &l.key).collect();
        let locked = self
            .timed("lock batch", self.lock(&mut tx, &keys))
            .await??;
        let held = leases
            .iter()
            .map(|lease| machine::holds(locked.get(&lease.key), lease, locked.now))
            .collect();
        Ok((tx, held))
    }

    /// `SAVEPOINT idem_item` before every handler (a savepoint of the same name replaces
    /// the last one).
    async fn savepoint(&self, tx: &mut MySqlTransaction, _at: Savepoint) -> Result<()> {
        let set = sqlx::raw_sql("SAVEPOINT idem_item").execute(&mut **tx);
        self.timed("savepoint", set).await?;
        Ok(())
    }

    async fn rollback_to_savepoint(&self, tx: &mut MySqlTransaction) -> Result<()> {
        let back = sqlx::raw_sql("ROLLBACK TO SAVEPOINT idem_item").execute(&mut **tx);
        self.timed("rollback", back).await?;
        Ok(())
    }

    /// Inside `tx`: settles `items` (distinct keys) against their records, locked now,
    /// and stores `at`. How many items were not fenced.
    async fn settle_in(
        &self,
        tx: &mut MySqlTransaction,
        items: &[Settlement],
        retention: Duration,
        at: Option<&OffsetPosition>,
    ) -> Result<usize> {
        let what = "settle in transaction";
        let retention = crate::locked::capped(retention);
        let conn = &mut **tx;
        let keys: Vec<_> = items.iter().map(|i| &i.lease.key).collect();
        let work = async {
            let settled = self
                .lock_apply_write(conn, &keys, &mut |locked| {
                    items
                        .iter()
                        .filter(|item| settle_locked(locked, item, retention).is_ok())
                        .count()
                })
                .await
                .map_err(|e| map(what, e))??;
            if let Some(at) = at {
                self.offset_query(at)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| map(what, e))?;
            }
            Ok(settled)
        };
        idem_core::layer::within(what, self.timeout, Box::pin(work)).await
    }

    async fn commit(&self, tx: MySqlTransaction) -> Result<()> {
        self.timed("commit", tx.commit()).await
    }

    async fn rollback(&self, tx: MySqlTransaction) -> Result<()> {
        self.timed("rollback", tx.rollback()).await
    }
}

#[async_trait::async_trait]
impl Transactional for MySqlBackend {
    type Tx = MySqlTransaction;

    /// Runs `handler` exactly once for `claim.key` as far as the database is concerned.
    ///
    /// 1. The claim runs in its own transaction and commits, so the attempt counts even
    ///    if what follows rolls back. A key that is not claimable answers at once.
    /// 2. A transaction opens; `handler` gets it and the lease, and writes through it.
    /// 3. In the same transaction the record is locked (`SELECT … FOR UPDATE`), its token
    ///    checked, and it becomes `Completed`; if `offset` is given, the group's next
    ///    offset is stored. Then COMMIT.
    ///
    /// A handler error or panic rolls everything back, then `fail` records the attempt in a
    /// transaction of its own. Dropping the future rolls back too. A replayed duplicate
    /// with `offset` given stores that offset.
    async fn execute_in_transaction<F>(
        &self,
        claim: &Claim,
        retention: Duration,
        offset: Option<&OffsetPosition>,
        handler: F,
    ) -> Result<Outcome>
    where
        F: for<'t> FnOnce(&'t mut MySqlTransaction, Lease) -> TxFuture<'t> + Send,
    {
        tx::execute(self, claim, retention, offset, handler).await
    }

    /// On MySQL: the claims in one transaction, then one transaction of
    ///
    /// 1. one `SELECT … FOR UPDATE` of the batch's records: a lease that no longer holds
    ///    its record is `Fenced` (its handler does not run); a held one cannot be taken
    ///    over until the transaction ends;
    /// 2. each held lease's handler, with no savepoints; if one fails, the transaction
    ///    rolls back and the batch runs again in a new one, each handler under
    ///    `SAVEPOINT idem_item` (one round trip per handler), a failure rolling back to it;
    /// 3. one write of the completes and failures, and the offset `offset` chose; then
    ///    COMMIT.
    async fn execute_batch_in_transaction<H, O>(
        &self,
        claims: &[Claim],
        retention: Duration,
        handler: H,
        offset: O,
    ) -> Result<Vec<Outcome>>
    where
        H: for<'t> FnMut(&'t mut MySqlTransaction, usize, Lease) -> TxFuture<'t> + Send,
        O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
    {
        tx::execute_batch(self, claims, retention, handler, offset).await
    }

    /// Stores `offset + 1` as the group's next offset for the partition, on its own.
    async fn store_offset(&self, at: &OffsetPosition) -> Result<()> {
        let query = self.offset_query(at);
        self.timed("store offset", query.execute(&self.pool))
            .await?;
        Ok(())
    }

    /// The next offsets stored for `group`, by topic and partition.
    async fn stored_offsets(&self, group: &str) -> Result<Vec<StoredOffset>> {
        let query = sqlx::query(AssertSqlSafe(self.tables.offsets())).bind(group);
        let rows = self
            .timed("read offsets", query.fetch_all(&self.pool))
            .await?;
        let get = |e| map("read offsets", e);
        rows.iter()
            .map(|row| {
                Ok(StoredOffset {
                    topic: row.try_get("topic").map_err(get)?,
                    partition: row.try_get("kafka_partition").map_err(get)?,
                    next_offset: row.try_get("next_offset").map_err(get)?,
                })
            })
            .collect()
    }
}

/// What `idem offsets` reads and moves: the `idem_offsets` rows of a group.
#[async_trait::async_trait]
impl Offsets for MySqlBackend {
    async fn offsets(&self, group: &str) -> Result<Vec<StoredOffset>> {
        self.stored_offsets(group).await
    }

    async fn set_offset(&self, group: &str, to: &StoredOffset) -> Result<()> {
        self.store_offset(&OffsetPosition::before(group, to)).await
    }

    async fn delete_offsets(
        &self,
        group: &str,
        topic: Option<&str>,
        partition: Option<i32>,
    ) -> Result<u64> {
        let query = sqlx::query(AssertSqlSafe(self.tables.delete_offsets()))
            .bind(group)
            .bind(topic)
            .bind(topic)
            .bind(partition)
            .bind(partition);
        let done = self
            .timed("delete offsets", query.execute(&self.pool))
            .await?;
        Ok(done.rows_affected())
    }
}
