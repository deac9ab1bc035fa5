//! The command line, as clap reads it.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// idem: effectively-once processing for Kafka and RabbitMQ consumers, over memory, Redis,
/// PostgreSQL, MySQL or DynamoDB.
///
/// Backends are named by URL: memory:, redis://host:port/db, postgres://user@host/db
/// (?schema=name), mysql://user@host/db (?schema=name),
/// dynamodb://TABLE?endpoint=http://host:port&region=name.
#[derive(Debug, Parser)]
#[command(name = "idem", version, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Play the Kafka failure scenario with a naive consumer and an idem consumer, side by
    /// side, on an in-process broker (no services needed).
    Demo(DemoArgs),
    /// Compare backends: what idem's claim+complete costs over the same two writes done by
    /// hand on each store, and over one raw write, measured in the same run; and replays.
    Bench(BenchArgs),
    /// Show one record.
    Inspect(InspectArgs),
    /// List records (backends that can enumerate only).
    List(ListArgs),
    /// Turn a Processing record into a retryable Failed one (fenced by its token).
    Release(ReleaseArgs),
    /// Delete one record, whatever its state.
    Delete(ChangeKeyArgs),
    /// Drop records past their expiry.
    Purge(ChangeArgs),
    /// Create the store's tables: PostgreSQL and MySQL migrations, or the DynamoDB table
    /// with TTL (memory and Redis need none).
    Migrate(ChangeArgs),
    /// Dead-letter topics: list their letters, send letters back to their topics.
    Dlq(DlqArgs),
    /// The consumer offsets transactional mode keeps in PostgreSQL or MySQL: show them,
    /// or move them.
    Offsets(OffsetsArgs),
    /// List the backends this build knows: their URL forms, and the feature that adds
    /// each one not compiled in.
    Backends,
}

/// The backend of an operator command.
#[derive(Debug, Args)]
pub struct BackendArg {
    /// The backend URL.
    #[arg(long, short = 'b', env = "IDEM_BACKEND", value_name = "URL")]
    pub backend: String,
}

/// `--yes`.
#[derive(Debug, Args)]
pub struct YesArg {
    /// Do it without asking. Without it, idem asks on the terminal, and refuses when
    /// there is no terminal.
    #[arg(long, short = 'y')]
    pub yes: bool,
}

/// A command on one key.
#[derive(Debug, Args)]
pub struct KeyArgs {
    #[command(flatten)]
    pub backend: BackendArg,
    /// The key's namespace.
    pub namespace: String,
    /// The key's id.
    pub id: String,
}

/// `idem inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    pub key: KeyArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A changing command on one key.
#[derive(Debug, Args)]
pub struct ChangeKeyArgs {
    #[command(flatten)]
    pub key: KeyArgs,
    #[command(flatten)]
    pub yes: YesArg,
}

/// `idem release`.
#[derive(Debug, Args)]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub target: ChangeKeyArgs,
    /// The error text stored on the released record.
    #[arg(long, default_value = "released by operator")]
    pub reason: String,
    /// How long the Failed record is kept.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    pub retention: Duration,
    /// Release even if the lease is still live (its worker may still be running, and
    /// another worker may then run the handler at the same time).
    #[arg(long)]
    pub force: bool,
}

/// A changing command on the whole store.
#[derive(Debug, Args)]
pub struct ChangeArgs {
    #[command(flatten)]
    pub backend: BackendArg,
    #[command(flatten)]
    pub yes: YesArg,
}

/// A state, as the command line names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    /// A worker holds, or held, the lease.
    Processing,
    /// Done; the response is kept.
    Completed,
    /// The last attempt failed.
    Failed,
}

impl From<StateArg> for idem_core::State {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::Processing => idem_core::State::Processing,
            StateArg::Completed => idem_core::State::Completed,
            StateArg::Failed => idem_core::State::Failed,
        }
    }
}

