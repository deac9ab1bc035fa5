//! The idem consumer (idem-kafka over any backend), crashed and restarted like the naive
//! one, through idem-kafka's crash probe.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use idem_core::{Backend, Engine, HandlerError};
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use idem_kafka::rdkafka::error::KafkaError;
use idem_kafka::rdkafka::message::{Headers, Message as _};
use idem_kafka::rdkafka::{Offset, TopicPartitionList};
use idem_kafka::{HEADER_KEY, HEADER_REASON, IdemConsumer, Point, Probe, Verdict};
use indicatif::ProgressBar;
use tokio::sync::{Notify, oneshot};

use super::naive::{STALL, committed, config};
use super::plan::{DLQ, Ledger, Stage, TOPIC, parse};
use crate::error::{Error, Result, StoreContext};

const GROUP: &str = "idem-payments";

/// What the idem side did.
#[derive(Debug, Default)]
pub struct IdemRun {
    /// Deliveries settled (completed, replayed or dead-lettered), over every instance.
    pub settled: u64,
    /// Instances that crashed.
    pub crashes: u32,
    /// Messages in the dead-letter topic, by `idem-reason`.
    pub dead_letters: HashMap<String, u64>,
    /// Distinct keys in the dead-letter topic (a redelivered poison message is
    /// dead-lettered again).
    pub dead_keys: u64,
}

/// Where an instance crashes.
#[derive(Clone, Copy, Debug)]
pub enum CrashAt {
    /// After the charge and its record, before the offset is stored and committed.
    AfterRecord,
    /// After the charge, before idem records it: the case a lease cannot cover, played
    /// only to check that the demo notices a double charge.
    BeforeRecord,
}

/// Counts settles and stored offsets, and crashes its instance when told to.
struct DemoProbe {
    crash: Option<(Point, u64)>,
    charged: Arc<AtomicU64>,
    fired: AtomicBool,
    crashed: Notify,
    settled: AtomicU64,
    next: Mutex<HashMap<i32, i64>>,
    stage: Arc<Stage>,
    done: Notify,
    bar: ProgressBar,
}

impl Probe for DemoProbe {
    fn reached(&self, point: Point, _topic: &str, partition: i32, offset: i64) -> Verdict {
        match point {
            Point::AfterSettle => {
                self.settled.fetch_add(1, Ordering::Relaxed);
                self.bar.inc(1);
            }
            Point::AfterStore if !self.fired.load(Ordering::SeqCst) => {
                let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
                next.insert(partition, offset + 1);
                if self.stage.caught_up(&next) {
                    self.done.notify_one();
                }
            }
            _ => {}
        }
        if self.fired.load(Ordering::SeqCst) {
            return Verdict::Crash;
        }
        match self.crash {
            Some((at, after)) if at == point && self.charged.load(Ordering::SeqCst) >= after => {
                self.fired.store(true, Ordering::SeqCst);
                self.crashed.notify_one();
                Verdict::Crash
            }
            _ => Verdict::Continue,
        }
    }
}

