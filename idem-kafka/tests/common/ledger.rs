//! The ledger of the fault tests: one row per effect of a payment, in a table with no
//! uniqueness (`super::postgres`), and the one check of what it holds.

use std::collections::HashMap;

use idem_core::HandlerError;
use idem_kafka::Message;

/// The payment id of a message: its idempotency key's id.
pub fn payment(msg: &Message) -> Result<String, HandlerError> {
    msg.key()
        .map(|k| k.id().to_owned())
        .ok_or_else(|| HandlerError::permanent("no payment id"))
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
