//! What is particular to DynamoDB: the client clock and its skew margin, TTL, the purge,
//! the number of round trips per path, and `claim_many` at width. On Amazon DynamoDB Local
//! (`IDEM_DYNAMO_ENDPOINT`); time comes from manual clocks read by the client, which is
//! where this backend's time comes from anyway.

mod common;

use std::time::Duration;

use aws_sdk_dynamodb::types::{AttributeValue, TimeToLiveStatus};
use bytes::Bytes;
use idem_conformance::acquire;
use idem_core::backend::machine::lapsed_error;
use idem_core::backend::{Claim, ClaimOutcome, Settlement};
use idem_core::clock::ManualClock;
use idem_core::{Backend, ClaimKind, FailureKind, Fingerprint, Key, Timestamp};
use idem_dynamo::DynamoBackend;

const TABLE: &str = "idem_behaviour";
const LEASE: Duration = Duration::from_secs(10);
const HOUR: Duration = Duration::from_secs(3600);

/// A backend on the shared table reading `clock`, with skew margin `skew`.
async fn on_clock(clock: &ManualClock, skew: Duration) -> DynamoBackend {
    let config = common::config(TABLE).with_clock_skew(skew);
    let b = DynamoBackend::connect(config).await.expect("connect");
    b.create_table().await.expect("create table");
    b.with_clock(clock.clone())
}

fn claim_of(key: &Key, owner: &str) -> Claim {
    idem_conformance::claim_of(key, owner, LEASE)
}

fn fresh_key(id: &str) -> Key {
    Key::new(idem_conformance::unique_namespace(), id).expect("key")
}

#[tokio::test]
async fn the_skew_margin_keeps_a_fast_clock_from_taking_a_live_lease() {
    let start = Timestamp::now();
    let holder_clock = ManualClock::new(start);
    let fast_clock = ManualClock::new(start.saturating_add(Duration::from_millis(300)));
    let holder = on_clock(&holder_clock, Duration::ZERO).await;
    let careful = on_clock(&fast_clock, Duration::from_millis(400)).await;
    let careless = on_clock(&fast_clock, Duration::ZERO).await;
    let key = fresh_key("skew");
    let lease = acquire(&holder, &claim_of(&key, "holder")).await;
    // 100 ms before the holder's deadline by its own clock; 200 ms past it by the fast one.
    for clock in [&holder_clock, &fast_clock] {
        clock.advance(LEASE - Duration::from_millis(100));
    }
    match careful
        .claim(&claim_of(&key, "careful"))
        .await
        .expect("claim")
    {
        ClaimOutcome::InProgress { owner, lease_until } => {
            assert_eq!(&*owner, "holder");
            let margin = Duration::from_millis(400);
            assert_eq!(lease_until, lease.lease_until.saturating_add(margin));
        }
        other => panic!("the margin covers 300 ms of skew, got {other:?}"),
    }
    // With no margin, the fast clock takes over a lease its holder still counts on: the
    // hazard the margin exists for. Fencing still refuses the holder's complete.
    let stolen = acquire(&careless, &claim_of(&key, "careless")).await;
    assert_eq!(stolen.kind, ClaimKind::Takeover);
    let res = holder.complete(&lease, Bytes::new(), HOUR).await;
    assert!(res.is_err_and(|e| e.is_fenced()));
}

#[tokio::test]
async fn create_table_enables_ttl_on_expires_at_in_seconds() {
    let clock = ManualClock::new(Timestamp::now());
    let b = on_clock(&clock, Duration::ZERO).await;
    b.create_table()
        .await
        .expect("a second create_table is harmless");
    let ttl = b
        .client()
        .describe_time_to_live()
        .table_name(TABLE)
        .send()
        .await
        .expect("describe TTL");
    let description = ttl.time_to_live_description().expect("description");
    assert_eq!(description.attribute_name(), Some("expires_at"));
    assert_eq!(
        description.time_to_live_status(),
        Some(&TimeToLiveStatus::Enabled)
    );
    let key = fresh_key("ttl");
    let lease = acquire(&b, &claim_of(&key, "a")).await;
    b.complete(&lease, Bytes::from_static(b"r"), HOUR)
        .await
        .expect("complete");
    let rec = b.get(&key).await.expect("get").expect("record");
    let expires_ms = rec.expires_at.expect("expiry").as_millis();
    let item = raw_item(&b, &key).await;
    let ttl_secs: u64 = match item.get("expires_at") {
        Some(AttributeValue::N(n)) => n.parse().expect("seconds"),
        other => panic!("expires_at is {other:?}"),
    };
    assert_eq!(
        ttl_secs,
        expires_ms.div_ceil(1000),
        "TTL in seconds, rounded up"
    );
}

