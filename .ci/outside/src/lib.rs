//! A backend of this crate's own, written against idem's public API only: the records in
//! one `BTreeMap` under one lock, each operation the state machine's transition
//! (`idem_once::backend::machine`) applied under it. Small on purpose; what makes it
//! correct is the published conformance suite (`tests/conformance.rs`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idem_once::clock::Clock;
use idem_once::backend::{
    Capabilities, Claim, ClaimOutcome, Settlement, async_trait, check_response, machine,
};
use idem_once::{Backend, Error, Key, Lease, Record, Result, Timestamp};

/// Records in a map under one lock, on an injectable clock.
#[derive(Clone)]
pub struct MapBackend {
    records: Arc<Mutex<BTreeMap<Key, Record>>>,
    clock: Arc<dyn Clock>,
}

impl MapBackend {
    /// An empty backend reading time from `clock`.
    pub fn new(clock: impl Clock) -> Self {
        MapBackend {
            records: Arc::default(),
            clock: Arc::new(clock),
        }
    }

    fn records(&self) -> MutexGuard<'_, BTreeMap<Key, Record>> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies a fenced transition to the lease's record: `Fenced` if it refuses.
    fn update(
        &self,
        lease: &Lease,
        step: impl FnOnce(Option<&Record>, Timestamp) -> Option<Record>,
    ) -> Result<Option<Timestamp>> {
        let now = self.clock.now();
        let mut records = self.records();
        let fenced = || Error::fenced(lease);
        let next = step(records.get(&lease.key), now).ok_or_else(fenced)?;
        let until = next.lease_until;
        records.insert(lease.key.clone(), next);
        Ok(until)
    }
}

#[async_trait]
impl Backend for MapBackend {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        let now = self.clock.now();
        let mut records = self.records();
        let current = if cfg!(feature = "broken") {
            None // the defect: every claim is granted as if the key were new
        } else {
            records.get(&claim.key)
        };
        let (answer, next) = machine::claim(current, claim, now);
        if let Some(next) = next {
            records.insert(claim.key.clone(), next);
        }
        Ok(answer)
    }

    /// In turn, as separate claims would.
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        let mut out = Vec::with_capacity(claims.len());
        for claim in claims {
            out.push(self.claim(claim).await?);
        }
        Ok(out)
    }

    /// In turn, as separate settles would: the response checked first, then the
    /// state machine's transition.
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let limit = self.capabilities().max_response_bytes;
        Ok(items
            .iter()
            .map(|item| {
                check_response(&item.settle, limit)?;
                self.update(&item.lease, |cur, now| {
                    machine::settle(cur, &item.lease, &item.settle, retention, now)
                })
                .map(drop)
            })
            .collect())
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        let until = self.update(lease, |cur, now| machine::extend(cur, lease, ttl, now))?;
        Ok(until.unwrap_or_default())
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let now = self.clock.now();
        Ok(self
            .records()
            .get(key)
            .filter(|r| machine::is_live(r, now))
            .cloned())
    }

    async fn delete(&self, key: &Key) -> Result<bool> {
        let now = self.clock.now();
        let removed = self.records().remove(key);
        Ok(removed.is_some_and(|r| machine::is_live(&r, now)))
    }

    async fn purge_expired(&self) -> Result<u64> {
        let now = self.clock.now();
        let mut records = self.records();
        let before = records.len();
        records.retain(|_, r| machine::is_live(r, now));
        Ok((before - records.len()) as u64)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
}
