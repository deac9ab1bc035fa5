//! Key-ordered concurrency within a partition (`in_flight` above one), on librdkafka's
//! MockCluster with the in-memory store: per-key order, every offset settled once, and
//! offsets stored only over the settled prefix. And across partitions: a key never runs in
//! two handlers of one process at once.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{Out, builder, committed, engine, mock_topic, produce, unique};
use idem_core::layer::{BackendExt, ChaosLayer};
use idem_core::{Backend, Key, MemoryBackend, State};
use idem_kafka::{OrderBy, Point, Probe, Verdict};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tokio::sync::Notify;

const WAIT: Duration = Duration::from_secs(30);

/// Records what a concurrent consumer does, and checks the consumer rule at every offset
/// store: nothing at or below the stored offset is unsettled.
#[derive(Default)]
struct Watch {
    settled: Mutex<Vec<i64>>,
    violations: Mutex<Vec<String>>,
    notify: Notify,
}

impl Watch {
    fn settled(&self) -> Vec<i64> {
        self.settled.lock().expect("lock").clone()
    }

    async fn wait_settled(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let notified = self.notify.notified();
            let have = self.settled.lock().expect("lock").len();
            if have >= n {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("only {have} of {n} messages settled in {WAIT:?}");
            }
        }
    }
}

impl Probe for Watch {
    fn reached(&self, point: Point, _topic: &str, _partition: i32, offset: i64) -> Verdict {
        match point {
            Point::AfterSettle => {
                self.settled.lock().expect("lock").push(offset);
                self.notify.notify_waiters();
            }
            Point::AfterStore => {
                let settled: BTreeSet<i64> =
                    self.settled.lock().expect("lock").iter().copied().collect();
                if let Some(gap) = (0..=offset).find(|o| !settled.contains(o)) {
                    self.violations
                        .lock()
                        .expect("lock")
                        .push(format!("stored {offset} while {gap} was unsettled"));
                }
            }
            _ => {}
        }
        Verdict::Continue
    }
}

/// Runs `consumer` until `watch` saw `n` messages settle, then stops it cleanly.
async fn run_until_settled(
    consumer: idem_kafka::IdemConsumer,
    watch: &Watch,
    n: usize,
    stop: tokio_util::sync::CancellationToken,
) {
    let task = tokio::spawn(consumer.run());
    watch.wait_settled(n).await;
    stop.cancel();
    task.await.expect("task").expect("clean stop");
}

/// What the handlers saw: per ordering key, the offsets in the order they started, and
/// whether two of one key ever ran at once.
#[derive(Default)]
struct Runs {
    started: Mutex<HashMap<String, Vec<i64>>>,
    running: Mutex<HashMap<String, i64>>,
    overlaps: Mutex<Vec<String>>,
    peak: Mutex<(usize, usize)>,
}

impl Runs {
    fn start(&self, key: &str, offset: i64) {
        self.started
            .lock()
            .expect("lock")
            .entry(key.to_owned())
            .or_default()
            .push(offset);
        let mut running = self.running.lock().expect("lock");
        if let Some(other) = running.insert(key.to_owned(), offset) {
            self.overlaps
                .lock()
                .expect("lock")
                .push(format!("{key}: {other} and {offset} at once"));
        }
        let mut peak = self.peak.lock().expect("lock");
        peak.0 += 1;
        peak.1 = peak.1.max(peak.0);
    }

    fn end(&self, key: &str) {
        self.running.lock().expect("lock").remove(key);
        self.peak.lock().expect("lock").0 -= 1;
    }
}

