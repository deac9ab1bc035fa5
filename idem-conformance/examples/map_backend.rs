//! A complete backend of its own, written against idem's public API only, proving itself
//! with the published suite: what a backend in another repository writes. The records live
//! in one `BTreeMap` under one lock, and each operation applies the state machine's
//! transition (`idem_core::backend::machine`) under it; what makes it correct is the
//! suite at the bottom of this file.
//!
//! `cargo test -p idem-conformance --example map_backend` runs every case on it. With
//! `IDEM_CONFORMANCE_BREAK=1` the backend grants every claim as if the key were new, and
//! the suite fails it, naming the invariants it breaks.

// Built as a program too (`cargo build --examples`), where only `main` is used.
#![cfg_attr(not(test), allow(dead_code))]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idem_conformance::{Factory, Fixture};
use idem_core::backend::{
    Capabilities, Claim, ClaimOutcome, Settlement, async_trait, check_response, machine,
};
use idem_core::clock::{Clock, ManualClock};
use idem_core::{Backend, Error, Key, Lease, Record, Result, Timestamp};

/// Records in a map under one lock, on an injectable clock.
#[derive(Clone)]
struct MapBackend {
    records: Arc<Mutex<BTreeMap<Key, Record>>>,
    clock: Arc<dyn Clock>,
}

impl MapBackend {
    /// An empty backend reading time from `clock`.
    fn new(clock: impl Clock) -> Self {
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
        let current = if std::env::var_os("IDEM_CONFORMANCE_BREAK").is_some() {
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

/// Makes a fresh, isolated backend for each case, on a clock the suite moves itself.
struct Map;

impl Factory for Map {
    type Backend = MapBackend;
    async fn setup(&self) -> Fixture<MapBackend> {
        let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
        Fixture::manual(MapBackend::new(clock.clone()), clock)
    }
}

// One #[tokio::test] per case.
idem_conformance::suite!(Map);

/// Run as tests, not as a program.
#[cfg(not(test))]
fn main() {
    eprintln!("the cases are tests: cargo test -p idem-conformance --example map_backend");
}
