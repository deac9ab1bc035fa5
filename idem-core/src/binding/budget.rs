//! A byte budget: the bytes of received messages a consumer holds, and their bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The bytes of received messages a consumer holds (taken from the broker and not dropped
/// yet: waiting, running or settling), and their bound. A binding stops taking messages
/// while it holds more than the bound and still has something in hand, so memory stays
/// within the bound plus about one message.
#[derive(Debug)]
pub struct Budget {
    bound: usize,
    held: AtomicUsize,
}

impl Budget {
    /// An empty budget of `bound` bytes.
    pub fn new(bound: usize) -> Arc<Budget> {
        Arc::new(Budget {
            bound,
            held: AtomicUsize::new(0),
        })
    }

    /// The most bytes held before the consumer stops taking messages.
    pub fn bound(&self) -> usize {
        self.bound
    }

    /// The bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Whether more than the bound is held.
    pub fn over(&self) -> bool {
        self.held() > self.bound
    }

    /// Counts `bytes`, until the returned ticket is dropped.
    pub fn hold(self: &Arc<Self>, bytes: usize) -> BudgetTicket {
        self.take(bytes);
        BudgetTicket {
            budget: Arc::clone(self),
            bytes,
        }
    }

    /// Counts `bytes` held, for a binding that keeps its own tickets (one that counts per
    /// partition too); [`Budget::give_back`] undoes it.
    pub fn take(&self, bytes: usize) {
        self.held.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Gives back `bytes` counted by [`Budget::take`].
    pub fn give_back(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// One message's share of a [`Budget`], given back when dropped.
#[derive(Debug)]
pub struct BudgetTicket {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Drop for BudgetTicket {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_count_until_dropped() {
        let budget = Budget::new(10);
        let a = budget.hold(6);
        let b = budget.hold(6);
        assert_eq!((budget.held(), budget.over()), (12, true));
        drop(a);
        assert_eq!((budget.held(), budget.over()), (6, false));
        drop(b);
        assert_eq!(budget.held(), 0);
    }
}
