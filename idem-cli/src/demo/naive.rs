//! The naive consumer: charge, and commit every so many messages, as a plain at-least-once
//! consumer does. A crash between a charge and the next commit charges again on restart.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use idem_kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use idem_kafka::rdkafka::message::Message;
use idem_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};

use indicatif::ProgressBar;

use super::plan::{Ledger, PARTITIONS, Stage, TOPIC, parse};
use crate::error::{Error, Result};

/// How long a consumer may wait for its next message before the demo gives up.
pub const STALL: Duration = Duration::from_secs(30);

/// What the naive side did.
#[derive(Debug, Default)]
pub struct NaiveRun {
    /// Messages received, over every instance.
    pub delivered: u64,
    /// Poison messages logged and skipped (each counted once, however often delivered).
    pub skipped: HashSet<(i32, i64)>,
    /// Instances that crashed.
    pub crashes: u32,
}

/// The consumer configuration both sides share.
pub fn config(brokers: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "4000")
        .set("heartbeat.interval.ms", "500")
        .set("fetch.queue.backoff.ms", "10");
    c
}

/// Runs instances one after another: instance `i` crashes once it has charged
/// `stage.crash_after[i]` payments (before its next commit); the last one runs to the end
/// of every partition and commits.
pub async fn run(stage: &Stage, ledger: &Ledger, bar: &ProgressBar) -> Result<NaiveRun> {
    let mut out = NaiveRun::default();
    for instance in 0..=stage.crash_after.len() {
        let consumer: StreamConsumer = config(&stage.brokers, "naive-payments")
            .set("enable.auto.commit", "false")
            .create()
            .map_err(|e| Error::Refused(format!("naive consumer: {e}")))?;
        let mut next = committed(&consumer)?;
        consumer
            .subscribe(&[TOPIC])
            .map_err(|e| Error::Refused(format!("naive consumer: {e}")))?;
        let limit = stage.crash_after.get(instance).copied();
        let (mut charged, mut handled) = (0u64, 0u64);
        loop {
            if stage.caught_up(&next) {
                commit(&consumer)?;
                return Ok(out);
            }
            let m = tokio::time::timeout(STALL, consumer.recv())
                .await
                .map_err(|_| Error::Refused(format!("naive consumer: no message for {STALL:?}")))?
                .map_err(|e| Error::Refused(format!("naive consumer: {e}")))?;
            out.delivered += 1;
            bar.inc(1);
            handled += 1;
            next.insert(m.partition(), m.offset() + 1);
            match parse(m.payload().unwrap_or_default()) {
                Ok((id, _cents)) => {
                    ledger.charge(&id).await;
                    charged += 1;
                }
                Err(_) => {
                    out.skipped.insert((m.partition(), m.offset()));
                }
            }
            if limit.is_some_and(|l| charged >= l) {
                // The process dies here: charged, not committed.
                out.crashes += 1;
                break;
            }
            if handled % stage.commit_every == 0 {
                commit(&consumer)?;
            }
        }
    }
    Err(Error::Refused(
        "naive consumer: ran out of instances".into(),
    ))
}

/// The group's committed offsets (next offset to read) per partition.
pub fn committed(consumer: &impl Consumer) -> Result<HashMap<i32, i64>> {
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition(TOPIC, p);
    }
    let got = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .map_err(|e| Error::Refused(format!("naive consumer: committed offsets: {e}")))?;
    let map = got
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some((e.partition(), o)),
            _ => None,
        })
        .collect();
    // Dropped before the consumer is (a held list makes the consumer's drop hang).
    drop(got);
    Ok(map)
}

fn commit(consumer: &StreamConsumer) -> Result<()> {
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) => Ok(()),
        // Nothing new since the last commit.
        Err(e)
            if e.rdkafka_error_code()
                == Some(idem_kafka::rdkafka::types::RDKafkaErrorCode::NoOffset) =>
        {
            Ok(())
        }
        Err(e) => Err(Error::Refused(format!("naive consumer: commit: {e}"))),
    }
}
