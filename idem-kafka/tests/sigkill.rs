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
//!
//! The churn tests (`sigkilled_workers_churn_*`) run four workers and, every 2 s while
//! payments flow, one leaves (a clean stop and a SIGKILL in turn) or a new one joins:
//! under eager (`range`) and cooperative-sticky assignment, at `in_flight` 1 and 32, for
//! 12 s (30 s with `IDEM_FAULTS_FULL=1`). Every scenario also checks that no worker ever
//! ran two handlers of one payment at once.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
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

/// How workers come and go.
#[derive(Clone, Copy, Debug)]
enum Schedule {
    /// A wave of payments before each of [`KILLS`] kills, a replacement after each.
    Kills,
    /// Every [`CHURN_EVERY`] a wave, then a worker leaves (a clean stop and a SIGKILL in
    /// turn) or a new one joins; `in_flight` handlers per partition.
    Churn {
        assignment: &'static str,
        in_flight: usize,
    },
}

const CHURN_EVERY: Duration = Duration::from_secs(2);
const CHURN_WORKERS: usize = 4;

/// How many churn steps: 30 s with `IDEM_FAULTS_FULL=1`, 12 s otherwise.
fn churn_steps() -> usize {
    if std::env::var_os("IDEM_FAULTS_FULL").is_some() {
        15
    } else {
        6
    }
}

macro_rules! churn_tests {
    ($($name:ident: $mode:expr, $assignment:literal, $in_flight:literal;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let schedule = Schedule::Churn { assignment: $assignment, in_flight: $in_flight };
            let f = scenario_with($mode, Sql::Postgres, schedule).await;
            assert!(f.stops > 0, "no worker was stopped cleanly");
            match $mode {
                Mode::Transactional => assert_eq!(f.effects, PAYMENTS, "each payment once"),
                Mode::Lease { .. } => assert_eq!(f.effects, PAYMENTS + f.doubles),
            }
        }
    )*};
}

#[test]
fn a_join_group_answer_names_its_generation_leader_and_member() {
    let line = "DEBUG librdkafka: [thrd:main]: JoinGroup response: GenerationId 2, Protocol \
                cooperative-sticky, LeaderId rdkafka-4635 (me), my MemberId rdkafka-4635, \
                member metadata count 4: (no error) fac=\"JOINGROUP\"";
    let joined = Joined::parse(line).expect("a JoinGroup answer");
    assert_eq!(
        joined,
        Joined {
            generation: 2,
            leader: "rdkafka-4635".into(),
            member: "rdkafka-4635".into()
        }
    );
    let failed = "JoinGroup response: GenerationId -1, Protocol , LeaderId , my MemberId \
                  rdkafka-da29, member metadata count 0: Broker: Group member needs a valid \
                  member ID";
    assert_eq!(Joined::parse(failed), None);
}

const REDIS: Mode = Mode::Lease {
    store: LeaseStore::Redis,
    max_unsettled: None,
};

churn_tests! {
    sigkilled_workers_churn_lease_redis_eager_in_flight_1: REDIS, "range", 1;
    sigkilled_workers_churn_lease_redis_eager_in_flight_32: REDIS, "range", 32;
    sigkilled_workers_churn_lease_redis_cooperative_in_flight_1: REDIS, "cooperative-sticky", 1;
    sigkilled_workers_churn_lease_redis_cooperative_in_flight_32: REDIS, "cooperative-sticky", 32;
    sigkilled_workers_churn_transactional_postgres_eager_in_flight_1: Mode::Transactional, "range", 1;
    sigkilled_workers_churn_transactional_postgres_eager_in_flight_32: Mode::Transactional, "range", 32;
    sigkilled_workers_churn_transactional_postgres_cooperative_in_flight_1: Mode::Transactional, "cooperative-sticky", 1;
    sigkilled_workers_churn_transactional_postgres_cooperative_in_flight_32: Mode::Transactional, "cooperative-sticky", 32;
}

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
    /// A worker started a handler of a payment while another of it ran.
    Overlap(u32, String),
    /// A worker's JoinGroup answer (from librdkafka's `cgrp` debug log, churn tests only).
    Joined(u32, Joined),
}

/// What a JoinGroup answer says: the generation, the group's leader, the member's own id.
#[derive(Debug, PartialEq)]
struct Joined {
    generation: i32,
    leader: String,
    member: String,
}