/// One property case: messages on one partition with the given Kafka keys (the ordering
/// key) and handler durations, each with its own idempotency key, run with `in_flight`.
async fn run_case(keys: Vec<u8>, millis: Vec<u8>, in_flight: usize) -> Result<(), TestCaseError> {
    let topic = unique("inflight");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let msgs: Vec<Out> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| Out {
            key: Some(format!("entity-{k}").into_bytes()),
            ..Out::keyed(
                0,
                &format!("op-{i}"),
                &format!("{}", millis[i % millis.len()]),
            )
        })
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let watch = Arc::new(Watch::default());
    let runs = Arc::new(Runs::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let seen = runs.clone();
    let consumer = builder(&brokers, &topic, &unique("g"))
        .engine(engine(
            Arc::new(MemoryBackend::new()),
            "w1",
            Duration::from_secs(10),
        ))
        .in_flight(in_flight)
        .order_by(OrderBy::MessageKey)
        .batch_size(16)
        .probe(watch.clone())
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |msg, _| {
            let runs = seen.clone();
            async move {
                let key = String::from_utf8_lossy(msg.message_key().expect("key")).into_owned();
                runs.start(&key, msg.offset());
                let ms: u64 = String::from_utf8_lossy(msg.payload()).parse().unwrap_or(0);
                if ms > 0 {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                runs.end(&key);
                Ok(Bytes::new())
            }
        })
        .build()
        .expect("consumer");
    run_until_settled(consumer, &watch, msgs.len(), stop).await;

    let mut settled = watch.settled();
    settled.sort_unstable();
    let all: Vec<i64> = (0..msgs.len() as i64).collect();
    prop_assert_eq!(settled, all, "every offset settles exactly once");
    let violations = watch.violations.lock().expect("lock").clone();
    prop_assert!(
        violations.is_empty(),
        "consumer rule broken: {:?}",
        violations
    );
    let overlaps = runs.overlaps.lock().expect("lock").clone();
    prop_assert!(
        overlaps.is_empty(),
        "one key ran twice at once: {:?}",
        overlaps
    );
    for (key, offsets) in runs.started.lock().expect("lock").iter() {
        let mut sorted = offsets.clone();
        sorted.sort_unstable();
        prop_assert_eq!(offsets, &sorted, "{} ran out of offset order", key);
    }
    let peak = runs.peak.lock().expect("lock").1;
    prop_assert!(
        peak <= in_flight,
        "{} handlers at once, over {}",
        peak,
        in_flight
    );
    Ok(())
}

