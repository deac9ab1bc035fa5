//! What MySQL's backend does with rows idem did not write, beyond the conformance suite's
//! corrupt-record case (`tests/conformance.rs`): a listing skips and counts them.

mod common;

use std::time::Duration;

use idem_core::Key;
use idem_core::backend::{Backend, ListFilter};
use sqlx::AssertSqlSafe;

/// Rows idem did not write (an unknown state, an owner that is not UTF-8) among a
/// namespace's records: the listing skips and counts them, naming each by namespace and id,
/// and lists the rest; a limit counts records, however many rows before them do not decode.
#[tokio::test]
async fn a_listing_skips_and_counts_rows_that_do_not_decode() {
    let b = common::backend().await;
    let ns = idem_conformance::unique_namespace();
    let insert = "INSERT INTO idem_records (namespace, id, state, owner, token, attempts, \
         lease_until_ms, fingerprint, expires_at_ms) VALUES (?, ?, ?, ?, 1, 1, \
         (UNIX_TIMESTAMP() + 3600) * 1000, NULL, (UNIX_TIMESTAMP() + 7200) * 1000)";
    // In key order, the foreign rows come first.
    for (id, state, owner) in [
        ("a-state", "exploded", vec![b'x']),
        ("b-owner", "processing", vec![0xff, 0xfe]),
    ] {
        sqlx::query(AssertSqlSafe(insert))
            .bind(ns.as_bytes())
            .bind(id.as_bytes())
            .bind(state)
            .bind(owner)
            .execute(b.pool())
            .await
            .expect("insert a foreign row");
    }
    for id in ["c", "d", "e"] {
        let key = Key::new(ns.clone(), id).expect("key");
        let claim = idem_conformance::claim_of(&key, "w", Duration::from_secs(60));
        idem_conformance::acquire(&b, &claim).await;
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
    assert_eq!(named, [format!("{ns}/a-state"), format!("{ns}/b-owner")]);
    let reasons: Vec<&str> = listing.skipped.iter().map(|s| s.reason.as_str()).collect();
    assert!(reasons[0].contains("\"exploded\""), "{reasons:?}");
    assert!(reasons[1].contains("owner is not UTF-8"), "{reasons:?}");
    let two = ListFilter { limit: 2, ..filter };
    let listing = b.list(&two).await.expect("list");
    let ids: Vec<&str> = listing.records.iter().map(|r| r.key.id()).collect();
    assert_eq!((ids, listing.skipped_total), (vec!["c", "d"], 2));
}
