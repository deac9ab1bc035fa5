//! The crash harness: payments on a real broker, consumers killed at random points and
//! replaced until every message is settled, then the end state checked.
#![allow(dead_code)]

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use futures::future::BoxFuture;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::{Backend, ClaimKind, Engine, Key, State};
use idem_kafka::{IdemConsumer, Point, Probe, Verdict};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::common::{self, Out};

/// The six crash points, in the order instances take them.
pub const POINTS: [Point; 6] = [
    Point::BeforeClaim,
    Point::AfterClaim,
    Point::AfterEffect,
    Point::AfterSettle,
    Point::AfterStore,
    Point::AfterCommit,
];

/// The crashes a default [`Plan`] injects: two at each point.
pub const CRASHES: usize = 2 * POINTS.len();

/// What the scenario looks like.
pub struct Plan {
    pub payments: usize,
    pub duplicate_every: usize,
    pub poison: usize,
    pub keyless: usize,
    pub partitions: i32,
    pub consumers: usize,
    pub crashes_per_point: usize,
    pub lease: Duration,
    pub timeout: Duration,
    /// Handlers in flight per partition (`ConsumerBuilder::in_flight`).
    pub in_flight: usize,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            payments: 2000,
            duplicate_every: 5,
            poison: 5,
            keyless: 2,
            partitions: 6,
            consumers: 3,
            crashes_per_point: 2,
            lease: Duration::from_secs(2),
            timeout: Duration::from_secs(240),
            in_flight: 1,
        }
    }
}

/// The payment id (none for a keyless message) at each produced position.
type Positions = HashMap<(i32, i64), Option<String>>;

/// One application of a payment's side effect, as the ledger saw it.
#[derive(Clone, Debug)]
pub struct Applied {
    pub token: u64,
    pub kind: ClaimKind,
    pub instance: u32,
}

/// The ledger of side effects, shared by every consumer instance.
#[derive(Default)]
pub struct Ledger {
    entries: Mutex<HashMap<String, Vec<Applied>>>,
}

impl Ledger {
    pub fn apply(&self, id: &str, applied: Applied) {
        self.entries
            .lock()
            .expect("lock")
            .entry(id.to_owned())
            .or_default()
            .push(applied);
    }
}

/// Counts what one consumer instance settles, and crashes it once the harness arms it.
struct CrashProbe {
    instance: u32,
    armed: Mutex<Option<(Point, u32)>>,
    fired: AtomicBool,
    crashed_tx: mpsc::UnboundedSender<(u32, Point)>,
    settled: Arc<Mutex<HashSet<(i32, i64)>>>,
    settles: Arc<Mutex<Vec<(i32, i64)>>>,
    mine: AtomicU32,
    closed: tokio::sync::Notify,
}

impl CrashProbe {
    fn arm(&self, point: Point, countdown: u32) {
        *self.armed.lock().expect("lock") = Some((point, countdown));
    }
}

impl Probe for CrashProbe {
    fn reached(&self, point: Point, _topic: &str, partition: i32, offset: i64) -> Verdict {
        // A settle is real even when it reaches a consumer that is crashing.
        if point == Point::AfterSettle {
            self.mine.fetch_add(1, Ordering::Relaxed);
            self.settled
                .lock()
                .expect("lock")
                .insert((partition, offset));
            self.settles.lock().expect("lock").push((partition, offset));
        }
        if self.fired.load(Ordering::SeqCst) {
            return Verdict::Crash;
        }
        let mut armed = self.armed.lock().expect("lock");
        if let Some((p, left)) = armed.as_mut() {
            if *p == point {
                *left -= 1;
                if *left == 0 {
                    *armed = None;
                    self.fired.store(true, Ordering::SeqCst);
                    let _ = self.crashed_tx.send((self.instance, point));
                    return Verdict::Crash;
                }
            }
        }
        Verdict::Continue
    }

    fn closed(&self) {
        self.closed.notify_one();
    }
}

/// A running consumer instance.
struct Instance {
    stop: CancellationToken,
    task: JoinHandle<idem_kafka::Result<()>>,
    probe: Arc<CrashProbe>,
}

