//! The waits between retries of a store or broker call that failed.

use std::time::Duration;

/// Exponential backoff between two bounds, for a binding's loop that waits for a store
/// or a broker.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Waits from `first`, doubling, up to `max`.
    pub fn new((first, max): (Duration, Duration)) -> Self {
        Backoff { next: first, max }
    }

    /// The next wait: the first bound, then doubling up to the second.
    pub fn wait(&mut self) -> Duration {
        let d = self.next;
        self.next = d.saturating_mul(2).min(self.max);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_bound_and_never_overflows() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new((ms(20), ms(50)));
        assert_eq!([b.wait(), b.wait(), b.wait()], [ms(20), ms(40), ms(50)]);
        let mut far = Backoff::new((Duration::MAX, Duration::MAX));
        assert_eq!([far.wait(), far.wait()], [Duration::MAX; 2]);
    }
}
