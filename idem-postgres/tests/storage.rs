//! How records are written and found.
//!
//! - Within its lease, `complete` keeps the expiry the claim set (`lease_until +
//!   retention`), so the update changes no indexed column and PostgreSQL makes it a HOT
//!   update: no index writes. Outside those conditions it falls back to `now() + retention`.
//! - Claims find rows by index even when their cached plan was made while the table was
//!   tiny, they reuse one cached plan instead of planning every call, and transactional
//!   handlers still plan with the server's own settings.
//! - So do batch settles and batch transactions: they read the rows of their own keys, not
//!   every live record through the expiry index.
//! - A settle notifies waiters only for keys someone watches.

mod common;

use std::time::Duration;

use bytes::Bytes;
use idem_conformance::acquire;
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{Backend, Key, Transactional};
use idem_postgres::PgBackend;
use sqlx::AssertSqlSafe;

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

/// A statistics counter of the schema's record table (`n_tup_hot_upd`, `seq_scan`), so far.
async fn table_stat(backend: &PgBackend, schema: &str, column: &str) -> i64 {
    // One connection: the statistics this backend process has pending are flushed once it
    // goes idle after this call, and read by the next statement.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(backend.pool())
        .await
        .expect("flush statistics");
    let sql = format!(
        "SELECT {column} FROM pg_stat_user_tables \
         WHERE schemaname = $1 AND relname = 'idem_records'"
    );
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(schema)
        .fetch_one(backend.pool())
        .await
        .expect("read statistics")
}

/// A migrated backend in a fresh schema, over one connection (so that its statistics
/// can be flushed, and its cached plans are the ones every call uses).
async fn single_connection() -> (PgBackend, String) {
    let backend = common::backend_with(|c| c.with_max_connections(1)).await;
    let schema = backend.schema().to_owned();
    (backend, schema)
}

#[tokio::test]
async fn completing_within_the_lease_is_a_hot_update_that_keeps_the_claims_expiry() {
    let (backend, schema) = single_connection().await;
    let before = table_stat(&backend, &schema, "n_tup_hot_upd").await;
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
    let after = table_stat(&backend, &schema, "n_tup_hot_upd").await;
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

#[tokio::test]
async fn claims_find_rows_by_index_after_the_table_grows_under_a_cached_plan() {
    let (backend, schema) = single_connection().await;
    // Enough claims on a tiny table for the server to settle on a cached generic plan.
    for i in 0..10 {
        acquire(&backend, &claim(&format!("warm{i}"), RETENTION)).await;
    }
    // Grow the table behind that plan's back: nothing analyzes it in between.
    let grow = format!(
        "INSERT INTO {schema}.idem_records \
         (namespace, id, state, owner, token, attempts, max_attempts, claim_kind) \
         SELECT 'bulk', 'b' || g, 'failed', 'w', 1, 1, 3, 'first' \
         FROM generate_series(1, 20000) g"
    );
    sqlx::query(AssertSqlSafe(grow))
        .execute(backend.pool())
        .await
        .expect("grow the table");
    let before = table_stat(&backend, &schema, "seq_scan").await;
    for i in 0..10 {
        acquire(&backend, &claim(&format!("late{i}"), RETENTION)).await;
    }
    let after = table_stat(&backend, &schema, "seq_scan").await;
    assert_eq!(after - before, 0, "claims scanned the whole table");
}

/// Rows of the schema's record table read so far, by sequential, index and bitmap scans.
const ROWS_READ: &str = "seq_tup_read + coalesce(idx_tup_fetch, 0)";

/// Claims `n` fresh keys named `prefix…` in one batch.
async fn leases(backend: &PgBackend, prefix: &str, n: usize) -> Vec<idem_core::Lease> {
    let claims: Vec<Claim> = (0..n)
        .map(|i| claim(&format!("{prefix}{i}"), RETENTION))
        .collect();
    let answers = backend.claim_many(&claims).await.expect("claim_many");
    answers
        .into_iter()
        .map(|a| match a {
            ClaimOutcome::Acquired(lease) => lease,
            other => panic!("a fresh key answered {other:?}"),
        })
        .collect()
}

/// Completes `leases` with one `settle_many`.
async fn settle(backend: &PgBackend, leases: Vec<idem_core::Lease>) {
    let items: Vec<idem_core::backend::Settlement> = leases
        .into_iter()
        .map(|l| idem_core::backend::Settlement::complete(l, Bytes::from_static(b"done")))
        .collect();
    let answers = backend
        .settle_many(&items, RETENTION)
        .await
        .expect("settle_many");
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
}

/// Runs `n` fresh keys named `prefix…` as one batch transaction (lock, handlers, settle).
async fn batch_transaction(backend: &PgBackend, prefix: &str, n: usize) {
    let claims: Vec<Claim> = (0..n)
        .map(|i| claim(&format!("{prefix}{i}"), RETENTION))
        .collect();
    let outcomes = backend
        .execute_batch_in_transaction(
            &claims,
            RETENTION,
            |_, _, _| Box::pin(async { Ok(Bytes::from_static(b"done")) }),
            |_| None,
        )
        .await
        .expect("batch transaction");
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, idem_core::Outcome::Executed(_))),
        "{outcomes:?}"
    );
}

