//! Reading a dead-letter topic back: which letters it holds and what their headers say.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_core::Key;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message as _};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::dead_letter::write::LogContext;
use crate::dead_letter::{
    HEADER_ATTEMPTS, HEADER_DROPPED, HEADER_ERROR, HEADER_KEY, HEADER_NAMESPACE, HEADER_OFFSET,
    HEADER_PARTITION, HEADER_REASON, HEADER_TOPIC,
};
use crate::{Error, Result};

/// Which letters of a dead-letter topic to read. The default selects every letter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Selection {
    /// Only these partitions of the dead-letter topic (empty: all).
    pub partitions: Vec<i32>,
    /// Only letters at this offset or later.
    pub from_offset: Option<i64>,
    /// Only letters at this offset or earlier.
    pub to_offset: Option<i64>,
    /// Only letters whose [`HEADER_REASON`] is this (`poisoned`, `mismatch`, …).
    pub reason: Option<String>,
}

impl Selection {
    /// Every letter.
    pub fn new() -> Self {
        Selection::default()
    }

    /// Sets [`Selection::partitions`].
    pub fn with_partitions(mut self, partitions: impl IntoIterator<Item = i32>) -> Self {
        self.partitions = partitions.into_iter().collect();
        self
    }

    /// Sets [`Selection::from_offset`].
    pub fn with_from_offset(mut self, offset: impl Into<Option<i64>>) -> Self {
        self.from_offset = offset.into();
        self
    }

    /// Sets [`Selection::to_offset`].
    pub fn with_to_offset(mut self, offset: impl Into<Option<i64>>) -> Self {
        self.to_offset = offset.into();
        self
    }

    /// Sets [`Selection::reason`].
    pub fn with_reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// Whether a letter passes the reason filter (positions are filtered while reading).
    fn keeps(&self, letter: &DeadLetter) -> bool {
        self.reason
            .as_deref()
            .is_none_or(|r| letter.reason.as_deref() == Some(r))
    }
}

/// One letter of a dead-letter topic, with its idem headers read. A header that is
/// missing leaves its field `None`; one that is there but unreadable (not UTF-8, not a
/// number) does too, and says why in [`DeadLetter::problems`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The dead-letter topic.
    pub topic: String,
    /// Its partition in the dead-letter topic.
    pub partition: i32,
    /// Its offset in the dead-letter topic.
    pub offset: i64,
    /// The letter's timestamp, ms since the epoch.
    pub timestamp_ms: Option<i64>,
    /// The original message key.
    pub message_key: Option<Bytes>,
    /// The original payload.
    pub payload: Bytes,
    /// Every header, in order: the original message's, then idem's.
    pub headers: Vec<(String, Option<Bytes>)>,
    /// [`HEADER_TOPIC`]: the topic the message came from.
    pub original_topic: Option<String>,
    /// [`HEADER_PARTITION`].
    pub original_partition: Option<i32>,
    /// [`HEADER_OFFSET`].
    pub original_offset: Option<i64>,
    /// [`HEADER_KEY`]: the idempotency key, `namespace/id`.
    pub key: Option<String>,
    /// [`HEADER_NAMESPACE`]: the key's namespace (letters written before it existed lack it).
    pub namespace: Option<String>,
    /// [`HEADER_REASON`].
    pub reason: Option<String>,
    /// [`HEADER_ERROR`].
    pub error: Option<String>,
    /// [`HEADER_ATTEMPTS`].
    pub attempts: Option<u32>,
    /// [`HEADER_DROPPED`]: set when the letter was written without the original payload,
    /// key and headers (it was over the producer's size limit); it cannot be replayed.
    pub dropped: Option<String>,
    /// What could not be read, one line each.
    pub problems: Vec<String>,
}

impl DeadLetter {
    /// `<topic>/<partition>/<offset>`: where the letter is, which names it.
    pub fn position(&self) -> String {
        format!("{}/{}/{}", self.topic, self.partition, self.offset)
    }

    /// Where a replay sends the letter (the original topic and partition), or why it
    /// cannot be replayed.
    pub fn destination(&self) -> Result<(&str, i32), String> {
        if let Some(dropped) = &self.dropped {
            return Err(format!("the letter holds no original: {dropped}"));
        }
        match (&self.original_topic, self.original_partition) {
            (Some(t), Some(p)) if !t.is_empty() && p >= 0 => Ok((t, p)),
            (None, _) => Err(self.missing(HEADER_TOPIC)),
            (Some(t), _) if t.is_empty() => Err(format!("header {HEADER_TOPIC} is empty")),
            (_, Some(p)) => Err(format!("header {HEADER_PARTITION} is {p}")),
            (_, None) => Err(self.missing(HEADER_PARTITION)),
        }
    }

