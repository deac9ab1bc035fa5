//! What goes wrong particular to DynamoDB, and what the backend says: missing tables,
//! oversized items and error texts. On Amazon DynamoDB Local (`IDEM_DYNAMO_ENDPOINT`). The
//! failures every backend shares (closed port, silent server, corrupt record, oversized
//! response) are `idem_conformance::remote_suite!` cases, run from `tests/conformance.rs`.

mod common;

use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use bytes::Bytes;
use idem_conformance::acquire;
use idem_core::backend::{Claim, ListFilter};
use idem_core::{Backend, Error, FailureKind, Fingerprint, Key};
use idem_dynamo::{DynamoBackend, DynamoConfig, ITEM_LIMIT_BYTES};

const HOUR: Duration = Duration::from_secs(3600);

fn claim_of(key: &Key, owner: &str) -> Claim {
    idem_conformance::claim_of(key, owner, Duration::from_secs(30))
}

#[tokio::test]
async fn a_missing_table_is_a_configuration_error() {
    let config = common::config(&common::unique_table("missing"));
    let b = DynamoBackend::connect(config).await.expect("connect");
    let key = Key::new("ns", "k").expect("key");
    match b.claim(&claim_of(&key, "a")).await {
        Err(Error::Config { message, .. }) => {
            assert!(message.contains("ResourceNotFound"), "{message}")
        }
        other => panic!("expected Config, got {other:?}"),
    }
}

/// An error text over the response limit is `TooLarge` too (oversized responses are a
/// conformance case).
#[tokio::test]
async fn an_oversized_error_text_is_too_large() {
    let b = common::backend("idem_errors").await;
    let key = Key::new(idem_conformance::unique_namespace(), "big").expect("key");
    let lease = acquire(&b, &claim_of(&key, "a")).await;
    let limit = b.capabilities().max_response_bytes;
    assert_eq!(limit, DynamoConfig::DEFAULT_MAX_RESPONSE_BYTES);
    let long = "e".repeat(limit + 1);
    let res = b.fail(&lease, &long, FailureKind::Retry, HOUR).await;
    assert!(
        matches!(
            res,
            Err(Error::TooLarge {
                what: "error text",
                ..
            })
        ),
        "{res:?}"
    );
    b.fail(&lease, "short", FailureKind::Retry, HOUR)
        .await
        .expect("the lease still holds");
}

#[tokio::test]
async fn an_item_over_dynamodbs_limit_is_too_large_and_changes_nothing() {
    // Allow responses up to the item limit itself: the key and the other attributes then
    // push the item over it, and DynamoDB refuses the write.
    let config = common::config("idem_errors").with_max_response_bytes(ITEM_LIMIT_BYTES);
    let b = DynamoBackend::connect(config).await.expect("connect");
    b.create_table().await.expect("create table");
    let key = Key::new(idem_conformance::unique_namespace(), "huge").expect("key");
    let lease = acquire(&b, &claim_of(&key, "a")).await;
    let res = b
        .complete(&lease, Bytes::from(vec![1u8; ITEM_LIMIT_BYTES]), HOUR)
        .await;
    assert!(
        matches!(res, Err(Error::TooLarge { what: "item", limit, .. }) if limit == ITEM_LIMIT_BYTES),
        "{res:?}"
    );
    let rec = b.get(&key).await.expect("get").expect("record");
    assert_eq!(rec.state, idem_core::State::Processing);
    b.complete(&lease, Bytes::from_static(b"small"), HOUR)
        .await
        .expect("the lease still holds");
}

#[tokio::test]
async fn a_record_without_fingerprint_keeps_none_when_claimed_with_one() {
    // A claim with a fingerprint against a record stored without one: the one-write form
    // cannot keep the record's (absent) fingerprint, so the claim decides from the
    // returned item and writes by compare-and-set. The answer is the state machine's.
    let b = common::backend("idem_errors").await;
    let key = Key::new(idem_conformance::unique_namespace(), "nofp").expect("key");
    let bare = Claim {
        fingerprint: None,
        max_attempts: 5,
        ..claim_of(&key, "a")
    };
    let lease = acquire(&b, &bare).await;
    b.fail(&lease, "boom", FailureKind::Retry, HOUR)
        .await
        .expect("fail");
    let with_fp = Claim {
        fingerprint: Some(Fingerprint::of(b"p")),
        ..bare.clone()
    };
    let retry = acquire(&b, &with_fp).await;
    assert_eq!((retry.token, retry.attempts), (2, 2));
    let rec = b.get(&key).await.expect("get").expect("record");
    assert_eq!(
        rec.fingerprint, None,
        "the first claim fixed the fingerprint"
    );
}

/// Timeouts and a skew of `Duration::MAX` (for "never") are a century, not an overflow:
/// the backend connects and claims.
#[tokio::test]
async fn durations_of_duration_max_connect_and_claim() {
    let config = common::config(&common::unique_table("forever"))
        .with_connect_timeout(Duration::MAX)
        .with_attempt_timeout(Duration::MAX)
        .with_operation_timeout(Duration::MAX);
    let century = idem_core::clock::capped(Duration::MAX);
    assert_eq!(
        (config.connect_timeout(), config.operation_timeout()),
        (century, century)
    );
    let b = DynamoBackend::connect(config).await.expect("connect");
    b.create_table().await.expect("create table");
    let key = Key::new("ns", "forever").expect("key");
    let res = b.claim(&claim_of(&key, "a")).await.expect("claim");
    assert!(
        matches!(res, idem_core::backend::ClaimOutcome::Acquired(_)),
        "{res:?}"
    );
}

/// An item idem did not write, live (`exp_ms` ahead) but without its state, owner, token
/// and attempts, among a namespace's records: the listing skips and counts it, naming its
/// partition key, and lists the records; a limit counts records.
#[tokio::test]
async fn a_listing_skips_and_counts_an_item_that_does_not_decode() {
    let table = "idem_errors";
    let b = common::backend(table).await;
    let ns = idem_conformance::unique_namespace();
    let far = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis()
        + 3_600_000;
    let pk = format!("{ns}/foreign");
    b.client()
        .put_item()
        .table_name(table)
        .item("pk", AttributeValue::S(pk.clone()))
        .item("exp_ms", AttributeValue::N(far.to_string()))
        .send()
        .await
        .expect("plant a foreign item");
    for id in ["a", "b"] {
        let key = Key::new(ns.clone(), id).expect("key");
        acquire(&b, &claim_of(&key, "w")).await;
    }
    let filter = ListFilter {
        namespace: Some(ns.clone()),
        ..ListFilter::default()
    };
    let listing = b.list(&filter).await.expect("list");
    let mut ids: Vec<&str> = listing.records.iter().map(|r| r.key.id()).collect();
    ids.sort();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(listing.skipped_total, 1);
    assert_eq!(listing.skipped[0].key, pk);
    assert!(
        listing.skipped[0].reason.contains("is missing"),
        "{:?}",
        listing.skipped
    );
    let one = ListFilter { limit: 1, ..filter };
    assert_eq!(b.list(&one).await.expect("list").records.len(), 1);
}