async fn raw_item(
    b: &DynamoBackend,
    key: &Key,
) -> std::collections::HashMap<String, AttributeValue> {
    b.client()
        .get_item()
        .table_name(b.config().table())
        .key(
            "pk",
            AttributeValue::S(format!("{}/{}", key.namespace(), key.id())),
        )
        .consistent_read(true)
        .send()
        .await
        .expect("raw get")
        .item
        .unwrap_or_default()
}

#[tokio::test]
async fn expired_items_count_as_absent_before_ttl_removes_them_and_purge_removes_them() {
    let table = common::unique_table("purge");
    let clock = ManualClock::new(Timestamp::now());
    let b = DynamoBackend::connect(common::config(&table).with_clock_skew(Duration::ZERO))
        .await
        .expect("connect")
        .with_clock(clock.clone());
    b.create_table().await.expect("create table");
    let (short, long) = (fresh_key("short"), fresh_key("long"));
    let l = acquire(&b, &claim_of(&short, "a")).await;
    b.complete(&l, Bytes::from_static(b"s"), Duration::from_secs(60))
        .await
        .expect("complete");
    let l = acquire(&b, &claim_of(&long, "a")).await;
    b.complete(&l, Bytes::from_static(b"l"), HOUR)
        .await
        .expect("complete");
    clock.advance(Duration::from_secs(61));
    assert_eq!(b.get(&short).await.expect("get"), None);
    assert!(!raw_item(&b, &short).await.is_empty(), "still in the table");
    assert_eq!(b.purge_expired().await.expect("purge"), 1);
    assert!(raw_item(&b, &short).await.is_empty(), "purged");
    assert!(b.get(&long).await.expect("get").is_some());
    assert_eq!(b.purge_expired().await.expect("purge"), 0);
    b.client()
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .expect("drop the table");
}

/// Requests sent per step, read from the backend's own counter.
struct Trips<'a> {
    backend: &'a DynamoBackend,
    seen: u64,
    log: Vec<(&'static str, u64)>,
}

impl<'a> Trips<'a> {
    fn new(backend: &'a DynamoBackend) -> Self {
        Trips {
            backend,
            seen: backend.requests_sent(),
            log: Vec::new(),
        }
    }

    /// Logs the requests sent since the last step as `name`'s.
    fn step(&mut self, name: &'static str) {
        let now = self.backend.requests_sent();
        self.log.push((name, now - self.seen));
        self.seen = now;
    }

    /// Forgets the requests sent since the last step.
    fn skip(&mut self) {
        self.seen = self.backend.requests_sent();
    }
}