/// `idem list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub backend: BackendArg,
    /// Only this namespace.
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Only this state.
    #[arg(long, short = 's', value_enum)]
    pub state: Option<StateArg>,
    /// Only Processing records whose lease has lapsed (a worker died or stalled).
    #[arg(long, conflicts_with = "poisoned")]
    pub stuck: bool,
    /// Only poisoned keys, which claims answer Poisoned (their messages were
    /// dead-lettered): a permanent failure, or attempts at --max-attempts on a Failed
    /// record or a lapsed lease.
    #[arg(long)]
    pub poisoned: bool,
    /// With --poisoned: the consumers' `max_attempts` (a record keeps its attempts, not
    /// the limit it was claimed under).
    #[arg(long, default_value_t = 5, requires = "poisoned")]
    pub max_attempts: u32,
    /// At most this many records (0: all); a listing cut short says so.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `idem bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Backend URLs to compare (repeat the flag, or separate with spaces).
    #[arg(long, short = 'b', value_name = "URL", num_args = 1.., default_value = "memory:")]
    pub backend: Vec<String>,
    /// Concurrent workers, a comma-separated list.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub concurrency: Vec<u32>,
    /// Keys per claim call (`claim_many` above 1), a comma-separated list.
    #[arg(long, value_delimiter = ',', default_value = "1,128")]
    pub batch: Vec<u32>,
    /// How long each measurement runs.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Where to write bench.json and bench.svg.
    #[arg(long, default_value = "idem-bench")]
    pub out: PathBuf,
    /// No progress: no bar on a terminal, no line per finished cell elsewhere (the line
    /// saying how long the run takes stays).
    #[arg(long)]
    pub quiet: bool,
    /// Also measure each backend behind `idem_core::layer::Coalesce` (single calls made
    /// while one is in flight joined into batch calls), as a row `<kind>+coalesce`.
    #[arg(long)]
    pub coalesce: bool,
    /// Print the results as one Markdown table, after a line with the command, the date,
    /// the git commit and the core count, instead of the terminal table (bench.md in
    /// --out has it either way).
    #[arg(long)]
    pub markdown: bool,
}

/// `idem demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Payment events the producer sends (before duplicates).
    #[arg(long, default_value_t = 2000)]
    pub messages: u32,
    /// How many of them the producer sends a second time.
    #[arg(long, default_value_t = 200)]
    pub duplicates: u32,
    /// Consumer crashes, each after charging and before committing.
    #[arg(long, default_value_t = 3)]
    pub crashes: u32,
    /// The idem side's backend URL.
    #[arg(long, short = 'b', value_name = "URL", default_value = "memory:")]
    pub backend: String,
    /// Play it on this RabbitMQ server (`amqp://user:pass@host:5672/%2f`) instead of
    /// the in-process Kafka cluster: two queues of the run's own, deleted at the end.
    #[arg(long, value_name = "AMQP_URL")]
    pub broker: Option<String>,
    /// Test hook: crash the idem side after a charge and before idem records it (the case
    /// a lease cannot cover), so that it charges twice and the run must fail.
    #[arg(
        long,
        hide = true,
        env = "IDEM_DEMO_FORCE_DOUBLE_CHARGE",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub force_double_charge: bool,
}

/// `idem dlq`.
#[derive(Debug, Args)]
pub struct DlqArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: DlqCommand,
}

/// `idem offsets`.
#[derive(Debug, Args)]
pub struct OffsetsArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: OffsetsCommand,
}

/// The `idem offsets` subcommands.
#[derive(Debug, Subcommand)]
pub enum OffsetsCommand {
    /// The next offset stored for each topic and partition of a consumer group: where its
    /// consumers in transactional mode start when they are assigned a partition.
    Show(OffsetsShowArgs),
    /// Move a group's stored offsets (stop the group's consumers first: they read the
    /// offsets on assignment and write them as they settle).
    Reset(OffsetsResetArgs),
}

/// `idem offsets show`.
#[derive(Debug, Args)]
pub struct OffsetsShowArgs {
    #[command(flatten)]
    pub backend: BackendArg,
    /// The consumer group.
    #[arg(long, short = 'g')]
    pub group: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `idem offsets reset`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["to", "delete"])))]