    fn missing(&self, header: &str) -> String {
        let why = self
            .problems
            .iter()
            .find(|p| p.contains(header))
            .cloned()
            .unwrap_or_else(|| format!("no header {header}"));
        format!("{why}: not written by idem-kafka, so where it came from is unknown")
    }

    /// The idempotency key of the dead-lettered message, if the letter names one and it is
    /// valid. The namespace comes from [`HEADER_NAMESPACE`] when present, else from the key
    /// text up to its first `/`.
    pub fn idem_key(&self) -> Option<Result<Key, String>> {
        let text = self.key.as_deref()?;
        let split = match self.namespace.as_deref() {
            Some(ns) => text
                .strip_prefix(ns)
                .and_then(|rest| rest.strip_prefix('/'))
                .map(|id| (ns, id)),
            None => text.split_once('/'),
        };
        Some(match split {
            Some((ns, id)) => Key::new(ns, id).map_err(|e| format!("header {HEADER_KEY}: {e}")),
            None => Err(format!(
                "header {HEADER_KEY} {text:?} is not namespace/id of its namespace"
            )),
        })
    }

    /// Reads a consumed letter. Never fails: what cannot be read is noted in `problems`.
    fn read(m: &BorrowedMessage<'_>) -> Self {
        let (headers, problem) = read_headers(m);
        let problems = Vec::from_iter(problem);
        let mut letter = DeadLetter {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            timestamp_ms: m.timestamp().to_millis(),
            message_key: m.key().map(Bytes::copy_from_slice),
            payload: m.payload().map(Bytes::copy_from_slice).unwrap_or_default(),
            headers,
            original_topic: None,
            original_partition: None,
            original_offset: None,
            key: None,
            namespace: None,
            reason: None,
            error: None,
            attempts: None,
            dropped: None,
            problems,
        };
        let mut text = |name: &str| letter_text(&letter.headers, name, &mut letter.problems);
        let original_topic = text(HEADER_TOPIC);
        let partition = text(HEADER_PARTITION);
        let offset = text(HEADER_OFFSET);
        let key = text(HEADER_KEY);
        let namespace = text(HEADER_NAMESPACE);
        let reason = text(HEADER_REASON);
        let error = text(HEADER_ERROR);
        let attempts = text(HEADER_ATTEMPTS);
        let dropped = text(HEADER_DROPPED);
        letter.original_partition = number(HEADER_PARTITION, partition, &mut letter.problems);
        letter.original_offset = number(HEADER_OFFSET, offset, &mut letter.problems);
        letter.attempts = number(HEADER_ATTEMPTS, attempts, &mut letter.problems);
        letter.original_topic = original_topic;
        letter.key = key;
        letter.namespace = namespace;
        letter.reason = reason;
        letter.error = error;
        letter.dropped = dropped;
        letter
    }
}

/// The headers of `m` that can be read, and a note of those that cannot (rdkafka panics on
/// a header name that is not UTF-8; see [`each_header`](crate::message::each_header)).
fn read_headers(m: &BorrowedMessage<'_>) -> (Vec<(String, Option<Bytes>)>, Option<String>) {
    let mut headers = Vec::new();
    let Some(h) = m.headers() else {
        return (headers, None);
    };
    let unreadable = crate::message::each_header(h, |name, value| {
        headers.push((name.to_owned(), value.map(Bytes::copy_from_slice)));
    });
    let problem =
        (unreadable > 0).then(|| format!("{unreadable} header name(s) not UTF-8: left unread"));
    (headers, problem)
}

/// The last header `name` as text, or `None` (noting why when it is there but unreadable).
fn letter_text(
    headers: &[(String, Option<Bytes>)],
    name: &str,
    problems: &mut Vec<String>,
) -> Option<String> {
    let (_, value) = headers.iter().rev().find(|(k, _)| k == name)?;
    let Some(value) = value else {
        problems.push(format!("header {name} has no value"));
        return None;
    };
    match std::str::from_utf8(value) {
        Ok(v) => Some(v.to_owned()),
        Err(e) => {
            problems.push(format!(
                "header {name} is not UTF-8 (at byte {})",
                e.valid_up_to()
            ));
            None
        }
    }
}