/// The cached plans of `settle_many.sql` and `lock_batch.sql` are made at their first run,
/// while the table is small. Their expiry test once matched the `expires_at` index, and
/// with sequential scans off those plans read every live record through it, then joined
/// the keys: a settle of a few keys cost a scan of the table (the Kafka bench on a fresh
/// schema fell from about 30,000 to 2,000 messages/s). 2,000 records is small enough that
/// a plan made afresh (another session's DDL can invalidate the cached one) is that plan
/// too.
#[tokio::test]
async fn batch_settles_find_rows_by_index_after_the_table_grows_under_cached_plans() {
    let (backend, schema) = single_connection().await;
    for round in 0..3 {
        let warm = leases(&backend, &format!("warm{round}-"), 5).await;
        settle(&backend, warm).await;
        batch_transaction(&backend, &format!("warmtx{round}-"), 3).await;
    }
    // Live records (expiry a day ahead) behind those plans' back; nothing analyzes them.
    let grow = format!(
        "INSERT INTO {schema}.idem_records \
         (namespace, id, state, owner, token, attempts, max_attempts, claim_kind, \
          response, expires_at) \
         SELECT 'bulk', 'b' || g, 'completed', 'w', 1, 1, 3, 'first', 'ok', \
                now() + interval '1 day' \
         FROM generate_series(1, 2000) g"
    );
    sqlx::query(AssertSqlSafe(grow))
        .execute(backend.pool())
        .await
        .expect("grow the table");

    let claimed = leases(&backend, "late", 10).await;
    let before = table_stat(&backend, &schema, ROWS_READ).await;
    settle(&backend, claimed).await;
    let read = table_stat(&backend, &schema, ROWS_READ).await - before;
    assert!(read < 200, "settling 10 keys read {read} rows");

    let before = table_stat(&backend, &schema, ROWS_READ).await;
    batch_transaction(&backend, "latetx", 10).await;
    let read = table_stat(&backend, &schema, ROWS_READ).await - before;
    assert!(
        read < 200,
        "a batch transaction of 10 keys read {read} rows"
    );
}

#[tokio::test]
async fn claims_reuse_one_plan_instead_of_planning_each_call() {
    let (backend, _) = single_connection().await;
    for i in 0..10 {
        acquire(&backend, &claim(&format!("k{i}"), RETENTION)).await;
    }
    // The same connection, the only one: prepared statements are per session.
    let (generic, custom): (i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(generic_plans), 0)::int8, coalesce(sum(custom_plans), 0)::int8 \
         FROM pg_prepared_statements WHERE strpos(statement, 'idem_records') > 0",
    )
    .fetch_one(backend.pool())
    .await
    .expect("read prepared statements");
    assert_eq!(custom, 0, "claims were planned afresh {custom} times");
    assert!(generic >= 10, "only {generic} runs of a cached plan");
}

/// The values of the `PLANNING` settings on a connection that does not set them.
async fn server_settings() -> Vec<String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&common::url())
        .await
        .expect("connect");
    let mut values = Vec::new();
    for (name, _) in idem_postgres::PLANNING {
        let v: String = sqlx::query_scalar("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(&mut conn)
            .await
            .expect("show");
        values.push(v);
    }
    values
}