#[test]
fn random_keys_and_durations_keep_per_key_order_and_settle_every_offset_once() {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(256)
        .min(12);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        proptest::collection::vec(0u8..6, 1..60),
        proptest::collection::vec(0u8..12, 1..8),
        2usize..12,
    );
    let result = runner.run(&strategy, |(keys, millis, in_flight)| {
        rt.block_on(run_case(keys, millis, in_flight))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A shutdown with handlers in flight: those that finish within the revoke timeout are
/// settled, the committed offset stops at the first unsettled message, and leases claimed
/// for messages that never ran are released, so the next owner runs them on their first
/// attempt.
///
/// The case needs all eight messages in the chunk claimed first. The poll thread routes
/// them one by one, so the worker may start a batch before the last ones arrive; a later
/// chunk is never claimed while offset 2 blocks. The attempt sees this (offset 7 has no
/// record once offset 2's handler runs) and starts again on a new topic, a few times.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoke_with_handlers_in_flight_commits_only_the_settled_prefix() {
    for _ in 0..5 {
        if revoke_with_handlers_in_flight().await {
            return;
        }
    }
    panic!("in five attempts the worker never claimed the eight messages in one chunk");
}

/// One attempt of the revoke case; `false` when the batch was split (nothing asserted).
async fn revoke_with_handlers_in_flight() -> bool {
    let topic = unique("revoke");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    // Offsets 0..8, no key shared: 0, 1 and 3 finish at once; 2, 4, 5 and 6 block until
    // the gate opens, holding all four handler slots, so 7 waits for a slot.
    let msgs: Vec<Out> = (0..8)
        .map(|i| {
            let blocks = matches!(i, 2 | 4 | 5 | 6);
            Out::keyed(0, &format!("r{i}"), if blocks { "block" } else { "go" })
        })
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let backend = Arc::new(MemoryBackend::new());
    let group = unique("g");
    let watch = Arc::new(Watch::default());
    let gate = Arc::new(Notify::new());
    let blocked = Arc::new(Notify::new());
    let stop = tokio_util::sync::CancellationToken::new();
    let (g, b) = (gate.clone(), blocked.clone());
    let consumer = builder(&brokers, &topic, &group)
        .engine(engine(backend.clone(), "w1", Duration::from_secs(10)))
        .in_flight(4)
        .revoke_timeout(Duration::from_millis(300))
        .probe(watch.clone())
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |msg, _| {
            let (gate, blocked) = (g.clone(), b.clone());
            async move {
                if msg.payload().as_ref() == b"block" {
                    if msg.offset() == 2 {
                        blocked.notify_one();
                    }
                    gate.notified().await;
                }
                Ok(Bytes::from_static(b"done"))
            }
        })
        .build()
        .expect("consumer");
    let task = tokio::spawn(consumer.run());
    blocked.notified().await;
    // Offset 2's handler runs, so its chunk was claimed: offset 7 has a record if it was in it.
    let r7 = idem_core::Key::new(group.as_str(), "r7").expect("key");
    let whole = backend.get(&r7).await.expect("get").is_some();
    if whole {
        watch.wait_settled(2).await;
    }
    stop.cancel();
    task.await.expect("task").expect("clean stop");
    gate.notify_waiters();
    if !whole {
        eprintln!("the worker split the batch before offset 7: again, on a new topic");
        return false;
    }

    let settled: BTreeSet<i64> = watch.settled().into_iter().collect();
    assert!(settled.contains(&0) && settled.contains(&1), "{settled:?}");
    assert!(!settled.contains(&2), "the blocked handler never settled");
    assert_eq!(
        committed(&brokers, &group, &topic, 1),
        vec![2],
        "committed up to the first unsettled message, not past it"
    );
    let violations = watch.violations.lock().expect("lock").clone();
    assert!(violations.is_empty(), "{violations:?}");
    // Offset 7 waited for a handler slot (2, 4, 5 and 6 held all four) when the shutdown
    // came: its lease was handed back unrun.
    let rec = backend
        .get(&r7)
        .await
        .expect("get")
        .expect("r7 was claimed");
    assert_eq!((rec.state, rec.attempts), (State::Processing, 0), "{rec:?}");
    assert!(!settled.contains(&7));
    true
}

/// Handlers slower than the loop's chunk budget still run `in_flight` at once. A chunk
/// sized by the budget alone shrank to one message after a few slow handlers, and ran the
/// rest one at a time; a chunk is now never shorter than `in_flight`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_handlers_still_run_in_flight_at_once() {
    const IN_FLIGHT: usize = 4;
    let topic = unique("slow");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let msgs: Vec<Out> = (0..32)
        .map(|i| Out::keyed(0, &format!("s{i}"), "x"))
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let watch = Arc::new(Watch::default());
    let running = Arc::new(AtomicUsize::new(0));
    // The most handlers running at once as one of the last half starts: by then the loop
    // has timed slow handlers for a while (the first chunk holds up to 16 messages).
    let late_peak = Arc::new(AtomicUsize::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let (now, peak) = (running.clone(), late_peak.clone());
    let consumer = builder(&brokers, &topic, &unique("g"))
        .engine(engine(
            Arc::new(MemoryBackend::new()),
            "w1",
            Duration::from_secs(10),
        ))
        .in_flight(IN_FLIGHT)
        .probe(watch.clone())
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |msg, _| {
            let (now, peak) = (now.clone(), peak.clone());
            async move {
                let at_once = now.fetch_add(1, Ordering::SeqCst) + 1;
                if msg.offset() >= 16 {
                    peak.fetch_max(at_once, Ordering::SeqCst);
                }
                // A handler waiting on I/O, longer than the chunk budget.
                tokio::time::sleep(Duration::from_millis(150)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                Ok(Bytes::new())
            }
        })
        .build()
        .expect("consumer");
    run_until_settled(consumer, &watch, msgs.len(), stop).await;
    assert_eq!(
        late_peak.load(Ordering::SeqCst),
        IN_FLIGHT,
        "slow handlers ran fewer than in_flight at once"
    );
    let violations = watch.violations.lock().expect("lock").clone();
    assert!(violations.is_empty(), "{violations:?}");
}