impl Joined {
    /// Reads librdkafka's `JoinGroup response: GenerationId 2, Protocol range, LeaderId
    /// <id>, my MemberId <id>, …` line; `None` for any other line or a failed join.
    fn parse(line: &str) -> Option<Joined> {
        let rest = line.split_once("JoinGroup response: GenerationId ")?.1;
        let (generation, rest) = rest.split_once(',')?;
        let leader = rest.split_once("LeaderId ")?.1;
        let leader = leader.split([' ', ',']).next()?;
        let member = rest.split_once("my MemberId ")?.1.split(',').next()?;
        let generation = generation.trim().parse().ok()?;
        (generation >= 0 && !leader.is_empty()).then(|| Joined {
            generation,
            leader: leader.to_owned(),
            member: member.to_owned(),
        })
    }
}

struct Worker {
    instance: u32,
    /// Messages it settled: a worker that settled one holds partitions and is working.
    settled: u64,
    /// Its member id in the group, once a JoinGroup answer named it.
    member: Option<String>,
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
    /// Workers stopped cleanly during the run, reaped at the end.
    stopped: Vec<Worker>,
    killed: HashSet<u32>,
    /// Workers whose stdout closed (they exited).
    exited: HashSet<u32>,
    /// The group's leader as the newest JoinGroup answer named it (generation, member id).
    leader: (i32, String),
    /// Whether workers log librdkafka's group debug lines (for [`Event::Joined`]).
    group_debug: bool,
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
        let mut command = Command::new(&self.example);
        command
            .args(&self.args)
            .args(["--instance", &instance.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if self.group_debug {
            let filter = match std::env::var("RUST_LOG") {
                Ok(f) => format!("{f},librdkafka=debug"),
                Err(_) => "idem_kafka=info,librdkafka=debug".to_owned(),
            };
            command.env("RUST_LOG", filter).env("RDKAFKA_DEBUG", "cgrp");
        }
        let mut child = command.spawn().expect("start a worker");
        // Each line of the shared log says which worker wrote it.
        let stderr = child.stderr.take().expect("piped stderr");
        let joins = self.events.clone();
        std::thread::spawn(move || {
            let mut log = log;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(joined) = Joined::parse(&line) {
                    let _ = joins.send(Event::Joined(instance, joined));
                }
                let _ = writeln!(log, "[worker {instance}] {line}");
            }
        });
        let stdout = child.stdout.take().expect("piped stdout");
        let events = self.events.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) if l.starts_with("settled ") => {
                        let _ = events.send(Event::Settled(instance));
                    }
                    Ok(l) if l.starts_with("overlap ") => {
                        let _ = events.send(Event::Overlap(instance, l));
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
            member: None,
            child,
            stdin,
        });
    }

    /// Counts a settle of a running worker; true when it was one.
    fn settled(&mut self, instance: u32) -> bool {
        let w = self.running.iter_mut().find(|w| w.instance == instance);
        w.map(|w| w.settled += 1).is_some()
    }

    /// SIGKILLs a random worker among those that settled something, or any if none did
    /// (`Child::kill` sends SIGKILL on Unix) and reaps it.
    fn kill_one(&mut self) -> u32 {
        let mut working: Vec<usize> = (0..self.running.len())
            .filter(|i| self.running[*i].settled > 0)
            .collect();
        if working.is_empty() {
            working = (0..self.running.len()).collect();
        }
        let mut w = self
            .running
            .swap_remove(working[fastrand::usize(..working.len())]);
        w.child.kill().expect("SIGKILL a worker");
        w.child.wait().expect("reap a worker");
        self.killed.insert(w.instance);
        w.instance
    }

    /// Stops a random worker cleanly (its stdin closes) that is not the group's leader;
    /// it is reaped at the end. `None` if no worker's member id is known but the leader's.
    ///
    /// Never the leader: tansu keeps a member that leaves while the group rebalances as
    /// the group's leader (its `Forming` state's `leave` does not clear it), so no member
    /// ever gets an assignment again. A leader killed is replaced once its session lapses.
    fn stop_one(&mut self) -> Option<u32> {
        let leader = &self.leader.1;
        let followers: Vec<usize> = (0..self.running.len())
            .filter(|i| {
                self.running[*i]
                    .member
                    .as_ref()
                    .is_some_and(|m| m != leader)
            })
            .collect();
        if followers.is_empty() {
            return None;
        }
        let mut w = self
            .running
            .swap_remove(followers[fastrand::usize(..followers.len())]);
        w.stdin = None;
        let instance = w.instance;
        self.stopped.push(w);
        Some(instance)
    }

    /// Handles one event; says whether it was a settle of a running worker.
    fn event(&mut self, event: Event, figures: &mut Figures) -> bool {
        match event {
            Event::Settled(i) => return self.settled(i),
            Event::Exited(i) => self.exited(i),
            Event::Overlap(i, line) => figures.overlaps.push(format!("worker {i}: {line}")),
            Event::Joined(i, joined) => {
                if let Some(w) = self.running.iter_mut().find(|w| w.instance == i) {
                    w.member = Some(joined.member);
                }
                if joined.generation >= self.leader.0 {
                    self.leader = (joined.generation, joined.leader);
                }
            }
        }
        false
    }

    /// A worker's stdout closed: fine once killed or stopped, a failure while it should
    /// be running.
    fn exited(&mut self, instance: u32) {
        assert!(
            !self.running.iter().any(|w| w.instance == instance),
            "worker {instance} exited on its own; its stderr is in {}",
            self.log.display()
        );
        self.exited.insert(instance);
    }
}

