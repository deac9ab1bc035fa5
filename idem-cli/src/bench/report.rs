//! The bench's results: a terminal table of ratios, JSON, Markdown, and an SVG plot.

use std::path::{Path, PathBuf};

use comfy_table::{CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Serialize;

use super::measure::Measure;
use super::provenance::Provenance;
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
    /// What the raw baseline is: the store's write-if-absent.
    pub raw_operation: &'static str,
    /// What the by-hand baseline is: the write-if-absent, then the overwrite.
    pub by_hand_operation: String,
    /// Concurrent workers.
    pub concurrency: u32,
    /// Keys per call.
    pub batch: u32,
    /// The store's raw conditional write, once per key.
    pub raw: Measure,
    /// idem's claim+complete done by hand: the raw write of a claim marker, then the
    /// response written over it; one round trip per batch and step where the store can.
    pub by_hand: Measure,
    /// Claim fresh keys, complete each.
    pub claim_complete: Measure,
    /// Claim completed keys (duplicates): the stored response comes back.
    pub replay: Measure,
    /// `claim_complete.keys_per_sec / by_hand.keys_per_sec`: what idem costs over doing
    /// the same writes by hand.
    pub claim_complete_vs_by_hand: f64,
    /// `claim_complete.keys_per_sec / raw.keys_per_sec`.
    pub claim_complete_vs_raw: f64,
    /// `replay.keys_per_sec / raw.keys_per_sec`.
    pub replay_vs_raw: f64,
}

/// The four workloads of a cell.
pub struct Measured {
    /// See [`Cell::raw`].
    pub raw: Measure,
    /// See [`Cell::by_hand`].
    pub by_hand: Measure,
    /// See [`Cell::claim_complete`].
    pub claim_complete: Measure,
    /// See [`Cell::replay`].
    pub replay: Measure,
}

/// `a / b`, or 0 when `b` is not positive.
fn ratio(a: &Measure, b: &Measure) -> f64 {
    if b.keys_per_sec > 0.0 {
        a.keys_per_sec / b.keys_per_sec
    } else {
        0.0
    }
}

impl Cell {
    /// A cell, with its ratios.
    pub fn new(s: &Subject, concurrency: u32, batch: u32, m: Measured) -> Self {
        Cell {
            backend: s.kind,
            url: s.shown.clone(),
            raw_operation: s.raw.name(),
            by_hand_operation: format!("{}, then {}", s.raw.name(), s.raw.settle_name()),
            concurrency,
            batch,
            claim_complete_vs_by_hand: ratio(&m.claim_complete, &m.by_hand),
            claim_complete_vs_raw: ratio(&m.claim_complete, &m.raw),
            replay_vs_raw: ratio(&m.replay, &m.raw),
            raw: m.raw,
            by_hand: m.by_hand,
            claim_complete: m.claim_complete,
            replay: m.replay,
        }
    }
}

/// The columns of the Markdown table; the terminal table adds p50 and p99 after the
/// eighth.
pub(super) const HEADER: [&str; 10] = [
    "backend",
    "workers",
    "batch",
    "idem keys/s",
    "by hand keys/s",
    "idem ÷ by hand",
    "raw keys/s",
    "idem ÷ raw",
    "replay keys/s",
    "replay ÷ raw",
];

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
    /// The command, the date and the commit of the run.
    #[serde(flatten)]
    pub provenance: Provenance,
    /// The results.
    pub cells: Vec<Cell>,
}

impl Report {
    /// The report of a run of `args`.
    pub fn new(args: &BenchArgs, provenance: Provenance, cells: Vec<Cell>) -> Self {
        Report {
            version: env!("CARGO_PKG_VERSION"),
            release_build: !cfg!(debug_assertions),
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            duration_ms: u64::try_from(args.duration.as_millis()).unwrap_or(u64::MAX),
            provenance,
            cells,
        }
    }