/// How one store variant runs the side effect and reports what was applied.
pub trait Store: Send + Sync + 'static {
    /// The backend every instance shares.
    fn backend(&self) -> Arc<dyn Backend>;
    /// A consumer instance from a builder that is ready but for its engine and handler.
    fn consumer(
        &self,
        builder: idem_kafka::ConsumerBuilder,
        engine: Engine,
        instance: u32,
    ) -> IdemConsumer;
    /// Every application of a side effect, by payment id.
    fn effects(&self) -> BoxFuture<'_, HashMap<String, Vec<Applied>>>;
    /// Whether each payment must be applied exactly once (transactional mode), rather than
    /// at least once with every double explained by a lapsed lease.
    fn exactly_once(&self) -> bool;
}

/// The figures the test prints.
#[derive(Debug, Default)]
pub struct Figures {
    pub crashes: usize,
    pub crashes_by_point: Vec<(Point, usize)>,
    pub duplicates_delivered: u64,
    pub duplicates_replayed: u64,
    pub effects_applied: usize,
    pub double_effects: usize,
    pub doubles_after_crash: usize,
    pub doubles_under_live_worker: usize,
    pub seconds: f64,
}

/// The ids whose handler fails permanently.
pub fn is_poison(id: &str) -> bool {
    id.starts_with("poison-")
}

/// The payment id of a message, or the permanent failure of a poison payment.
pub fn payment(msg: &idem_kafka::Message) -> Result<String, idem_core::HandlerError> {
    let id = msg
        .idempotency_key()
        .map(|k| k.id().to_owned())
        .unwrap_or_default();
    if is_poison(&id) {
        return Err(idem_core::HandlerError::permanent("card declined"));
    }
    Ok(id)
}