fn number<T: std::str::FromStr>(
    name: &str,
    text: Option<String>,
    problems: &mut Vec<String>,
) -> Option<T> {
    let text = text?;
    let n = text.trim().parse().ok();
    if n.is_none() {
        problems.push(format!("header {name} {text:?} is not a number"));
    }
    n
}

/// Reads the letters of dead-letter topic `topic` that `select` picks, in partition and
/// offset order, from each partition's low watermark (or `from_offset`) to its end (or
/// `to_offset`), then stops. The end is where the broker reports the read has caught up
/// (librdkafka's partition EOF, a signal, not a timeout); a partition that is empty by its
/// watermarks is not read at all, so an empty topic answers at once. No group joins and
/// nothing is committed.
///
/// `timeout` bounds each metadata request and the wait for any next letter; a topic that
/// does not exist is [`Error::UnknownTopic`], a broker that does not answer is
/// [`Error::Kafka`], a name no topic can have (empty, over 249 bytes, or with NUL) is
/// [`Error::Config`]. A timeout over `i32::MAX` milliseconds (librdkafka's bound) is cut
/// to it.
pub fn read_letters(
    config: &ClientConfig,
    topic: &str,
    select: &Selection,
    timeout: Duration,
) -> Result<Vec<DeadLetter>> {
    crate::settings::check_topic(topic)?;
    // librdkafka takes timeouts as i32 milliseconds (about 24.8 days); longer would wrap.
    let timeout = timeout.min(Duration::from_millis(i32::MAX as u64));
    let mut config = config.clone();
    if config.get("group.id").is_none() {
        config.set("group.id", "idem-dlq-reader");
    }
    if config.get("fetch.wait.max.ms").is_none() {
        config.set("fetch.wait.max.ms", "100");
    }
    config
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true");
    let consumer: BaseConsumer<LogContext> = config
        .create_with_context(LogContext)
        .map_err(|e| Error::kafka("creating the dead-letter reader", e))?;
    let starts = starts(&consumer, topic, select, timeout)?;
    let mut letters = Vec::new();
    if starts.is_empty() {
        return Ok(letters);
    }
    let mut tpl = TopicPartitionList::new();
    for (&p, &start) in &starts {
        tpl.add_partition_offset(topic, p, Offset::Offset(start))
            .map_err(|e| Error::kafka("assigning the dead-letter topic", e))?;
    }
    consumer
        .assign(&tpl)
        .map_err(|e| Error::kafka("assigning the dead-letter topic", e))?;
    let mut reading: BTreeSet<i32> = starts.into_keys().collect();
    let last_wanted = select.to_offset.unwrap_or(i64::MAX);
    let mut last = Instant::now();
    while !reading.is_empty() {
        match consumer.poll(Duration::from_millis(100)) {
            None if last.elapsed() >= timeout => {
                return Err(Error::kafka(
                    "reading the dead-letter topic: nothing within the timeout",
                    KafkaError::MessageConsumption(RDKafkaErrorCode::OperationTimedOut),
                ));
            }
            None => {}
            Some(Err(KafkaError::PartitionEOF(p))) => {
                last = Instant::now();
                reading.remove(&p);
            }
            Some(Err(e)) => return Err(Error::kafka("reading the dead-letter topic", e)),
            Some(Ok(m)) => {
                last = Instant::now();
                if !reading.contains(&m.partition()) || m.offset() > last_wanted {
                    continue;
                }
                let letter = DeadLetter::read(&m);
                if select.keeps(&letter) {
                    letters.push(letter);
                }
                if m.offset() >= last_wanted {
                    reading.remove(&m.partition());
                }
            }
        }
    }
    letters.sort_by_key(|l| (l.partition, l.offset));
    Ok(letters)
}

