//! Network faults between the consumers and the Kafka broker: two consumers of one group
//! reach a tansu broker of the test's own (`IDEM_TANSU_BIN`, its log in memory) only
//! through a TCP proxy (`idem_conformance::proxy`) that the test switches while payments flow. The
//! broker listens on a port of its own and advertises the proxy's address, so every
//! client connection, to the bootstrap address and to the broker's address from metadata
//! alike, goes through the proxy (checked first); the test's producer and offset checks go
//! through it too, between faults. The store is reached directly.
//!
//! Payments (every fifth sent twice, the copy on another partition) go out in waves, each
//! met by a fault once the consumers have started on it, as in `tests/netfault.rs`:
//!
//! 1. a latency window: 800 ms added to each chunk each way (a round trip of 1.6 s, above
//!    the consumers' 500 ms heartbeat interval) for 3 s, with every connection reset in the
//!    middle of it;
//! 2. every connection reset again, mid-traffic, without latency;
//! 3. a 5 s blackhole: nothing forwarded, both ways (below the 6 s session timeout).
//!
//! The full form goes round twice, the second time with a 10 s blackhole, past the
//! session timeout: the consumers' sessions expire under it, they lose their partitions
//! and join the group again once it is over.
//!
//! The consumers prefetch little (`queued.min.messages` and the batch at 20), so that they
//! keep fetching while they work through a wave and the faults meet fetches, not only
//! heartbeats and offset commits; about five payments a wave hold their lease 1 s after
//! their effect (every fiftieth in the short form), so that each wave lasts past its
//! fault's start.
//!
//! Each payment's side effect is a row of a PostgreSQL `ledger` table with no uniqueness
//! (`IDEM_POSTGRES_URL`): in Redis lease mode (`IDEM_REDIS_URL`) written on its own, in
//! PostgreSQL transactional mode in the handler's transaction. Checked at the end: every
//! payment in the ledger; in transactional mode each exactly once; in lease mode every
//! later row of a payment under a higher token, from a takeover; the group's committed
//! offsets at the end of every partition (and in transactional mode the offsets stored in
//! PostgreSQL); the resets cut at least one connection per consumer each; each fault met
//! its wave in flight; both consumers stop cleanly. Each test prints its figures and a row of
//! `scripts/faults`' table. Short by default (1,000 payments, the three faults once, about
//! 30 s); with `IDEM_FAULTS_FULL=1` (as `scripts/faults` runs it) 5,000 payments and the
//! faults twice.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Recorder;
use common::broker::{self, Broker};
use common::faults::{self, Counters};
use common::ledger::{self, Mode};
use idem_conformance::proxy::{Faults, Proxy};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idem_kafka::{IdemConsumer, Point, Probe, Verdict};

const PARTITIONS: i32 = 4;
/// Every fifth payment is sent twice.
const DUPLICATE_EVERY: usize = 5;
const CONSUMERS: u32 = 2;
/// 800 ms each way (a round trip of 1.6 s, past the 500 ms heartbeat interval of
/// `common::consumer_config`) for 3 s; a 5 s blackhole, within its 6 s session timeout.
const FAULTS: Faults = Faults::new()
    .with_latency(Duration::from_millis(800))
    .with_latency_for(Duration::from_secs(3))
    .with_blackhole_for(Duration::from_secs(5));
