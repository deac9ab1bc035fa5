//! `idem dlq`: list a dead-letter topic's letters, and send letters back once. The
//! reading and the replay itself are idem-kafka's (`read_letters`, `Replayer`); this is
//! the command line around them.

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use futures::StreamExt;
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::{DeadLetter, Previous, Replay, Replayer, Reset, Selection, read_letters};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::cli::{
    DlqArgs, DlqCommand, DlqListArgs, DlqReplayArgs, KafkaArgs, LetterArgs, ReasonArg,
};
use crate::confirm::confirm;
use crate::error::{Error, Result};
use crate::ops::{open, print_json};

/// Runs an `idem dlq` subcommand.
pub async fn run(args: DlqArgs) -> Result<()> {
    match args.command {
        DlqCommand::List(a) => list(&a).await,
        DlqCommand::Replay(a) => replay(&a).await,
    }
}

fn kafka_error(context: impl Into<String>) -> impl FnOnce(idem_kafka::Error) -> Error {
    let context = context.into();
    move |source| Error::Kafka {
        context,
        source: Box::new(source),
    }
}

fn client_config(args: &KafkaArgs) -> Result<ClientConfig> {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &args.brokers);
    for kv in &args.kafka_config {
        match kv.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                config.set(k.trim(), v.trim());
            }
            _ => {
                return Err(Error::Usage(format!(
                    "-X {kv:?}: write a librdkafka property as KEY=VALUE"
                )));
            }
        }
    }
    Ok(config)
}

/// The `idem-reason` header value a `--reason` names.
fn reason_text(r: ReasonArg) -> String {
    use clap::ValueEnum;
    r.to_possible_value()
        .map(|v| v.get_name().to_owned())
        .unwrap_or_default()
}

fn selection(args: &LetterArgs) -> Result<Selection> {
    if let (Some(from), Some(to)) = (args.from_offset, args.to_offset)
        && from > to
    {
        return Err(Error::Usage(format!(
            "--from-offset {from} is after --to-offset {to}: nothing to select"
        )));
    }
    let select = Selection::new()
        .with_partitions(args.partition.iter().copied())
        .with_from_offset(args.from_offset)
        .with_to_offset(args.to_offset);
    Ok(match args.reason {
        Some(reason) => select.with_reason(reason_text(reason)),
        None => select,
    })
}

/// Reads the selected letters on a blocking thread (the reader polls librdkafka).
async fn letters(kafka: &KafkaArgs, args: &LetterArgs) -> Result<Vec<DeadLetter>> {
    let config = client_config(kafka)?;
    let select = selection(args)?;
    let topic = args.topic.clone();
    let timeout = kafka.timeout;
    let context = format!("read dead-letter topic {topic}");
    tokio::task::spawn_blocking(move || read_letters(&config, &topic, &select, timeout))
        .await
        .map_err(|e| Error::Refused(format!("the reader thread failed: {e}")))?
        .map_err(kafka_error(context))
}

/// A letter as `--json` shows it.
#[derive(Debug, Serialize)]
struct LetterView<'a> {
    partition: i32,
    offset: i64,
    timestamp_ms: Option<i64>,
    original_topic: Option<&'a str>,
    original_partition: Option<i32>,
    original_offset: Option<i64>,
    key: Option<&'a str>,
    reason: Option<&'a str>,
    error: Option<&'a str>,
    attempts: Option<u32>,
    payload_bytes: usize,
    /// Why it cannot be replayed, if it cannot.
    unreplayable: Option<String>,
    problems: &'a [String],
}

impl<'a> LetterView<'a> {
    fn new(l: &'a DeadLetter) -> Self {
        LetterView {
            partition: l.partition,
            offset: l.offset,
            timestamp_ms: l.timestamp_ms,
            original_topic: l.original_topic.as_deref(),
            original_partition: l.original_partition,
            original_offset: l.original_offset,
            key: l.key.as_deref(),
            reason: l.reason.as_deref(),
            error: l.error.as_deref(),
            attempts: l.attempts,
            payload_bytes: l.payload.len(),
            unreplayable: l.destination().err(),
            problems: &l.problems,
        }
    }
}

fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

/// `topic/partition/offset` of the original message, with `?` for what is unknown.
fn origin(l: &DeadLetter) -> String {
    let q = |v: Option<String>| v.unwrap_or_else(|| "?".into());
    format!(
        "{}/{}/{}",
        q(l.original_topic.clone()),
        q(l.original_partition.map(|p| p.to_string())),
        q(l.original_offset.map(|o| o.to_string()))
    )
}