/// For each selected partition with something to read, the first offset to read.
///
/// The high watermark only tells an empty partition: tansu reports one past the base
/// offset of the last record batch, which is below the true end when that batch holds
/// several records, so the read runs to the partition's EOF instead.
fn starts(
    consumer: &BaseConsumer<LogContext>,
    topic: &str,
    select: &Selection,
    timeout: Duration,
) -> Result<BTreeMap<i32, i64>> {
    let metadata = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| Error::kafka("reading the dead-letter topic's metadata", e))?;
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Err(Error::UnknownTopic(topic.to_owned()));
    };
    match t.error() {
        None => {}
        Some(e) if RDKafkaErrorCode::from(e) == RDKafkaErrorCode::UnknownTopicOrPartition => {
            return Err(Error::UnknownTopic(topic.to_owned()));
        }
        Some(e) => {
            return Err(Error::kafka(
                "reading the dead-letter topic's metadata",
                KafkaError::MetadataFetch(e.into()),
            ));
        }
    }
    let all: Vec<i32> = t.partitions().iter().map(|p| p.id()).collect();
    if all.is_empty() {
        return Err(Error::UnknownTopic(topic.to_owned()));
    }
    if let Some(p) = select.partitions.iter().find(|p| !all.contains(p)) {
        return Err(Error::Config(format!(
            "topic {topic} has no partition {p} (it has {})",
            all.len()
        )));
    }
    let mut out = BTreeMap::new();
    for p in all {
        if !select.partitions.is_empty() && !select.partitions.contains(&p) {
            continue;
        }
        let (low, high) = consumer
            .fetch_watermarks(topic, p, timeout)
            .map_err(|e| Error::kafka("reading the dead-letter topic's watermarks", e))?;
        let start = select.from_offset.map_or(low, |f| f.max(low));
        if low < high && select.to_offset.is_none_or(|to| start <= to) {
            out.insert(p, start);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_no_topic_can_have_is_refused_before_any_client_call() {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", "127.0.0.1:1");
        let any = Selection::default();
        for name in ["", "a\0b", &"t".repeat(513)] {
            let err = read_letters(&config, name, &any, Duration::from_secs(1)).unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{name:?}: {err}");
        }
    }

    fn letter(key: Option<&str>, namespace: Option<&str>) -> DeadLetter {
        DeadLetter {
            topic: "t.dlq".into(),
            partition: 0,
            offset: 3,
            timestamp_ms: None,
            message_key: None,
            payload: Bytes::new(),
            headers: Vec::new(),
            original_topic: Some("t".into()),
            original_partition: Some(1),
            original_offset: Some(7),
            key: key.map(Into::into),
            namespace: namespace.map(Into::into),
            reason: Some("poisoned".into()),
            error: None,
            attempts: Some(3),
            dropped: None,
            problems: Vec::new(),
        }
    }

    #[test]
    fn the_key_splits_at_its_namespace() {
        let k = letter(Some("a/b/c"), Some("a/b"))
            .idem_key()
            .unwrap()
            .unwrap();
        assert_eq!((k.namespace(), k.id()), ("a/b", "c"));
        let k = letter(Some("a/b/c"), None).idem_key().unwrap().unwrap();
        assert_eq!((k.namespace(), k.id()), ("a", "b/c"));
        assert!(letter(None, None).idem_key().is_none());
        assert!(letter(Some("nosplit"), None).idem_key().unwrap().is_err());
        assert!(letter(Some("x/y"), Some("z")).idem_key().unwrap().is_err());
        assert!(letter(Some("ns/"), None).idem_key().unwrap().is_err());
    }

    #[test]
    fn a_letter_without_its_origin_cannot_be_sent_back() {
        let mut dropped = letter(None, None);
        dropped.dropped = Some("payload (9 bytes)".into());
        let why = dropped.destination().unwrap_err();
        assert!(
            why.contains("holds no original: payload (9 bytes)"),
            "{why}"
        );
        let mut l = letter(None, None);
        assert_eq!(l.destination(), Ok(("t", 1)));
        l.original_partition = None;
        l.problems
            .push("header idem-original-partition is not UTF-8".into());
        assert!(l.destination().unwrap_err().contains("not UTF-8"));
        l.original_topic = None;
        assert!(
            l.destination()
                .unwrap_err()
                .contains("no header idem-original-topic")
        );
    }

    #[test]
    fn headers_are_read_forgivingly() {
        let headers = vec![
            ("a".to_owned(), Some(Bytes::from_static(b"1"))),
            ("a".to_owned(), Some(Bytes::from_static(b"2"))),
            ("bin".to_owned(), Some(Bytes::from_static(&[0xff, 0x00]))),
            ("none".to_owned(), None),
        ];
        let mut problems = Vec::new();
        assert_eq!(
            letter_text(&headers, "a", &mut problems).as_deref(),
            Some("2")
        );
        assert_eq!(letter_text(&headers, "bin", &mut problems), None);
        assert_eq!(letter_text(&headers, "none", &mut problems), None);
        assert_eq!(letter_text(&headers, "absent", &mut problems), None);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert_eq!(number::<u32>("n", Some("x".into()), &mut problems), None);
        assert_eq!(
            number::<u32>("n", Some(" 4".into()), &mut problems),
            Some(4)
        );
        assert_eq!(problems.len(), 3);
    }
}