pub struct OffsetsResetArgs {
    #[command(flatten)]
    pub backend: BackendArg,
    /// The consumer group.
    #[arg(long, short = 'g')]
    pub group: String,
    /// The topic (with `--delete`, every topic when left out).
    #[arg(long, short = 't')]
    pub topic: Option<String>,
    /// The partition (with `--delete`, every partition when left out).
    #[arg(long, short = 'p')]
    pub partition: Option<i32>,
    /// Store this as the partition's next offset (needs `--topic` and `--partition`).
    #[arg(long, value_name = "OFFSET", value_parser = clap::value_parser!(i64).range(0..))]
    pub to: Option<i64>,
    /// Remove the stored offsets instead: the consumers then start those partitions from
    /// the offsets committed to Kafka.
    #[arg(long)]
    pub delete: bool,
    #[command(flatten)]
    pub yes: YesArg,
}

/// The `idem dlq` subcommands.
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List the letters of a dead-letter topic: where each came from, why, and the error.
    List(DlqListArgs),
    /// Send letters back to their original topic and partition, each letter once.
    Replay(DlqReplayArgs),
}

/// How to reach Kafka.
#[derive(Debug, Args)]
pub struct KafkaArgs {
    /// The Kafka bootstrap servers.
    #[arg(long, env = "IDEM_KAFKA_BROKERS", value_name = "HOST:PORT,…")]
    pub brokers: String,
    /// A librdkafka property for the reader and the producer, repeatable: e.g.
    /// `security.protocol=SASL_SSL`, `ssl.ca.location=ca.pem`, `sasl.mechanism=SCRAM-SHA-512`.
    /// `SSL` and `SASL_SSL` need an `idem` built with the feature `tls`
    /// (`cargo install idem-cli --features tls`).
    #[arg(long = "kafka-config", short = 'X', value_name = "KEY=VALUE")]
    pub kafka_config: Vec<String>,
    /// How long to wait for the broker: each metadata request, and the next letter.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

/// Why a message was dead-lettered, as the `idem-reason` header says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReasonArg {
    /// Attempts spent, or a permanent handler failure.
    Poisoned,
    /// The key is known with another payload.
    Mismatch,
    /// No key was found.
    MissingKey,
    /// The key found is not valid.
    InvalidKey,
    /// The payload could not be read by the key source.
    MalformedPayload,
}

/// Which letters of a dead-letter topic.
#[derive(Debug, Args)]
pub struct LetterArgs {
    /// The dead-letter topic (idem-kafka writes `<topic>.dlq` unless configured otherwise).
    pub topic: String,
    /// Only this partition of the dead-letter topic; repeatable.
    #[arg(long, short = 'p')]
    pub partition: Vec<i32>,
    /// Only letters at this offset of the dead-letter topic or later.
    #[arg(long)]
    pub from_offset: Option<i64>,
    /// Only letters at this offset of the dead-letter topic or earlier.
    #[arg(long)]
    pub to_offset: Option<i64>,
    /// Only letters dead-lettered for this reason.
    #[arg(long, value_enum)]
    pub reason: Option<ReasonArg>,
}

/// `idem dlq list`.
#[derive(Debug, Args)]
pub struct DlqListArgs {
    #[command(flatten)]
    pub kafka: KafkaArgs,
    #[command(flatten)]
    pub letters: LetterArgs,
    /// Print JSON instead of a table (every letter, errors in full).
    #[arg(long)]
    pub json: bool,
}

/// `idem dlq replay`.
#[derive(Debug, Args)]
pub struct DlqReplayArgs {
    #[command(flatten)]
    pub kafka: KafkaArgs,
    #[command(flatten)]
    pub letters: LetterArgs,
    /// The consumer's store: it keeps the replay records that make a replay happen once,
    /// and `--reset` deletes poisoned records there.
    #[command(flatten)]
    pub backend: BackendArg,
    /// Every letter of the topic (without it, a selection is required).
    #[arg(long)]
    pub all: bool,
    /// Before sending a letter, delete its key's Failed (poisoned) record, so that the
    /// consumer runs the handler again; Completed and Processing records are kept.
    #[arg(long)]
    pub reset: bool,
    /// Say what would be sent, and send nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub yes: YesArg,
    /// How long the store remembers that a letter was replayed: a second replay within it
    /// sends nothing.
    #[arg(long, default_value = "30days", value_parser = humantime::parse_duration)]
    pub retention: Duration,
    /// Letters sent at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrency: u16,
    /// No progress bar (it also hides itself when stderr is not a terminal).
    #[arg(long)]
    pub quiet: bool,
}