fn shorten(text: &str, max: usize) -> String {
    let one_line = text.replace('\n', " ");
    match one_line.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &one_line[..at]),
        None => one_line,
    }
}

fn letters_table(letters: &[DeadLetter]) -> Table {
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED).set_header([
        "letter", "original", "reason", "attempts", "key", "error", "notes",
    ]);
    for l in letters {
        table.add_row([
            format!("{}/{}", l.partition, l.offset),
            origin(l),
            or_dash(l.reason.as_deref()),
            or_dash(l.attempts),
            or_dash(l.key.as_deref()),
            shorten(l.error.as_deref().unwrap_or("-"), 60),
            l.problems.join("; "),
        ]);
    }
    table
}

/// `idem dlq list`.
async fn list(args: &DlqListArgs) -> Result<()> {
    let letters = letters(&args.kafka, &args.letters).await?;
    if args.json {
        let views: Vec<LetterView<'_>> = letters.iter().map(LetterView::new).collect();
        return print_json(&views);
    }
    if letters.is_empty() {
        out!("no letters in {} match", args.letters.topic);
        return Ok(());
    }
    out!("{}", letters_table(&letters));
    out!("{} letter(s) in {}", letters.len(), args.letters.topic);
    Ok(())
}

fn check_replay(args: &DlqReplayArgs) -> Result<()> {
    let l = &args.letters;
    let selected = !l.partition.is_empty()
        || l.from_offset.is_some()
        || l.to_offset.is_some()
        || l.reason.is_some();
    match (args.all, selected) {
        (false, false) => Err(Error::Usage(
            "select letters (--partition, --from-offset, --to-offset, --reason) or pass --all"
                .into(),
        )),
        (true, true) => Err(Error::Usage(
            "--all replays every letter: it cannot go with a selection".into(),
        )),
        _ => Ok(()),
    }
}

