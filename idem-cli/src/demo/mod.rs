//! `idem demo`: the canonical failure, played by a naive consumer and an idem consumer side
//! by side on librdkafka's in-process MockCluster.
//!
//! A producer sends payment events, some twice, plus a few poison messages. Each side
//! crashes `--crashes` times after charging and before committing its offsets, and is
//! restarted; the restarted consumer gets the uncommitted messages again. The naive side
//! commits every so many messages and charges those again. The idem side (idem-kafka over
//! the backend of `--backend`) crashes after a charge is recorded and before its offset is
//! committed, so the redelivered messages are answered from the store.

#[cfg(feature = "rabbitmq")]
mod amqp;
mod idem_side;
mod naive;
mod plan;
mod report;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::Key;
use idem_kafka::rdkafka::mocking::MockCluster;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::cli::DemoArgs;
use crate::error::{Error, Result, StoreContext};
use crate::target::Target;
use idem_once::backend::driver::Options;
use idem_side::CrashAt;
use plan::{DLQ, Ledger, PARTITIONS, Plan, Stage, TOPIC};
use report::{Counters, Report};

/// Runs the demo and prints its report. Fails if the idem side charged a payment twice.
pub async fn run(args: &DemoArgs) -> Result<()> {
    check(args)?;
    let started = Instant::now();
    let target = Target::parse(&args.backend)?;
    let backend = target.connect(&Options::new()).await?.backend();
    let namespace = format!("demo-{}-{}", std::process::id(), fastrand::u32(..));
    // A store that cannot answer (no tables yet, say) would stall the idem side: ask first.
    let probe =
        Key::new(namespace.clone(), "preflight").map_err(|e| Error::Refused(e.to_string()))?;
    backend
        .get(&probe)
        .await
        .store(format!("the idem side's backend {target}"))?;
    if let Some(url) = &args.broker {
        return on_rabbitmq(url, args, backend, &target.to_string()).await;
    }
    let counters = Counters::install()?;

    let cluster = MockCluster::new(1).map_err(|e| Error::Refused(format!("MockCluster: {e}")))?;
    for (topic, partitions) in [(TOPIC, PARTITIONS), (DLQ, 1)] {
        cluster
            .create_topic(topic, partitions, 1)
            .map_err(|e| Error::Refused(format!("create topic {topic}: {e}")))?;
    }
    let brokers = cluster.bootstrap_servers();
    let plan = Plan::new(args.messages, args.duplicates);
    let ends = plan.produce(&brokers).await?;

    // Each crash falls three quarters of the way between two of the naive side's commits.
    let total = plan.events.len() as u64;
    let commit_every = (total / (4 * u64::from(args.crashes + 1))).clamp(5, 100);
    let share = total / u64::from(args.crashes + 1);
    let step = (share / commit_every).max(1) * commit_every + commit_every * 3 / 4;
    let stage = Arc::new(Stage {
        brokers,
        ends,
        crash_after: (0..args.crashes).map(|_| step).collect(),
        commit_every,
    });
    let at = if args.force_double_charge {
        CrashAt::BeforeRecord
    } else {
        CrashAt::AfterRecord
    };

    let bars = MultiProgress::new();
    let naive_bar = bars.add(bar("naive", total));
    let idem_bar = bars.add(bar("idem ", total));
    let naive_ledger = Ledger::default();
    let idem_ledger = Arc::new(Ledger::default());
    let (naive, idem) = tokio::join!(
        naive::run(&stage, &naive_ledger, &naive_bar),
        idem_side::run(&stage, at, backend, &namespace, &idem_ledger, &idem_bar,),
    );
    naive_bar.finish_and_clear();
    idem_bar.finish_and_clear();
    let report = Report {
        plan: &plan,
        backend: target.to_string(),
        commit_every,
        at,
        naive: naive?,
        naive_ledger: naive_ledger.totals(),
        idem: idem?,
        idem_ledger: idem_ledger.totals(),
        counters: counters.totals(),
        elapsed: started.elapsed(),
    };
    crate::write_out(format_args!("{report}"));
    drop(cluster);
    match report.idem_ledger.2 {
        0 => Ok(()),
        n => Err(Error::DoubleCharge(u64::from(n))),
    }
}

/// The demo on a RabbitMQ server.
#[cfg(feature = "rabbitmq")]
async fn on_rabbitmq(
    url: &str,
    args: &DemoArgs,
    backend: Arc<dyn idem_core::Backend>,
    label: &str,
) -> Result<()> {
    let plan = Plan::new(args.messages, args.duplicates);
    amqp::run(url, &plan, args.crashes, backend, label).await
}

#[cfg(not(feature = "rabbitmq"))]
async fn on_rabbitmq(_: &str, _: &DemoArgs, _: Arc<dyn idem_core::Backend>, _: &str) -> Result<()> {
    Err(Error::FeatureMissing {
        what: "idem demo --broker".into(),
        feature: "rabbitmq",
    })
}

fn bar(name: &str, total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    let template = format!("{name} {{bar:30}} {{pos}} deliveries ({{len}} messages) {{msg}}");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

fn check(args: &DemoArgs) -> Result<()> {
    if args.messages == 0 || args.messages > 20_000 {
        return Err(Error::Usage("--messages must be 1 to 20000".into()));
    }
    if args.duplicates > args.messages {
        return Err(Error::Usage("--duplicates cannot exceed --messages".into()));
    }
    if args.crashes > 20 {
        return Err(Error::Usage("--crashes must be at most 20".into()));
    }
    Ok(())
}