/// Runs idem consumer instances one after another over `backend`: instance `i` crashes
/// once it has charged `stage.crash_after[i]` payments, at `at`; the last one runs until
/// every partition's offset is stored, then shuts down cleanly. Messages are claimed
/// `stage.commit_every` at a time and offsets stored after each batch, as the naive side
/// commits.
pub async fn run(
    stage: &Arc<Stage>,
    at: CrashAt,
    backend: Arc<dyn Backend>,
    namespace: &str,
    ledger: &Arc<Ledger>,
    bar: &ProgressBar,
) -> Result<IdemRun> {
    let mut out = IdemRun::default();
    let point = match at {
        CrashAt::AfterRecord => Point::AfterSettle,
        CrashAt::BeforeRecord => Point::AfterEffect,
    };
    let brokers = stage.brokers.as_str();
    for instance in 0..=stage.crash_after.len() {
        let charged = Arc::new(AtomicU64::new(0));
        let probe = Arc::new(DemoProbe {
            crash: stage.crash_after.get(instance).map(|&n| (point, n)),
            charged: Arc::clone(&charged),
            fired: AtomicBool::new(false),
            crashed: Notify::new(),
            settled: AtomicU64::new(0),
            next: Mutex::new(committed_for(brokers)?),
            stage: Arc::clone(stage),
            done: Notify::new(),
            bar: bar.clone(),
        });
        let engine = Engine::builder(Arc::clone(&backend))
            .lease_ttl(Duration::from_secs(1))
            .max_attempts(stage.crash_after.len() as u32 + 5)
            .retention(Duration::from_secs(3600))
            .build()
            .store("demo engine")?;
        let ledger = Arc::clone(ledger);
        let (stop, stopped) = oneshot::channel::<()>();
        let consumer = IdemConsumer::builder(config(brokers, GROUP))
            .topics([TOPIC])
            .namespace(namespace)
            .engine(engine)
            .partition_concurrency(1)
            .batch_size(usize::try_from(stage.commit_every).unwrap_or(100))
            .commit_interval(Duration::from_millis(10))
            .probe(Arc::clone(&probe) as Arc<dyn Probe>)
            .shutdown(async move {
                let _ = stopped.await;
            })
            .handler(move |msg, ctx| {
                let (ledger, charged) = (Arc::clone(&ledger), Arc::clone(&charged));
                async move {
                    let (id, cents) = parse(msg.payload()).map_err(HandlerError::permanent)?;
                    ledger.charge(&id).await;
                    charged.fetch_add(1, Ordering::SeqCst);
                    let token = ctx.map_or(0, |c| c.token());
                    let receipt =
                        format!(r#"{{"receipt":"r-{id}","cents":{cents},"token":{token}}}"#);
                    Ok(Bytes::from(receipt))
                }
            })
            .build()
            .map_err(|e| Error::Refused(format!("idem consumer: {e}")))?;
        let mut run = Box::pin(consumer.run());
        if stage.caught_up(&probe.next.lock().unwrap_or_else(|e| e.into_inner())) {
            probe.done.notify_one();
        }
        // A crashed loop also ends its run future by itself: the crash signal goes first.
        let crashed = tokio::select! {
            biased;
            () = probe.crashed.notified() => true,
            () = probe.done.notified() => false,
            res = &mut run => {
                res.map_err(|e| Error::Refused(format!("idem consumer: {e}")))?;
                if !probe.fired.load(Ordering::SeqCst) {
                    return Err(Error::Refused("idem consumer: stopped before the end".into()));
                }
                true
            }
            () = tokio::time::sleep(STALL * 2) => {
                return Err(Error::Refused(format!("idem consumer: not done after {:?}", STALL * 2)));
            }
        };
        if crashed {
            // The process dies: the loop's future is dropped without a shutdown.
            drop(run);
            out.crashes += 1;
            out.settled += probe.settled.load(Ordering::Relaxed);
            continue;
        }
        let _ = stop.send(());
        run.await
            .map_err(|e| Error::Refused(format!("idem consumer: {e}")))?;
        out.settled += probe.settled.load(Ordering::Relaxed);
        (out.dead_letters, out.dead_keys) = dead_letters(brokers).await?;
        return Ok(out);
    }
    Err(Error::Refused("idem consumer: ran out of instances".into()))
}

/// The idem group's committed offsets, read by a consumer that does not join the group.
fn committed_for(brokers: &str) -> Result<HashMap<i32, i64>> {
    let probe: BaseConsumer = config(brokers, GROUP)
        .create()
        .map_err(|e| Error::Refused(format!("idem consumer: {e}")))?;
    committed(&probe)
}

/// Reads the dead-letter topic from the start: how many letters by reason, and how many
/// distinct keys.
async fn dead_letters(brokers: &str) -> Result<(HashMap<String, u64>, u64)> {
    let fail = |e: KafkaError| Error::Refused(format!("dead-letter reader: {e}"));
    let reader: StreamConsumer = config(brokers, "demo-dlq-reader").create().map_err(fail)?;
    let (_, high) = reader
        .fetch_watermarks(DLQ, 0, Duration::from_secs(10))
        .map_err(fail)?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(DLQ, 0, Offset::Beginning)
        .map_err(fail)?;
    reader.assign(&tpl).map_err(fail)?;
    drop(tpl);
    let mut reasons = HashMap::new();
    let mut keys = HashSet::new();
    let mut read = 0;
    while read < high {
        let m = tokio::time::timeout(STALL, reader.recv())
            .await
            .map_err(|_| Error::Refused(format!("dead-letter reader: no message for {STALL:?}")))?
            .map_err(fail)?;
        let header = |name: &str| {
            m.headers()
                .and_then(|h| h.iter().find(|h| h.key == name))
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        };
        *reasons
            .entry(header(HEADER_REASON).unwrap_or_else(|| "no reason".into()))
            .or_default() += 1;
        keys.insert(header(HEADER_KEY));
        read = m.offset() + 1;
    }
    Ok((reasons, keys.len() as u64))
}