/// A test that fails leaves no worker behind.
impl Drop for Pool {
    fn drop(&mut self) {
        for w in self.running.iter_mut().chain(&mut self.stopped) {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
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
    /// Workers that left cleanly, and that joined, during churn.
    stops: usize,
    joins: usize,
    /// Handlers started while another of the same payment ran in the same worker.
    overlaps: Vec<String>,
    /// From the last change of the group until everything was settled and committed.
    recovered: f64,
    seconds: f64,
}

async fn scenario(mode: Mode, sql: Sql) -> Figures {
    scenario_with(mode, sql, Schedule::Kills).await
}

async fn scenario_with(mode: Mode, sql: Sql, schedule: Schedule) -> Figures {
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let (ledger, ledger_url) = Ledger::create(sql).await;
    let topic = common::unique("sigkill");
    let group = common::unique("sigkill-group");
    let dlq = format!("{topic}.dlq");
    common::create_topics(&brokers, &[(&topic, PARTITIONS), (&dlq, 1)]).await;
    let example = idem_conformance::process::build_workspace_example(
        concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
        "worker",
    );
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
    let label = match schedule {
        Schedule::Kills => label,
        Schedule::Churn {
            assignment,
            in_flight,
        } => format!("churn, {label}, {assignment}, in_flight {in_flight}"),
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
    let in_flight;
    let workers = match schedule {
        Schedule::Kills => WORKERS,
        Schedule::Churn {
            assignment,
            in_flight: n,
        } => {
            in_flight = n.to_string();
            args.extend([("assignment", assignment), ("in-flight", &in_flight)]);
            CHURN_WORKERS
        }
    };
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
        stopped: Vec::new(),
        killed: HashSet::new(),
        exited: HashSet::new(),
        leader: (-1, String::new()),
        group_debug: matches!(schedule, Schedule::Churn { .. }),
    };
    eprintln!("workers log to {}", pool.log.display());
    for _ in 0..workers {
        pool.start();
    }

    let mut ends: BTreeMap<i32, i64> = BTreeMap::new();
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    let mut produce = async |wave: &[Out]| {
        let at = common::produce(&brokers, &topic, wave).await;
        for (out, (p, o)) in wave.iter().zip(at) {
            let end = ends.entry(p).or_default();
            *end = (*end).max(o + 1);
            let id = String::from_utf8_lossy(out.key.as_deref().unwrap_or_default());
            partition_of.insert(id.into_owned(), p);
        }
    };
    if let Schedule::Churn { .. } = schedule {
        // A wave, then events until the step's end, then a worker leaves or joins.
        let steps = churn_steps();
        let mut step_end = tokio::time::Instant::now();
        for (n, wave) in outs.chunks(outs.len().div_ceil(steps)).enumerate() {
            produce(wave).await;
            step_end += CHURN_EVERY;
            while let Ok(event) = tokio::time::timeout_at(step_end, rx.recv()).await {
                pool.event(event.expect("the pool holds a sender"), &mut figures);
            }
            // A stop when no follower is known (see `Pool::stop_one`) is a join instead.
            let stopped = if n % 4 == 2 { pool.stop_one() } else { None };
            let change = match (n % 4, stopped) {
                (0, _) => {
                    figures.kills += 1;
                    format!("killed worker {}", pool.kill_one())
                }
                (_, Some(stopped)) => {
                    figures.stops += 1;
                    format!("stopped worker {stopped}")
                }
                _ => {
                    figures.joins += 1;
                    pool.start();
                    format!("worker {} joined", pool.next - 1)
                }
            };
            eprintln!(
                "{label} {:5.1} s: {change}",
                started.elapsed().as_secs_f64()
            );
        }
    }

    // A wave before each kill, so every kill finds work; the kill comes once running
    // workers settled a random number of messages, after a random pause of up to 250 ms,
    // and hits one of the workers that settled something (its partitions are assigned).
    let kills = if let Schedule::Kills = schedule {
        KILLS
    } else {
        0
    };
    let waves: Vec<&[Out]> = if kills == 0 {
        Vec::new()
    } else {
        outs.chunks(outs.len().div_ceil(KILLS + 1)).collect()
    };
    for (n, wave) in waves.iter().enumerate() {
        produce(wave).await;
        if n == KILLS {
            break;
        }
        let want = fastrand::usize(1..=wave.len());
        let mut seen = 0;
        while seen < want {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(event)) => seen += usize::from(pool.event(event, &mut figures)),
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
    let last_change = Instant::now();
    let mut open: Vec<String> = (0..PAYMENTS).map(|i| format!("pay-{i}")).collect();
    loop {
        while let Ok(event) = rx.try_recv() {
            pool.event(event, &mut figures);
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

    figures.recovered = last_change.elapsed().as_secs_f64();
    eprintln!(
        "{label} {:5.1} s: every payment in the ledger and Completed, offsets at the end",
        started.elapsed().as_secs_f64()
    );

    // A clean stop: stdin closes, each worker stops and says so.
    for w in &mut pool.running {
        w.stdin = None;
    }
    // Workers stopped during churn had their stdin closed long ago: none may hang either.
    let mut left: HashSet<u32> = pool
        .running
        .iter()
        .chain(&pool.stopped)
        .map(|w| w.instance)
        .filter(|i| !pool.exited.contains(i))
        .collect();
    while !left.is_empty() {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some(Event::Exited(i))) => {
                left.remove(&i);
            }
            Ok(Some(Event::Overlap(i, line))) => {
                figures.overlaps.push(format!("worker {i}: {line}"));
            }
            Ok(Some(Event::Settled(_) | Event::Joined(..))) => {}
            Ok(None) | Err(_) => panic!(
                "workers {left:?} did not stop within 30 s of their stdin closing; log {}",
                pool.log.display()
            ),
        }
    }
    // Every stdout closed: each process has ended or is ending.
    for w in pool.running.iter_mut().chain(&mut pool.stopped) {
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
        "sigkill ({label}): {PAYMENTS} payments, {} duplicates, {} kills, {} clean stops, \
         {} joins, {} effects, {} doubles ({} after a kill), {:.2} doubles per kill, at most \
         {} by one kill on one partition, {} effects after a takeover, {:.1} s",
        figures.duplicates,
        figures.kills,
        figures.stops,
        figures.joins,
        figures.effects,
        figures.doubles,
        figures.doubles_after_kill,
        figures.doubles as f64 / figures.kills.max(1) as f64,
        figures.worst_kill,
        figures.takeovers,
        figures.seconds
    );
    assert!(
        figures.overlaps.is_empty(),
        "a worker ran two handlers of one payment at once: {:?}",
        figures.overlaps
    );
    if let Schedule::Churn { .. } = schedule {
        // A row of `scripts/faults`' table.
        println!(
            "| {label} | {} | {} kills, {} stops, {} joins | {} | {} | {:.1} s after the last \
             change | {:.1} s |",
            PAYMENTS + figures.duplicates,
            figures.kills,
            figures.stops,
            figures.joins,
            figures.effects,
            figures.doubles,
            figures.recovered,
            figures.seconds
        );
    }
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