#[tokio::test]
async fn a_transactional_handler_plans_with_the_servers_own_settings() {
    let backend = common::backend().await;
    let mut ours = Vec::new();
    for (name, value) in idem_postgres::PLANNING {
        let v: String = sqlx::query_scalar("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(backend.pool())
            .await
            .expect("show");
        assert_eq!(v, value, "idem's own statements run with {name} = {value}");
        ours.push(v);
    }
    let server = server_settings().await;
    assert_ne!(
        server, ours,
        "this test needs a server with other settings than idem's"
    );
    let c = claim("k", RETENTION);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let inside = seen.clone();
    backend
        .execute_in_transaction(&c, RETENTION, None, move |tx, _lease| {
            Box::pin(async move {
                for (name, _) in idem_postgres::PLANNING {
                    let v: String = sqlx::query_scalar("SELECT current_setting($1)")
                        .bind(name)
                        .fetch_one(&mut **tx)
                        .await
                        .map_err(idem_core::HandlerError::retry)?;
                    inside.lock().expect("lock").push(v);
                }
                Ok(Bytes::from_static(b"ok"))
            })
        })
        .await
        .expect("transaction");
    assert_eq!(*seen.lock().expect("lock"), server);
}

/// Index scans, inserted rows and updated rows of the schema's record table, so far.
async fn writes_and_scans(backend: &PgBackend, schema: &str) -> [i64; 3] {
    let mut out = [0; 3];
    for (slot, column) in out.iter_mut().zip(["idx_scan", "n_tup_ins", "n_tup_upd"]) {
        *slot = table_stat(backend, schema, column).await;
    }
    out
}

#[tokio::test]
async fn a_fresh_keys_claim_runs_the_insert_alone() {
    let (backend, schema) = single_connection().await;
    let mut before = writes_and_scans(&backend, &schema).await;
    let mut delta = |after: [i64; 3]| {
        let d = [0, 1, 2].map(|i| after[i] - before[i]);
        before = after;
        d
    };
    let lease = acquire(&backend, &claim("fresh", RETENTION)).await;
    // The insert looks for a conflicting row once (one index scan); nothing else reads.
    let d = delta(writes_and_scans(&backend, &schema).await);
    assert_eq!(
        d,
        [1, 1, 0],
        "[index scans, inserts, updates] of a fresh claim"
    );

    let claims: Vec<Claim> = (0..3)
        .map(|i| claim(&format!("many{i}"), RETENTION))
        .collect();
    let answers = backend.claim_many(&claims).await.expect("claim_many");
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, ClaimOutcome::Acquired(_)))
    );
    let d = delta(writes_and_scans(&backend, &schema).await);
    assert_eq!(d, [3, 3, 0], "claim_many of three fresh keys");

    // An existing key takes the full claim: it reads the row and updates it.
    backend.release(&lease).await.expect("release");
    delta(writes_and_scans(&backend, &schema).await);
    acquire(&backend, &claim("fresh", RETENTION)).await;
    let d = delta(writes_and_scans(&backend, &schema).await);
    assert!(
        d[0] >= 2 && d[1..] == [0, 1],
        "a claim of an existing key: {d:?}"
    );
}

type Sent = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

thread_local! {
    /// Where this thread's statements go while [`statements`] records them.
    static SINK: std::cell::RefCell<Option<Sent>> = const { std::cell::RefCell::new(None) };
}

/// Stops recording this thread's statements when dropped.
struct Recording;

impl Drop for Recording {
    fn drop(&mut self) {
        SINK.with(|s| s.borrow_mut().take());
    }
}

/// The first line of SQL (after comments) of each statement sqlx sends from this thread
/// (the test's runtime has one) while the guard lives, from sqlx's `sqlx::query` events.
/// The subscriber is global, installed once, because tracing's callsite filters and
/// sqlx's level check are global: a thread's own subscriber misses events while other
/// tests run.
fn statements() -> (Sent, Recording) {
    use tracing_subscriber::layer::SubscriberExt;

    struct Sql;
    struct Statement<'a>(&'a mut Option<String>);
    impl tracing::field::Visit for Statement<'_> {
        fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
            if field.name() == "db.statement" {
                *self.0 = Some(value.to_owned());
            }
        }
        fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
    }
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Sql {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if event.metadata().target() != "sqlx::query" {
                return;
            }
            let Some(sink) = SINK.with(|s| s.borrow().clone()) else {
                return;
            };
            let mut sql = None;
            event.record(&mut Statement(&mut sql));
            let sql = sql.unwrap_or_default();
            let first = sql.lines().find(|l| {
                let l = l.trim_start();
                !l.is_empty() && !l.starts_with("--")
            });
            let first = first.unwrap_or("").trim().to_owned();
            sink.lock().unwrap_or_else(|e| e.into_inner()).push(first);
        }
    }
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Sql))
            .expect("the only global subscriber in this test binary");
    });
    let sent = Sent::default();
    SINK.with(|s| *s.borrow_mut() = Some(std::sync::Arc::clone(&sent)));
    (sent, Recording)
}

