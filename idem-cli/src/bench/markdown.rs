//! The bench's results as one Markdown table, headed by what says where they come from
//! ([`Provenance`](super::provenance::Provenance)).

use super::report::{HEADER, Report, rate, unique};

/// `text` in a Markdown code span.
fn code(text: &str) -> String {
    if text.contains('`') {
        format!("`` {text} ``")
    } else {
        format!("`{text}`")
    }
}

/// `text` safe in a Markdown table cell.
fn cell(text: &str) -> String {
    text.replace('|', r"\|")
}

impl Report {
    /// The results as one Markdown table, a row per cell: the line before it gives the
    /// command, the date, the commit and the core count; the lines after it say what idem,
    /// by hand and raw are on each backend.
    pub fn markdown(&self) -> String {
        let p = &self.provenance;
        let mut out = format!(
            "{} on {}, commit {}, {} cores ({}, {} per measurement, idem-cli {})\n\n",
            code(&p.command),
            p.date,
            code(&p.commit),
            self.cpus,
            if self.release_build {
                "release build"
            } else {
                "DEBUG BUILD: use --release for figures"
            },
            humantime::format_duration(std::time::Duration::from_millis(self.duration_ms)),
            self.version,
        );
        out.push_str(&format!("| {} |\n", HEADER.join(" | ")));
        let align: Vec<&str> = HEADER
            .iter()
            .enumerate()
            .map(|(i, _)| if i == 0 { ":---" } else { "---:" })
            .collect();
        out.push_str(&format!("|{}|\n", align.join("|")));
        let kinds: Vec<&str> = unique(self.cells.iter().map(|c| c.backend));
        let urls = unique(self.cells.iter().map(|c| (c.backend, c.url.as_str())));
        for c in &self.cells {
            let backend = if kinds.len() == urls.len() {
                c.backend.to_owned()
            } else {
                format!("{} {}", c.backend, code(&c.url))
            };
            let row = [
                cell(&backend),
                c.concurrency.to_string(),
                c.batch.to_string(),
                rate(c.claim_complete.keys_per_sec),
                rate(c.by_hand.keys_per_sec),
                format!("{:.2}", c.claim_complete_vs_by_hand),
                rate(c.raw.keys_per_sec),
                format!("{:.2}", c.claim_complete_vs_raw),
                rate(c.replay.keys_per_sec),
                format!("{:.2}", c.replay_vs_raw),
            ];
            out.push_str(&format!("| {} |\n", row.join(" | ")));
        }
        let ops = |of: Vec<String>| {
            of.iter()
                .map(|o| match o.split_once(": ") {
                    Some((backend, op)) => format!("{backend} {}", code(op)),
                    None => code(o),
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        out.push_str(&format!(
            "\nidem: claim then complete of fresh keys (above batch 1, one `claim_many` and one \
             `settle_many` per batch). By hand: the same two writes with no leases, tokens or \
             fencing, batched alike: {}. Raw: the first write alone, once per key: {}. \
             Replay: claims of completed keys. Every baseline runs through idem's own client, \
             in the same run.\n",
            ops(self.by_hand_operations()),
            ops(self.raw_operations()),
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_spans_and_cells_stay_whole() {
        assert_eq!(code("a`b"), "`` a`b ``");
        assert_eq!(code("SET NX PX"), "`SET NX PX`");
        assert_eq!(cell("a|b"), r"a\|b");
    }
}
