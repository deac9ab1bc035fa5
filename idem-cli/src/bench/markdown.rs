//! The bench's results as one Markdown table, headed by what says where they come from:
//! the command that ran (to run it again), the date, the commit and the core count.

use std::process::{Command, Stdio};

use idem_once::backend::driver::redact;
use serde::Serialize;

use super::report::{Report, rate, unique};

/// Where a run's figures come from.
#[derive(Clone, Debug, Serialize)]
pub struct Provenance {
    /// The command line as it can be run again: `idem bench …`, shell-quoted, passwords
    /// hidden.
    pub command: String,
    /// The day of the run, UTC, `YYYY-MM-DD`.
    pub date: String,
    /// `git rev-parse --short HEAD` where the command ran, or `unknown`.
    pub commit: String,
}

impl Provenance {
    /// This process's: its arguments, today, and the commit of the working directory.
    pub fn here() -> Self {
        let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
        Provenance {
            command: command_line(std::env::args().skip(1)),
            date: now.get(..10).unwrap_or(&now).to_owned(),
            commit: commit(),
        }
    }
}

/// `idem` and `args`, each quoted for a POSIX shell where it needs it, URLs with their
/// passwords hidden.
pub fn command_line(args: impl IntoIterator<Item = String>) -> String {
    let mut words = vec!["idem".to_owned()];
    words.extend(args.into_iter().map(|a| quote(&hide_password(&a))));
    words.join(" ")
}

/// `arg`, or `--flag=value`'s value, with any password in a URL replaced by `***`.
fn hide_password(arg: &str) -> String {
    let (flag, value) = match arg.split_once('=') {
        Some((flag, value)) if flag.starts_with("--") && !flag.contains("://") => {
            (Some(flag), value)
        }
        _ => (None, arg),
    };
    if !value.contains("://") {
        return arg.to_owned();
    }
    // Shown as typed unless the redaction hid something (it also normalises a URL).
    let shown = redact(value);
    let value = if shown.contains("***") || shown.contains("<unparsable URL>") {
        shown
    } else {
        value.to_owned()
    };
    match flag {
        Some(flag) => format!("{flag}={value}"),
        None => value,
    }
}

/// `word` as a POSIX shell reads it back: as it is when it has only plain characters,
/// single-quoted otherwise.
fn quote(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:=,@%+^".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The short commit of the working directory's git checkout, or `unknown` (no git, not a
/// checkout).
fn commit() -> String {
    let out = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output();
    match out {
        Ok(out) if out.status.success() => {
            let commit = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if commit.is_empty() {
                "unknown".into()
            } else {
                commit
            }
        }
        _ => "unknown".into(),
    }
}

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
    fn the_command_line_runs_again_without_its_passwords() {
        let args = [
            "bench",
            "-b",
            "memory:",
            "-b",
            "redis://:s3cret@127.0.0.1:6379/",
            "--backend=postgres://u:pw@db/x",
            "-b",
            "dynamodb://idem?endpoint=http://127.0.0.1:8000",
            "--duration",
            "200ms",
            "it's",
        ]
        .map(String::from);
        let line = command_line(args);
        assert!(!line.contains("s3cret") && !line.contains(":pw@"), "{line}");
        assert_eq!(
            line,
            "idem bench -b memory: -b 'redis://:***@127.0.0.1:6379/' \
             '--backend=postgres://u:***@db/x' -b \
             'dynamodb://idem?endpoint=http://127.0.0.1:8000' --duration 200ms 'it'\\''s'"
        );
        // A URL without a password is shown as typed, not normalised.
        assert_eq!(
            command_line(["-b".into(), "redis://h:6379".into()]),
            "idem -b redis://h:6379"
        );
    }

    #[test]
    fn code_spans_and_cells_stay_whole() {
        assert_eq!(code("a`b"), "`` a`b ``");
        assert_eq!(code("SET NX PX"), "`SET NX PX`");
        assert_eq!(cell("a|b"), r"a\|b");
        assert_eq!(quote(""), "''");
    }

    #[test]
    fn the_commit_is_a_short_hash_or_unknown() {
        let c = commit();
        assert!(
            c == "unknown" || (c.len() >= 4 && c.chars().all(|c| c.is_ascii_hexdigit())),
            "{c}"
        );
    }
}
