//! The ledger of the fault tests: one row per effect of a payment, in a table with no
//! uniqueness (`super::postgres`), the payments, the consumers that apply them, and the one
//! check of what the ledger holds.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Backend, HandlerError, Transactional};
use idem_kafka::{ConsumerBuilder, Message};
use idem_postgres::PgBackend;

use super::Out;

/// The payment id of a message: its idempotency key's id.
pub fn payment(msg: &Message) -> Result<String, HandlerError> {
    msg.idempotency_key()
        .map(|k| k.id().to_owned())
        .ok_or_else(|| HandlerError::permanent("no payment id"))
}

/// `n` payments (`pay-0` …) in the order sent: payment `i` on partition `i % partitions`,
/// every `duplicate_every`th sent twice, the copy on another partition, anywhere in the
/// stream.
pub fn payments(n: usize, duplicate_every: usize, partitions: i32) -> Vec<Out> {
    let out = |id: &str, partition: usize| Out {
        partition: Some(i32::try_from(partition).expect("partition")),
        key: Some(id.as_bytes().to_vec()),
        payload: format!(r#"{{"id":"{id}"}}"#).into_bytes(),
        headers: vec![("idempotency-key".into(), id.as_bytes().to_vec())],
    };
    let parts = usize::try_from(partitions).expect("partitions");
    let mut outs: Vec<Out> = (0..n)
        .map(|i| out(&format!("pay-{i}"), i % parts))
        .collect();
    for i in (0..n).step_by(duplicate_every) {
        let other = (i + fastrand::usize(1..parts)) % parts;
        outs.insert(
            fastrand::usize(..=outs.len()),
            out(&format!("pay-{i}"), other),
        );
    }
    outs
}

/// How a fault test's consumers apply payments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// PostgreSQL transactional mode: the ledger row in the handler's transaction.
    Transactional,
    /// Redis lease mode (`IDEM_REDIS_URL`): the ledger row committed on its own before the
    /// handler returns.
    Lease,
}

impl Mode {
    /// The store and mode, for a table row.
    pub fn label(self) -> &'static str {
        match self {
            Mode::Transactional => "PostgreSQL transactional",
            Mode::Lease => "Redis lease",
        }
    }
}

/// `builder`, a consumer of `group`, made to apply payments to `ledger` in `mode`: one row
/// per effect with the lease's token and claim kind and `instance`. The store is
/// `ledger_db` in transactional mode; in lease mode Redis, in keys the consumers of `group`
/// share. Each handler holds its lease `hold(payment)` longer after its effect. Leases of
/// 5 s, 3 attempts.
pub async fn payer(
    builder: ConsumerBuilder,
    mode: Mode,
    group: &str,
    ledger_db: &PgBackend,
    ledger: &str,
    instance: u32,
    hold: impl Fn(&str) -> Duration + Clone + Send + Sync + 'static,
) -> ConsumerBuilder {
    let insert =
        format!("INSERT INTO {ledger} (payment, token, instance, kind) VALUES ($1, $2, $3, $4)");
    let instance = i32::try_from(instance).expect("instance");
    let lease = Duration::from_secs(5);
    match mode {
        Mode::Transactional => {
            let engine = super::engine(Arc::new(ledger_db.clone()), "tx", lease);
            builder
                .engine(engine)
                .transactional(ledger_db.clone(), move |msg, tx, lease| {
                    let (insert, hold) = (insert.clone(), hold.clone());
                    Box::pin(async move {
                        let id = payment(&msg)?;
                        sqlx::query(sqlx::AssertSqlSafe(insert))
                            .bind(&id)
                            .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
                            .bind(instance)
                            .bind(format!("{:?}", lease.kind))
                            .execute(&mut **tx)
                            .await?;
                        pause(hold(&id)).await;
                        Ok(bytes::Bytes::from(format!("paid {id}")))
                    })
                })
        }
        Mode::Lease => {
            let url = idem_conformance::service_env("IDEM_REDIS_URL");
            let prefix = format!("idem-payer:{group}:");
            let redis = idem_redis::RedisBackend::connect(
                idem_redis::RedisConfig::new(url).with_prefix(prefix),
            )
            .await
            .expect("connect to IDEM_REDIS_URL");
            let store: Arc<dyn Backend> = Arc::new(redis);
            let engine = super::engine(store, &format!("w{instance}"), lease);
            let pool = ledger_db.pool().clone();
            builder.engine(engine).handler(move |msg, ctx| {
                let (insert, pool, hold) = (insert.clone(), pool.clone(), hold.clone());
                async move {
                    let id = payment(&msg)?;
                    let ctx = ctx.ok_or_else(|| HandlerError::permanent("no lease"))?;
                    sqlx::query(sqlx::AssertSqlSafe(insert))
                        .bind(&id)
                        .bind(i64::try_from(ctx.token()).unwrap_or(i64::MAX))
                        .bind(instance)
                        .bind(format!("{:?}", ctx.kind()))
                        .execute(&pool)
                        .await
                        .map_err(|e| HandlerError::retry(format!("ledger: {e}")))?;
                    pause(hold(&id)).await;
                    Ok(bytes::Bytes::from(format!("paid {id}")))
                }
            })
        }
    }
}