    /// The results as a terminal table: throughput in keys/s, idem's as a ratio of the
    /// by-hand and the raw baselines, claim+complete latency, and replays.
    pub fn table(&self) -> String {
        let mut t = Table::new();
        let mut header = HEADER.to_vec();
        header.splice(8..8, ["p50", "p99"]);
        t.load_preset(UTF8_FULL_CONDENSED).set_header(header);
        for c in &self.cells {
            t.add_row([
                c.backend.to_owned(),
                c.concurrency.to_string(),
                c.batch.to_string(),
                rate(c.claim_complete.keys_per_sec),
                rate(c.by_hand.keys_per_sec),
                format!("{:.2}", c.claim_complete_vs_by_hand),
                rate(c.raw.keys_per_sec),
                format!("{:.2}", c.claim_complete_vs_raw),
                micros(c.claim_complete.p50_us),
                micros(c.claim_complete.p99_us),
                rate(c.replay.keys_per_sec),
                format!("{:.2}", c.replay_vs_raw),
            ]);
        }
        for i in 1..12 {
            if let Some(col) = t.column_mut(i) {
                col.set_cell_alignment(CellAlignment::Right);
            }
        }
        let mut text = t.to_string();
        text.push_str(&format!(
            "\nidem = claim then complete (claim_many and settle_many above batch 1); \
             p50/p99 = one such call\nby hand = {}\nraw = {}\n\
             same client, same run; {} per measurement{}",
            self.by_hand_operations().join("; "),
            self.raw_operations().join("; "),
            humantime::format_duration(std::time::Duration::from_millis(self.duration_ms)),
            if self.release_build {
                ""
            } else {
                "; DEBUG BUILD: use --release for figures"
            }
        ));
        text
    }

    /// `backend: operation` of each backend's by-hand baseline, in the order measured.
    pub fn by_hand_operations(&self) -> Vec<String> {
        unique(
            self.cells
                .iter()
                .map(|c| format!("{}: {}", c.backend, c.by_hand_operation)),
        )
    }

    /// `backend: operation` of each backend's raw baseline, in the order measured.
    pub fn raw_operations(&self) -> Vec<String> {
        unique(
            self.cells
                .iter()
                .map(|c| format!("{}: {}", c.backend, c.raw_operation)),
        )
    }