/// The full form's second round: the same but a 10 s blackhole, past the session
/// timeout, so that the group's sessions expire under it and its partitions are revoked
/// and assigned again.
const FAULTS_LONG: Faults = FAULTS.with_blackhole_for(Duration::from_secs(10));
/// Resets in each round of faults: one under latency, one alone.
const RESETS_PER_ROUND: usize = 2;
/// librdkafka's prefetch per partition (`queued.min.messages`) and the batch.
const PREFETCH: usize = 20;
/// A payment's handler holds its lease this long after its effect if the payment's
/// number is a multiple of the run's `slow_every`.
const SLOW: Duration = Duration::from_secs(1);
/// The most any one wait of the test may take.
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_network_faults_lease_redis() {
    scenario(Mode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_network_faults_transactional_postgres() {
    scenario(Mode::Transactional).await;
}

/// The size of a run: short in CI, full with `IDEM_FAULTS_FULL=1`.
struct Size {
    payments: usize,
    /// Rounds of the three faults.
    rounds: usize,
    /// Which payments hold their lease [`SLOW`] (every `slow_every`th): about five a wave.
    slow_every: usize,
}

fn size() -> Size {
    match std::env::var("IDEM_FAULTS_FULL").as_deref() {
        Ok("1") => Size {
            payments: 5000,
            rounds: 2,
            slow_every: 150,
        },
        _ => Size {
            payments: 1000,
            rounds: 1,
            slow_every: 50,
        },
    }
}

/// The consumers' shared [`Recorder`], and which consumer settled each partition's last
/// message: a change of hands is a partition moved by a rebalance.
#[derive(Default)]
struct Hands {
    recorder: Arc<Recorder>,
    last: Mutex<HashMap<i32, u32>>,
    moves: AtomicUsize,
}

/// The probe of consumer `instance`.
struct Hand {
    instance: u32,
    hands: Arc<Hands>,
}

impl Probe for Hand {
    fn reached(&self, point: Point, topic: &str, partition: i32, offset: i64) -> Verdict {
        if point == Point::AfterSettle {
            let mut last = self.hands.last.lock().expect("lock");
            if last
                .insert(partition, self.instance)
                .is_some_and(|before| before != self.instance)
            {
                self.hands.moves.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.hands.recorder.reached(point, topic, partition, offset)
    }
}

/// What a run saw: the fault tests' figures, and the broker's own.
#[derive(Debug, Default)]
struct Figures {
    all: faults::Figures,
    /// Failed offset commits.
    commit_errors: u64,
    /// Partitions that changed hands after the first wave.
    moves: usize,
    /// Of each faulted wave, how many messages had settled when its fault began and when
    /// it ended, of how many.
    during: Vec<(usize, usize, usize)>,
    /// For comparison, the first wave (no fault): from its first message settled to its
    /// last.
    clean_wave: f64,
    /// Connections the proxy cut.
    cut: usize,
}

faults::extends_figures!(Figures);

async fn scenario(mode: Mode) {
    let started = Instant::now();
    let bin = idem_conformance::service_env("IDEM_TANSU_BIN");
    common::install_metrics();
    common::log_from_env();
    let Size {
        payments,
        rounds,
        slow_every,
    } = size();
    // How long a payment's handler holds its lease after its effect.
    let hold = move |id: &str| {
        let slow = id
            .strip_prefix("pay-")
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|n| n % slow_every == 0);
        if slow { SLOW } else { Duration::ZERO }
    };
    let port = broker::free_port();
    let proxy = Proxy::start(&format!("127.0.0.1:{port}")).await;
    let brokers = proxy.addr().to_string();
    let _broker = Broker::in_memory(bin, port, &brokers).await;
    assert_eq!(
        advertised(&brokers).await,
        std::slice::from_ref(&brokers),
        "the broker's address in metadata is the proxy's"
    );
    let topic = common::unique("broker_netfault");
    let group = common::unique("broker_netfault");
    let dlq = format!("{topic}.dlq");
    common::create_topics(&brokers, &[(topic.as_str(), PARTITIONS), (&dlq, 1)]).await;
    let (ledger_db, ledger) = common::postgres().await;
    let label = format!("broker network faults, {}", mode.label());

    let hands = Arc::new(Hands::default());
    let mut consumers = Vec::new();
    for instance in 0..CONSUMERS {
        let mut config = common::consumer_config(&brokers);
        config.set("queued.min.messages", PREFETCH.to_string());
        let builder = IdemConsumer::builder(config)
            .topics([topic.as_str()])
            .group(group.as_str())
            .batch_size(PREFETCH)
            .commit_interval(Duration::from_millis(200))
            .revoke_timeout(Duration::from_secs(5))
            .retry_backoff(Duration::from_millis(20), Duration::from_millis(500));
        let builder = ledger::payer(builder, mode, &group, &ledger_db, &ledger, instance, hold);
        let hand = Arc::new(Hand {
            instance,
            hands: hands.clone(),
        });
        consumers.push(common::start(builder.await, &hand));
    }
    let recorder = &hands.recorder;

    let outs = ledger::payments(payments, DUPLICATE_EVERY, PARTITIONS);
    let waves = 1 + 3 * rounds;
    let mut ends = vec![0i64; PARTITIONS as usize];
    let mut produced = 0;
    let mut figures = Figures::default();
    let mut moves_before = 0;
    let mut last_fault_end = Instant::now();
    for (n, wave) in outs.chunks(outs.len().div_ceil(waves)).enumerate() {
        for (p, o) in common::produce(&brokers, &topic, wave).await {
            let end = &mut ends[usize::try_from(p).expect("partition")];
            *end = (*end).max(o + 1);
        }
        // The fault comes once the consumers have started on the wave.
        recorder.wait_settled(produced + 1, WAIT).await;
        produced += wave.len();
        if n == 0 {
            let begun = Instant::now();
            recorder.wait_settled(produced, WAIT).await;
            figures.clean_wave = begun.elapsed().as_secs_f64();
            moves_before = hands.moves.load(Ordering::Relaxed);
            continue;
        }
        let before = recorder.settled_count();
        let faults = if n <= 3 { &FAULTS } else { &FAULTS_LONG };
        figures.faults.extend(faults.inject(n, &proxy).await);
        last_fault_end = Instant::now();
        figures
            .during
            .push((before, recorder.settled_count(), produced));
        assert!(
            before < produced,
            "{label}: wave {n} was over before its fault ({before} of {produced} settled)"
        );
        recorder.wait_settled(produced, WAIT).await;
        figures
            .recovered
            .push(last_fault_end.elapsed().as_secs_f64());
    }

    // Done once every payment is in the ledger and the committed offsets reach the end;
    // neither signals, so both are polled.
    let deadline = Instant::now() + WAIT;
    loop {
        let applied = common::ledger_counts(&ledger_db, &ledger).await;
        let at = committed(&brokers, &group, &topic).await;
        if applied.len() == payments && at == ends {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{label}: not done in {WAIT:?}: {} of {payments} payments in the ledger, \
             committed {at:?}, end {ends:?}",
            applied.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    figures.committed_after_last = last_fault_end.elapsed().as_secs_f64();
    for consumer in consumers {
        consumer.stop().await;
    }
    figures.moves = hands.moves.load(Ordering::Relaxed) - moves_before;
    figures.connections = proxy.accepted();
    figures.cut = proxy.cut();
    figures.counters = Counters::read(&topic);
    figures.commit_errors = common::counter_by(idem_kafka::metrics::COMMIT_ERRORS, "group", &group);

    let transactional = mode == Mode::Transactional;
    let tally = ledger::check_run(
        &ledger_db,
        &ledger,
        &group,
        &topic,
        &ends,
        payments,
        transactional,
        &label,
    )
    .await;
    (figures.effects, figures.doubles) = (tally.effects, tally.doubles);
    figures.takeovers = tally.takeovers;
    figures.seconds = started.elapsed().as_secs_f64();
    let during: Vec<String> = figures
        .during
        .iter()
        .map(|(from, to, of)| format!("{from}→{to} of {of}"))
        .collect();
    eprintln!(
        "{label}: faults [{}]; {} effects, {} doubles, {} effects under a takeover; {}, {} \
         failed commits; {} partition moves; settled during each fault [{}]; settled all {} \
         s after each fault (the first wave, without one, in {:.1} s), committed to the end \
         {:.1} s after the last; {} proxied connections, {} cut; {:.1} s",
        figures.faults.join(", "),
        figures.effects,
        figures.doubles,
        figures.takeovers,
        figures.counters,
        figures.commit_errors,
        figures.moves,
        during.join(", "),
        faults::seconds(&figures.recovered),
        figures.clean_wave,
        figures.committed_after_last,
        figures.connections,
        figures.cut,
        figures.seconds
    );
    let scenario = format!(
        "broker network faults ({}), {}",
        figures.faults.join(", "),
        mode.label()
    );
    eprintln!("{}", figures.row(&scenario, payments));
    assert_eq!(figures.effects, payments + figures.doubles);
    // Every consumer holds a connection to the broker at all times: a reset that cut
    // fewer than one per consumer cut traffic that did not go through the proxy.
    let resets = RESETS_PER_ROUND * rounds;
    let consumers = usize::try_from(CONSUMERS).expect("consumers");
    assert!(
        figures.cut >= resets * consumers,
        "{label}: {resets} resets cut {} connections",
        figures.cut
    );
    common::drop_schema(&ledger_db).await;
}

/// The broker addresses (`host:port`) the metadata fetched through `bootstrap` gives.
async fn advertised(bootstrap: &str) -> Vec<String> {
    let bootstrap = bootstrap.to_owned();
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()
            .expect("metadata client");
        let metadata = client
            .fetch_metadata(None, Duration::from_secs(10))
            .expect("metadata");
        metadata
            .brokers()
            .iter()
            .map(|b| format!("{}:{}", b.host(), b.port()))
            .collect()
    })
    .await
    .expect("metadata task")
}

/// The group's committed offsets on each partition of `topic` (-1 when none).
async fn committed(brokers: &str, group: &str, topic: &str) -> Vec<i64> {
    let (b, g, t) = (brokers.to_owned(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || common::committed(&b, &g, &t, PARTITIONS))
        .await
        .expect("committed offsets")
}
