//! Clocks for backends that decide time in the client (memory, DynamoDB).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::Timestamp;

/// A source of the current time.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Now.
    fn now(&self) -> Timestamp;
}

/// The system clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that moves only when told to; clones share one time. For tests.
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock reading `start`.
    pub fn new(start: Timestamp) -> Self {
        ManualClock(Arc::new(AtomicU64::new(start.as_millis())))
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        let d = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.0.fetch_add(d, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.0.load(Ordering::SeqCst))
    }
}
