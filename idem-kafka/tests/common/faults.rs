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

/// What every fault test's run saw; each test adds its own figures beside these.
#[derive(Debug, Default)]
pub struct Figures {
    /// Each fault, as injected.
    pub faults: Vec<String>,
    pub effects: usize,
    pub doubles: usize,
    /// Effects whose claim took over a lapsed lease.
    pub takeovers: usize,
    pub counters: Counters,
    /// From the end of each fault until every message produced so far was settled.
    pub recovered: Vec<f64>,
    /// From the end of the last fault until the committed offsets reached the end.
    pub committed_after_last: f64,
    /// Connections the proxy accepted.
    pub connections: usize,
    pub seconds: f64,
}

impl Figures {
    /// This run's row of `scripts/faults`' table.
    pub fn row<'a>(&'a self, scenario: &'a str, messages: usize) -> Row<'a> {
        Row {
            scenario,
            messages,
            faults: self.faults.len(),
            effects: self.effects,
            doubles: self.doubles,
            recovered: &self.recovered,
            seconds: self.seconds,
        }
    }
}

/// Derefs a test's own figures, a struct whose `all` field holds [`Figures`], to them.
#[allow(unused_macros)] // not every test binary that includes `common` uses it
macro_rules! extends_figures {
    ($figures:ty) => {
        impl std::ops::Deref for $figures {
            type Target = $crate::common::faults::Figures;
            fn deref(&self) -> &Self::Target {
                &self.all
            }
        }

        impl std::ops::DerefMut for $figures {
            fn deref_mut(&mut self) -> &mut Self::Target {
                &mut self.all
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use extends_figures;

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
