//! What the demo prints, and the idem-kafka counters it reads.

use std::fmt;
use std::time::Duration;

use comfy_table::{CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use idem_kafka::metrics::{DEAD_LETTERED, EXECUTED, REPLAYED};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

use super::idem_side::{CrashAt, IdemRun};
use super::naive::NaiveRun;
use super::plan::{DLQ, PARTITIONS, Plan};
use crate::error::{Error, Result};

/// idem-kafka's `metrics` counters, through a recorder installed for this process.
pub struct Counters {
    snapshotter: Snapshotter,
}

/// The counters' totals over every partition and instance.
#[derive(Clone, Copy, Debug, Default)]
pub struct Totals {
    /// Handlers run to completion.
    pub executed: u64,
    /// Duplicates answered from the store.
    pub replayed: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
}

impl Counters {
    /// Installs the recorder (once per process).
    pub fn install() -> Result<Self> {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .map_err(|e| Error::Refused(format!("metrics recorder: {e}")))?;
        Ok(Counters { snapshotter })
    }

    /// The totals since the recorder was installed (read once: a snapshot resets them).
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let DebugValue::Counter(n) = value else {
                continue;
            };
            match key.key().name() {
                EXECUTED => t.executed += n,
                REPLAYED => t.replayed += n,
                DEAD_LETTERED => t.dead_lettered += n,
                _ => {}
            }
        }
        t
    }
}

/// Everything the report says.
pub struct Report<'a> {
    /// What was sent.
    pub plan: &'a Plan,
    /// The idem side's backend, as shown.
    pub backend: String,
    /// How often the naive side commits.
    pub commit_every: u64,
    /// Where the idem side crashed.
    pub at: CrashAt,
    /// The naive side.
    pub naive: NaiveRun,
    /// Its ledger: (payments charged, charges, payments charged more than once).
    pub naive_ledger: (u32, u32, u32),
    /// The idem side.
    pub idem: IdemRun,
    /// Its ledger.
    pub idem_ledger: (u32, u32, u32),
    /// idem-kafka's counters.
    pub counters: Totals,
    /// How long the whole demo took.
    pub elapsed: Duration,
}

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.plan;
        let (n_charged, n_charges, n_twice) = self.naive_ledger;
        let (i_charged, i_charges, i_twice) = self.idem_ledger;
        let letters: u64 = self.idem.dead_letters.values().sum();
        writeln!(
            f,
            "idem demo: {} payment events, {} of them sent twice, and {} poison message(s): {} messages",
            p.payments,
            p.duplicates,
            p.poison,
            p.events.len()
        )?;
        writeln!(
            f,
            "on an in-process Kafka (librdkafka MockCluster, {PARTITIONS} partitions). Each consumer crashes {} time(s)",
            self.naive.crashes.max(self.idem.crashes)
        )?;
        writeln!(
            f,
            "after charging and before committing its offsets, and is restarted.\n"
        )?;
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED)
            .set_header(["", "naive consumer", "idem consumer"]);
        t.add_row([
            "deliveries (crashes)".to_owned(),
            format!("{} ({})", self.naive.delivered, self.naive.crashes),
            format!("{} ({})", self.idem.settled, self.idem.crashes),
        ]);
        t.add_row([
            "payments charged".to_owned(),
            n_charged.to_string(),
            i_charged.to_string(),
        ]);
        t.add_row([
            "charges in all".to_owned(),
            n_charges.to_string(),
            i_charges.to_string(),
        ]);
        t.add_row([
            "payments charged more than once".to_owned(),
            n_twice.to_string(),
            i_twice.to_string(),
        ]);
        t.add_row([
            "duplicates answered from the store".to_owned(),
            "-".to_owned(),
            self.counters.replayed.to_string(),
        ]);
        t.add_row([
            "poison messages".to_owned(),
            format!("{} skipped", self.naive.skipped.len()),
            format!("{} dead-lettered", self.idem.dead_keys),
        ]);
        for i in 1..3 {
            if let Some(col) = t.column_mut(i) {
                col.set_cell_alignment(CellAlignment::Right);
            }
        }
        writeln!(f, "{t}\n")?;
        writeln!(
            f,
            "naive: {n_twice} payment(s) charged more than once ({} extra charges): the producer's copies, and after each crash the messages since its last commit (it commits every {} messages).",
            n_charges.saturating_sub(n_charged),
            self.commit_every
        )?;
        let reasons: Vec<String> = self
            .idem
            .dead_letters
            .iter()
            .map(|(reason, n)| format!("{n} {reason}"))
            .collect();
        if i_twice == 0 {
            writeln!(
                f,
                "idem:  every payment charged exactly once ({}); {} duplicate deliveries answered with the stored receipt; {} poison message(s) dead-lettered to {DLQ} ({} letters: {}).",
                self.backend,
                self.counters.replayed,
                self.idem.dead_keys,
                letters,
                reasons.join(", ")
            )?;
        } else {
            writeln!(
                f,
                "idem:  FAILED: {i_twice} payment(s) charged more than once ({}).",
                self.backend
            )?;
        }
        if matches!(self.at, CrashAt::BeforeRecord) {
            writeln!(
                f,
                "       (forced: the idem consumer crashed after charging and before idem recorded the charge, the case a lease cannot cover; see the README's guarantee table)"
            )?;
        }
        writeln!(f, "finished in {:.1} s", self.elapsed.as_secs_f64())
    }
}