/// Runs the scenario against `store` on the broker at `brokers`.
pub async fn run(brokers: &str, store: Arc<dyn Store>, plan: Plan) -> Figures {
    let started = Instant::now();
    let topic = common::unique("crash");
    let dlq = format!("{topic}.dlq");
    common::create_topics(brokers, &[(&topic, plan.partitions), (&dlq, 1)]).await;
    let group = common::unique("crash-group");

    // Payments, every `duplicate_every`-th sent twice (the copy later in the stream), a
    // few poison payments and a few messages without a key.
    let mut msgs: Vec<(Option<String>, Out)> = Vec::new();
    let payment = |id: &str, amount: usize| Out {
        partition: None,
        key: Some(id.as_bytes().to_vec()),
        payload: format!(r#"{{"id":"{id}","amount":{amount}}}"#).into_bytes(),
        headers: vec![("idempotency-key".into(), id.as_bytes().to_vec())],
    };
    for i in 0..plan.payments {
        let id = format!("pay-{i}");
        msgs.push((Some(id.clone()), payment(&id, i)));
        if i % plan.duplicate_every == 0 {
            let at = fastrand::usize(..=msgs.len());
            msgs.insert(at, (Some(id.clone()), payment(&id, i)));
        }
    }
    for j in 0..plan.poison {
        let id = format!("poison-{j}");
        let at = fastrand::usize(..=msgs.len());
        msgs.insert(at, (Some(id.clone()), payment(&id, j)));
    }
    for j in 0..plan.keyless {
        let at = fastrand::usize(..=msgs.len());
        let out = Out {
            partition: Some(0),
            key: None,
            payload: format!("keyless {j}").into_bytes(),
            headers: vec![],
        };
        msgs.insert(at, (None, out));
    }
    let total = msgs.len();
    let mut dead_letters = DeadLetterWatch::new(brokers, &dlq);
    let mut pending = msgs.into_iter();
    let ids: Arc<Mutex<Positions>> = Arc::default();
    let mut all: BTreeSet<(i32, i64)> = BTreeSet::new();

    let settled = Arc::new(Mutex::new(HashSet::new()));
    let settles = Arc::new(Mutex::new(Vec::new()));
    let (crashed_tx, mut crashed_rx) = mpsc::unbounded_channel();
    let mut plans: Vec<Point> = POINTS
        .iter()
        .flat_map(|p| std::iter::repeat_n(*p, plan.crashes_per_point))
        .collect();
    fastrand::shuffle(&mut plans);
    let crashes_planned = plans.len();
    let mut plans = plans.into_iter();
    let mut next_instance = 0u32;
    let mut crashed_instances: HashSet<u32> = HashSet::new();
    let mut crashes_by_point: HashMap<Point, usize> = HashMap::new();
    let mut running: HashMap<u32, Instance> = HashMap::new();

    let mut start = || {
        let instance = next_instance;
        next_instance += 1;
        let probe = Arc::new(CrashProbe {
            instance,
            armed: Mutex::new(None),
            fired: AtomicBool::new(false),
            crashed_tx: crashed_tx.clone(),
            settled: settled.clone(),
            settles: settles.clone(),
            mine: AtomicU32::new(0),
            closed: tokio::sync::Notify::new(),
        });
        let engine = Engine::builder(store.backend())
            .owner(format!("instance-{instance}"))
            .lease_ttl(plan.lease)
            .max_attempts(5)
            .retention(Duration::from_secs(600))
            .build()
            .expect("engine");
        let stop = CancellationToken::new();
        let signal = stop.clone();
        let builder = IdemConsumer::builder(common::consumer_config(brokers))
            .topics([topic.clone()])
            .group(group.clone())
            .batch_size(50)
            .in_flight(plan.in_flight)
            .commit_interval(Duration::from_millis(200))
            .revoke_timeout(Duration::from_secs(5))
            .retry_backoff(Duration::from_millis(20), Duration::from_millis(500))
            .probe(probe.clone())
            .shutdown(async move { signal.cancelled().await });
        let consumer = store.consumer(builder, engine, instance);
        let task = tokio::spawn(consumer.run());
        (instance, Instance { stop, task, probe })
    };
    for _ in 0..plan.consumers {
        let (i, inst) = start();
        running.insert(i, inst);
    }

    // Messages are produced in waves paced so that every planned crash still finds work:
    // about six seconds of production per crash left (a crash and the replacement's
    // join are two rebalances on tansu).
    let tick = Duration::from_millis(250);
    let deadline = Instant::now() + plan.timeout;
    let mut armed: Option<(u32, Instant)> = None;
    loop {
        let crashes_left = crashes_planned - crashed_instances.len();
        let left = pending.len();
        if left > 0 {
            let ticks_left = (crashes_left as u32 * 24 + 8).max(1) as usize;
            let wave: Vec<(Option<String>, Out)> =
                pending.by_ref().take(left.div_ceil(ticks_left)).collect();
            let outs: Vec<Out> = wave.iter().map(|(_, o)| o.clone()).collect();
            let at = common::produce(brokers, &topic, &outs).await;
            let mut ids = ids.lock().expect("lock");
            for (pos, (id, _)) in at.into_iter().zip(wave) {
                ids.insert(pos, id);
                all.insert(pos);
            }
        }
        // Done when every position is settled. A crash can land between a settle and
        // its probe (a transaction that committed, a dead letter that was acknowledged),
        // and transactional mode then seeks past it: such a position counts as settled
        // when the store has its key Completed, or the dead-letter topic has it.
        dead_letters.poll();
        if pending.len() == 0 && crashes_left == 0 {
            let open: Vec<(i32, i64)> = {
                let settled = settled.lock().expect("lock");
                all.iter()
                    .filter(|p| !settled.contains(p))
                    .copied()
                    .collect()
            };
            let mut done = true;
            for at in open {
                let id = ids.lock().expect("lock").get(&at).cloned().flatten();
                let completed = match id {
                    Some(id) if !is_poison(&id) => {
                        let key = Key::new(group.as_str(), id.as_str()).expect("key");
                        let rec = store.backend().get(&key).await.ok().flatten();
                        rec.is_some_and(|r| r.state == State::Completed)
                    }
                    _ => dead_letters.has(at),
                };
                done &= completed;
            }
            if done {
                break;
            }
        }
        if Instant::now() >= deadline {
            let settled = settled.lock().expect("lock");
            let missing: Vec<_> = all
                .iter()
                .filter(|p| !settled.contains(p))
                .take(10)
                .collect();
            let ids = ids.lock().expect("lock");
            let missing: Vec<_> = missing.iter().map(|p| (**p, ids.get(p).cloned())).collect();
            panic!(
                "not settled in {:?}: {} of {} produced positions settled ({} of {total} \
                 produced, {} crashes); missing {missing:?}",
                plan.timeout,
                settled.len(),
                all.len(),
                all.len(),
                crashed_instances.len()
            );
        }
        // Arm one instance at a time, and only once every running instance has settled
        // something: the group is then stable, so the kill lands in steady processing.
        if armed.is_none() && crashes_left > 0 {
            let stable = running
                .values()
                .all(|i| i.probe.mine.load(Ordering::Relaxed) > 0);
            if stable {
                if let Some(point) = plans.next() {
                    let ids: Vec<u32> = running.keys().copied().collect();
                    let victim = ids[fastrand::usize(..ids.len())];
                    let countdown = match point {
                        Point::AfterEffect | Point::AfterSettle => fastrand::u32(1..=10),
                        _ => fastrand::u32(1..=2),
                    };
                    running[&victim].probe.arm(point, countdown);
                    armed = Some((victim, Instant::now()));
                }
            }
        }
        tokio::select! {
            Some((instance, point)) = crashed_rx.recv() => {
                // Kill it: abort the task, which drops the client with no commit.
                // Then wait until its client has left the group before starting the
                // replacement (tansu mishandles a join racing the leader's leave).
                if let Some(inst) = running.remove(&instance) {
                    inst.task.abort();
                    let _ = inst.task.await;
                    tokio::time::timeout(Duration::from_secs(30), inst.probe.closed.notified())
                        .await
                        .expect("the crashed client closes");
                }
                crashed_instances.insert(instance);
                *crashes_by_point.entry(point).or_default() += 1;
                armed = None;
                let (i, inst) = start();
                running.insert(i, inst);
            }
            () = tokio::time::sleep(tick) => {}
        }
    }
    for (_, inst) in running.drain() {
        inst.stop.cancel();
        inst.task.await.expect("consumer task").expect("clean stop");
    }
    let ids = ids.lock().expect("lock").clone();
    let poison_at: BTreeSet<(i32, i64)> = ids
        .iter()
        .filter(|(_, id)| id.as_deref().is_none_or(is_poison))
        .map(|(at, _)| *at)
        .collect();

    // Nothing lost: every payment Completed, every poison or keyless message dead-lettered.
    let backend = store.backend();
    let mut payment_ids: BTreeSet<String> = BTreeSet::new();
    for id in ids.values().flatten() {
        payment_ids.insert(id.clone());
    }
    for id in &payment_ids {
        let rec = backend
            .get(&Key::new(group.as_str(), id.as_str()).expect("key"))
            .await
            .expect("get")
            .unwrap_or_else(|| panic!("no record for {id}"));
        if is_poison(id) {
            assert_eq!(rec.state, State::Failed, "{id}");
            assert!(rec.permanent, "{id}");
        } else {
            assert_eq!(rec.state, State::Completed, "{id}");
        }
    }
    let wait = Instant::now() + Duration::from_secs(30);
    while !poison_at.iter().all(|at| dead_letters.has(*at)) && Instant::now() < wait {
        dead_letters.poll();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lettered = dead_letters.seen.clone();
    assert!(
        lettered.is_superset(&poison_at),
        "dead letters {lettered:?} miss some of {poison_at:?}"
    );

    // The ledger: every payment applied; in transactional mode exactly once, in lease
    // mode any double explained by a lapsed lease.
    let entries = store.effects().await;
    let mut figures = Figures {
        crashes: crashed_instances.len(),
        crashes_by_point: POINTS
            .iter()
            .map(|p| (*p, crashes_by_point.get(p).copied().unwrap_or(0)))
            .collect(),
        ..Figures::default()
    };
    for id in payment_ids.iter().filter(|id| !is_poison(id)) {
        let applied = entries
            .get(id)
            .unwrap_or_else(|| panic!("{id} never applied"));
        figures.effects_applied += applied.len();
        if store.exactly_once() {
            assert_eq!(
                applied.len(),
                1,
                "{id} applied {} times: {applied:?}",
                applied.len()
            );
        }
        let mut sorted = applied.clone();
        sorted.sort_by_key(|a| a.token);
        for pair in sorted.windows(2) {
            let (first, later) = (&pair[0], &pair[1]);
            figures.double_effects += 1;
            assert!(
                later.token > first.token && later.kind == ClaimKind::Takeover,
                "{id}: a double effect not explained by a lapsed lease: {sorted:?}"
            );
            if crashed_instances.contains(&first.instance) {
                figures.doubles_after_crash += 1;
            } else {
                figures.doubles_under_live_worker += 1;
            }
        }
    }
    let mut per_id: HashMap<&str, u64> = HashMap::new();
    for pos in settles.lock().expect("lock").iter() {
        if let Some(Some(id)) = ids.get(pos) {
            *per_id.entry(id.as_str()).or_default() += 1;
        }
    }
    figures.duplicates_delivered = per_id
        .iter()
        .filter(|(id, _)| !is_poison(id))
        .map(|(_, n)| n.saturating_sub(1))
        .sum();
    figures.duplicates_replayed = crate::common::counter(idem_kafka::metrics::REPLAYED, &topic);
    figures.seconds = started.elapsed().as_secs_f64();
    figures
}

/// The crash test of `plan` in lease mode over `backend`, named `name` in its figures:
/// every payment is applied at least once, 400 of the copies are replayed, and every
/// double effect follows a takeover with a higher token (the harness checks each one).
pub async fn lease_mode(
    brokers: &str,
    name: &str,
    backend: Arc<dyn Backend>,
    plan: Plan,
) -> Figures {
    let store = Arc::new(LeaseStore::new(backend));
    let figures = run(brokers, store, plan).await;
    print(name, &figures);
    assert_eq!(figures.crashes, CRASHES);
    // 400 payments were sent twice. A copy can go unreplayed only when a crash lands
    // between its settle and its probe (then it is skipped, not lost).
    assert!(
        figures.duplicates_replayed >= 400 - 2 * figures.crashes as u64,
        "{figures:?}"
    );
    assert!(figures.effects_applied >= 2000, "{figures:?}");
    assert_eq!(
        figures.effects_applied,
        2000 + figures.double_effects,
        "{figures:?}"
    );
    figures
}

/// Lease mode over any backend: the side effect is an entry in the in-process ledger,
/// tagged with the lease's token and claim kind.
pub struct LeaseStore {
    pub backend: Arc<dyn Backend>,
    pub ledger: Arc<Ledger>,
}

impl LeaseStore {
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        LeaseStore {
            backend,
            ledger: Arc::default(),
        }
    }
}

impl Store for LeaseStore {
    fn backend(&self) -> Arc<dyn Backend> {
        self.backend.clone()
    }

    fn consumer(
        &self,
        builder: idem_kafka::ConsumerBuilder,
        engine: Engine,
        instance: u32,
    ) -> IdemConsumer {
        let ledger = self.ledger.clone();
        builder
            .engine(engine)
            .handler(move |msg, ctx| {
                let ledger = ledger.clone();
                async move {
                    let id = payment(&msg)?;
                    let ctx = ctx.ok_or_else(|| idem_core::HandlerError::permanent("no lease"))?;
                    let applied = Applied {
                        token: ctx.token(),
                        kind: ctx.kind(),
                        instance,
                    };
                    ledger.apply(&id, applied);
                    Ok(bytes::Bytes::from(format!("paid {id}")))
                }
            })
            .build()
            .expect("consumer")
    }

    fn effects(&self) -> BoxFuture<'_, HashMap<String, Vec<Applied>>> {
        let entries = self.ledger.entries.lock().expect("lock").clone();
        Box::pin(std::future::ready(entries))
    }

    fn exactly_once(&self) -> bool {
        false
    }
}

