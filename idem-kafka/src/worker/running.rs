//! The keys whose handler runs in this consumer now, across all its partitions.
//!
//! The store alone cannot keep a key out of two handlers of one consumer: a lease that
//! lapsed while its handler still ran (a slow store, lost heartbeats) is taken over by the
//! next claim, and that claim may come from another partition of the same consumer (the
//! same payment sent twice) or from the same partition handed back after a revoke while
//! its old handler runs on, detached. So a worker asks here first: a key running here is
//! not claimed at all (it waits, as for a key in progress elsewhere), and a handler starts
//! only if no other handler of its key runs here, whatever its lease says.

use std::collections::HashSet;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::Key;

/// Shards of the set, so that partitions on different threads seldom share a lock.
const SHARDS: usize = 16;

/// The keys with a running handler, by hash: a collision only makes a key wait for an
/// unrelated handler to end.
#[derive(Default)]
pub(crate) struct Running {
    shards: [Shard; SHARDS],
    /// Randomly seeded, as the in-memory store's: keys come from outside, and a collision
    /// only makes a key wait.
    hasher: foldhash::fast::RandomState,
}

/// One lock on a cache line of its own.
#[derive(Default)]
#[repr(align(128))]
struct Shard(Mutex<HashSet<u64, BuildHasherDefault<Hashed>>>);

/// The hasher of a set of hashes: the value is its own hash.
#[derive(Default)]
struct Hashed(u64);

impl Hasher for Hashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A key marked running until dropped, borrowing the set ([`Runs::keep`] makes it owned).
pub(crate) struct Runs<'a> {
    running: &'a Running,
    hash: Option<u64>,
}

/// A key marked running until dropped, for a handler that outlives its worker.
pub(crate) struct Kept {
    running: Arc<Running>,
    hash: u64,
}

impl Running {
    fn hash(&self, key: &Key) -> u64 {
        self.hasher.hash_one(key)
    }

    fn shard(&self, hash: u64) -> MutexGuard<'_, HashSet<u64, BuildHasherDefault<Hashed>>> {
        // Bits the set's own buckets do not use (they take the low ones).
        let shard = &self.shards[(hash >> 32) as usize % SHARDS];
        shard.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks `key` running, unless a handler of it runs here already.
    pub fn start(&self, key: &Key) -> Option<Runs<'_>> {
        let hash = self.hash(key);
        let fresh = self.shard(hash).insert(hash);
        // Made only when fresh: a mark dropped unused would end the other handler's.
        fresh.then(|| Runs {
            running: self,
            hash: Some(hash),
        })
    }

    /// Which of `keys` run here now (`false` for `None`). A key that starts running as
    /// this returns is caught when its handler starts ([`Running::start`]).
    pub fn which<'a>(&self, keys: impl Iterator<Item = Option<&'a Key>>) -> Vec<bool> {
        keys.map(|key| key.is_some_and(|key| self.contains(key)))
            .collect()
    }

    /// Whether `key` runs here now.
    pub fn contains(&self, key: &Key) -> bool {
        let hash = self.hash(key);
        self.shard(hash).contains(&hash)
    }

    fn end(&self, hash: u64) {
        self.shard(hash).remove(&hash);
    }
}

impl Runs<'_> {
    /// The same mark, owned: it stays until the [`Kept`] is dropped.
    pub fn keep(mut self, running: &Arc<Running>) -> Kept {
        Kept {
            running: Arc::clone(running),
            hash: self.hash.take().unwrap_or_default(),
        }
    }
}

impl Drop for Runs<'_> {
    fn drop(&mut self) {
        if let Some(hash) = self.hash {
            self.running.end(hash);
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.running.end(self.hash);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> Key {
        Key::new("ns", id).expect("key")
    }

    #[test]
    fn a_key_runs_once_until_its_mark_is_dropped() {
        let running = Running::default();
        let (a, b) = (key("a"), key("b"));
        let first = running.start(&a).expect("a is free");
        assert!(running.start(&a).is_none(), "a runs already");
        assert!(running.contains(&a));
        assert_eq!(
            running.which([Some(&a), None, Some(&b)].into_iter()),
            vec![true, false, false]
        );
        drop(first);
        assert!(!running.contains(&a));
        assert!(running.start(&a).is_some(), "a is free again");
    }

    /// A handler detached when its partition was given up keeps its key marked until it
    /// ends: the partition assigned back to this process does not run the key beside it.
    #[tokio::test]
    async fn a_detached_handler_keeps_its_key_until_it_ends() {
        let running = Arc::new(Running::default());
        let a = key("a");
        let runs = running.start(&a).expect("a is free");
        let (finish, finished) = tokio::sync::oneshot::channel::<()>();
        let slot = crate::slot::Slot::new(Box::pin(async move {
            let _ = finished.await;
            Ok(bytes::Bytes::new())
        }));
        slot.detach(tracing::Span::none(), runs.keep(&running));
        tokio::task::yield_now().await;
        assert!(running.start(&a).is_none(), "a runs on, detached");
        finish.send(()).expect("the handler waits");
        let freed = async {
            while running.contains(&a) {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), freed)
            .await
            .expect("a is free once the detached handler ends");
    }
}
