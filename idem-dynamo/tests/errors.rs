//! What goes wrong, and what the backend says: items that do not decode, unreachable or
//! silent servers, missing tables, oversized items. On Amazon DynamoDB Local
//! (`IDEM_DYNAMO_ENDPOINT`), except where the point is that no server answers.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use conformance::acquire;
use idem_core::{Backend, Claim, Error, FailureKind, Fingerprint, Key};
use idem_dynamo::{DynamoBackend, DynamoConfig, ITEM_LIMIT_BYTES};

const HOUR: Duration = Duration::from_secs(3600);

fn claim_of(key: &Key, owner: &str) -> Claim {
    conformance::claim_of(key, owner, Duration::from_secs(30))
}

#[tokio::test]
async fn an_item_that_does_not_decode_is_corrupt() {
    let b = common::backend("idem_errors").await;
    let ns = conformance::unique_namespace();
    let key = Key::new(ns.clone(), "garbage").expect("key");
    b.client()
        .put_item()
        .table_name("idem_errors")
        .item("pk", s(&format!("{ns}/garbage")))
        .item("st", s("dancing"))
        .item("tok", s("not a number"))
        .send()
        .await
        .expect("raw put");
    for res in [
        b.claim(&claim_of(&key, "a")).await.map(drop),
        b.get(&key).await.map(drop),
    ] {
        match res {
            Err(Error::Corrupt { message, .. }) => {
                assert!(message.contains("garbage"), "{message}")
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }
    assert!(b.delete(&key).await.expect("delete"), "garbage was there");
    assert_eq!(b.get(&key).await.expect("get"), None);
    acquire(&b, &claim_of(&key, "a")).await;
}

fn s(text: &str) -> aws_sdk_dynamodb::types::AttributeValue {
    aws_sdk_dynamodb::types::AttributeValue::S(text.to_owned())
}

/// A configuration for an endpoint where nothing useful answers, bounding every call at
/// about a second.
fn unreachable(endpoint: String) -> DynamoConfig {
    DynamoConfig::local(endpoint, "idem_nowhere")
        .with_connect_timeout(Duration::from_millis(300))
        .with_attempt_timeout(Duration::from_millis(300))
        .with_operation_timeout(Duration::from_secs(1))
        .with_max_attempts(3)
}

/// `call` fails with `Unavailable` within the configured operation timeout (plus a margin
/// for a loaded machine), and never hangs.
async fn fails_in_time(config: DynamoConfig) {
    let bound = config.operation_timeout() + Duration::from_secs(2);
    let b = DynamoBackend::connect(config).await.expect("connect");
    let key = Key::new("ns", "k").expect("key");
    let start = Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(30), b.claim(&claim_of(&key, "a")))
        .await
        .expect("the call hung for 30 s");
    let took = start.elapsed();
    match res {
        Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(took <= bound, "took {took:?}, over the bound {bound:?}");
}

#[tokio::test]
async fn a_closed_port_fails_within_the_timeout() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    fails_in_time(unreachable(format!("http://127.0.0.1:{port}"))).await;
}

#[tokio::test]
async fn a_server_that_never_answers_fails_within_the_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn); // accept, read nothing, answer nothing
        }
    });
    fails_in_time(unreachable(format!("http://127.0.0.1:{port}"))).await;
    silent.abort();
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

#[tokio::test]
async fn oversized_responses_and_errors_are_too_large() {
    let b = common::backend("idem_errors").await;
    let key = Key::new(conformance::unique_namespace(), "big").expect("key");
    let lease = acquire(&b, &claim_of(&key, "a")).await;
    let limit = b.capabilities().max_response_bytes;
    assert_eq!(limit, DynamoConfig::DEFAULT_MAX_RESPONSE_BYTES);
    let res = b
        .complete(&lease, Bytes::from(vec![7u8; 500 * 1024]), HOUR)
        .await;
    assert!(
        matches!(res, Err(Error::TooLarge { what: "response", size, limit: l }) if size == 500 * 1024 && l == limit),
        "{res:?}"
    );
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
    b.complete(&lease, Bytes::from(vec![7u8; limit]), HOUR)
        .await
        .expect("a response at the limit fits");
}

#[tokio::test]
async fn an_item_over_dynamodbs_limit_is_too_large_and_changes_nothing() {
    // Allow responses up to the item limit itself: the key and the other attributes then
    // push the item over it, and DynamoDB refuses the write.
    let config = common::config("idem_errors").with_max_response_bytes(ITEM_LIMIT_BYTES);
    let b = DynamoBackend::connect(config).await.expect("connect");
    b.create_table().await.expect("create table");
    let key = Key::new(conformance::unique_namespace(), "huge").expect("key");
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
    let key = Key::new(conformance::unique_namespace(), "nofp").expect("key");
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
