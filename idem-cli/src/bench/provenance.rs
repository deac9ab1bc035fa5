//! Where a run's figures come from: the command that ran (to run it again), the date and
//! the commit.

use std::process::{Command, Stdio};

use idem_once::backend::driver::redact;
use serde::Serialize;

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
