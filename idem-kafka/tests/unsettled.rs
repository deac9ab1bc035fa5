//! The blast radius of a crash in lease mode, on librdkafka's MockCluster with the
//! in-memory store: a consumer crashes right after a handler's effect, a second consumer
//! takes over once the leases lapse, and the effects run twice are counted per partition.
//! With `max_unsettled(n)` no partition repeats more than `n` effects. Every store call
//! waits a few milliseconds first (a store across a network), so results do wait for
//! their settle.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{
    Effects, Out, Recorder, builder, engine, mock_topic, produce, start, unique, wait_committed,
};
use idem_core::layer::{BackendExt, ChaosLayer};
use idem_core::{Backend, HandlerError, Key, MemoryBackend};
use idem_kafka::{Point, Probe, Verdict};

const WAIT: Duration = Duration::from_secs(30);
const PARTITIONS: i32 = 2;
const PER_PARTITION: i64 = 200;
/// The offset of partition 0 whose effect the crash follows: past the first chunk (16),
/// in a chunk of the whole batch when nothing bounds it.
const CRASH_AT: i64 = 100;
const LEASE: Duration = Duration::from_millis(300);
/// How long each store call takes.
const STORE_CALL: Duration = Duration::from_millis(3);

/// Crashes the consumer right after the effect of `CRASH_AT` on partition 0, and at every
/// point after that (the process is dead).
#[derive(Default)]
struct CrashAfterEffect {
    fired: AtomicBool,
    closed: tokio::sync::Notify,
}

impl Probe for CrashAfterEffect {
    fn reached(&self, point: Point, _topic: &str, partition: i32, offset: i64) -> Verdict {
        if self.fired.load(Ordering::SeqCst) {
            return Verdict::Crash;
        }
        if point == Point::AfterEffect && partition == 0 && offset == CRASH_AT {
            self.fired.store(true, Ordering::SeqCst);
            return Verdict::Crash;
        }
        Verdict::Continue
    }

    fn closed(&self) {
        self.closed.notify_one();
    }
}

/// The key id of the message at `offset` of `partition`.
fn id(partition: i32, offset: i64) -> String {
    format!("p{partition}-{offset}")
}

/// Runs the crash and the takeover with `in_flight` handlers per partition and the bound
/// `max_unsettled` (none: the default); answers the effects run twice, by partition.
async fn doubles_after_a_crash(in_flight: usize, max_unsettled: Option<usize>) -> Vec<u32> {
    let topic = unique("unsettled");
    let (_cluster, brokers) = mock_topic(&topic, PARTITIONS);
    let mut msgs = Vec::new();
    for offset in 0..PER_PARTITION {
        for partition in 0..PARTITIONS {
            msgs.push(Out::keyed(partition, &id(partition, offset), "x"));
        }
    }
    produce(&brokers, &topic, &msgs).await;
    let backend: Arc<dyn Backend> =
        Arc::new(MemoryBackend::new().layer(ChaosLayer::new().with_delay(STORE_CALL)));
    let effects = Effects::new();
    let group = unique("g");
    let consumer = |owner: &str| {
        let fx = effects.clone();
        let b = builder(&brokers, &topic, &group)
            .engine(engine(backend.clone(), owner, LEASE))
            .in_flight(in_flight)
            .handler(move |msg, _| {
                let fx = fx.clone();
                async move {
                    // A yield before the effect, so concurrent handlers interleave.
                    tokio::task::yield_now().await;
                    let id = msg.idempotency_key().map(Key::id).unwrap_or_default();
                    Ok::<_, HandlerError>(fx.apply(id))
                }
            });
        match max_unsettled {
            Some(n) => b.max_unsettled(n),
            None => b,
        }
    };

    // The first consumer dies after the effect at CRASH_AT; it is dropped, as a process
    // that died, once its client has left the group.
    let probe = Arc::new(CrashAfterEffect::default());
    let closed = probe.closed.notified();
    let dead = consumer("w1")
        .probe(probe.clone())
        .build()
        .expect("consumer");
    let task = tokio::spawn(dead.run());
    tokio::time::timeout(WAIT, closed)
        .await
        .expect("the consumer crashes and its client closes");
    task.abort();
    let _ = task.await;
    assert!(probe.fired.load(Ordering::SeqCst));

    // The second takes over once the first one's leases lapse, and settles everything:
    // done when every partition's offset is committed through its last message.
    let recorder = Recorder::new();
    let running = start(consumer("w2"), &recorder);
    let ends = [PER_PARTITION; PARTITIONS as usize];
    wait_committed(&brokers, &group, &topic, &ends, WAIT).await;
    running.stop().await;

    let all = usize::try_from(i64::from(PARTITIONS) * PER_PARTITION).expect("count");
    assert_eq!(effects.distinct(), all, "every payment's effect ran");
    let mut doubles: BTreeMap<i32, u32> = BTreeMap::new();
    for partition in 0..PARTITIONS {
        let d = (0..PER_PARTITION)
            .map(|o| effects.runs(&id(partition, o)).saturating_sub(1))
            .sum();
        doubles.insert(partition, d);
    }
    eprintln!("in_flight {in_flight}, max_unsettled {max_unsettled:?}: doubles {doubles:?}");
    // The effect the crash followed was never settled: it runs again.
    assert!(
        doubles[&0] >= 1,
        "the effect at the crash repeats: {doubles:?}"
    );
    doubles.into_values().collect()
}

/// Asserts no partition repeated more than `bound` effects.
fn at_most(doubles: &[u32], bound: u32) {
    for (partition, d) in doubles.iter().enumerate() {
        assert!(
            *d <= bound,
            "partition {partition} repeated {d} effects after one crash, bound {bound}: \
             {doubles:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_repeats_at_most_one_effect_per_partition_at_max_unsettled_1() {
    at_most(&doubles_after_a_crash(1, Some(1)).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_repeats_at_most_max_unsettled_effects_per_partition() {
    at_most(&doubles_after_a_crash(1, Some(8)).await, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_bound_holds_with_handlers_in_flight_at_once() {
    // `in_flight` above the bound: the chunk's floor of distinct keys is capped too.
    at_most(&doubles_after_a_crash(16, Some(1)).await, 1);
    at_most(&doubles_after_a_crash(16, Some(8)).await, 8);
}
