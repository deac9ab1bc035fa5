//! Bad input and a store that is down, as far as PostgreSQL's own: typed errors, never a
//! panic or a hang. The failures every backend shares (closed port, silent server, corrupt
//! record, oversized response) are `idem_conformance::remote_suite!` cases, run from
//! `tests/conformance.rs`.

mod common;

use std::time::Duration;

use idem_core::backend::{Claim, ListFilter};
use idem_core::{Backend, Error, Fingerprint, Key};
use idem_postgres::{PgBackend, PgConfig};

fn claim(key: &Key) -> Claim {
    Claim {
        key: key.clone(),
        owner: "a".into(),
        lease_ttl: Duration::from_secs(10),
        fingerprint: Some(Fingerprint::of(b"p")),
        max_attempts: 3,
        retention: Duration::from_secs(60),
    }
}

#[tokio::test]
async fn a_closed_port_fails_within_the_timeout_without_the_password() {
    let config = PgConfig::new("postgres://app:hunter2-secret@127.0.0.1:1/test")
        .with_connect_timeout(Duration::from_millis(500));
    let res = tokio::time::timeout(Duration::from_secs(10), PgBackend::connect(config))
        .await
        .expect("connect must not hang");
    let err = res.expect_err("nothing listens on port 1");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let mut text = format!("{err} {err:?}");
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        text.push_str(&s.to_string());
        source = s.source();
    }
    assert!(!text.contains("hunter2-secret"), "{text}");
    assert!(text.contains("***"), "the URL is shown redacted: {text}");
}

#[tokio::test]
async fn an_unmigrated_schema_is_a_config_error_naming_migrate() {
    let config = PgConfig::new(common::url()).with_schema(common::fresh_schema());
    let backend = PgBackend::connect(config).await.expect("connect");
    let res = backend
        .claim(&claim(&Key::new("ns", "k").expect("key")))
        .await;
    match res {
        Err(Error::Config { message, .. }) => assert!(message.contains("migrate"), "{message}"),
        other => panic!("expected Config, got {other:?}"),
    }
}

#[tokio::test]
async fn a_pool_of_no_connections_is_a_config_error() {
    let config = PgConfig::new(common::url()).with_max_connections(0);
    match PgBackend::connect(config).await {
        Err(Error::Config { message, .. }) => assert!(message.contains("max_connections")),
        other => panic!("expected Config, got {other:?}"),
    }
}

#[tokio::test]
async fn a_bad_schema_name_is_refused() {
    let config = PgConfig::new(common::url()).with_schema("idem; drop table x");
    let res = PgBackend::connect(config).await;
    assert!(matches!(res, Err(Error::Config { .. })), "{res:?}");
}

#[tokio::test]
async fn a_dropped_connection_is_unavailable_then_recovers() {
    let app = common::fresh_schema(); // a name no other pool uses
    let config = PgConfig::new(common::url()).with_application_name(app.clone());
    let backend = PgBackend::connect(config).await.expect("connect");
    let key = Key::new("ns", "dropped").expect("key");
    let _ = backend.get(&key).await; // warm the pool (the default schema may not exist)
    // Kill the server processes serving this pool, as a restart or a proxy would.
    let killer = common::backend().await;
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(&app)
    .fetch_all(killer.pool())
    .await
    .expect("terminate");
    assert!(!killed.is_empty(), "the pool had a connection to kill");
    let answer = backend.get(&key).await;
    assert!(
        matches!(
            answer,
            Err(Error::Unavailable { .. } | Error::Config { .. })
        ),
        "a dropped connection must be Unavailable, not {answer:?}"
    );
    // The pool replaces dead connections: the store answers again (Config: the default
    // schema was never migrated, which is an answer from a live server).
    let mut recovered = false;
    for _ in 0..20 {
        if let Err(Error::Config { .. }) = backend.get(&key).await {
            recovered = true;
            break;
        }
    }
    assert!(recovered, "the backend never answered again");
}

/// A connect or query timeout of `Duration::MAX` (for "never") is a century, not an
/// overflow in the pool or the clock: the backend connects and claims.
#[tokio::test]
async fn a_timeout_of_duration_max_connects_and_claims() {
    let connect = PgConfig::new(common::url())
        .with_schema(common::fresh_schema())
        .with_connect_timeout(Duration::MAX);
    assert_eq!(
        connect.connect_timeout(),
        idem_core::clock::capped(Duration::MAX)
    );
    let query = PgConfig::new(common::url())
        .with_schema(common::fresh_schema())
        .with_query_timeout(Duration::MAX);
    assert_eq!(
        query.query_timeout(),
        idem_core::clock::capped(Duration::MAX)
    );
    for config in [connect, query] {
        let backend = PgBackend::connect(config).await.expect("connect");
        backend.migrate().await.expect("migrate");
        let key = Key::new(idem_conformance::unique_namespace(), "forever").expect("key");
        let res = backend.claim(&claim(&key)).await.expect("claim");
        assert!(
            matches!(res, idem_core::backend::ClaimOutcome::Acquired(_)),
            "{res:?}"
        );
    }
}

/// Rows idem did not write (an unknown state, a two-byte fingerprint) among a namespace's
/// records: the listing skips and counts them, naming each by namespace and id, and lists
/// the rest; a limit counts records, however many rows before them do not decode.
#[tokio::test]
async fn a_listing_skips_and_counts_rows_that_do_not_decode() {
    let b = common::backend().await;
    let ns = idem_conformance::unique_namespace();
    let insert = format!(
        "INSERT INTO \"{}\".idem_records (namespace, id, state, owner, token, attempts, \
         max_attempts, claim_kind, lease_until, fingerprint, expires_at) VALUES ($1, $2, $3, \
         'x', 1, 1, 3, 'first', now() + interval '1 hour', $4, now() + interval '2 hours')",
        b.schema()
    );
    // In key order, the foreign rows come first.
    for (id, state, fingerprint) in [
        ("a-state", "exploded", None),
        ("b-fingerprint", "processing", Some(vec![1u8, 2])),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
            .bind(&ns)
            .bind(id)
            .bind(state)
            .bind(fingerprint)
            .execute(b.pool())
            .await
            .expect("insert a foreign row");
    }
    for id in ["c", "d", "e"] {
        let key = Key::new(ns.clone(), id).expect("key");
        idem_conformance::acquire(&b, &claim(&key)).await;
    }
    let filter = ListFilter {
        namespace: Some(ns.clone()),
        ..ListFilter::default()
    };
    let listing = b.list(&filter).await.expect("list");
    let ids: Vec<&str> = listing.records.iter().map(|r| r.key.id()).collect();
    assert_eq!(ids, ["c", "d", "e"]);
    assert_eq!(listing.skipped_total, 2);
    let named: Vec<String> = listing.skipped.iter().map(|s| s.key.clone()).collect();
    assert_eq!(
        named,
        [format!("{ns}/a-state"), format!("{ns}/b-fingerprint")]
    );
    assert!(
        listing.skipped[0].reason.contains("\"exploded\""),
        "{:?}",
        listing.skipped
    );
    assert!(
        listing.skipped[1].reason.contains("2 bytes"),
        "{:?}",
        listing.skipped
    );
    let two = ListFilter { limit: 2, ..filter };
    let listing = b.list(&two).await.expect("list");
    let ids: Vec<&str> = listing.records.iter().map(|r| r.key.id()).collect();
    assert_eq!((ids, listing.skipped_total), (vec!["c", "d"], 2));
}