/// `idem dlq replay`.
async fn replay(args: &DlqReplayArgs) -> Result<()> {
    check_replay(args)?;
    let (target, store) = open(&args.backend.backend).await?;
    if target.kind() == "memory" {
        return Err(Error::Usage(
            "replay needs the consumer's store (it remembers each replay there, and --reset \
             deletes records there); memory: lives only in this process"
                .into(),
        ));
    }
    let letters = letters(&args.kafka, &args.letters).await?;
    let topic = &args.letters.topic;
    if letters.is_empty() {
        out!("no letters in {topic} match: nothing to replay");
        return Ok(());
    }
    let config = client_config(&args.kafka)?;
    let replayer = Replayer::new(&config, store.backend(), args.retention)
        .map_err(kafka_error("create the replay producer"))?
        .reset(args.reset);
    if args.dry_run {
        return dry_run(&replayer, &letters, args.reset).await;
    }
    let reset = if args.reset {
        format!(", deleting their keys' failed records in {target} first")
    } else {
        String::new()
    };
    confirm(
        &format!(
            "send up to {} letter(s) from {topic} back to their topics{reset}",
            letters.len()
        ),
        args.yes.yes,
    )?;
    let bar = progress(letters.len(), args.quiet);
    let mut tally = Tally::default();
    let replayer = &replayer;
    let mut results = futures::stream::iter(&letters)
        .map(|l| async move { (l, replayer.replay(l).await) })
        .buffered(usize::from(args.concurrency));
    while let Some((letter, result)) = results.next().await {
        if let Some(line) = tally.add(letter, result) {
            bar.suspend(|| eprintln!("{line}"));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    out!("{}", tally.summary());
    let unsent = tally.failed + tally.in_progress;
    if unsent > 0 {
        return Err(Error::Refused(format!(
            "{unsent} letter(s) were not sent: run the same command again to retry them"
        )));
    }
    Ok(())
}

fn progress(total: usize, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total as u64);
    if let Ok(style) = ProgressStyle::with_template("replay {bar:30} {pos}/{len} letters {msg}") {
        bar.set_style(style);
    }
    bar
}

/// What the replay did, counted.
#[derive(Debug, Default)]
struct Tally {
    sent: usize,
    already: usize,
    unreplayable: usize,
    in_progress: usize,
    failed: usize,
    deleted: usize,
    kept: usize,
}

impl Tally {
    /// Counts one letter; a line to show for what needs attention.
    fn add(&mut self, l: &DeadLetter, result: idem_kafka::Result<Replay>) -> Option<String> {
        let at = l.position();
        match result {
            Ok(Replay::Sent { reset, .. }) => {
                self.sent += 1;
                match reset {
                    Reset::Deleted => self.deleted += 1,
                    Reset::Kept(_) => self.kept += 1,
                    _ => {}
                }
                None
            }
            Ok(Replay::AlreadySent(_)) => {
                self.already += 1;
                None
            }
            Ok(Replay::Unreplayable(why)) => {
                self.unreplayable += 1;
                Some(format!("{at}: not replayable: {why}"))
            }
            Ok(Replay::InProgress { owner }) => {
                self.in_progress += 1;
                Some(format!("{at}: another replay holds it ({owner})"))
            }
            Ok(Replay::Failed(why)) => {
                self.failed += 1;
                Some(format!("{at}: failed: {why}"))
            }
            Ok(other) => {
                self.failed += 1;
                Some(format!("{at}: {other:?}"))
            }
            Err(e) => {
                self.failed += 1;
                Some(format!("{at}: the store failed: {e}"))
            }
        }
    }

    fn summary(&self) -> String {
        let mut text = format!(
            "sent {} letter(s); {} already sent by an earlier replay (not sent again)",
            self.sent, self.already
        );
        for (n, what) in [
            (self.unreplayable, "not replayable"),
            (self.in_progress, "held by another replay"),
            (self.failed, "failed"),
        ] {
            if n > 0 {
                text.push_str(&format!("; {n} {what}"));
            }
        }
        if self.deleted + self.kept > 0 {
            text.push_str(&format!(
                "\nreset: {} failed record(s) deleted, {} completed or processing record(s) kept",
                self.deleted, self.kept
            ));
        }
        text
    }
}

/// `--dry-run`: what each letter would come to, from the replay records.
async fn dry_run(replayer: &Replayer, letters: &[DeadLetter], reset: bool) -> Result<()> {
    let (mut send, mut already, mut other) = (0, 0, 0);
    for l in letters {
        let at = l.position();
        let (to, partition) = match l.destination() {
            Ok(d) => d,
            Err(why) => {
                other += 1;
                out!("{at}: not replayable: {why}");
                continue;
            }
        };
        let previous = replayer
            .previous(l)
            .await
            .map_err(kafka_error(format!("read the replay record of {at}")))?;
        let key = or_dash(l.key.as_deref());
        match previous {
            Previous::Sent(s) => {
                already += 1;
                out!(
                    "{at}: already sent to {}/{} at offset {}",
                    s.topic,
                    s.partition,
                    s.offset
                );
            }
            Previous::InProgress(owner) => {
                other += 1;
                out!("{at}: another replay holds it ({owner})");
            }
            Previous::New | Previous::Failed(_) => {
                send += 1;
                let reset = if reset {
                    ", after deleting its key's failed record if it has one"
                } else {
                    ""
                };
                out!("{at}: would send to {to}/{partition} (key {key}){reset}");
            }
            // What a later idem-kafka's replay records say: shown, not sent.
            unknown => {
                other += 1;
                out!("{at}: {unknown:?}");
            }
        }
    }
    out!(
        "dry run: {send} letter(s) would be sent, {already} already sent, {other} not sent; nothing was sent"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_named_as_the_header_names_them() {
        let names: Vec<String> = [
            ReasonArg::Poisoned,
            ReasonArg::Mismatch,
            ReasonArg::MissingKey,
            ReasonArg::InvalidKey,
            ReasonArg::MalformedPayload,
        ]
        .into_iter()
        .map(reason_text)
        .collect();
        for name in &names {
            assert!(idem_kafka::Reason::parse(name).is_some(), "{name}");
        }
        assert_eq!(names.len(), 5);
    }

    #[test]
    fn errors_are_shortened_to_one_line() {
        assert_eq!(shorten("a\nb", 10), "a b");
        assert_eq!(shorten("ééééé", 3), "ééé…");
    }

    #[test]
    fn kafka_properties_are_key_value() {
        let args = |x: &[&str]| KafkaArgs {
            brokers: "b:9092".into(),
            kafka_config: x.iter().map(|s| (*s).to_owned()).collect(),
            timeout: std::time::Duration::from_secs(1),
        };
        let c = client_config(&args(&["security.protocol = ssl"])).unwrap();
        assert_eq!(c.get("security.protocol"), Some("ssl"));
        assert_eq!(c.get("bootstrap.servers"), Some("b:9092"));
        assert!(client_config(&args(&["novalue"])).is_err());
        assert!(client_config(&args(&["=x"])).is_err());
    }
}
