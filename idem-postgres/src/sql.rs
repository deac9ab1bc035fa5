//! The statements, read from `sql/*.sql` and bound to the configured schema once.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

/// The record columns every read returns, times as milliseconds rounded up (so a lease the
/// database saw as live is live to the client too).
const COLUMNS: &str = "namespace, id, state, owner, token, attempts, claim_kind, \
    ceil(extract(epoch FROM lease_until) * 1000)::int8 AS lease_until_ms, fingerprint, \
    response, error, permanent, ceil(extract(epoch FROM expires_at) * 1000)::int8 AS expires_at_ms";
const LIVE: &str = "(expires_at IS NULL OR expires_at > now())";

/// Whether record `r` is held by the lease with `token` and `owner`: `Processing` under
/// that token and owner, and not expired. The one fencing rule of every settle, extend and
/// lock. The expiry test is written so that no index matches it (`coalesce(…)`, not
/// `expires_at IS NULL OR …`): the keys' primary key is then the only index a statement
/// can find its rows by, which matters for the batch statements' cached generic plans (see
/// `settle_many.sql`).
fn holds(r: &str, token: &str, owner: &str) -> String {
    format!(
        "({r}.state = 'processing' AND {r}.token = {token} AND {r}.owner = {owner} \
         AND coalesce({r}.expires_at > now(), true))"
    )
}

/// The expiry of record `r` as `complete` or `fail` settles it, with retention
/// `retention_ms` (a parameter or a column): `now() + retention`, unless the claim already
/// set `lease_until + retention` and the lease is still live, in which case that later
/// expiry is kept unchanged. Keeping it means
/// the update touches no indexed column, so PostgreSQL can make it a HOT update (no index
/// writes); the record then lives up to one lease longer than `retention` after settling.
fn settled_expiry(retention_ms: &str) -> String {
    let retention = format!("{retention_ms} * interval '1 millisecond'");
    format!(
        "CASE WHEN r.lease_until >= now() AND r.expires_at = r.lease_until + {retention} \
         THEN r.expires_at ELSE now() + {retention} END"
    )
}

/// Whether record `r` is past its retention.
fn expired(r: &str) -> String {
    format!("({r}.expires_at IS NOT NULL AND {r}.expires_at <= now())")
}

/// Whether record `r` is `Processing` under a lease that has lapsed.
fn lapsed(r: &str) -> String {
    format!("({r}.state = 'processing' AND ({r}.lease_until IS NULL OR {r}.lease_until <= now()))")
}

/// Whether record `r` may be claimed by claim `c` (which has `fingerprint` and a
/// `max_attempts` of at least 1): the claimable cases of `idem_core::backend::machine::claim`,
/// including a lapsed lease with no attempts left, which the claim turns failed.
fn claimable(r: &str, c: &str) -> String {
    format!(
        "({expired} OR (({r}.fingerprint IS NULL OR {c}.fingerprint IS NULL \
         OR {r}.fingerprint = {c}.fingerprint) AND (({r}.state = 'failed' AND NOT {r}.permanent \
         AND {r}.attempts < {c}.max_attempts) OR {lapsed})))",
        expired = expired(r),
        lapsed = lapsed(r),
    )
}

/// Makes the claim's commit asynchronous (transactional mode; see `claim_async`).
const ASYNC_COMMIT: &str =
    ", (SELECT set_config('synchronous_commit', 'off', true)) AS commit_mode";
/// The same for `claim_fresh.sql`, whose `RETURNING` list takes no subquery: run for the
/// row it returns, so before the commit, as the claim's is.
const ASYNC_COMMIT_RETURNING: &str =
    ", set_config('synchronous_commit', 'off', true) AS commit_mode";

/// One statement's text.
#[derive(Debug, Clone)]
pub(crate) struct Stmt(Arc<str>);

impl Stmt {
    fn new(template: &str, schema: &str) -> Self {
        let poison = format!(
            "(NOT {} AND {} AND r.attempts >= excluded.max_attempts)",
            expired("r"),
            lapsed("r")
        );
        let text = template
            .replace("{poison}", &poison)
            .replace("{expired_r}", &expired("r"))
            .replace("{claimable_existing}", &claimable("r", "excluded"))
            .replace("{claimable_current}", &claimable("c", "i"))
            .replace("{columns}", COLUMNS)
            .replace("{live}", LIVE)
            .replace("{holds}", &holds("r", "$3", "$4"))
            .replace("{holds_batch}", &holds("r", "i.token", "i.owner"))
            .replace("{settled_expiry_6}", &settled_expiry("$6"))
            .replace("{settled_expiry_7}", &settled_expiry("$7"))
            .replace("{settled_expiry_batch}", &settled_expiry("i.retention_ms"))
            .replace("{schema}", schema);
        Stmt(text.into())
    }

    /// For `sqlx::query`: the text is ours, with only the checked schema name put in.
    pub(crate) fn sql(&self) -> AssertSqlSafe<Arc<str>> {
        AssertSqlSafe(Arc::clone(&self.0))
    }
}

