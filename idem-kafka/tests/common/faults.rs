//! What every fault test reports at the end of a run: the consumer's counters, the times
//! to recover, and its row of the table `scripts/faults` prints.

use std::fmt;

/// The consumer's counters for one topic that a fault moves.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    pub store_errors: u64,
    /// Settles refused because the lease was taken over meanwhile.
    pub fenced: u64,
    /// Waits on a key in progress elsewhere.
    pub in_progress_waits: u64,
    pub dead_lettered: u64,
}

impl Counters {
    /// The counters of `topic` since the start (`super::install_metrics` first).
    pub fn read(topic: &str) -> Counters {
        let count = |name| super::counter(name, topic);
        Counters {
            store_errors: count(idem_kafka::metrics::STORE_ERRORS),
            fenced: count(idem_kafka::metrics::FENCED),
            in_progress_waits: count(idem_kafka::metrics::IN_PROGRESS_WAITS),
            dead_lettered: count(idem_kafka::metrics::DEAD_LETTERED),
        }
    }
}

impl fmt::Display for Counters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} store errors, {} fenced, {} in-progress waits, {} dead letters",
            self.store_errors, self.fenced, self.in_progress_waits, self.dead_lettered
        )
    }
}

/// Seconds, one decimal each, separated by ` / `.
pub fn seconds(each: &[f64]) -> String {
    let each: Vec<String> = each.iter().map(|s| format!("{s:.1}")).collect();
    each.join(" / ")
}

/// One run's row of `scripts/faults`' table: scenario, messages, faults, effects,
/// doubles, recovery after each fault, run time.
pub struct Row<'a> {
    pub scenario: &'a str,
    pub messages: usize,
    pub faults: usize,
    pub effects: usize,
    pub doubles: usize,
    pub recovered: &'a [f64],
    pub seconds: f64,
}

impl fmt::Display for Row<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "| {} | {} | {} | {} | {} | {} s | {:.1} s |",
            self.scenario,
            self.messages,
            self.faults,
            self.effects,
            self.doubles,
            seconds(self.recovered),
            self.seconds
        )
    }
}