/// A claim of one new key is one plain insert (`claim_fresh.sql`). A claim of an existing
/// key tries it and reads the record (`claim_read.sql`): a duplicate is answered from
/// that; a key the claim can take runs the claim statement as well.
#[tokio::test]
async fn one_fresh_claim_is_one_insert_and_a_duplicates_an_insert_and_a_read() {
    let backend = common::backend().await;
    let (seen, _guard) = statements();
    let lease = acquire(&backend, &claim("fresh-one", RETENTION)).await;
    let sent = std::mem::take(&mut *seen.lock().expect("lock"));
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent[0].starts_with("INSERT INTO"), "{sent:?}");
    assert_eq!((lease.token, lease.attempts), (1, 1));
    assert!(lease.lease_until > idem_core::Timestamp::now(), "{lease:?}");

    backend.release(&lease).await.expect("release");
    seen.lock().expect("lock").clear();
    let again = acquire(&backend, &claim("fresh-one", RETENTION)).await;
    let sent = std::mem::take(&mut *seen.lock().expect("lock"));
    assert_eq!(sent.len(), 3, "{sent:?}");
    assert!(sent[0].starts_with("INSERT INTO"), "{sent:?}");
    assert!(sent[1].starts_with("SELECT"), "{sent:?}");
    assert!(sent[2].starts_with("WITH input"), "{sent:?}");
    assert_eq!(again.token, 2, "the claim statement granted the next token");

    backend
        .complete(&again, Bytes::from_static(b"done"), RETENTION)
        .await
        .expect("complete");
    seen.lock().expect("lock").clear();
    let replay = backend
        .claim(&claim("fresh-one", RETENTION))
        .await
        .expect("claim");
    let sent = std::mem::take(&mut *seen.lock().expect("lock"));
    assert!(
        matches!(&replay, ClaimOutcome::Completed(r) if r.as_ref() == b"done"),
        "{replay:?}"
    );
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent[1].starts_with("SELECT"), "{sent:?}");
}

/// A batch of new keys is one plain insert (`claim_fresh_many.sql`), and a key repeated
/// in it is answered from the record that insert wrote, with no statement of its own. A
/// round of completes is one update (`complete_many.sql`). A batch with a key that exists
/// runs the insert, then the claim statement for that key; after a batch of mostly such
/// keys, the next batch runs the claim statement alone.
#[tokio::test]
async fn a_fresh_batch_is_one_insert_and_its_completes_one_update() {
    let backend = common::backend().await;
    let (seen, _guard) = statements();
    let take = || std::mem::take(&mut *seen.lock().expect("lock"));
    let mut claims: Vec<Claim> = (0..3)
        .map(|i| claim(&format!("fresh-batch{i}"), RETENTION))
        .collect();
    claims.push(claim("fresh-batch0", RETENTION));
    let answers = backend.claim_many(&claims).await.expect("claim_many");
    let sent = take();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent[0].starts_with("INSERT INTO"), "{sent:?}");
    let granted: Vec<idem_core::Lease> = answers[..3]
        .iter()
        .map(|a| match a {
            ClaimOutcome::Acquired(lease) => lease.clone(),
            other => panic!("a fresh key answered {other:?}"),
        })
        .collect();
    assert!(
        granted.iter().all(|l| (l.token, l.attempts) == (1, 1)),
        "{granted:?}"
    );
    match &answers[3] {
        ClaimOutcome::InProgress { lease_until, .. } => {
            assert_eq!(*lease_until, granted[0].lease_until);
        }
        other => panic!("the repeated key answered {other:?}"),
    }

    settle(&backend, granted).await;
    let sent = take();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent[0].starts_with("WITH i AS"), "{sent:?}");

    let claims = [
        claim("fresh-batch0", RETENTION),
        claim("fresh-batch9", RETENTION),
    ];
    let answers = backend.claim_many(&claims).await.expect("claim_many");
    let sent = take();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent[0].starts_with("INSERT INTO"), "{sent:?}");
    assert!(sent[1].starts_with("WITH input"), "{sent:?}");
    assert!(
        matches!(&answers[0], ClaimOutcome::Completed(r) if r.as_ref() == b"done"),
        "{answers:?}"
    );
    assert!(
        matches!(&answers[1], ClaimOutcome::Acquired(_)),
        "{answers:?}"
    );

    // A batch of keys that all exist (a redelivery) pays the insert once; while batches
    // stay so, the next goes straight to the claim statement, and a batch of new keys
    // there switches the insert back on for the batch after it.
    let replays = [
        claim("fresh-batch1", RETENTION),
        claim("fresh-batch2", RETENTION),
    ];
    for expected in [&["INSERT INTO", "WITH input"][..], &["WITH input"][..]] {
        let answers = backend.claim_many(&replays).await.expect("claim_many");
        assert!(
            answers
                .iter()
                .all(|a| matches!(a, ClaimOutcome::Completed(r) if r.as_ref() == b"done")),
            "{answers:?}"
        );
        let sent = take();
        assert_eq!(sent.len(), expected.len(), "{sent:?}");
        for (line, start) in sent.iter().zip(expected) {
            assert!(line.starts_with(start), "{sent:?}");
        }
    }
    for (batch, start) in [("late-a", "WITH input"), ("late-b", "INSERT INTO")] {
        leases(&backend, batch, 2).await;
        let sent = take();
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert!(sent[0].starts_with(start), "{sent:?}");
    }
}

