//! Transactional mode fails closed at assignment: with PostgreSQL unreachable (a TCP proxy
//! in front of `IDEM_POSTGRES_URL`, blackholed) when the partitions are assigned, they wait
//! paused, nothing handled, and once it answers they start from the offsets PostgreSQL
//! keeps, never from Kafka's (here none are committed, so `earliest` would run the first
//! payments again, and `latest` skip the rest). MockCluster; the ledger is in the same
//! database.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Out, Recorder, committed, mock, produce, start, unique};
use futures::FutureExt;
use idem_conformance::proxy::{self, Proxy};
use idem_core::{Key, Transactional};
use idem_kafka::metrics::AWAITING_STORED_OFFSET;
use idem_postgres::{OffsetPosition, PgBackend, PgConfig};

const WAIT: Duration = Duration::from_secs(30);
/// Each store call through the proxy gives up after this (the blackhole holds it forever).
const PG_TIMEOUT: Duration = Duration::from_millis(500);
const PER_PARTITION: i64 = 10;
/// PostgreSQL's next offset for partitions 0 and 1: what ran before this consumer.
const STORED: [i64; 2] = [5, 3];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_down_at_assignment_holds_the_partitions_until_it_answers() {
    scenario("earliest").await;
}

/// With `latest`, Kafka's start (no committed offset) is past every message: only the
/// seek to PostgreSQL's offsets, not the workers' floor, gets the rest handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_partitions_are_sought_to_the_stored_offsets_not_started_at_kafkas() {
    scenario("latest").await;
}

/// The store cut off at assignment, with `auto.offset.reset` at `reset`.
async fn scenario(reset: &str) {
    common::install_metrics();
    let (direct, ledger) = common::postgres().await;
    let url = idem_conformance::service_env("IDEM_POSTGRES_URL");
    let proxy = Proxy::start(&proxy::split_url(&url, 5432).1).await;
    let config = PgConfig::new(proxy::through(&url, 5432, &proxy))
        .with_schema(direct.schema())
        .with_max_connections(4)
        .with_query_timeout(PG_TIMEOUT)
        .with_connect_timeout(PG_TIMEOUT);
    let pg = PgBackend::connect(config)
        .await
        .expect("connect through the proxy");

    let topic = unique("held");
    let cluster = mock(1, &[(&topic, 2), (&format!("{topic}.dlq"), 1)]);
    let brokers = cluster.bootstrap_servers();
    let group = unique("g");
    let mut msgs = Vec::new();
    for p in 0..2 {
        for i in 0..PER_PARTITION {
            msgs.push(Out::keyed(p, &format!("p{p}-{i}"), "x"));
        }
    }
    produce(&brokers, &topic, &msgs).await;
    // What ran before: the first payments of each partition, their rows and the offset
    // past them in PostgreSQL; nothing committed in Kafka.
    for (p, next) in STORED.iter().enumerate() {
        let partition = i32::try_from(p).expect("partition");
        for i in 0..*next {
            let q = format!("INSERT INTO {ledger} (payment, token, instance) VALUES ($1, 1, 0)");
            sqlx::query(sqlx::AssertSqlSafe(q))
                .bind(format!("p{p}-{i}"))
                .execute(direct.pool())
                .await
                .expect("ledger row");
        }
        let at = OffsetPosition {
            group: group.clone(),
            topic: topic.clone(),
            partition,
            offset: next - 1,
        };
        direct.store_offset(&at).await.expect("store offset");
    }

    proxy.blackhole(true);
    let recorder = Recorder::new();
    let table = ledger.clone();
    let mut config = common::consumer_config(&brokers);
    config.set("auto.offset.reset", reset);
    let running = start(
        common::builder_with(config, &topic, &group)
            .commit_interval(Duration::from_millis(100))
            .transactional(pg.clone(), move |msg, tx, lease| {
                let table = table.clone();
                async move {
                    let id = msg
                        .idempotency_key()
                        .map(Key::id)
                        .unwrap_or_default()
                        .to_owned();
                    let q = format!(
                        "INSERT INTO {table} (payment, token, instance) VALUES ($1, $2, 0)"
                    );
                    sqlx::query(sqlx::AssertSqlSafe(q))
                        .bind(&id)
                        .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                        .execute(&mut **tx)
                        .await?;
                    Ok(Bytes::from(id))
                }
                .boxed()
            }),
        &recorder,
    );
    // The assignment's three reads fail within about 2 s (three timeouts, two pauses);
    // then both partitions are held. Polled, up to a bound past that.
    let began = Instant::now();
    let held = || (0..2).all(|p| common::gauge(AWAITING_STORED_OFFSET, &topic, p) == 1.0);
    while !held() && began.elapsed() < Duration::from_secs(8) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let was_held = held();
    assert_eq!(
        recorder.settled_count(),
        0,
        "nothing handled while the store is down"
    );
    let before = common::ledger_counts(&direct, &ledger).await;
    assert_eq!(before.values().sum::<i64>(), STORED.iter().sum::<i64>());

    proxy.blackhole(false);
    let left = usize::try_from(2 * PER_PARTITION - STORED.iter().sum::<i64>()).expect("count");
    recorder.wait_settled(left, WAIT).await;
    running.stop().await;

    for (p, next) in STORED.iter().enumerate() {
        let partition = i32::try_from(p).expect("partition");
        assert_eq!(
            recorder
                .settled_on(partition)
                .into_iter()
                .collect::<Vec<_>>(),
            (*next..PER_PARTITION).collect::<Vec<_>>(),
            "partition {p} started at PostgreSQL's offset {next}"
        );
        assert_eq!(
            common::gauge(AWAITING_STORED_OFFSET, &topic, partition),
            0.0
        );
    }
    assert!(
        was_held,
        "both partitions were held back, waiting for the store"
    );
    let rows = common::ledger_counts(&direct, &ledger).await;
    assert_eq!(
        rows.len(),
        2 * PER_PARTITION as usize,
        "every payment: {rows:?}"
    );
    assert!(rows.values().all(|n| *n == 1), "none twice: {rows:?}");
    let stored = direct.stored_offsets(&group).await.expect("stored offsets");
    assert!(
        stored.iter().all(|s| s.next_offset == PER_PARTITION),
        "{stored:?}"
    );
    assert_eq!(
        committed(&brokers, &group, &topic, 2),
        vec![PER_PARTITION; 2]
    );
    common::drop_schema(&direct).await;
}
