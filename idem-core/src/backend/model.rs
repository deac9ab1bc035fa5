//! The reference model: the state machine over one ordered map and a manual clock, with no
//! concurrency at all. The conformance suite replays operation sequences against it and
//! against a backend and requires the same answers.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use crate::backend::{Claim, ClaimOutcome, machine};
use crate::{FailureKind, Key, Lease, Record, Timestamp};

/// A single-threaded, obviously-correct store of records.
#[derive(Debug, Clone, Default)]
pub struct Model {
    records: BTreeMap<Key, Record>,
    now: Timestamp,
}

impl Model {
    /// An empty model whose clock reads `now`.
    pub fn new(now: Timestamp) -> Self {
        Model {
            records: BTreeMap::new(),
            now,
        }
    }

    /// Moves the model's clock forward.
    pub fn advance(&mut self, d: Duration) {
        self.now = self.now.saturating_add(d);
    }

    /// The model's clock.
    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// [`Backend::claim`](crate::Backend::claim).
    pub fn claim(&mut self, claim: &Claim) -> ClaimOutcome {
        let (answer, next) = machine::claim(self.records.get(&claim.key), claim, self.now);
        if let Some(next) = next {
            self.records.insert(claim.key.clone(), next);
        }
        answer
    }

    /// [`Backend::complete`](crate::Backend::complete); `false` when fenced.
    pub fn complete(&mut self, lease: &Lease, response: Bytes, retention: Duration) -> bool {
        let next = machine::complete(
            self.records.get(&lease.key),
            lease,
            response,
            retention,
            self.now,
        );
        self.put(next)
    }

    /// [`Backend::fail`](crate::Backend::fail); `false` when fenced.
    pub fn fail(
        &mut self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> bool {
        let cur = self.records.get(&lease.key);
        let next = machine::fail(cur, lease, error, kind, retention, self.now);
        self.put(next)
    }

    /// [`Backend::release`](crate::Backend::release); `false` when fenced.
    pub fn release(&mut self, lease: &Lease) -> bool {
        let next = machine::release(self.records.get(&lease.key), lease, self.now);
        self.put(next)
    }

    /// One item of [`Backend::settle_many`](crate::Backend::settle_many); `false` when
    /// fenced.
    pub fn settle(&mut self, item: &crate::backend::Settlement, retention: Duration) -> bool {
        let cur = self.records.get(&item.lease.key);
        let next = machine::settle(cur, &item.lease, &item.settle, retention, self.now);
        self.put(next)
    }

    /// [`Backend::extend`](crate::Backend::extend); `false` when fenced.
    pub fn extend(&mut self, lease: &Lease, ttl: Duration) -> bool {
        let next = machine::extend(self.records.get(&lease.key), lease, ttl, self.now);
        self.put(next)
    }

    /// [`Backend::get`](crate::Backend::get).
    pub fn get(&self, key: &Key) -> Option<&Record> {
        self.records
            .get(key)
            .filter(|r| machine::is_live(r, self.now))
    }

    /// [`Backend::delete`](crate::Backend::delete).
    pub fn delete(&mut self, key: &Key) -> bool {
        let now = self.now;
        self.records
            .remove(key)
            .is_some_and(|r| machine::is_live(&r, now))
    }

    fn put(&mut self, next: Option<Record>) -> bool {
        match next {
            Some(rec) => {
                self.records.insert(rec.key.clone(), rec);
                true
            }
            None => false,
        }
    }
}