/// A connection listening on the channel the settle triggers notify.
async fn settled_listener(backend: &PgBackend) -> sqlx::postgres::PgListener {
    let mut listener = sqlx::postgres::PgListener::connect_with(backend.pool())
        .await
        .expect("listen connection");
    listener.listen("idem_settled").await.expect("LISTEN");
    listener
}

/// A settle notifies only keys someone watches: a notifying commit takes a database-wide
/// lock until it has flushed, so notifying every settle serialised every complete. The
/// settles of an unwatched and then a watched key reach a listener in commit order; the
/// first notification is the watched key's.
#[tokio::test]
async fn only_watched_keys_are_notified_when_settled() {
    let backend = common::backend().await;
    let mut listener = settled_listener(&backend).await;
    let unwatched = acquire(&backend, &claim("unwatched", RETENTION)).await;
    let watched = acquire(&backend, &claim("watched", RETENTION)).await;
    let _watch = backend.watch(&watched.key).await;
    for lease in [&unwatched, &watched] {
        backend
            .complete(lease, Bytes::from_static(b"r"), RETENTION)
            .await
            .expect("complete");
    }
    let first = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a notification within 10 s")
        .expect("a notification");
    assert!(
        first.payload().ends_with(":ns:watched"),
        "first notification: {}",
        first.payload()
    );
    let waiters = format!("SELECT count(*) FROM \"{}\".idem_waiters", backend.schema());
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(waiters))
        .fetch_one(backend.pool())
        .await
        .expect("count waiters");
    assert_eq!(rows, 1, "one waiter row, for the watched key");
}

/// Only watched records notify (migration 0006): of one batch settle only its watched
/// keys; a release (attempts handed back), not an extend (still Processing, same
/// attempts). A watch marks a record that exists: a key watched before its record existed
/// is not notified, since claims do not look for waiters (the engine watches a key only
/// once a claim found it in progress).
#[tokio::test]
async fn a_batch_settle_notifies_its_watched_keys_and_a_release_but_not_an_extend() {
    let backend = common::backend().await;
    let mut listener = settled_listener(&backend).await;
    let early = Key::new("ns", "early").expect("key");
    let _early_watch = backend.watch(&early).await;
    let early = acquire(&backend, &claim("early", RETENTION)).await;
    let mut leases = Vec::new();
    for id in ["quiet", "batch-watched", "extended", "released", "last"] {
        leases.push(acquire(&backend, &claim(id, RETENTION)).await);
    }
    let [quiet, batch_watched, extended, released, last] = &leases[..] else {
        unreachable!("five leases");
    };
    let mut watches = Vec::new();
    for lease in [batch_watched, extended, released, last] {
        watches.push(backend.watch(&lease.key).await);
    }
    let done = |lease: &idem_core::Lease| idem_core::backend::Settlement {
        lease: lease.clone(),
        settle: idem_core::backend::Settle::Complete(Bytes::from_static(b"r")),
    };
    let answers = backend
        .settle_many(&[done(quiet), done(batch_watched)], RETENTION)
        .await
        .expect("settle_many");
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    backend
        .extend(extended, Duration::from_secs(60))
        .await
        .expect("extend");
    backend.release(released).await.expect("release");
    backend
        .complete(&early, Bytes::from_static(b"r"), RETENTION)
        .await
        .expect("complete");
    backend
        .complete(last, Bytes::from_static(b"r"), RETENTION)
        .await
        .expect("complete");
    let mut seen = Vec::new();
    while seen
        .last()
        .is_none_or(|p: &String| !p.ends_with(":ns:last"))
    {
        let next = tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .expect("a notification within 10 s")
            .expect("a notification");
        seen.push(next.payload().to_owned());
    }
    let ids: Vec<&str> = seen
        .iter()
        .map(|p| p.rsplit(':').next().unwrap_or(""))
        .collect();
    assert_eq!(ids, ["batch-watched", "released", "last"], "{seen:?}");
}
