//! Transactional mode on a real MySQL or MariaDB: the handler's writes, the record and the
//! offset commit together; in a batch a failing handler rolls back only its own writes.

mod common;

use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use idem_core::backend::Claim;
use idem_core::{Backend, Fingerprint, HandlerError, Key, Outcome, State, Transactional};
use idem_mysql::{MySqlBackend, OffsetPosition, StoredOffset};
use sqlx::AssertSqlSafe;

const HOUR: Duration = Duration::from_secs(3600);

/// A backend and a business table of its own.
async fn setup() -> (MySqlBackend, String, String) {
    let backend = common::backend().await;
    let ns = idem_conformance::unique_namespace();
    let ledger = format!("ledger_{}", ns.replace('-', "_"));
    let create = format!("CREATE TABLE {ledger} (k VARCHAR(64) NOT NULL, token BIGINT NOT NULL)");
    sqlx::query(AssertSqlSafe(create))
        .execute(backend.pool())
        .await
        .expect("create ledger");
    (backend, ledger, ns)
}

fn claim(ns: &str, id: &str) -> Claim {
    Claim {
        key: Key::new(ns, id).expect("key"),
        owner: "w".into(),
        lease_ttl: Duration::from_secs(30),
        fingerprint: Some(Fingerprint::of(id.as_bytes())),
        max_attempts: 3,
        retention: HOUR,
    }
}

async fn rows(backend: &MySqlBackend, ledger: &str) -> Vec<(String, i64)> {
    let q = format!("SELECT k, token FROM {ledger} ORDER BY k");
    let rows = sqlx::query_as(AssertSqlSafe(q))
        .fetch_all(backend.pool())
        .await
        .expect("read ledger");
    let drop = format!("DROP TABLE IF EXISTS {ledger}");
    let _ = sqlx::query(AssertSqlSafe(drop))
        .execute(backend.pool())
        .await;
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_message_commits_its_write_record_and_offset_together() {
    let (backend, ledger, ns) = setup().await;
    let group = format!("g-{ns}");
    let at = OffsetPosition {
        group: group.clone(),
        topic: "payments".into(),
        partition: 3,
        offset: 41,
    };
    let table = ledger.clone();
    let outcome = backend
        .execute_in_transaction(&claim(&ns, "a"), HOUR, Some(&at), move |tx, lease| {
            async move {
                let q = format!("INSERT INTO {table} (k, token) VALUES (?, ?)");
                sqlx::query(AssertSqlSafe(q))
                    .bind("a")
                    .bind(i64::try_from(lease.token).unwrap_or(0))
                    .execute(&mut **tx)
                    .await?;
                Ok(Bytes::from_static(b"done"))
            }
            .boxed()
        })
        .await
        .expect("execute");
    assert_eq!(outcome, Outcome::Executed(Bytes::from_static(b"done")));
    let offsets = backend.stored_offsets(&group).await.expect("offsets");
    let want = StoredOffset {
        topic: "payments".into(),
        partition: 3,
        next_offset: 42,
    };
    assert_eq!(offsets, vec![want]);
    // A failing handler's write rolls back; the failure is recorded.
    let table = ledger.clone();
    let failed = backend
        .execute_in_transaction(&claim(&ns, "b"), HOUR, None, move |tx, _| {
            async move {
                let q = format!("INSERT INTO {table} (k, token) VALUES ('b', 1)");
                sqlx::query(AssertSqlSafe(q)).execute(&mut **tx).await?;
                Err(HandlerError::retry("downstream said no"))
            }
            .boxed()
        })
        .await
        .expect("execute");
    assert!(
        matches!(failed, Outcome::Failed { attempts: 1, .. }),
        "{failed:?}"
    );
    let b = backend.get(&claim(&ns, "b").key).await.expect("get");
    assert_eq!(b.map(|r| r.state), Some(State::Failed));
    assert_eq!(rows(&backend, &ledger).await, vec![("a".to_owned(), 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_handler_in_a_batch_rolls_back_only_its_own_writes() {
    let (backend, ledger, ns) = setup().await;
    let claims: Vec<Claim> = ["a", "b", "c"].iter().map(|id| claim(&ns, id)).collect();
    let group = format!("g-{ns}");
    let table = ledger.clone();
    let outcomes = backend
        .execute_batch_in_transaction(
            &claims,
            HOUR,
            move |tx, i, lease| {
                let table = table.clone();
                async move {
                    let id = ["a", "b", "c"][i];
                    let q = format!("INSERT INTO {table} (k, token) VALUES (?, ?)");
                    sqlx::query(AssertSqlSafe(q))
                        .bind(id)
                        .bind(i64::try_from(lease.token).unwrap_or(0))
                        .execute(&mut **tx)
                        .await?;
                    if id == "b" {
                        return Err(HandlerError::permanent("card declined"));
                    }
                    Ok(Bytes::from(format!("paid {id}")))
                }
                .boxed()
            },
            |outcomes: &[Outcome]| {
                assert_eq!(outcomes.len(), 3);
                Some(OffsetPosition {
                    group: group.clone(),
                    topic: "t".into(),
                    partition: 0,
                    offset: 0,
                })
            },
        )
        .await
        .expect("batch");
    assert_eq!(outcomes[0], Outcome::Executed(Bytes::from("paid a")));
    assert!(
        matches!(outcomes[1], Outcome::Poisoned { .. }),
        "{outcomes:?}"
    );
    assert_eq!(outcomes[2], Outcome::Executed(Bytes::from("paid c")));
    let states: Vec<_> = {
        let mut v = Vec::new();
        for c in &claims {
            v.push(backend.get(&c.key).await.expect("get").map(|r| r.state));
        }
        v
    };
    assert_eq!(
        states,
        vec![
            Some(State::Completed),
            Some(State::Failed),
            Some(State::Completed)
        ]
    );
    assert_eq!(
        rows(&backend, &ledger).await,
        vec![("a".to_owned(), 1), ("c".to_owned(), 1)]
    );
    let offsets = backend
        .stored_offsets(&format!("g-{ns}"))
        .await
        .expect("offsets");
    assert_eq!(offsets.len(), 1);
    assert_eq!(offsets[0].next_offset, 1);
}
