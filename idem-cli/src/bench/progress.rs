//! What a bench says while it runs: first how long it will take, then a bar on a terminal,
//! or off one (a CI log, where the bar hides itself) a plain line per finished cell.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use super::WORKLOADS;
use super::report::{Cell, rate};

/// The progress of one run.
pub struct Progress {
    bar: ProgressBar,
    /// A line per finished cell on stderr (off a terminal, not `--quiet`).
    lines: bool,
    /// Cells in the whole run.
    cells: usize,
}

impl Progress {
    /// For a run of `cells` cells: a bar when stderr is a `terminal`, lines otherwise,
    /// neither when `quiet`.
    pub fn new(quiet: bool, terminal: bool, cells: usize) -> Self {
        let bar = if quiet || !terminal {
            ProgressBar::hidden()
        } else {
            let bar = ProgressBar::new((cells * WORKLOADS) as u64);
            if let Ok(style) = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} measurements  {msg}",
            ) {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        };
        Progress {
            bar,
            lines: !quiet && !terminal,
            cells,
        }
    }

    /// What is being measured now (on the bar).
    pub fn set_message(&self, message: String) {
        self.bar.set_message(message);
    }

    /// One workload measured.
    pub fn inc(&self) {
        self.bar.inc(1);
    }

    /// A line on stderr, above the bar if there is one.
    pub fn println(&self, line: &str) {
        self.bar.suspend(|| eprintln!("{line}"));
    }

    /// The `done`th cell of the run is measured: its line, off a terminal.
    pub fn cell_done(&self, done: usize, cell: &Cell) {
        if self.lines {
            self.println(&cell_line(done, self.cells, cell));
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// `[3/24] redis ×16 workers, batch 128: idem 41.2k keys/s (0.55 of by hand), …`.
fn cell_line(done: usize, cells: usize, c: &Cell) -> String {
    format!(
        "[{done}/{cells}] {} ×{} workers, batch {}: idem {} keys/s ({:.2} of by hand), by hand {}, raw {}, replay {}",
        c.backend,
        c.concurrency,
        c.batch,
        rate(c.claim_complete.keys_per_sec),
        c.claim_complete_vs_by_hand,
        rate(c.by_hand.keys_per_sec),
        rate(c.raw.keys_per_sec),
        rate(c.replay.keys_per_sec),
    )
}

/// The line said before a run of `stores` stores of `cells` cells each, every workload
/// measured for `duration`: how long the measurements take in all. Each also makes one
/// uncounted call per worker first, and its last calls end after `duration`; a store is
/// set up before its cells (replay keys written): the run takes somewhat longer.
pub fn estimate(stores: usize, cells: usize, duration: Duration) -> String {
    let measurements = stores * cells * WORKLOADS;
    let total = duration.saturating_mul(u32::try_from(measurements).unwrap_or(u32::MAX));
    format!(
        "idem bench: {stores} store(s) × {cells} cell(s) × {WORKLOADS} workloads × {} = {} of measurement, plus set-up and warm-up",
        shown(duration),
        shown(total)
    )
}

/// A duration as `2m 24s`, `240ms`: whole seconds from 10 s up, milliseconds below.
fn shown(d: Duration) -> String {
    let d = if d >= Duration::from_secs(10) {
        Duration::from_secs(d.as_secs_f64().round() as u64)
    } else {
        Duration::from_millis(d.as_millis() as u64)
    };
    humantime::format_duration(d).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_is_the_product_of_the_arguments() {
        // The README's default run on three stores: 3 × 6 × 4 × 2 s.
        assert_eq!(
            estimate(3, 6, Duration::from_secs(2)),
            "idem bench: 3 store(s) × 6 cell(s) × 4 workloads × 2s = 2m 24s of measurement, plus set-up and warm-up"
        );
        assert!(estimate(1, 2, Duration::from_millis(10)).contains("× 10ms = 80ms of"));
        assert!(estimate(2, 1, Duration::from_millis(1500)).contains("× 1s 500ms = 12s of"));
    }
}