    /// Writes `bench.json`, `bench.md` and `bench.svg` into `dir`, returning their paths.
    pub fn write(&self, dir: &Path) -> Result<[PathBuf; 3]> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let json = dir.join("bench.json");
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Refused(format!("encode the report: {e}")))?;
        std::fs::write(&json, text)
            .map_err(|e| Error::io(format!("write {}", json.display()), e))?;
        let md = dir.join("bench.md");
        std::fs::write(&md, self.markdown())
            .map_err(|e| Error::io(format!("write {}", md.display()), e))?;
        let svg = dir.join("bench.svg");
        let drawing = self
            .svg()
            .map_err(|e| Error::Refused(format!("draw {}: {e}", svg.display())))?;
        std::fs::write(&svg, drawing)
            .map_err(|e| Error::io(format!("write {}", svg.display()), e))?;
        Ok([json, md, svg])
    }

    /// The plot as SVG text. One column per batch size; in each, idem's claim+complete ÷
    /// by hand (solid) and ÷ raw (dashed) against concurrency on top (linear, 1 marked), and
    /// the three rates in keys/s below (log), idem solid, by hand dashed and raw dotted, in
    /// one colour per backend. A legend on the right names every line; the x axes mark the
    /// measured concurrencies and nothing else.
    fn svg(&self) -> Result<String, Box<dyn std::error::Error>> {
        let lines = self.lines();
        let batches = sorted(self.cells.iter().map(|c| c.batch));
        let axes = self.axes();
        let columns = batches.len().max(1);
        let width = COLUMN * u32::try_from(columns)?;
        let middle_height = (RATIO + RATES).max(legend_height(lines.len()));
        let size = (width + LEGEND, TITLE + middle_height + FOOTER);
        let mut out = String::new();
        {
            let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
            root.fill(&WHITE)?;
            let (title, rest) = root.split_vertically(TITLE);
            self.draw_title(&title, &batches)?;
            let (middle, footer) = rest.split_vertically(middle_height);
            // The rate charts take what height a long legend adds.
            let (charts, legend) = middle.split_horizontally(width);
            for (column, &batch) in charts.split_evenly((1, columns)).iter().zip(&batches) {
                let (top, bottom) = column.split_vertically(RATIO);
                self.draw_ratios(&top, &lines, &axes, batch)?;
                self.draw_rates(&bottom, &lines, &axes, batch)?;
            }
            draw_legend(&legend, &lines)?;
            self.draw_footer(&footer)?;
            root.present()?;
        }
        Ok(out)
    }

    /// One line per backend URL, in the order measured, each with its own colour.
    fn lines(&self) -> Vec<Line<'_>> {
        let urls = unique(self.cells.iter().map(|c| (c.backend, c.url.as_str())));
        let kinds = unique(urls.iter().map(|(kind, _)| *kind));
        urls.iter()
            .enumerate()
            .map(|(i, &(backend, url))| Line {
                backend,
                url,
                label: if kinds.len() == urls.len() {
                    backend.to_owned()
                } else {
                    format!("{backend} {url}")
                },
                raw_operation: self
                    .cells
                    .iter()
                    .find(|c| c.url == url && c.backend == backend)
                    .map_or("", |c| c.raw_operation),
                by_hand_operation: self
                    .cells
                    .iter()
                    .find(|c| c.url == url && c.backend == backend)
                    .map_or("", |c| c.by_hand_operation.as_str()),
                colour: COLOURS[i % COLOURS.len()],
            })
            .collect()
    }

    /// The ranges every column shares, so that columns compare by eye.
    fn axes(&self) -> Axes {
        let concurrency: Vec<f64> = sorted(self.cells.iter().map(|c| c.concurrency))
            .into_iter()
            .map(f64::from)
            .collect();
        let first = concurrency.first().copied().unwrap_or(1.0);
        let last = concurrency.last().copied().unwrap_or(1.0);
        let ratio = self
            .cells
            .iter()
            .flat_map(|c| [c.claim_complete_vs_by_hand, c.claim_complete_vs_raw])
            .fold(1.0, f64::max);
        let rates = self
            .cells
            .iter()
            .flat_map(|c| {
                [
                    c.raw.keys_per_sec,
                    c.by_hand.keys_per_sec,
                    c.claim_complete.keys_per_sec,
                ]
            })
            .map(|r| r.max(1.0));
        let (lo, hi) = rates.fold((f64::MAX, 1.0_f64), |(lo, hi), r| (lo.min(r), hi.max(r)));
        let lo = lo.min(hi);
        let ratio_ticks = ratio_ticks(ratio * 1.2);
        Axes {
            x: first / 1.5..last * 1.5,
            concurrency,
            ratio_top: ratio_ticks.last().copied().unwrap_or(1.2),
            ratio_labels: ratio_ticks.len(),
            rates: (lo / 2.0).max(1.0)..hi * 2.0,
        }
    }

    fn draw_title(
        &self,
        area: &Area<'_>,
        batches: &[u32],
    ) -> Result<(), Box<dyn std::error::Error>> {
        let (w, _) = area.dim_in_pixel();
        let centre = i32::try_from(w / 2)?;
        let batch = match batches {
            [one] => format!("batch {one}"),
            more => format!("batches {}", join(more)),
        };
        area.draw(&Text::new(
            "idem bench: what idem costs over doing it by hand",
            (centre, 12),
            bold(28).pos(top_centre()),
        ))?;
        area.draw(&Text::new(
            format!(
                "claim+complete of fresh keys, {batch} per call, {} per measurement, {} CPUs{}",
                humantime::format_duration(std::time::Duration::from_millis(self.duration_ms)),
                self.cpus,
                if self.release_build {
                    ""
                } else {
                    "; DEBUG BUILD: use --release for figures"
                }
            ),
            (centre, 48),
            font(19).pos(top_centre()),
        ))?;
        Ok(())
    }

    /// idem ÷ by hand (solid) and ÷ raw (dashed) against concurrency, with the line where
    /// idem is as fast as the same writes by hand.
    fn draw_ratios(
        &self,
        area: &Area<'_>,
        lines: &[Line<'_>],
        axes: &Axes,
        batch: u32,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let call = if batch == 1 { "claim" } else { "claim_many" };
        let mut chart = ChartBuilder::on(area)
            .caption(format!("batch {batch} ({call})"), font(22))
            .margin_left(8)
            .margin_right(24)
            .x_label_area_size(10)
            .y_label_area_size(70)
            .build_cartesian_2d(
                axes.x
                    .clone()
                    .log_scale()
                    .with_key_points(axes.concurrency.clone()),
                0.0..axes.ratio_top,
            )?;
        chart
            .configure_mesh()
            .y_desc("idem ÷ baseline (keys/s)")
            .y_labels(axes.ratio_labels)
            .y_label_formatter(&|y| ratio_label(*y))
            .x_label_style(font(17).color(&TRANSPARENT))
            .y_label_style(font(17))
            .axis_desc_style(font(17))
            .light_line_style(TRANSPARENT)
            .bold_line_style(BLACK.mix(0.12))
            .draw()?;
        let (start, end) = (axes.x.start, axes.x.end);
        chart.draw_series(DashedLineSeries::new(
            [(start, 1.0), (end, 1.0)],
            8,
            5,
            BLACK.stroke_width(1),
        ))?;
        chart.draw_series(std::iter::once(
            EmptyElement::at((start, 1.0))
                + Text::new(
                    "1 = as fast as by hand",
                    (6, -3),
                    font(16).pos(Pos::new(HPos::Left, VPos::Bottom)),
                ),
        ))?;
        for line in lines {
            let raw = line.points(&self.cells, batch, |c| c.claim_complete_vs_raw);
            chart.draw_series(DashedLineSeries::new(
                raw.clone(),
                8,
                5,
                line.colour.stroke_width(2),
            ))?;
            chart.draw_series(
                raw.into_iter()
                    .map(|p| Circle::new(p, 3, line.colour.filled())),
            )?;
            let by_hand = line.points(&self.cells, batch, |c| c.claim_complete_vs_by_hand);
            chart.draw_series(LineSeries::new(
                by_hand.clone(),
                line.colour.stroke_width(3),
            ))?;
            chart.draw_series(
                by_hand
                    .into_iter()
                    .map(|p| Circle::new(p, 4, line.colour.filled())),
            )?;
        }
        Ok(())
    }

    /// idem's, by hand and raw keys/s against concurrency.
    fn draw_rates(
        &self,
        area: &Area<'_>,
        lines: &[Line<'_>],
        axes: &Axes,
        batch: u32,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let mut chart = ChartBuilder::on(area)
            .margin_left(8)
            .margin_right(24)
            .margin_top(16)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(
                axes.x
                    .clone()
                    .log_scale()
                    .with_key_points(axes.concurrency.clone()),
                axes.rates
                    .clone()
                    .log_scale()
                    .with_key_points(rate_ticks(&axes.rates)),
            )?;
        chart
            .configure_mesh()
            .x_desc("concurrent workers")
            .y_desc("keys/s (log scale)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| rate_label(*y))
            .label_style(font(17))
            .axis_desc_style(font(17))
            .light_line_style(TRANSPARENT)
            .bold_line_style(BLACK.mix(0.12))
            .draw()?;
        for line in lines {
            let idem = line.points(&self.cells, batch, |c| {
                c.claim_complete.keys_per_sec.max(1.0)
            });
            let raw = line.points(&self.cells, batch, |c| c.raw.keys_per_sec.max(1.0));
            let by_hand = line.points(&self.cells, batch, |c| c.by_hand.keys_per_sec.max(1.0));
            for (points, stroke) in [(raw, Stroke::Dotted), (by_hand, Stroke::Dashed)] {
                let (dash, gap) = stroke.dashes();
                chart.draw_series(DashedLineSeries::new(
                    points.clone(),
                    dash,
                    gap,
                    line.colour.stroke_width(2),
                ))?;
                chart.draw_series(
                    points
                        .into_iter()
                        .map(|p| Circle::new(p, 3, line.colour.filled())),
                )?;
            }
            chart.draw_series(LineSeries::new(idem.clone(), line.colour.stroke_width(3)))?;
            chart.draw_series(
                idem.into_iter()
                    .map(|p| Circle::new(p, 4, line.colour.filled())),
            )?;
        }
        Ok(())
    }

    fn draw_footer(&self, area: &Area<'_>) -> Result<(), Box<dyn std::error::Error>> {
        let notes = [
            "idem: claim then complete; above batch 1, one claim_many and one settle_many per batch."
                .to_owned(),
            "by hand: the same two writes with no leases or fencing: the store's write-if-absent, \
             then the response written over it, batched alike."
                .to_owned(),
            "raw: the write-if-absent alone, one per key. All through one client, in one run."
                .to_owned(),
            format!(
                "Replays of completed keys are in the table and bench.json. idem-cli {}.",
                self.version
            ),
        ];
        for (i, note) in notes.iter().enumerate() {
            area.draw(&Text::new(
                note.as_str(),
                (16, 8 + 20 * i32::try_from(i)?),
                font(16).pos(Pos::new(HPos::Left, VPos::Top)),
            ))?;
        }
        Ok(())
    }
}

/// Pixels: a column of charts per batch size, the legend, the title, the two charts' rows
/// and the notes under them.
const COLUMN: u32 = 500;
const LEGEND: u32 = 420;
const TITLE: u32 = 80;
const RATIO: u32 = 280;
const RATES: u32 = 360;
const FOOTER: u32 = 92;

/// Pixels of the legend: where its rows start, an entry, and an entry's second line.
const LEGEND_TOP: i32 = 48;
const ENTRY: i32 = 28;
const DETAIL: i32 = 19;

/// Where the legend's second part (the rate chart's lines) starts, below the first part
/// (one entry per line) and no higher than the rate charts.
fn legend_rates_top(lines: usize) -> i32 {
    let lines = i32::try_from(lines).unwrap_or(i32::MAX / 1024);
    (RATIO as i32 + 24).max(LEGEND_TOP + ENTRY * lines + 40)
}

/// How tall the legend is for `lines` backends: three entries each in its second part, two
/// of them with a second line.
fn legend_height(lines: usize) -> u32 {
    let per_line = 3 * ENTRY + 2 * DETAIL;
    let n = i32::try_from(lines).unwrap_or(i32::MAX / 1024);
    u32::try_from(legend_rates_top(lines) + per_line * n + 24).unwrap_or(u32::MAX)
}

/// Okabe and Ito's colour-blind safe palette without its yellow, orange and sky blue,
/// which are too pale on white: each of these has at least 3:1 contrast against white.
const COLOURS: [RGBColor; 5] = [
    RGBColor(0x00, 0x72, 0xB2),
    RGBColor(0xD5, 0x5E, 0x00),
    RGBColor(0x00, 0x9E, 0x73),
    RGBColor(0xCC, 0x79, 0xA7),
    RGBColor(0x00, 0x00, 0x00),
];

fn top_centre() -> Pos {
    Pos::new(HPos::Center, VPos::Top)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// One backend's lines.
struct Line<'a> {
    backend: &'a str,
    url: &'a str,
    /// The backend, or the backend and its URL when two URLs share a backend.
    label: String,
    raw_operation: &'a str,
    by_hand_operation: &'a str,
    colour: RGBColor,
}

impl Line<'_> {
    /// (concurrency, `y` of the cell) of this line's cells of one batch size.
    fn points(&self, cells: &[Cell], batch: u32, y: impl Fn(&Cell) -> f64) -> Vec<(f64, f64)> {
        let mut points: Vec<(f64, f64)> = cells
            .iter()
            .filter(|c| c.backend == self.backend && c.url == self.url && c.batch == batch)
            .map(|c| (f64::from(c.concurrency), y(c)))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points
    }
}

/// The ranges the columns share.
struct Axes {
    /// The measured concurrencies, ascending: the x axis's ticks.
    concurrency: Vec<f64>,
    x: std::ops::Range<f64>,
    /// The ratio axis's top, a round number, and how many labels from 0 to it.
    ratio_top: f64,
    ratio_labels: usize,
    rates: std::ops::Range<f64>,
}

/// How a line is drawn: idem solid, by hand dashed, raw dotted (on the ratio chart, idem ÷
/// raw is dashed).
#[derive(Clone, Copy)]
enum Stroke {
    Solid,
    Dashed,
    Dotted,
}

impl Stroke {
    /// A dashed stroke's dash and gap, in pixels.
    fn dashes(self) -> (u32, u32) {
        match self {
            Stroke::Dotted => (2, 4),
            Stroke::Solid | Stroke::Dashed => (8, 5),
        }
    }
}

/// Names every line: top, the ratio chart's (one per backend, solid ÷ by hand and dashed ÷
/// raw; the line at 1 has its label on it); below, the rate chart's (idem, by hand and raw
/// per backend).
fn draw_legend(area: &Area<'_>, lines: &[Line<'_>]) -> Result<(), Box<dyn std::error::Error>> {
    let entry = |label: String, detail: &str, line: &Line<'_>, stroke| Entry {
        label,
        detail: detail.to_owned(),
        colour: line.colour,
        stroke,
    };
    let mut top = vec![];
    let mut bottom = vec![];
    for line in lines {
        top.push(entry(line.label.clone(), "", line, Stroke::Solid));
        bottom.push(entry(
            format!("{} idem", line.label),
            "",
            line,
            Stroke::Solid,
        ));
        let by_hand = format!("{} by hand", line.label);
        bottom.push(entry(by_hand, line.by_hand_operation, line, Stroke::Dashed));
        let raw = format!("{} raw", line.label);
        bottom.push(entry(raw, line.raw_operation, line, Stroke::Dotted));
    }
    let rows = [
        ("idem ÷ by hand solid, ÷ raw dashed", LEGEND_TOP, top),
        (
            "keys/s: idem solid, by hand dashed, raw dotted",
            legend_rates_top(lines.len()),
            bottom,
        ),
    ];
    for (heading, mut y, entries) in rows {
        area.draw(&Text::new(
            heading,
            (8, y),
            bold(18).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
        for e in entries {
            y += ENTRY;
            let ends = vec![(12, y), (52, y)];
            match e.stroke {
                Stroke::Solid => area.draw(&PathElement::new(ends, e.colour.stroke_width(3)))?,
                dashed @ (Stroke::Dashed | Stroke::Dotted) => {
                    let (dash, gap) = dashed.dashes();
                    area.draw(&DashedPathElement::new(
                        ends,
                        dash,
                        gap,
                        e.colour.stroke_width(2),
                    ))?
                }
            }
            area.draw(&Circle::new((32, y), 4, e.colour.filled()))?;
            let left = Pos::new(HPos::Left, VPos::Center);
            area.draw(&Text::new(e.label, (62, y), font(17).pos(left)))?;
            if !e.detail.is_empty() {
                y += DETAIL;
                area.draw(&Text::new(e.detail, (62, y), font(15).pos(left)))?;
            }
        }
    }
    Ok(())
}

/// A line in the legend: its name, and what it measures on a second line if anything.
struct Entry {
    label: String,
    detail: String,
    colour: RGBColor,
    stroke: Stroke,
}

fn font(size: u32) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&BLACK)
}

