//! A backlog of large messages consumed by a slow handler, in a process of its own so its
//! peak resident memory can be read alone (the test `tests/memory.rs` runs it). It consumes
//! a topic that already holds `messages` messages, each with an `idempotency-key` header,
//! on the memory store, with a handler that sleeps `handler_ms`. Handlers wait until the
//! consumer holds `hold_bytes` of fetched messages (0: they start at once).
//! `max_buffered_bytes` and `queued_kbytes` (librdkafka's `queued.max.messages.kbytes`, each
//! partition queue's prefetch) are the consumer's when given. Once every message is settled
//! it shuts down and prints one line:
//!
//! `runs=<handler runs> distinct=<keys run> settled=<messages settled>
//! peak_buffered=<largest sum of idem_kafka_buffered_bytes seen> vmhwm_kb=<peak RSS>
//! elapsed_ms=<time from start to shutdown>`
//!
//! ```sh
//! cargo run -p idem-kafka --example backlog -- <brokers> <topic> <group> <messages> <handler_ms> <hold_bytes> [max_buffered_bytes [queued_kbytes]]
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{Bytes, Engine, MemoryBackend};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::{IdemConsumer, Point, Probe, Verdict};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tokio::sync::Notify;

/// How long the whole run may take before the example gives up.
const GIVE_UP: Duration = Duration::from_secs(240);

/// Counts the distinct messages settled and wakes the waiter at each one.
#[derive(Default)]
struct Settled {
    seen: Mutex<HashSet<(i32, i64)>>,
    notify: Notify,
}

impl Probe for Settled {
    fn reached(&self, point: Point, _topic: &str, partition: i32, offset: i64) -> Verdict {
        if point == Point::AfterSettle {
            self.seen.lock().expect("lock").insert((partition, offset));
            self.notify.notify_one();
        }
        Verdict::Continue
    }
}

impl Settled {
    fn count(&self) -> usize {
        self.seen.lock().expect("lock").len()
    }
}

/// The process's peak resident set size, in KiB, from `/proc/self/status`.
fn vm_hwm_kb() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| "no VmHWM line in /proc/self/status".to_owned())
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, name: &str) -> Result<T, String> {
    args.get(i)
        .ok_or_else(|| format!("missing argument {name}"))?
        .parse()
        .map_err(|_| format!("argument {name}: not a number"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: backlog <brokers> <topic> <group> <messages> <handler_ms> <hold_bytes> [max_buffered_bytes [queued_kbytes]]";
    let [brokers, topic, group] = [0, 1, 2].map(|i| args.get(i).cloned());
    let (Some(brokers), Some(topic), Some(group)) = (brokers, topic, group) else {
        return Err(usage.into());
    };
    let messages: usize = arg(&args, 3, "messages")?;
    let handler_ms: u64 = arg(&args, 4, "handler_ms")?;
    let hold_bytes: f64 = arg(&args, 5, "hold_bytes")?;
    let max_bytes: Option<usize> = args
        .get(6)
        .map(|_| arg(&args, 6, "max_buffered_bytes"))
        .transpose()?;
    let queued_kbytes: Option<u64> = args
        .get(7)
        .map(|_| arg(&args, 7, "queued_kbytes"))
        .transpose()?;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install()?;

    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &brokers)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000");
    if let Some(kbytes) = queued_kbytes {
        config.set("queued.max.messages.kbytes", kbytes.to_string());
    }
    let backend = Arc::new(MemoryBackend::new());
    let engine = Engine::builder(backend)
        .lease_ttl(Duration::from_secs(60))
        .build()?;
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let settled = Arc::new(Settled::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let counted = Arc::clone(&runs);
    let (filled, held) = tokio::sync::watch::channel(hold_bytes <= 0.0);
    let mut builder = IdemConsumer::builder(config)
        .topics([topic.as_str()])
        .group(group)
        .engine(engine)
        .probe(Arc::clone(&settled) as Arc<dyn Probe>)
        .shutdown(async move {
            let _ = stop_rx.await;
        })
        .handler(move |msg, _ctx| {
            let runs = Arc::clone(&counted);
            let mut held = held.clone();
            async move {
                // The sender outlives the consumer, so this wait ends only when it is set.
                let _ = held.wait_for(|filled| *filled).await;
                tokio::time::sleep(Duration::from_millis(handler_ms)).await;
                let id = msg
                    .idempotency_key()
                    .map(|k| k.id().to_owned())
                    .unwrap_or_default();
                *runs.lock().expect("lock").entry(id).or_default() += 1;
                Ok(Bytes::from_static(b"ok"))
            }
        });
    if let Some(bytes) = max_bytes {
        builder = builder.max_buffered_bytes(bytes);
    }
    let began = std::time::Instant::now();
    let running = tokio::spawn(builder.build()?.run());

    // Samples the gauge (summed over partitions) while waiting for every message, and lets
    // the handlers go once it reaches `hold_bytes`. A snapshot swaps each gauge to zero, so
    // it reads the change since the last one, and the level is their running sum.
    let mut buffered = 0.0f64;
    let mut peak_buffered = 0.0f64;
    let deadline = tokio::time::Instant::now() + GIVE_UP;
    while settled.count() < messages {
        let change: f64 = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(k, ..)| k.key().name() == idem_kafka::metrics::BUFFERED_BYTES)
            .filter_map(|(.., v)| match v {
                DebugValue::Gauge(g) => Some(g.into_inner()),
                _ => None,
            })
            .sum();
        buffered += change;
        peak_buffered = peak_buffered.max(buffered);
        if buffered >= hold_bytes {
            filled.send_replace(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "only {} of {messages} messages settled in {GIVE_UP:?}; \
                 peak_buffered={peak_buffered}",
                settled.count()
            )
            .into());
        }
        let _ = tokio::time::timeout(Duration::from_millis(20), settled.notify.notified()).await;
    }
    let _ = stop_tx.send(());
    running.await??;

    let runs = runs.lock().expect("lock");
    println!(
        "runs={} distinct={} settled={} peak_buffered={} vmhwm_kb={} elapsed_ms={}",
        runs.values().sum::<u32>(),
        runs.len(),
        settled.count(),
        peak_buffered.round(),
        vm_hwm_kb()?,
        began.elapsed().as_millis()
    );
    Ok(())
}