/// Transactional mode: the side effect is a row in a PostgreSQL `ledger` table, written
/// through the open transaction.
pub struct TransactionalStore {
    pub backend: idem_postgres::PgBackend,
    pub ledger: String,
}

impl Store for TransactionalStore {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }

    fn consumer(
        &self,
        builder: idem_kafka::ConsumerBuilder,
        engine: Engine,
        instance: u32,
    ) -> IdemConsumer {
        use futures::FutureExt;
        let table = self.ledger.clone();
        builder
            .engine(engine)
            .transactional(self.backend.clone(), move |msg, tx, lease| {
                let table = table.clone();
                async move {
                    let id = payment(&msg)?;
                    let q = format!(
                        "INSERT INTO {table} (payment, token, instance, kind) VALUES ($1, $2, $3, $4)"
                    );
                    sqlx::query(sqlx::AssertSqlSafe(q))
                        .bind(&id)
                        .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                        .bind(i32::try_from(instance).unwrap_or(i32::MAX))
                        .bind(format!("{:?}", lease.kind))
                        .execute(&mut **tx)
                        .await?;
                    Ok(bytes::Bytes::from(format!("paid {id}")))
                }
                .boxed()
            })
            .build()
            .expect("consumer")
    }

    fn effects(&self) -> BoxFuture<'_, HashMap<String, Vec<Applied>>> {
        Box::pin(async move {
            let q = format!("SELECT payment, token, instance, kind FROM {}", self.ledger);
            let rows: Vec<(String, i64, i32, String)> = sqlx::query_as(sqlx::AssertSqlSafe(q))
                .fetch_all(self.backend.pool())
                .await
                .expect("read ledger");
            let mut out: HashMap<String, Vec<Applied>> = HashMap::new();
            for (payment, token, instance, kind) in rows {
                let kind = match kind.as_str() {
                    "First" => ClaimKind::First,
                    "Retry" => ClaimKind::Retry,
                    _ => ClaimKind::Takeover,
                };
                out.entry(payment).or_default().push(Applied {
                    token: u64::try_from(token).unwrap_or(0),
                    kind,
                    instance: u32::try_from(instance).unwrap_or(0),
                });
            }
            out
        })
    }

    fn exactly_once(&self) -> bool {
        true
    }
}