const CLAIM: &str = include_str!("../sql/claim.sql");
const SETTLE: &str = include_str!("../sql/settle_many.sql");
const FRESH: &str = include_str!("../sql/claim_fresh.sql");
const FRESH_MANY: &str = include_str!("../sql/claim_fresh_many.sql");

/// The claims of `claim.sql` as arrays, one element per claim.
const INPUT_MANY: &str = "SELECT namespace, id, owner, ttl_ms, fingerprint, \
    greatest(max_attempts, 1) AS max_attempts, retention_ms \
    FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::bytea[], $6::int4[], \
    $7::int8[]) AS u (namespace, id, owner, ttl_ms, fingerprint, max_attempts, retention_ms)";

/// One claim as scalars. Arrays hide their length from the planner; scalars also spare the
/// unnest (measured with pgbench: 6% more single claims per second).
const INPUT_ONE: &str = "SELECT $1::text AS namespace, $2::text AS id, $3::text AS owner, \
    $4::int8 AS ttl_ms, $5::bytea AS fingerprint, greatest($6::int4, 1) AS max_attempts, \
    $7::int8 AS retention_ms";

/// The claim statement for a batch and for one claim, and the inserts tried first for one
/// claim and for a batch, with the same commit mode.
#[derive(Debug)]
pub(crate) struct ClaimStmt {
    pub many: Stmt,
    pub one: Stmt,
    pub fresh: Stmt,
    pub fresh_many: Stmt,
}

impl ClaimStmt {
    fn new((commit_mode, returning): (&str, &str), schema: &str) -> Self {
        let claim = CLAIM.replace("{commit_mode}", commit_mode);
        ClaimStmt {
            many: Stmt::new(&claim.replace("{input}", INPUT_MANY), schema),
            one: Stmt::new(&claim.replace("{input}", INPUT_ONE), schema),
            fresh: Stmt::new(&FRESH.replace("{commit_mode}", returning), schema),
            fresh_many: Stmt::new(&FRESH_MANY.replace("{commit_mode}", returning), schema),
        }
    }
}

/// Every statement the backend runs.
#[derive(Debug)]
pub(crate) struct Statements {
    pub claim: ClaimStmt,
    /// The claim with an asynchronous commit, for transactional mode: the main
    /// transaction's synchronous commit flushes the WAL past it anyway, so only a server
    /// crash before that commit can lose it, and then the handler's work is lost too.
    pub claim_async: ClaimStmt,
    pub complete_with_offset: Stmt,
    pub complete: Stmt,
    pub settle_many: Stmt,
    /// `settle_many` for a round of completes only.
    pub complete_many: Stmt,
    /// `settle_many` that also stores an offset (batch transactional mode).
    pub settle_batch: Stmt,
    pub lock_batch: Stmt,
    /// One key's record and the clock, for a claim whose insert found the key.
    pub claim_read: Stmt,
    pub release: Stmt,
    pub fail: Stmt,
    pub extend: Stmt,
    pub get: Stmt,
    pub delete: Stmt,
    pub purge: Stmt,
    pub purge_waiters: Stmt,
    pub wait: Stmt,
    pub list: Stmt,
    pub store_offset: Stmt,
    pub offsets: Stmt,
    pub delete_offsets: Stmt,
}

impl Statements {
    /// The statements for `schema`, an already quoted identifier.
    pub fn new(schema: &str) -> Self {
        let s = |t: &str| Stmt::new(t, schema);
        Statements {
            claim: ClaimStmt::new(("", ""), schema),
            claim_async: ClaimStmt::new((ASYNC_COMMIT, ASYNC_COMMIT_RETURNING), schema),
            complete_with_offset: s(include_str!("../sql/complete_with_offset.sql")),
            complete: s(include_str!("../sql/complete.sql")),
            settle_many: s(&SETTLE.replace("{offset}", "")),
            complete_many: s(include_str!("../sql/complete_many.sql")),
            settle_batch: s(&SETTLE.replace("{offset}", include_str!("../sql/batch_offset.sql"))),
            lock_batch: s(include_str!("../sql/lock_batch.sql")),
            claim_read: s(include_str!("../sql/claim_read.sql")),
            release: s(include_str!("../sql/release.sql")),
            fail: s(include_str!("../sql/fail.sql")),
            extend: s(include_str!("../sql/extend.sql")),
            get: s(include_str!("../sql/get.sql")),
            delete: s(include_str!("../sql/delete.sql")),
            purge: s(include_str!("../sql/purge.sql")),
            purge_waiters: s(include_str!("../sql/purge_waiters.sql")),
            wait: s(include_str!("../sql/wait.sql")),
            list: s(include_str!("../sql/list.sql")),
            store_offset: s(include_str!("../sql/store_offset.sql")),
            offsets: s(include_str!("../sql/offsets.sql")),
            delete_offsets: s(include_str!("../sql/delete_offsets.sql")),
        }
    }
}
