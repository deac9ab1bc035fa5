//! PostgreSQL with `Transactional`'s default batch: one transaction per message, the mode
//! idem-kafka ran before batch transactions, kept to measure against.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Listing, OffsetPosition, Settlement,
    StoredOffset, TxFuture,
};
use idem_core::{
    Backend, FailureKind, Key, Lease, Outcome, Record, Result, Timestamp, Transactional,
};
use idem_postgres::{PgBackend, PgTransaction};

/// `PgBackend` without its batch transaction.
pub struct OnePerTx(pub PgBackend);

#[async_trait]
impl Backend for OnePerTx {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        self.0.claim(claim).await
    }
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.0.claim_many(claims).await
    }
    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
        self.0.complete(lease, response, retention).await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.0.fail(lease, error, kind, retention).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.0.release(lease).await
    }
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.0.settle_many(items, retention).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        self.0.extend(lease, ttl).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.0.get(key).await
    }
    async fn delete(&self, key: &Key) -> Result<bool> {
        self.0.delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64> {
        self.0.purge_expired().await
    }
    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        self.0.list(filter).await
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
}

#[async_trait]
impl Transactional for OnePerTx {
    type Tx = PgTransaction;

    async fn execute_in_transaction<F>(
        &self,
        claim: &Claim,
        retention: Duration,
        offset: Option<&OffsetPosition>,
        handler: F,
    ) -> Result<Outcome>
    where
        F: for<'t> FnOnce(&'t mut PgTransaction, Lease) -> TxFuture<'t> + Send,
    {
        Transactional::execute_in_transaction(&self.0, claim, retention, offset, handler).await
    }

    async fn store_offset(&self, at: &OffsetPosition) -> Result<()> {
        Transactional::store_offset(&self.0, at).await
    }

    async fn stored_offsets(&self, group: &str) -> Result<Vec<StoredOffset>> {
        Transactional::stored_offsets(&self.0, group).await
    }
}