/// Prints the figures in one block.
pub fn print(name: &str, f: &Figures) {
    println!("crash test ({name}), {:.1} s:", f.seconds);
    println!(
        "  crashes injected:      {} {:?}",
        f.crashes, f.crashes_by_point
    );
    println!("  duplicates delivered:  {}", f.duplicates_delivered);
    println!("  duplicates replayed:   {}", f.duplicates_replayed);
    println!("  effects applied:       {}", f.effects_applied);
    println!(
        "  double effects:        {} (after a crash: {}, lease lapsed under a live worker: {})",
        f.double_effects, f.doubles_after_crash, f.doubles_under_live_worker
    );
}

/// Follows the dead-letter topic from its beginning and keeps the original positions of
/// what it finds there.
pub struct DeadLetterWatch {
    consumer: idem_kafka::rdkafka::consumer::BaseConsumer,
    pub seen: BTreeSet<(i32, i64)>,
}

impl DeadLetterWatch {
    pub fn new(brokers: &str, topic: &str) -> Self {
        use idem_kafka::rdkafka::consumer::Consumer;
        use idem_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
        let consumer: idem_kafka::rdkafka::consumer::BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", common::unique("dlq-watch"))
            .set("enable.auto.commit", "false")
            .create()
            .expect("dead-letter watcher");
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, 0, Offset::Beginning)
            .expect("offset");
        consumer.assign(&tpl).expect("assign");
        DeadLetterWatch {
            consumer,
            seen: BTreeSet::new(),
        }
    }

    /// Takes in whatever arrived, without blocking.
    pub fn poll(&mut self) {
        use idem_kafka::rdkafka::message::{Headers, Message as _};
        while let Some(Ok(m)) = self.consumer.poll(Duration::ZERO) {
            let header = |name: &str| -> Option<i64> {
                m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == name)
                        .and_then(|h| h.value)
                        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
                })
            };
            let partition = header("idem-original-partition").and_then(|p| i32::try_from(p).ok());
            if let (Some(p), Some(o)) = (partition, header("idem-original-offset")) {
                self.seen.insert((p, o));
            }
        }
    }

    pub fn has(&self, at: (i32, i64)) -> bool {
        self.seen.contains(&at)
    }
}
