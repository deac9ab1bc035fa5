//! The bench's results: a terminal table of ratios, JSON, and an SVG plot.

use std::path::{Path, PathBuf};

use comfy_table::{CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use plotters::prelude::*;
use serde::Serialize;

use super::measure::Measure;
use super::subject::Subject;
use crate::cli::BenchArgs;
use crate::error::{Error, Result};

/// One backend at one concurrency and batch size.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    /// `memory`, `redis`, `postgres`, `dynamodb`.
    pub backend: &'static str,
    /// The URL, password hidden.
    pub url: String,
    /// What the raw baseline is.
    pub raw_operation: &'static str,
    /// Concurrent workers.
    pub concurrency: u32,
    /// Keys per call.
    pub batch: u32,
    /// The store's raw conditional write.
    pub raw: Measure,
    /// Claim fresh keys, complete each.
    pub claim_complete: Measure,
    /// Claim completed keys (duplicates): the stored response comes back.
    pub replay: Measure,
    /// `claim_complete.keys_per_sec / raw.keys_per_sec`.
    pub claim_complete_vs_raw: f64,
    /// `replay.keys_per_sec / raw.keys_per_sec`.
    pub replay_vs_raw: f64,
}

impl Cell {
    /// A cell, with its ratios.
    pub fn new(
        s: &Subject,
        concurrency: u32,
        batch: u32,
        raw: Measure,
        claim_complete: Measure,
        replay: Measure,
    ) -> Self {
        let ratio = |m: &Measure| {
            if raw.keys_per_sec > 0.0 {
                m.keys_per_sec / raw.keys_per_sec
            } else {
                0.0
            }
        };
        Cell {
            backend: s.kind,
            url: s.shown.clone(),
            raw_operation: s.raw.name(),
            concurrency,
            batch,
            claim_complete_vs_raw: ratio(&claim_complete),
            replay_vs_raw: ratio(&replay),
            raw,
            claim_complete,
            replay,
        }
    }
}

/// A whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// idem-cli's version.
    pub version: &'static str,
    /// Whether this binary was built with optimisations.
    pub release_build: bool,
    /// Logical CPUs on this machine.
    pub cpus: usize,
    /// How long each measurement ran, milliseconds.
    pub duration_ms: u64,
    /// The results.
    pub cells: Vec<Cell>,
}

impl Report {
    /// The report of a run of `args`.
    pub fn new(args: &BenchArgs, cells: Vec<Cell>) -> Self {
        Report {
            version: env!("CARGO_PKG_VERSION"),
            release_build: !cfg!(debug_assertions),
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            duration_ms: u64::try_from(args.duration.as_millis()).unwrap_or(u64::MAX),
            cells,
        }
    }

