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
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::Key;

/// The keys with a running handler, by hash: a collision only makes a key wait for an
/// unrelated handler to end.
#[derive(Default)]
pub(crate) struct Running {
    keys: Mutex<HashSet<u64>>,
    hasher: RandomState,
}

/// A key marked running until dropped.
pub(crate) struct Runs {
    running: Arc<Running>,
    hash: u64,
}

impl Running {
    fn hash(&self, key: &Key) -> u64 {
        self.hasher.hash_one(key)
    }

    fn lock(&self) -> MutexGuard<'_, HashSet<u64>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks `key` running, unless a handler of it runs here already.
    pub fn start(self: &Arc<Self>, key: &Key) -> Option<Runs> {
        let hash = self.hash(key);
        self.lock().insert(hash).then(|| Runs {
            running: Arc::clone(self),
            hash,
        })
    }

    /// Which of `keys` run here now (`false` for `None`). A key that starts running as
    /// this returns is caught when its handler starts ([`Running::start`]).
    pub fn which<'a>(&self, keys: impl ExactSizeIterator<Item = Option<&'a Key>>) -> Vec<bool> {
        if self.lock().is_empty() {
            return vec![false; keys.len()];
        }
        let hashes: Vec<Option<u64>> = keys.map(|k| k.map(|k| self.hash(k))).collect();
        let running = self.lock();
        hashes
            .into_iter()
            .map(|h| h.is_some_and(|h| running.contains(&h)))
            .collect()
    }

    /// Whether `key` runs here now.
    pub fn contains(&self, key: &Key) -> bool {
        let hash = self.hash(key);
        self.lock().contains(&hash)
    }
}

impl Drop for Runs {
    fn drop(&mut self) {
        self.running.lock().remove(&self.hash);
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
        let running = Arc::new(Running::default());
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
        slot.detach(tracing::Span::none(), runs);
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
