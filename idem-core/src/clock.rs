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

/// A century: the longest wait idem puts on a clock.
const FAR: Duration = Duration::from_secs(100 * 365 * 86_400);

/// `d`, or a century if `d` is longer. Timeouts and intervals from configuration pass
/// through this, so that `Duration::MAX` (for "never") is a wait and not an overflow of
/// the clock where a deadline is computed (in idem or in a client library).
pub fn capped(d: Duration) -> Duration {
    d.min(FAR)
}

/// The instant `d` from now, capped (see [`capped`]).
pub(crate) fn deadline(d: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(capped(d)).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_past_the_clock_is_a_century_away() {
        let now = tokio::time::Instant::now();
        let far = deadline(Duration::MAX);
        assert!(
            far >= now + FAR,
            "{far:?} is less than a century after {now:?}"
        );
        let near = deadline(Duration::from_secs(1));
        assert!(near >= now + Duration::from_secs(1) && near < far);
        assert_eq!(capped(Duration::MAX), FAR);
        assert_eq!(capped(Duration::from_secs(5)), Duration::from_secs(5));
    }
}
