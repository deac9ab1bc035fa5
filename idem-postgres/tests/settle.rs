//! How settling a record writes. Within its lease, `complete` keeps the expiry the claim
//! set (`lease_until + retention`), so the update changes no indexed column and PostgreSQL
//! makes it a HOT update: no index writes. Outside those conditions it falls back to
//! `now() + retention`.

mod common;

use std::time::Duration;

use bytes::Bytes;
use idem_core::{Backend, Claim, ClaimOutcome, Key, Lease};
use idem_postgres::{PgBackend, PgConfig};

const RETENTION: Duration = Duration::from_secs(600);

fn claim(id: &str, retention: Duration) -> Claim {
    Claim {
        key: Key::new("ns", id).expect("key"),
        owner: "worker".into(),
        lease_ttl: Duration::from_secs(30),
        fingerprint: None,
        max_attempts: 3,
        retention,
    }
}

async fn acquire(backend: &PgBackend, claim: &Claim) -> Lease {
    match backend.claim(claim).await.expect("claim") {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("a fresh key must be acquired, got {other:?}"),
    }
}

/// HOT updates of the schema's record table so far, as the statistics system counts them.
async fn hot_updates(backend: &PgBackend, schema: &str) -> i64 {
    // One connection: the statistics this backend process has pending are flushed once it
    // goes idle after this call, and read by the next statement.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(backend.pool())
        .await
        .expect("flush statistics");
    sqlx::query_scalar(
        "SELECT n_tup_hot_upd FROM pg_stat_user_tables \
         WHERE schemaname = $1 AND relname = 'idem_records'",
    )
    .bind(schema)
    .fetch_one(backend.pool())
    .await
    .expect("read statistics")
}

#[tokio::test]
async fn completing_within_the_lease_is_a_hot_update_that_keeps_the_claims_expiry() {
    let schema = common::fresh_schema();
    let config = PgConfig::new(common::url())
        .schema(schema.clone())
        .max_connections(1);
    let backend = PgBackend::connect(config).await.expect("connect");
    backend.migrate().await.expect("migrate");

    let before = hot_updates(&backend, &schema).await;
    for i in 0..10 {
        let lease = acquire(&backend, &claim(&format!("k{i}"), RETENTION)).await;
        backend
            .complete(&lease, Bytes::from_static(b"done"), RETENTION)
            .await
            .expect("complete");
        let record = backend.get(&lease.key).await.expect("get").expect("record");
        assert_eq!(
            record.expires_at,
            Some(lease.lease_until.saturating_add(RETENTION)),
            "the claim's expiry is kept"
        );
    }
    let after = hot_updates(&backend, &schema).await;
    assert_eq!(after - before, 10, "every complete is a HOT update");
}

#[tokio::test]
async fn a_complete_with_another_retention_counts_it_from_now() {
    let backend = common::backend().await;
    let lease = acquire(&backend, &claim("k", Duration::from_secs(3600))).await;
    let short = Duration::from_secs(60);
    backend
        .complete(&lease, Bytes::from_static(b"done"), short)
        .await
        .expect("complete");
    let record = backend.get(&lease.key).await.expect("get").expect("record");
    let expires = record.expires_at.expect("expiry");
    let lease_until = lease.lease_until;
    // now() + 60 s, which is well before the claim's lease_until + 1 h.
    assert!(
        expires < lease_until.saturating_add(Duration::from_secs(120)),
        "expires {expires:?}, lease until {lease_until:?}"
    );
    assert!(
        expires.saturating_add(Duration::from_secs(31)) >= lease_until.saturating_add(short),
        "expires {expires:?}, lease until {lease_until:?}"
    );
}
