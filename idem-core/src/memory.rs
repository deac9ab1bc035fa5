//! The in-memory backend: the reference model of CONTRACT.md behind a sharded map, safe
//! under real concurrency, and the embedded default.

use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::backend::watch::{self, Watch, Watchers};
use crate::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Listing, Settlement, check_response, machine,
};
use crate::clock::{Clock, SystemClock};
use crate::{Backend, Error, Key, Lease, Record, Result, Timestamp};

/// A fast, randomly seeded hash: keys come from outside, so the seed guards against
/// collision floods, and SipHash's extra strength costs more than the rest of a claim.
type Hasher = foldhash::fast::RandomState;

/// One shard: its records, each boxed and found by the key it holds.
type Shard = Mutex<HashTable<Slot>>;

/// A record and its key's hash. A slot is 16 bytes, so the table stays small, and growing
/// it moves 16 bytes a record and reads no record (inline, a record is about 190 bytes,
/// and a map keyed by a copy of the key held the key twice).
#[derive(Debug)]
struct Slot {
    hash: u64,
    record: Box<Record>,
}

impl Slot {
    fn holds(&self, hash: u64, key: &Key) -> bool {
        self.hash == hash && self.record.key == *key
    }
}

/// Records in process memory, lost when the process ends.
///
/// Every operation runs [`machine`](crate::backend::machine)'s transition under the lock of the
/// key's shard, so it is atomic. Time comes from an injectable [`Clock`].
#[derive(Debug, Clone)]
pub struct MemoryBackend {
    shards: Arc<[Shard]>,
    hasher: Hasher,
    clock: Arc<dyn Clock>,
    max_response_bytes: usize,
    /// Waiters on keys, woken by every settle and delete.
    watchers: Arc<Watchers>,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// How many shards the records are spread over (by key hash), each under its own lock.
    pub(crate) const SHARDS: usize = 64;

    /// An empty backend on the system clock, with 64 shards.
    pub fn new() -> Self {
        Self::with_clock(SystemClock)
    }

    /// An empty backend reading time from `clock`.
    pub fn with_clock(clock: impl Clock) -> Self {
        let hasher = Hasher::default();
        let shards: Vec<Shard> = (0..Self::SHARDS)
            .map(|_| Mutex::new(HashTable::new()))
            .collect();
        MemoryBackend {
            shards: shards.into(),
            hasher,
            clock: Arc::new(clock),
            max_response_bytes: Capabilities::default().max_response_bytes,
            watchers: Watchers::new(),
        }
    }

    /// Sets the largest response `complete` accepts (default 64 KiB).
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// How many live records there are.
    pub fn len(&self) -> usize {
        let now = self.clock.now();
        self.shards
            .iter()
            .map(|s| {
                let shard = lock(s);
                shard
                    .iter()
                    .filter(|s| machine::is_live(&s.record, now))
                    .count()
            })
            .sum()
    }

    /// Whether there are no live records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shard of `key` and the key's hash. The shard is picked by bits 32 and up of the
    /// hash, as its table places a key by the low bits (and tags it by the top seven):
    /// picked by the low bits, every key of a shard would have the same low six bits and
    /// start its probe in one 64th of the slots.
    fn shard(&self, key: &Key) -> (MutexGuard<'_, HashTable<Slot>>, u64) {
        let hash = self.hasher.hash_one(key);
        let i = (hash >> 32) as usize % self.shards.len();
        (lock(&self.shards[i]), hash)
    }

    /// The record of `key` in its shard, to read or change under the shard's lock.
    fn with_record<T>(&self, key: &Key, f: impl FnOnce(Option<&mut Record>) -> T) -> T {
        let (mut shard, hash) = self.shard(key);
        f(shard
            .find_mut(hash, |s| s.holds(hash, key))
            .map(|s| &mut *s.record))
    }

    /// Applies a fencing transition in place and returns the new lease deadline, if any;
    /// `Fenced` if the transition refuses.
    fn update(
        &self,
        lease: &Lease,
        step: impl FnOnce(Option<&Record>, Timestamp) -> Option<Record>,
    ) -> Result<Option<Timestamp>> {
        let now = self.clock.now();
        let fenced = || Error::fenced(lease);
        // `holds` already requires a record, so a fenced step never needs an insert.
        self.with_record(&lease.key, |slot| {
            let slot = slot.ok_or_else(fenced)?;
            *slot = step(Some(slot), now).ok_or_else(fenced)?;
            Ok(slot.lease_until)
        })
    }

