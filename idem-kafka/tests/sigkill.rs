//! Consumer processes killed with SIGKILL at random moments and restarted, on the real
//! broker (tansu, `IDEM_KAFKA_BROKERS`). Each worker is the `worker` example in a process
//! of its own; the side effect of a payment is a row of a ledger table in PostgreSQL
//! (`IDEM_POSTGRES_URL`) or, in transactional mode, MySQL (`IDEM_MYSQL_URL`). Payments are
//! produced in waves; after each wave, once a random number of messages settled (plus a
//! random pause), a random worker among those that settled something is killed and a
//! replacement starts. When every payment is in the ledger and the group's offsets reach
//! the end, the remaining workers stop and the ledger is checked: no payment lost; in
//! transactional mode each exactly once; in lease mode (on Redis, `IDEM_REDIS_URL`,
//! PostgreSQL, MySQL or DynamoDB Local, `IDEM_DYNAMO_ENDPOINT`) every double effect comes
//! after a takeover with a higher token, and the test reports the doubles per kill; with
//! `--max-unsettled 1` no kill repeats more than one effect per partition.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use common::Out;
use idem_core::backend::StoredOffset;
use idem_core::{Backend, Key, State, Transactional};
use idem_mysql::{MySqlBackend, MySqlConfig};
use idem_postgres::PgBackend;
use tokio::sync::mpsc;

const PAYMENTS: usize = 1000;
/// Every fifth payment is sent twice: 200 duplicates.
const DUPLICATE_EVERY: usize = 5;
const PARTITIONS: i32 = 4;
const WORKERS: usize = 3;
const KILLS: usize = 8;
const LEASE_MS: &str = "2000";
/// Each handler sleeps this long before its effect, so kills land mid-batch.
const WORK_MS: &str = "5";
const TIMEOUT: Duration = Duration::from_secs(180);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Transactional,
    /// Lease mode on `store`, with the worker's `--max-unsettled` if given.
    Lease {
        store: LeaseStore,
        max_unsettled: Option<usize>,
    },
}

/// The store of lease mode.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum LeaseStore {
    Redis,
    Postgres,
    Mysql,
    Dynamo,
}