/// Sleeps `d` unless it is zero.
async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// The end of a fault run: in transactional mode the offsets `db` stores for `group`
/// reach `ends` (partition `i` at `ends[i]`); then [`check`].
#[allow(clippy::too_many_arguments)]
pub async fn check_run(
    db: &PgBackend,
    ledger: &str,
    group: &str,
    topic: &str,
    ends: &[i64],
    payments: usize,
    transactional: bool,
    label: &str,
) -> Tally {
    if transactional {
        let stored: BTreeMap<i32, i64> = db
            .stored_offsets(group)
            .await
            .expect("stored offsets")
            .into_iter()
            .filter(|s| s.topic == topic)
            .map(|s| (s.partition, s.next_offset))
            .collect();
        let want: BTreeMap<i32, i64> = (0..).zip(ends.iter().copied()).collect();
        assert_eq!(stored, want, "{label}: offsets stored in PostgreSQL");
    }
    check(db.pool(), ledger, payments, transactional, label).await
}

/// What the ledger held.
#[derive(Debug, Default)]
pub struct Tally {
    pub effects: usize,
    pub doubles: usize,
    /// Effects whose claim took over a lapsed lease.
    pub takeovers: usize,
}

/// Checks the ledger of a run of `payments` payments (`pay-0` …): every payment applied
/// and none outside the run; with `exactly_once`, each once; otherwise each later effect
/// of a payment (in the order written) under a higher token than the one before, from a
/// takeover. Each double is printed.
pub async fn check(
    pool: &sqlx::PgPool,
    ledger: &str,
    payments: usize,
    exactly_once: bool,
    label: &str,
) -> Tally {
    let q = format!("SELECT payment, token, kind FROM {ledger} ORDER BY seq");
    let rows: Vec<(String, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(q))
        .fetch_all(pool)
        .await
        .expect("read the ledger");
    let mut by_id: HashMap<String, Vec<(i64, String)>> = HashMap::new();
    for (id, token, kind) in rows {
        by_id.entry(id).or_default().push((token, kind));
    }
    let lost: Vec<String> = (0..payments)
        .map(|i| format!("pay-{i}"))
        .filter(|id| !by_id.contains_key(id))
        .collect();
    assert!(lost.is_empty(), "{label}: payments lost: {lost:?}");
    assert_eq!(by_id.len(), payments, "{label}: no payment outside the run");
    let mut tally = Tally::default();
    for (id, effects) in &by_id {
        tally.effects += effects.len();
        tally.doubles += effects.len() - 1;
        tally.takeovers += effects.iter().filter(|e| e.1 == "Takeover").count();
        if exactly_once {
            assert_eq!(
                effects.len(),
                1,
                "{label}: {id} applied more than once: {effects:?}"
            );
        }
        if effects.len() > 1 {
            eprintln!("{label}: {id} applied under (token, kind) {effects:?}");
        }
        for pair in effects.windows(2) {
            let ((earlier, _), (later, kind)) = (&pair[0], &pair[1]);
            assert!(
                later > earlier && kind == "Takeover",
                "{label}: {id}: a double effect without a takeover under a higher token: \
                 {effects:?}"
            );
        }
    }
    tally
}