fn bold(size: u32) -> TextStyle<'static> {
    ("sans-serif", size, FontStyle::Bold)
        .into_font()
        .color(&BLACK)
}

/// The distinct items, ascending.
fn sorted<T: Ord>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut out: Vec<T> = items.collect();
    out.sort();
    out.dedup();
    out
}

fn join(items: &[u32]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!(
            "{} and {last}",
            rest.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Ticks for a ratio axis from 0 to at least `top`: five or six, at a round step.
fn ratio_ticks(top: f64) -> Vec<f64> {
    let step = [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        .into_iter()
        .find(|step| top / step <= 6.0)
        .unwrap_or(top / 5.0);
    (0..)
        .map(|i: u32| f64::from(i) * step)
        .take_while(|t| *t < top + step)
        .collect()
}

/// Ticks for a log axis of rates: powers of ten, or if fewer than three of those fall in
/// `range`, 1-2-5 steps, or finer steps still.
fn rate_ticks(range: &std::ops::Range<f64>) -> Vec<f64> {
    let steps: [&[f64]; 4] = [
        &[1.0],
        &[1.0, 2.0, 5.0],
        &[1.0, 1.5, 2.0, 3.0, 5.0, 7.0],
        &[1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0],
    ];
    let (lo, hi) = (range.start.max(1.0), range.end.max(1.0));
    let decades = lo.log10().floor() as i32..=hi.log10().ceil() as i32;
    let mut ticks = vec![];
    for mantissas in steps {
        ticks = decades
            .clone()
            .flat_map(|e| mantissas.iter().map(move |m| m * 10f64.powi(e)))
            .filter(|t| (lo..=hi).contains(t))
            .collect();
        if ticks.len() >= 3 {
            break;
        }
    }
    ticks
}

/// A ratio tick: one or two decimals (so `1.0`, never `1`, which could be taken for a
/// concurrency).
fn ratio_label(y: f64) -> String {
    let text = format!("{y:.2}");
    text.strip_suffix('0').map_or(text.clone(), str::to_owned)
}

/// A keys/s tick: `500`, `2k`, `1.5M`.
fn rate_label(y: f64) -> String {
    if y >= 1e6 {
        format!("{}M", trim(format!("{:.2}", y / 1e6)))
    } else if y >= 1e3 {
        format!("{}k", trim(format!("{:.1}", y / 1e3)))
    } else {
        format!("{y:.0}")
    }
}

/// `1.50` → `1.5`, `2.00` → `2`.
fn trim(number: String) -> String {
    if number.contains('.') {
        number
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_owned()
    } else {
        number
    }
}

/// The distinct items, in first-seen order.
pub(super) fn unique<T: PartialEq>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

/// A rate in keys/s: `1.23M`, `15.7k`, `950`.
pub(super) fn rate(keys_per_sec: f64) -> String {
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

    fn measure(keys_per_sec: f64) -> Measure {
        Measure {
            keys: 0,
            calls: 0,
            seconds: 1.0,
            keys_per_sec,
            p50_us: 100,
            p99_us: 200,
        }
    }

    const BACKENDS: [(&str, &str, &str, f64); 3] = [
        ("memory", "HashMap insert", "HashMap overwrite", 2e6),
        ("redis", "SET NX PX", "SET PX", 40e3),
        ("postgres", "INSERT … ON CONFLICT DO NOTHING", "UPDATE", 8e3),
    ];

    /// A report of three backends at 1, 4, 16 and 64 workers and each of `batches`.
    fn report(batches: &[u32]) -> Report {
        let mut cells = vec![];
        for (backend, raw_operation, settle, base) in BACKENDS {
            for &batch in batches {
                for (i, concurrency) in [1u32, 4, 16, 64].into_iter().enumerate() {
                    let raw = base * f64::from(concurrency).sqrt() * f64::from(batch).sqrt();
                    let by_hand = raw * 0.5;
                    let idem = by_hand * (0.6 + 0.1 * i as f64);
                    cells.push(Cell {
                        backend,
                        url: format!("{backend}://bench"),
                        raw_operation,
                        by_hand_operation: format!("{raw_operation}, then {settle}"),
                        concurrency,
                        batch,
                        raw: measure(raw),
                        by_hand: measure(by_hand),
                        claim_complete: measure(idem),
                        replay: measure(raw * 1.5),
                        claim_complete_vs_by_hand: idem / by_hand,
                        claim_complete_vs_raw: idem / raw,
                        replay_vs_raw: 1.5,
                    });
                }
            }
        }
        Report {
            version: "0.0.0",
            release_build: true,
            cpus: 2,
            duration_ms: 2000,
            provenance: Provenance {
                command: "idem bench -b memory: --markdown".into(),
                date: "2026-01-02".into(),
                commit: "abc1234".into(),
            },
            cells,
        }
    }

    /// What each `<text>` element says.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .map(|t| {
                let body = &t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()];
                body.trim().replace("&apos;", "'").replace("&amp;", "&")
            })
            .collect()
    }

    /// Every `#RRGGBB` colour in the SVG.
    fn colours(svg: &str) -> Vec<(u8, u8, u8)> {
        let hex = |s: &str| u8::from_str_radix(s, 16).ok();
        svg.match_indices('#')
            .filter_map(|(i, _)| {
                let c = svg.get(i + 1..i + 7)?;
                Some((hex(&c[0..2])?, hex(&c[2..4])?, hex(&c[4..6])?))
            })
            .collect()
    }

    /// WCAG's contrast ratio of a colour against white.
    fn contrast_on_white((r, g, b): (u8, u8, u8)) -> f64 {
        let linear = |c: u8| {
            let c = f64::from(c) / 255.0;
            if c <= 0.040_45 {
                c / 12.92
            } else {
                ((c + 0.055) / 1.055).powf(2.4)
            }
        };
        let luminance = 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b);
        1.05 / (luminance + 0.05)
    }

    #[test]
    fn the_plot_labels_every_line_and_each_measured_concurrency_once() {
        let texts = texts(&report(&[1]).svg().unwrap());
        let count = |s: &str| texts.iter().filter(|t| *t == s).count();
        for (backend, raw_operation, settle, _) in BACKENDS {
            assert_eq!(count(backend), 1, "{backend} in {texts:?}");
            assert_eq!(count(&format!("{backend} idem")), 1, "{texts:?}");
            assert_eq!(count(&format!("{backend} by hand")), 1, "{texts:?}");
            assert_eq!(count(&format!("{backend} raw")), 1, "{texts:?}");
            assert_eq!(count(raw_operation), 1, "{raw_operation} in {texts:?}");
            let by_hand = format!("{raw_operation}, then {settle}");
            assert_eq!(count(&by_hand), 1, "{by_hand} in {texts:?}");
        }
        for tick in ["1", "4", "16", "64"] {
            assert_eq!(count(tick), 1, "tick {tick} in {texts:?}");
        }
        assert_eq!(count("1 = as fast as by hand"), 1, "{texts:?}");
        assert_eq!(
            count("idem bench: what idem costs over doing it by hand"),
            1,
            "{texts:?}"
        );
        assert_eq!(count("batch 1 (claim)"), 1, "{texts:?}");
        assert!(
            texts.iter().any(|t| t.contains("2s per measurement")),
            "{texts:?}"
        );
        let mut distinct = texts.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), texts.len(), "a text twice: {texts:?}");
    }

    #[test]
    fn the_plot_has_a_column_per_batch_size() {
        let texts = texts(&report(&[128, 1]).svg().unwrap());
        let count = |s: &str| texts.iter().filter(|t| *t == s).count();
        assert_eq!(count("batch 1 (claim)"), 1, "{texts:?}");
        assert_eq!(count("batch 128 (claim_many)"), 1, "{texts:?}");
        for tick in ["1", "4", "16", "64"] {
            assert_eq!(count(tick), 2, "tick {tick} in {texts:?}");
        }
        for (backend, ..) in BACKENDS {
            assert_eq!(count(backend), 1, "{backend} in {texts:?}");
        }
        let empty = Report {
            cells: vec![],
            ..report(&[1])
        };
        assert!(empty.svg().is_ok());
    }

    #[test]
    fn the_plot_colours_stand_out_on_white() {
        let svg = report(&[1, 128]).svg().unwrap();
        let used = colours(&svg);
        for colour in &used {
            if *colour != (255, 255, 255) {
                assert!(
                    contrast_on_white(*colour) >= 3.0,
                    "{colour:?} is too pale on white"
                );
            }
        }
        for (i, _) in BACKENDS.iter().enumerate() {
            let RGBColor(r, g, b) = COLOURS[i];
            assert!(used.contains(&(r, g, b)), "backend {i}'s colour unused");
        }
        assert!(contrast_on_white((0xF0, 0xE4, 0x42)) < 3.0, "yellow passes");
    }

    #[test]
    fn the_legend_fits_every_backend() {
        let height = |report: &Report| -> u32 {
            let svg = report.svg().unwrap();
            let at = svg.find("height=\"").unwrap() + 8;
            svg[at..].split('"').next().unwrap().parse().unwrap()
        };
        let three = report(&[1]);
        let one = Report {
            cells: three.cells[..4].to_vec(),
            ..three.clone()
        };
        assert_eq!(height(&one), TITLE + RATIO + RATES + FOOTER);
        // Three backends' legend is taller than the charts: the plot grows to hold it.
        assert!(legend_height(3) > RATIO + RATES);
        assert_eq!(height(&three), TITLE + legend_height(3) + FOOTER);
        assert!(legend_rates_top(8) >= LEGEND_TOP + 8 * ENTRY);
    }

    #[test]
    fn the_markdown_has_its_provenance_and_a_row_per_cell() {
        let report = report(&[1, 128]);
        let md = report.markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(
            lines[0],
            "`idem bench -b memory: --markdown` on 2026-01-02, commit `abc1234`, 2 cores \
             (release build, 2s per measurement, idem-cli 0.0.0)"
        );
        let rows: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.starts_with('|'))
            .collect();
        assert_eq!(rows.len(), 2 + report.cells.len(), "{md}");
        assert!(rows[0].contains("| idem ÷ by hand |"), "{md}");
        assert_eq!(rows[1].matches("---:").count(), 9, "{md}");
        let first = &report.cells[0];
        assert_eq!(
            rows[2],
            format!(
                "| memory | 1 | 1 | {} | {} | {:.2} | {} | {:.2} | {} | 1.50 |",
                rate(first.claim_complete.keys_per_sec),
                rate(first.by_hand.keys_per_sec),
                first.claim_complete_vs_by_hand,
                rate(first.raw.keys_per_sec),
                first.claim_complete_vs_raw,
                rate(first.replay.keys_per_sec),
            )
        );
        for row in rows.iter().filter(|r| !r.contains("---")) {
            assert_eq!(row.matches(" | ").count(), 9, "{row}");
        }
        assert!(
            md.contains("redis `SET NX PX, then SET PX`") && md.contains("redis `SET NX PX`"),
            "{md}"
        );
        // Two URLs of one backend are told apart.
        let mut two = report.clone();
        two.cells[0].url = "memory://other".into();
        assert!(
            two.markdown()
                .contains("| memory `memory://other` | 1 | 1 |")
        );
    }

    #[test]
    fn the_table_names_both_baselines() {
        let table = report(&[1]).table();
        for text in [
            "idem keys/s",
            "by hand keys/s",
            "idem ÷ by hand",
            "raw keys/s",
            "idem ÷ raw",
            "by hand = memory: HashMap insert, then HashMap overwrite; redis: SET NX PX, then SET PX",
            "raw = memory: HashMap insert; redis: SET NX PX",
        ] {
            assert!(table.contains(text), "{text} in {table}");
        }
    }

    #[test]
    fn ratio_ticks_are_round_and_reach_the_top() {
        assert_eq!(ratio_ticks(1.2).len(), 7);
        assert_eq!(ratio_ticks(3.0), [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
        assert_eq!(ratio_label(1.0), "1.0");
        assert_eq!(ratio_label(0.25), "0.25");
        assert_eq!(ratio_label(0.6000000001), "0.6");
        assert_eq!(rate_label(1_500_000.0), "1.5M");
        assert_eq!(rate_label(20_000.0), "20k");
        assert_eq!(join(&[1, 16, 128]), "1, 16 and 128");
        assert_eq!(rate_ticks(&(50.0..20_000.0)), [100.0, 1000.0, 10_000.0]);
        assert_eq!(
            rate_ticks(&(4_000.0..150_000.0)),
            [5000.0, 10_000.0, 20_000.0, 50_000.0, 100_000.0]
        );
        assert_eq!(
            rate_ticks(&(22_000.0..146_000.0)),
            [30_000.0, 50_000.0, 70_000.0, 100_000.0]
        );
    }
}
