//! What the Kafka loop benches share: client settings, unique names, topics, producing, and a probe
//! that times an idem loop from its first claim to its `n`-th settled message.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::message::{BorrowedMessage, Header, Headers, Message as _, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::{Point, Probe, Verdict};
use tokio::sync::Notify;

/// A consumer's settings: earliest offsets, quick group join on tansu, quick refetch.
pub fn config(brokers: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("fetch.queue.backoff.ms", "10");
    c
}

/// What every loop does per message besides its bookkeeping: read the key, answer.
pub fn handle(key: Option<&[u8]>) -> Bytes {
    Bytes::from(format!("ok {}", key.map_or(0, <[u8]>::len)))
}

/// A message's `idempotency-key` header.
pub fn header_key<'m>(m: &'m BorrowedMessage<'_>) -> Option<&'m [u8]> {
    m.headers()
        .and_then(|h| h.iter().find(|h| h.key == "idempotency-key"))
        .and_then(|h| h.value)
}

/// A name no other run or iteration uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Creates `topic` and its dead-letter topic (`<topic>.dlq`, one partition; the consumer
/// checks both exist at start) on a real broker (tansu does not create topics itself).
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin");
    let dlq = format!("{topic}.dlq");
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    let letters = NewTopic::new(&dlq, 1, TopicReplication::Fixed(1));
    for r in admin
        .create_topics([&new, &letters], &AdminOptions::new())
        .await
        .expect("create topic")
    {
        r.expect("topic created");
    }
}

/// Counts settled messages and notes when the first claim started.
pub struct Timing {
    n: u64,
    first: Mutex<Option<Instant>>,
    settled: AtomicU64,
    pub done: Notify,
}

impl Timing {
    /// A probe that signals `done` at the `n`-th settled message.
    pub fn new(n: usize) -> Self {
        Timing {
            n: n as u64,
            first: Mutex::new(None),
            settled: AtomicU64::new(0),
            done: Notify::new(),
        }
    }

    /// When the first claim started (or `now` if none did).
    pub fn first(&self, now: Instant) -> Instant {
        self.first
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unwrap_or(now)
    }
}

impl Probe for Timing {
    fn reached(&self, point: Point, _: &str, _: i32, _: i64) -> Verdict {
        match point {
            Point::BeforeClaim => {
                let mut first = self.first.lock().unwrap_or_else(|e| e.into_inner());
                if first.is_none() {
                    window(true);
                }
                first.get_or_insert_with(Instant::now);
            }
            Point::AfterSettle if self.settled.fetch_add(1, Ordering::Relaxed) + 1 == self.n => {
                self.done.notify_one();
            }
            _ => {}
        }
        Verdict::Continue
    }
}

/// Under `valgrind --tool=callgrind --instr-atstart=no` with `IDEM_CALLGRIND=1` set:
/// `true` switches instrumentation on (at a loop's first message), `false` dumps what was
/// counted since and switches it off (at its `n`-th), so a profile holds the loop alone.
/// Does nothing otherwise.
pub fn callgrind(on: bool) {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ENABLED.get_or_init(|| std::env::var_os("IDEM_CALLGRIND").is_some()) {
        return;
    }
    let pid = std::process::id().to_string();
    let steps: &[&str] = if on { &["-i", "on"] } else { &["-d"] };
    let status = std::process::Command::new("callgrind_control")
        .args(steps)
        .arg(&pid)
        .stdout(std::process::Stdio::null())
        .status();
    if !status.as_ref().is_ok_and(|s| s.success()) {
        eprintln!("callgrind_control {steps:?} failed: {status:?}");
    }
    if !on {
        let _ = std::process::Command::new("callgrind_control")
            .args(["-i", "off", &pid])
            .stdout(std::process::Stdio::null())
            .status();
    }
}

/// Under `perf record --control=fifo:FIFO -D -1` with `IDEM_PERF_CTL=FIFO` set: `true`
/// enables sampling (at a loop's first message), `false` disables it (at its `n`-th), so
/// the samples hold the loops' windows alone, not the group joins and set-up between
/// them. Does nothing otherwise.
pub fn perf(on: bool) {
    static CTL: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    let Some(fifo) = CTL.get_or_init(|| std::env::var_os("IDEM_PERF_CTL").map(Into::into)) else {
        return;
    };
    let command: &[u8] = if on { b"enable\n" } else { b"disable\n" };
    let sent = std::fs::OpenOptions::new()
        .write(true)
        .open(fifo)
        .and_then(|mut f| std::io::Write::write_all(&mut f, command));
    if let Err(e) = sent {
        eprintln!("IDEM_PERF_CTL {}: {e}", fifo.display());
    }
}