/// A payment sent to two partitions that one consumer holds. The first copy's handler runs
/// while the store refuses every call, so no heartbeat lands and its lease lapses; then
/// the store answers again. The second copy must wait for the running handler rather than
/// take the lapsed lease over and start a second handler of the key beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_on_two_partitions_never_runs_in_two_handlers_at_once() {
    /// How long the first handler waits for a second one to start beside it.
    const GRACE: Duration = Duration::from_secs(2);
    let topic = unique("twoparts");
    let (_cluster, brokers) = mock_topic(&topic, 2);
    let raw = MemoryBackend::new();
    let chaos = ChaosLayer::new();
    let backend: Arc<dyn Backend> = Arc::new(raw.clone().layer(chaos.clone()));
    let runs = Arc::new(Runs::default());
    let effects = common::Effects::new();
    let started = Arc::new(AtomicUsize::new(0));
    let (first_key, first_started) = tokio::sync::oneshot::channel::<Key>();
    let first_key = Arc::new(Mutex::new(Some(first_key)));
    let second = Arc::new(Notify::new());
    let handler = {
        let (runs, effects, started, second) =
            (runs.clone(), effects.clone(), started, second.clone());
        move |msg: idem_kafka::Message, _| {
            let (runs, effects, started) = (runs.clone(), effects.clone(), started.clone());
            let (first_key, second) = (first_key.clone(), second.clone());
            async move {
                let key = msg.idempotency_key().expect("keyed").clone();
                runs.start(key.id(), msg.offset());
                if started.fetch_add(1, Ordering::SeqCst) == 0 {
                    if let Some(tx) = first_key.lock().expect("lock").take() {
                        let _ = tx.send(key.clone());
                    }
                    // Ends early if a second handler of the key starts beside this one.
                    let _ = tokio::time::timeout(GRACE, second.notified()).await;
                } else {
                    second.notify_one();
                }
                runs.end(key.id());
                Ok::<_, idem_core::HandlerError>(effects.apply(key.id()))
            }
        }
    };
    common::install_metrics();
    let recorder = common::Recorder::new();
    let consumer = builder(&brokers, &topic, &unique("g"))
        .engine(engine(backend, "w1", Duration::from_millis(600)))
        .handler(handler);
    let running = common::start(consumer, &recorder);

    produce(&brokers, &topic, &[Out::keyed(0, "pay-1", "x")]).await;
    let key = tokio::time::timeout(WAIT, first_started)
        .await
        .expect("the first copy's handler starts")
        .expect("its key");
    // No heartbeat lands from here on; the copy on partition 1 arrives meanwhile.
    let _ = chaos.clone().with_refused(1.0);
    produce(&brokers, &topic, &[Out::keyed(1, "pay-1", "x")]).await;
    let record = raw
        .get(&key)
        .await
        .expect("get")
        .expect("the claim's record");
    let lease_until = record.lease_until.expect("a lease").to_system_time();
    let left = lease_until
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    tokio::time::sleep(left + Duration::from_millis(100)).await;
    let _ = chaos.clone().with_refused(0.0);

    recorder.wait_settled(2, WAIT).await;
    running.stop().await;
    let overlaps = runs.overlaps.lock().expect("lock").clone();
    assert!(
        overlaps.is_empty(),
        "two handlers of one key at once: {overlaps:?}"
    );
    assert_eq!(effects.runs("pay-1"), 1, "the payment's effect ran once");
    // The second copy waited on a key in progress here; no settle was fenced.
    let count = |name| common::counter(name, &topic);
    assert!(
        count(idem_kafka::metrics::IN_PROGRESS_WAITS) > 0,
        "the copy waited"
    );
    assert_eq!(count(idem_kafka::metrics::FENCED), 0, "nothing was fenced");
}