/// The DynamoDB table the worker example uses in lease mode.
const DYNAMO_TABLE: &str = "idem_sigkill";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_transactional_postgres() {
    let f = scenario(Mode::Transactional, Sql::Postgres).await;
    assert_eq!(f.effects, PAYMENTS, "each payment exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_transactional_mysql() {
    let f = scenario(Mode::Transactional, Sql::Mysql).await;
    assert_eq!(f.effects, PAYMENTS, "each payment exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_lease_redis() {
    lease(LeaseStore::Redis, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_lease_redis_max_unsettled_1() {
    lease(LeaseStore::Redis, Some(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_lease_postgres() {
    lease(LeaseStore::Postgres, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_lease_postgres_max_unsettled_1() {
    lease(LeaseStore::Postgres, Some(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_lease_mysql() {
    lease(LeaseStore::Mysql, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_lease_mysql_max_unsettled_1() {
    lease(LeaseStore::Mysql, Some(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_lease_dynamo() {
    lease(LeaseStore::Dynamo, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_lease_dynamo_max_unsettled_1() {
    lease(LeaseStore::Dynamo, Some(1)).await;
}

/// Lease mode on `store`: every payment applied, each double after a takeover; with
/// `max_unsettled`, no kill repeats more than that many effects on one partition.
async fn lease(store: LeaseStore, max_unsettled: Option<usize>) -> Figures {
    let mode = Mode::Lease {
        store,
        max_unsettled,
    };
    let f = scenario(mode, Sql::Postgres).await;
    assert_eq!(f.effects, PAYMENTS + f.doubles);
    if let Some(n) = max_unsettled {
        assert!(
            f.worst_kill <= n,
            "a kill repeated {} effects on one partition, bound {n}",
            f.worst_kill
        );
        let most = f.kills * usize::try_from(PARTITIONS).expect("partitions") * n;
        assert!(
            f.doubles_after_kill <= most,
            "{} doubles after {} kills of workers holding at most {PARTITIONS} partitions, \
             bound {n} per partition",
            f.doubles_after_kill,
            f.kills
        );
    }
    f
}

/// The database of the ledger (in transactional mode, idem's store too).
#[derive(Clone, Copy)]
enum Sql {
    Postgres,
    Mysql,
}

/// A `ledger` table of (payment, token, instance, kind, seq) rows with no uniqueness, so
/// a double effect would show, in a schema of its own beside idem's migrated tables.
enum Ledger {
    Postgres(PgBackend),
    Mysql(MySqlBackend),
}

/// `$body` with `$pool` bound to the ledger's pool, whichever database it is in.
macro_rules! with_pool {
    ($ledger:expr, |$pool:ident| $body:expr) => {
        match $ledger {
            Ledger::Postgres(b) => {
                let $pool = b.pool();
                $body
            }
            Ledger::Mysql(b) => {
                let $pool = b.pool();
                $body
            }
        }
    };
}

impl Ledger {
    /// Creates the ledger; also answers its server's URL.
    async fn create(sql: Sql) -> (Ledger, String) {
        match sql {
            Sql::Postgres => {
                let url = idem_conformance::service_env("IDEM_POSTGRES_URL");
                (Ledger::Postgres(common::postgres().await.0), url)
            }
            Sql::Mysql => {
                let url = idem_conformance::service_env("IDEM_MYSQL_URL");
                let schema = format!("kafkatest_{}_{}", std::process::id(), fastrand::u32(..));
                let config = MySqlConfig::new(url.as_str()).with_schema(schema.as_str());
                let my = MySqlBackend::connect(config).await;
                let my = my.expect("connect to IDEM_MYSQL_URL");
                my.migrate().await.expect("migrate");
                let ledger = Ledger::Mysql(my);
                let create = format!(
                    "CREATE TABLE {} (payment VARCHAR(64) NOT NULL, token BIGINT NOT NULL, \
                     instance INT NOT NULL, kind VARCHAR(16) NOT NULL, \
                     seq BIGINT AUTO_INCREMENT PRIMARY KEY) ENGINE = InnoDB",
                    ledger.table()
                );
                ledger.execute(create).await.expect("create the ledger");
                (ledger, url)
            }
        }
    }

    fn schema(&self) -> &str {
        match self {
            Ledger::Postgres(pg) => pg.schema(),
            Ledger::Mysql(my) => my.schema().expect("a schema of its own"),
        }
    }

    fn quoted_schema(&self) -> String {
        match self {
            Ledger::Postgres(_) => format!("\"{}\"", self.schema()),
            Ledger::Mysql(_) => format!("`{}`", self.schema()),
        }
    }

    fn table(&self) -> String {
        format!("{}.ledger", self.quoted_schema())
    }

    /// idem's store in the same schema, for transactional mode.
    fn backend(&self) -> std::sync::Arc<dyn Backend> {
        match self {
            Ledger::Postgres(pg) => std::sync::Arc::new(pg.clone()),
            Ledger::Mysql(my) => std::sync::Arc::new(my.clone()),
        }
    }

    async fn execute(&self, q: String) -> sqlx::Result<()> {
        let q = sqlx::AssertSqlSafe(q);
        with_pool!(self, |pool| sqlx::query(q).execute(pool).await.map(drop))
    }

    /// (payment, token, instance, kind) in the order the rows were written.
    async fn rows(&self) -> Vec<(String, i64, i32, String)> {
        let q = format!(
            "SELECT payment, token, instance, kind FROM {} ORDER BY seq",
            self.table()
        );
        with_pool!(self, |pool| sqlx::query_as(sqlx::AssertSqlSafe(q))
            .fetch_all(pool)
            .await)
        .expect("read the ledger")
    }

    /// The next offsets stored in transactional mode.
    async fn stored_offsets(&self, group: &str) -> Vec<StoredOffset> {
        let stored = match self {
            Ledger::Postgres(pg) => pg.stored_offsets(group).await,
            Ledger::Mysql(my) => my.stored_offsets(group).await,
        };
        stored.expect("stored offsets")
    }

    /// Drops the schema, idem's tables with it.
    async fn drop_schema(&self) {
        let cascade = if matches!(self, Ledger::Postgres(_)) {
            " CASCADE"
        } else {
            ""
        };
        let q = format!("DROP SCHEMA IF EXISTS {}{cascade}", self.quoted_schema());
        let _ = self.execute(q).await;
    }
}

/// What a worker's stdout said, read on a thread of its own.
enum Event {
    Settled(u32),
    Exited(u32),
}

struct Worker {
    instance: u32,
    /// Messages it settled: a worker that settled one holds partitions and is working.
    settled: u64,
    child: Child,
    stdin: Option<ChildStdin>,
}

/// The running workers, and how to start another.
struct Pool {
    example: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    next: u32,
    events: mpsc::UnboundedSender<Event>,
    running: Vec<Worker>,
    killed: HashSet<u32>,
}

impl Pool {
    fn start(&mut self) {
        let instance = self.next;
        self.next += 1;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the worker log");
        let mut child = Command::new(&self.example)
            .args(&self.args)
            .args(["--instance", &instance.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start a worker");
        let stdout = child.stdout.take().expect("piped stdout");
        let events = self.events.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) if l.starts_with("settled ") => {
                        let _ = events.send(Event::Settled(instance));
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            let _ = events.send(Event::Exited(instance));
        });
        let stdin = child.stdin.take();
        self.running.push(Worker {
            instance,
            settled: 0,
            child,
            stdin,
        });
    }

    /// Counts a settle of a running worker; true when it was one.
    fn settled(&mut self, instance: u32) -> bool {
        let w = self.running.iter_mut().find(|w| w.instance == instance);
        w.map(|w| w.settled += 1).is_some()
    }

    /// SIGKILLs a random worker among those that settled something (`Child::kill` sends
    /// SIGKILL on Unix) and reaps it.
    fn kill_one(&mut self) -> u32 {
        let working: Vec<usize> = (0..self.running.len())
            .filter(|i| self.running[*i].settled > 0)
            .collect();
        let mut w = self
            .running
            .swap_remove(working[fastrand::usize(..working.len())]);
        w.child.kill().expect("SIGKILL a worker");
        w.child.wait().expect("reap a worker");
        self.killed.insert(w.instance);
        w.instance
    }

    /// A worker's stdout closed: fine once killed, a failure while it should be running.
    fn exited(&self, instance: u32) {
        assert!(
            !self.running.iter().any(|w| w.instance == instance),
            "worker {instance} exited on its own; its stderr is in {}",
            self.log.display()
        );
    }
}

/// The figures printed at the end.
#[derive(Debug, Default)]
struct Figures {
    duplicates: usize,
    kills: usize,
    effects: usize,
    doubles: usize,
    doubles_after_kill: usize,
    /// Effects whose claim took over a lapsed lease (a kill after a claim).
    takeovers: usize,
    /// The most effects one kill repeated on one partition.
    worst_kill: usize,
    seconds: f64,
}

async fn scenario(mode: Mode, sql: Sql) -> Figures {
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let (ledger, ledger_url) = Ledger::create(sql).await;
    let topic = common::unique("sigkill");
    let group = common::unique("sigkill-group");
    let dlq = format!("{topic}.dlq");
    common::create_topics(&brokers, &[(&topic, PARTITIONS), (&dlq, 1)]).await;
    let example = common::build_example("worker");
    // The store, as the workers reach it (`--store`) and as this test reads it.
    let mut mysql_schema = None;
    let (store_url, store): (String, std::sync::Arc<dyn Backend>) = match mode {
        // The ledger's schema has idem's tables migrated.
        Mode::Transactional
        | Mode::Lease {
            store: LeaseStore::Postgres,
            ..
        } => (ledger_url.clone(), ledger.backend()),
        Mode::Lease {
            store: LeaseStore::Redis,
            ..
        } => {
            let url = idem_conformance::service_env("IDEM_REDIS_URL");
            let config = idem_redis::RedisConfig::new(url.as_str())
                .with_prefix(format!("idem-sigkill:{group}:"));
            let redis = idem_redis::RedisBackend::connect(config).await;
            (
                url,
                std::sync::Arc::new(redis.expect("connect to IDEM_REDIS_URL")),
            )
        }
        Mode::Lease {
            store: LeaseStore::Mysql,
            ..
        } => {
            let url = idem_conformance::service_env("IDEM_MYSQL_URL");
            let config = MySqlConfig::new(url.as_str()).with_schema(ledger.schema());
            let my = MySqlBackend::connect(config).await;
            let my = my.expect("connect to IDEM_MYSQL_URL");
            my.migrate().await.expect("migrate");
            mysql_schema = Some(Ledger::Mysql(my.clone()));
            (url, std::sync::Arc::new(my))
        }
        Mode::Lease {
            store: LeaseStore::Dynamo,
            ..
        } => {
            let endpoint = idem_conformance::service_env("IDEM_DYNAMO_ENDPOINT");
            let config = idem_dynamo::DynamoConfig::local(endpoint.as_str(), DYNAMO_TABLE)
                .with_clock_skew(Duration::from_millis(50));
            let dynamo = idem_dynamo::DynamoBackend::connect(config).await;
            let dynamo = dynamo.expect("connect to IDEM_DYNAMO_ENDPOINT");
            dynamo.create_table().await.expect("create the table");
            (endpoint, std::sync::Arc::new(dynamo))
        }
    };

    // The payments, every fifth one sent twice (the copy anywhere in the stream).
    let mut ids: Vec<String> = (0..PAYMENTS).map(|i| format!("pay-{i}")).collect();
    for i in (0..PAYMENTS).step_by(DUPLICATE_EVERY) {
        ids.insert(fastrand::usize(..=ids.len()), format!("pay-{i}"));
    }
    let mut figures = Figures {
        duplicates: ids.len() - PAYMENTS,
        ..Figures::default()
    };
    let outs: Vec<Out> = ids
        .iter()
        .map(|id| Out {
            partition: None,
            key: Some(id.as_bytes().to_vec()),
            payload: format!(r#"{{"id":"{id}"}}"#).into_bytes(),
            headers: vec![("idempotency-key".into(), id.as_bytes().to_vec())],
        })
        .collect();

    let mode_arg = match mode {
        Mode::Transactional => "transactional",
        Mode::Lease { .. } => "lease",
    };
    let label = match (mode, sql) {
        (
            Mode::Lease {
                store,
                max_unsettled,
            },
            _,
        ) => format!(
            "lease, {store:?}, max_unsettled {}",
            max_unsettled.map_or("default".into(), |n| n.to_string())
        ),
        (Mode::Transactional, Sql::Postgres) => "transactional, PostgreSQL".into(),
        (Mode::Transactional, Sql::Mysql) => "transactional, MySQL".into(),
    };
    let max_unsettled = match mode {
        Mode::Lease {
            max_unsettled: Some(n),
            ..
        } => Some(n.to_string()),
        _ => None,
    };
    let mut args = vec![
        ("mode", mode_arg),
        ("brokers", &brokers),
        ("topic", &topic),
        ("group", &group),
        ("store", &store_url),
        ("ledger", &ledger_url),
        ("schema", ledger.schema()),
        ("lease-ms", LEASE_MS),
        ("work-ms", WORK_MS),
    ];
    if let Some(n) = &max_unsettled {
        args.push(("max-unsettled", n));
    }
    let (events, mut rx) = mpsc::unbounded_channel();
    let mut pool = Pool {
        example: example.path().to_owned(),
        args: args
            .iter()
            .flat_map(|(k, v)| [format!("--{k}"), (*v).to_owned()])
            .collect(),
        log: std::env::temp_dir().join(format!("{topic}.log")),
        next: 0,
        events,
        running: Vec::new(),
        killed: HashSet::new(),
    };
    eprintln!("workers log to {}", pool.log.display());
    for _ in 0..WORKERS {
        pool.start();
    }

    // A wave before each kill, so every kill finds work; the kill comes once running
    // workers settled a random number of messages, after a random pause of up to 250 ms,
    // and hits one of the workers that settled something (its partitions are assigned).
    let mut ends: BTreeMap<i32, i64> = BTreeMap::new();
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    let waves: Vec<&[Out]> = outs.chunks(outs.len().div_ceil(KILLS + 1)).collect();
    for (n, wave) in waves.iter().enumerate() {
        let at = common::produce(&brokers, &topic, wave).await;
        for (out, (p, o)) in wave.iter().zip(at) {
            let end = ends.entry(p).or_default();
            *end = (*end).max(o + 1);
            let id = String::from_utf8_lossy(out.key.as_deref().unwrap_or_default());
            partition_of.insert(id.into_owned(), p);
        }
        if n == KILLS {
            break;
        }
        let want = fastrand::usize(1..=wave.len());
        let mut seen = 0;
        while seen < want {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(Event::Settled(i))) => seen += usize::from(pool.settled(i)),
                Ok(Some(Event::Exited(i))) => pool.exited(i),
                Ok(None) => unreachable!("the pool holds a sender"),
                Err(_) => panic!(
                    "kill {n}: only {seen} of {want} settles in {TIMEOUT:?}; worker log {}",
                    pool.log.display()
                ),
            }
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..250))).await;
        let victim = pool.kill_one();
        figures.kills += 1;
        eprintln!(
            "{label} {:5.1} s: killed worker {victim} after {seen} settles",
            started.elapsed().as_secs_f64()
        );
        pool.start();
    }

    // Done when every payment is in the ledger and Completed, and the offsets reach the
    // end. Neither the database nor the broker signals, so both are polled.
    let mut open: Vec<String> = (0..PAYMENTS).map(|i| format!("pay-{i}")).collect();
    loop {
        while let Ok(event) = rx.try_recv() {
            if let Event::Exited(i) = event {
                pool.exited(i);
            }
        }
        let applied: HashSet<String> = ledger.rows().await.into_iter().map(|r| r.0).collect();
        if open.iter().all(|id| applied.contains(id)) {
            let mut still = Vec::new();
            for id in open {
                let key = Key::new(group.as_str(), id.as_str()).expect("key");
                let rec = store.get(&key).await.expect("read a record");
                if rec.is_none_or(|r| r.state != State::Completed) {
                    still.push(id);
                }
            }
            open = still;
            if open.is_empty() && offsets(mode, &ledger, &brokers, &group, &topic).await == ends {
                break;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not done in {TIMEOUT:?}: {} of {PAYMENTS} payments in the ledger, {} not seen \
             Completed (first {:?}); offsets {:?}, end {ends:?}; worker log {}",
            applied.len(),
            open.len(),
            open.first(),
            offsets(mode, &ledger, &brokers, &group, &topic).await,
            pool.log.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    eprintln!(
        "{label} {:5.1} s: every payment in the ledger and Completed, offsets at the end",
        started.elapsed().as_secs_f64()
    );

    // A clean stop: stdin closes, each worker stops and says so.
    for w in &mut pool.running {
        w.stdin = None;
    }
    let mut left: HashSet<u32> = pool.running.iter().map(|w| w.instance).collect();
    while !left.is_empty() {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some(Event::Exited(i))) => {
                left.remove(&i);
            }
            Ok(Some(Event::Settled(_))) => {}
            Ok(None) | Err(_) => panic!("workers {left:?} did not stop within 30 s"),
        }
    }
    for w in &mut pool.running {
        let status = w.child.wait().expect("reap a worker");
        assert!(
            status.success(),
            "worker {} stopped with {status}",
            w.instance
        );
    }

    check(mode, &ledger, &pool.killed, &partition_of, &mut figures).await;
    figures.seconds = started.elapsed().as_secs_f64();
    println!(
        "sigkill ({label}): {PAYMENTS} payments, {} duplicates, {} kills, {} effects, {} \
         doubles ({} after a kill), {:.2} doubles per kill, at most {} by one kill on one \
         partition, {} effects after a takeover, {:.1} s",
        figures.duplicates,
        figures.kills,
        figures.effects,
        figures.doubles,
        figures.doubles_after_kill,
        figures.doubles as f64 / figures.kills.max(1) as f64,
        figures.worst_kill,
        figures.takeovers,
        figures.seconds
    );
    ledger.drop_schema().await;
    if let Some(schema) = mysql_schema {
        schema.drop_schema().await;
    }
    let _ = std::fs::remove_file(&pool.log);
    figures
}

/// The group's next offsets by partition: the store's in transactional mode (where the
/// consumer seeks on assignment), Kafka's committed offsets in lease mode.
async fn offsets(
    mode: Mode,
    ledger: &Ledger,
    brokers: &str,
    group: &str,
    topic: &str,
) -> BTreeMap<i32, i64> {
    match mode {
        Mode::Transactional => ledger
            .stored_offsets(group)
            .await
            .into_iter()
            .filter(|s| s.topic == topic)
            .map(|s| (s.partition, s.next_offset))
            .collect(),
        Mode::Lease { .. } => {
            let (b, g, t) = (brokers.to_owned(), group.to_owned(), topic.to_owned());
            let got =
                tokio::task::spawn_blocking(move || common::committed(&b, &g, &t, PARTITIONS))
                    .await
                    .expect("committed offsets");
            (0..PARTITIONS).zip(got).filter(|(_, o)| *o >= 0).collect()
        }
    }
}

/// The ledger: every payment applied; in transactional mode once; in lease mode each
/// later effect of a payment (in the order they were written) has a higher token than the
/// one before and comes from a takeover. Counts the effects each kill repeated on each
/// partition (the earlier effect's worker, and the payment's partition).
async fn check(
    mode: Mode,
    ledger: &Ledger,
    killed: &HashSet<u32>,
    partition_of: &HashMap<String, i32>,
    figures: &mut Figures,
) {
    let mut by_kill: HashMap<(u32, i32), usize> = HashMap::new();
    let rows = ledger.rows().await;
    let mut by_id: HashMap<String, Vec<(i64, i32, String)>> = HashMap::new();
    for (payment, token, instance, kind) in rows {
        by_id
            .entry(payment)
            .or_default()
            .push((token, instance, kind));
    }
    let lost: Vec<String> = (0..PAYMENTS)
        .map(|i| format!("pay-{i}"))
        .filter(|id| !by_id.contains_key(id))
        .collect();
    assert!(lost.is_empty(), "payments lost: {lost:?}");
    for (id, effects) in &by_id {
        figures.effects += effects.len();
        figures.takeovers += effects.iter().filter(|e| e.2 == "Takeover").count();
        if mode == Mode::Transactional {
            assert_eq!(effects.len(), 1, "{id} applied more than once: {effects:?}");
        }
        for pair in effects.windows(2) {
            let ((earlier, by, _), (later, _, kind)) = (&pair[0], &pair[1]);
            assert!(
                later > earlier && kind == "Takeover",
                "{id}: a double effect without a takeover with a higher token: {effects:?}"
            );
            figures.doubles += 1;
            if let Some(by) = u32::try_from(*by).ok().filter(|by| killed.contains(by)) {
                figures.doubles_after_kill += 1;
                let partition = partition_of.get(id).copied().unwrap_or(-1);
                *by_kill.entry((by, partition)).or_default() += 1;
            }
        }
    }
    figures.worst_kill = by_kill.values().copied().max().unwrap_or(0);
    assert_eq!(by_id.len(), PAYMENTS, "no payment outside the plan");
}