/// Marks the window a loop is measured in, from its first message (`true`) to its `n`-th
/// (`false`): [`callgrind`] collects in it, [`perf`] samples in it, and the CPU time every
/// thread of this process spent in it (the in-process broker's too) is kept for
/// [`window_cpu`].
pub fn window(on: bool) {
    static START: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);
    if on {
        *START.lock().unwrap_or_else(|e| e.into_inner()) = Some(thread_cpu_ns());
        callgrind(true);
        perf(true);
    } else {
        perf(false);
        callgrind(false);
        let start = START.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(start) = start {
            let mut spent: Vec<(String, u64)> = thread_cpu_ns()
                .into_iter()
                .map(|(name, ns)| {
                    let before = start.get(&name).copied().unwrap_or(0);
                    (name, ns.saturating_sub(before))
                })
                .collect();
            spent.sort_by_key(|t| std::cmp::Reverse(t.1));
            WINDOW_CPU.store(spent.iter().map(|t| t.1).sum(), Ordering::Relaxed);
            *WINDOW_THREADS.lock().unwrap_or_else(|e| e.into_inner()) = spent;
        }
    }
}

static WINDOW_CPU: AtomicU64 = AtomicU64::new(0);
static WINDOW_THREADS: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());

/// The CPU time of the last [`window`], in nanoseconds.
pub fn window_cpu() -> u64 {
    WINDOW_CPU.load(Ordering::Relaxed)
}

/// The CPU time of the last [`window`] per thread name (threads of one name summed),
/// most first.
pub fn window_threads() -> Vec<(String, u64)> {
    WINDOW_THREADS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// The CPU time of this process's live threads so far, in nanoseconds, summed per thread
/// name (Linux schedstat; empty elsewhere).
fn thread_cpu_ns() -> HashMap<String, u64> {
    let mut by_name = HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return by_name;
    };
    for task in tasks.filter_map(|t| t.ok()) {
        let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let ns = std::fs::read_to_string(task.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        *by_name.entry(name.trim().to_owned()).or_insert(0) += ns;
    }
    by_name
}

/// The median of `v` (0 when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// A message to produce: its partition, `idempotency-key` header, Kafka key and payload.
pub struct Produce {
    pub partition: i32,
    pub id: String,
    pub key: Option<String>,
    pub payload: Vec<u8>,
}

/// Produces `messages` to `topic` and waits until every one is delivered.
pub async fn produce(brokers: &str, topic: &str, messages: impl IntoIterator<Item = Produce>) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .expect("producer");
    let mut pending = Vec::new();
    for m in messages {
        let headers = OwnedHeaders::new().insert(Header {
            key: "idempotency-key",
            value: Some(m.id.as_bytes()),
        });
        let mut record = FutureRecord::<[u8], [u8]>::to(topic)
            .partition(m.partition)
            .payload(&m.payload)
            .headers(headers);
        if let Some(key) = &m.key {
            record = record.key(key.as_bytes());
        }
        pending.push(
            producer
                .send_result(record)
                .map_err(|(e, _)| e)
                .expect("enqueue"),
        );
    }
    for d in pending {
        d.await.expect("delivery").expect("delivered");
    }
}

/// The line above a bench's summary: the command (`cargo bench -p benches --bench <bench>`
/// and what followed `--`), the date, the commit, the cores and `brokers` (which brokers
/// the run used).
pub fn provenance(bench: &str, brokers: &str) -> String {
    // Cargo runs the bench binary with `--bench` and then what followed `--`.
    let rest: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let mut command = format!("cargo bench -p benches --bench {bench}");
    if !rest.is_empty() {
        command = format!("{command} -- {}", rest.join(" "));
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    format!(
        "`{command}` on {}, commit `{commit}`, {cores} cores ({brokers}; release build)",
        today()
    )
}

/// Today's date, UTC, `YYYY-MM-DD` (the civil calendar from days since 1970, after Howard
/// Hinnant's `civil_from_days`).
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = i64::try_from(secs / 86_400).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// Removes every Redis key that starts with `prefix` (what earlier runs left), by `SCAN`
/// and `UNLINK`.
pub async fn clear_redis(conn: &redis::aio::ConnectionManager, prefix: &str) {
    let mut conn = conn.clone();
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await
            .expect("SCAN");
        if !keys.is_empty() {
            let () = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(&mut conn)
                .await
                .expect("UNLINK");
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}