    fn wake(&self, key: &Key) {
        if !self.watchers.is_idle() {
            self.watchers.notify(&watch::topic(key));
        }
    }

    /// Claims at `now` under the shard's lock: the transition, and its write if any. The
    /// key is hashed and looked up once.
    fn claim_at(&self, claim: &Claim, now: Timestamp) -> ClaimOutcome {
        let (mut shard, hash) = self.shard(&claim.key);
        match shard.entry(hash, |s| s.holds(hash, &claim.key), |s| s.hash) {
            Entry::Occupied(mut slot) => {
                let (answer, next) = machine::claim(Some(&slot.get().record), claim, now);
                if let Some(next) = next {
                    *slot.get_mut().record = next;
                }
                answer
            }
            Entry::Vacant(slot) => {
                let (answer, next) = machine::claim(None, claim, now);
                if let Some(next) = next {
                    let record = Box::new(next);
                    slot.insert(Slot { hash, record });
                }
                answer
            }
        }
    }

    /// Settles one item at `now`, in place under the shard's lock.
    fn settle_at(&self, item: &Settlement, retention: Duration, now: Timestamp) -> Result<()> {
        check_response(&item.settle, self.max_response_bytes)?;
        let lease = &item.lease;
        let held = self.with_record(&lease.key, |rec| {
            rec.is_some_and(|rec| {
                machine::settle_in_place(rec, lease, &item.settle, retention, now)
            })
        });
        if !held {
            return Err(Error::fenced(lease));
        }
        self.wake(&lease.key);
        Ok(())
    }
}

/// A poisoned lock only means another thread panicked while holding it; every write
/// under it is a single `insert`, so the map is still whole.
fn lock(shard: &Shard) -> MutexGuard<'_, HashTable<Slot>> {
    shard.lock().unwrap_or_else(|e| e.into_inner())
}

#[async_trait]
impl Backend for MemoryBackend {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        Ok(self.claim_at(claim, self.clock.now()))
    }

    /// In turn, as separate claims would, without a future per claim, at one reading of
    /// the clock (as one store call of a store whose clock decides).
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        let now = self.clock.now();
        Ok(claims.iter().map(|c| self.claim_at(c, now)).collect())
    }

    /// In turn, as separate calls would, without a future per item, at one reading of the
    /// clock, each record changed in place.
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let now = self.clock.now();
        Ok(items
            .iter()
            .map(|item| self.settle_at(item, retention, now))
            .collect())
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        let until = self.update(lease, |cur, now| machine::extend(cur, lease, ttl, now))?;
        Ok(until.unwrap_or_default())
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let now = self.clock.now();
        Ok(self.with_record(key, |r| {
            r.filter(|r| machine::is_live(r, now)).map(|r| r.clone())
        }))
    }

    async fn delete(&self, key: &Key) -> Result<bool> {
        let now = self.clock.now();
        let removed = {
            let (mut shard, hash) = self.shard(key);
            match shard.find_entry(hash, |s| s.holds(hash, key)) {
                Ok(slot) => Some(slot.remove().0.record),
                Err(_) => None,
            }
        };
        self.wake(key);
        Ok(removed.is_some_and(|r| machine::is_live(&r, now)))
    }

    async fn purge_expired(&self) -> Result<u64> {
        let now = self.clock.now();
        let mut purged = 0u64;
        for shard in self.shards.iter() {
            let mut map = lock(shard);
            let before = map.len();
            map.retain(|s| machine::is_live(&s.record, now));
            purged += (before - map.len()) as u64;
        }
        Ok(purged)
    }

    /// Holds only records idem wrote: nothing is ever skipped.
    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        let now = self.clock.now();
        let limit = if filter.limit == 0 {
            usize::MAX
        } else {
            filter.limit
        };
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let map = lock(shard);
            let records = map.iter().map(|s| &*s.record);
            let live = records.filter(|r| machine::is_live(r, now));
            out.extend(
                live.filter(|r| filter.matches(r))
                    .take(limit - out.len())
                    .cloned(),
            );
            if out.len() >= limit {
                break;
            }
        }
        Ok(Listing::of(out))
    }

    async fn watch(&self, key: &Key) -> Watch {
        self.watchers.subscribe(watch::topic(key))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_max_response_bytes(self.max_response_bytes)
            .with_list(true)
            .with_notify(true)
    }
}