    /// The results as a terminal table: throughput in keys/s and as a ratio of the raw
    /// write, and claim+complete latency.
    pub fn table(&self) -> String {
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED).set_header([
            "backend",
            "workers",
            "batch",
            "raw keys/s",
            "claim+complete keys/s",
            "÷ raw",
            "p50",
            "p99",
            "replay keys/s",
            "÷ raw",
        ]);
        for c in &self.cells {
            t.add_row([
                c.backend.to_owned(),
                c.concurrency.to_string(),
                c.batch.to_string(),
                rate(c.raw.keys_per_sec),
                rate(c.claim_complete.keys_per_sec),
                format!("{:.2}", c.claim_complete_vs_raw),
                micros(c.claim_complete.p50_us),
                micros(c.claim_complete.p99_us),
                rate(c.replay.keys_per_sec),
                format!("{:.2}", c.replay_vs_raw),
            ]);
        }
        for i in 1..10 {
            if let Some(col) = t.column_mut(i) {
                col.set_cell_alignment(CellAlignment::Right);
            }
        }
        let mut text = t.to_string();
        let raws = unique(
            self.cells
                .iter()
                .map(|c| format!("{}: {}", c.backend, c.raw_operation)),
        );
        text.push_str(&format!(
            "\nraw = {} (same client, same run); p50/p99 = one claim+complete call; {} per measurement{}",
            raws.join(", "),
            humantime::format_duration(std::time::Duration::from_millis(self.duration_ms)),
            if self.release_build {
                ""
            } else {
                "; DEBUG BUILD: use --release for figures"
            }
        ));
        text
    }

    /// Writes `bench.json` and `bench.svg` into `dir`, returning their paths.
    pub fn write(&self, dir: &Path) -> Result<(PathBuf, PathBuf)> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let json = dir.join("bench.json");
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Refused(format!("encode the report: {e}")))?;
        std::fs::write(&json, text)
            .map_err(|e| Error::io(format!("write {}", json.display()), e))?;
        let svg = dir.join("bench.svg");
        self.plot(&svg)
            .map_err(|e| Error::Refused(format!("draw {}: {e}", svg.display())))?;
        Ok((json, svg))
    }

    /// Claim+complete throughput (solid) and the raw write (dashed) against concurrency,
    /// one colour per backend, one line per batch size; both axes logarithmic.
    fn plot(&self, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let xs = self.cells.iter().map(|c| f64::from(c.concurrency));
        let x_max = xs.fold(1.0, f64::max).max(2.0);
        let ys = self
            .cells
            .iter()
            .flat_map(|c| [c.raw.keys_per_sec, c.claim_complete.keys_per_sec]);
        let (y_min, y_max) = ys.fold((f64::MAX, 10.0_f64), |(lo, hi), y| (lo.min(y), hi.max(y)));
        let y_min = (y_min / 2.0).clamp(1.0, y_max / 10.0);
        let y_max = y_max * 2.0;
        let mut chart = ChartBuilder::on(&root)
            .caption("idem bench: keys/s against concurrency", ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((1.0..x_max).log_scale(), (y_min..y_max).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("concurrent workers")
            .y_desc("keys/s")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| rate(*y))
            .draw()?;
        let series = unique(self.cells.iter().map(|c| (c.backend, c.batch)));
        let backends = unique(self.cells.iter().map(|c| c.backend));
        for (backend, batch) in series {
            let i = backends.iter().position(|b| *b == backend).unwrap_or(0);
            let color = Palette99::pick(i).to_rgba();
            let cells: Vec<&Cell> = self
                .cells
                .iter()
                .filter(|c| c.backend == backend && c.batch == batch)
                .collect();
            let points = |f: fn(&Cell) -> f64| -> Vec<(f64, f64)> {
                cells
                    .iter()
                    .map(|c| (f64::from(c.concurrency), f(c).max(1.0)))
                    .collect()
            };
            let width = if batch == 1 { 2 } else { 3 };
            chart
                .draw_series(
                    LineSeries::new(
                        points(|c| c.claim_complete.keys_per_sec),
                        color.stroke_width(width),
                    )
                    .point_size(3),
                )?
                .label(format!("{backend} claim+complete, batch {batch}"))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(width))
                });
            chart.draw_series(DashedLineSeries::new(
                points(|c| c.raw.keys_per_sec),
                6,
                4,
                color.stroke_width(1),
            ))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
        root.draw(&Text::new(
            "dashed: the store's raw write at the same batch size",
            (80, 580),
            ("sans-serif", 13),
        ))?;
        root.present()?;
        Ok(())
    }
}

/// The distinct items, in first-seen order.
fn unique<T: PartialEq>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

fn rate(keys_per_sec: f64) -> String {
    if keys_per_sec >= 1e6 {
        format!("{:.2}M", keys_per_sec / 1e6)
    } else if keys_per_sec >= 1e3 {
        format!("{:.1}k", keys_per_sec / 1e3)
    } else {
        format!("{keys_per_sec:.0}")
    }
}

fn micros(us: u64) -> String {
    if us >= 10_000 {
        format!("{:.0} ms", us as f64 / 1e3)
    } else if us >= 1_000 {
        format!("{:.1} ms", us as f64 / 1e3)
    } else {
        format!("{us} µs")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_latencies_read_well() {
        assert_eq!(rate(1_234_567.0), "1.23M");
        assert_eq!(rate(15_700.0), "15.7k");
        assert_eq!(rate(950.4), "950");
        assert_eq!(micros(850), "850 µs");
        assert_eq!(micros(1_250), "1.2 ms");
        assert_eq!(micros(42_000), "42 ms");
    }
}