#[tokio::test]
async fn round_trips_per_path() {
    let clock = ManualClock::new(Timestamp::now());
    let b = on_clock(&clock, Duration::ZERO).await;
    let mut trips = Trips::new(&b);
    let key = fresh_key("trips");
    let claim = Claim {
        max_attempts: 3,
        ..claim_of(&key, "a")
    };

    let first = acquire(&b, &claim).await;
    trips.step("first claim");
    let lost = b.claim(&claim_of(&key, "b")).await.expect("claim");
    assert!(matches!(lost, ClaimOutcome::InProgress { .. }), "{lost:?}");
    trips.step("lost race (live lease)");
    let other = Claim {
        fingerprint: Some(Fingerprint::of(b"other")),
        ..claim_of(&key, "b")
    };
    assert_eq!(
        b.claim(&other).await.expect("claim"),
        ClaimOutcome::Mismatch
    );
    trips.step("mismatch");
    b.extend(&first, LEASE).await.expect("extend");
    trips.step("extend");
    b.fail(&first, "boom", FailureKind::Retry, HOUR)
        .await
        .expect("fail");
    trips.step("fail");
    let retry = acquire(&b, &claim).await;
    assert_eq!(retry.kind, ClaimKind::Retry);
    trips.step("retry");
    clock.advance(LEASE); // exactly on the deadline: lapsed
    let takeover = acquire(&b, &claim).await;
    assert_eq!((takeover.kind, takeover.attempts), (ClaimKind::Takeover, 3));
    trips.step("takeover");
    clock.advance(LEASE); // exactly on the deadline: lapsed
    let poisoned = ClaimOutcome::Poisoned {
        attempts: 3,
        error: lapsed_error(3),
    };
    assert_eq!(b.claim(&claim).await.expect("claim"), poisoned);
    trips.step("lapsed lease, attempts spent: turns poisoned");
    assert_eq!(b.claim(&claim).await.expect("claim"), poisoned);
    trips.step("poisoned");

    let done = fresh_key("trips-done");
    let lease = acquire(&b, &claim_of(&done, "a")).await;
    trips.skip();
    b.complete(&lease, Bytes::from_static(b"ok"), Duration::from_secs(60))
        .await
        .expect("complete");
    trips.step("complete");
    let replay = ClaimOutcome::Completed(Bytes::from_static(b"ok"));
    assert_eq!(b.claim(&claim_of(&done, "b")).await.expect("claim"), replay);
    trips.step("duplicate");
    clock.advance(Duration::from_secs(60)); // exactly on the expiry: expired
    let again = acquire(&b, &claim_of(&done, "b")).await;
    assert_eq!((again.token, again.kind), (1, ClaimKind::First));
    trips.step("expired item not yet removed by TTL");

    let back = fresh_key("trips-back");
    let lease = acquire(&b, &claim_of(&back, "a")).await;
    trips.skip();
    b.release(&lease).await.expect("release");
    trips.step("release");
    let after = acquire(&b, &claim_of(&back, "b")).await;
    assert_eq!((after.kind, after.attempts), (ClaimKind::Takeover, 1));
    trips.step("claim after a release");
    let mut batch = Vec::new();
    for id in ["trips-s1", "trips-s2", "trips-s3"] {
        let lease = acquire(&b, &claim_of(&fresh_key(id), "a")).await;
        batch.push(Settlement::complete(lease, Bytes::from_static(b"ok")));
    }
    batch.push(Settlement::release(after));
    trips.skip();
    let answers = b.settle_many(&batch, HOUR).await.expect("settle_many");
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    trips.step("settle_many of 4 keys");

    let expected = [
        ("first claim", 1),
        ("lost race (live lease)", 1),
        ("mismatch", 1),
        ("extend", 1),
        ("fail", 1),
        ("retry", 1),
        ("takeover", 1),
        ("lapsed lease, attempts spent: turns poisoned", 2),
        ("poisoned", 1),
        ("complete", 1),
        ("duplicate", 1),
        ("expired item not yet removed by TTL", 2),
        ("release", 1),
        ("claim after a release", 1),
        ("settle_many of 4 keys", 4),
    ];
    assert_eq!(trips.log, expected);
}

#[tokio::test]
async fn claim_many_answers_a_wide_batch_in_order() {
    let clock = ManualClock::new(Timestamp::now());
    let b = on_clock(&clock, Duration::ZERO).await;
    let ns = idem_conformance::unique_namespace();
    let keys: Vec<Key> = (0..100)
        .map(|i| Key::new(ns.clone(), format!("k{i}")).expect("key"))
        .collect();
    for key in keys.iter().step_by(2) {
        let l = acquire(&b, &claim_of(key, "first")).await;
        b.complete(&l, Bytes::from(key.id().to_owned()), HOUR)
            .await
            .expect("complete");
    }
    let batch: Vec<Claim> = keys.iter().map(|k| claim_of(k, "batch")).collect();
    let answers = b.claim_many(&batch).await.expect("claim_many");
    assert_eq!(answers.len(), 100);
    for (i, (key, answer)) in keys.iter().zip(&answers).enumerate() {
        if i % 2 == 0 {
            assert_eq!(
                answer,
                &ClaimOutcome::Completed(Bytes::from(key.id().to_owned()))
            );
        } else {
            assert!(
                matches!(answer, ClaimOutcome::Acquired(l) if l.key == *key && l.token == 1),
                "{i}: {answer:?}"
            );
        }
    }
}
