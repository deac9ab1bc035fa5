//! The statements, read from `sql/*.sql` and bound to the configured schema once.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

/// The record columns every read returns, times as milliseconds rounded up (so a lease the
/// database saw as live is live to the client too).
const COLUMNS: &str = "namespace, id, state, owner, token, attempts, claim_kind, \
    ceil(extract(epoch FROM lease_until) * 1000)::int8 AS lease_until_ms, fingerprint, \
    response, error, permanent, ceil(extract(epoch FROM expires_at) * 1000)::int8 AS expires_at_ms";
const LIVE: &str = "(expires_at IS NULL OR expires_at > now())";
const HOLDS: &str = "state = 'processing' AND token = $3 AND owner = $4 \
    AND (expires_at IS NULL OR expires_at > now())";
const POISON: &str = "(NOT {expired} AND {lapsed} AND r.attempts >= excluded.max_attempts)";
const EXPIRED: &str = "(r.expires_at IS NOT NULL AND r.expires_at <= now())";
const LAPSED: &str =
    "(r.state = 'processing' AND (r.lease_until IS NULL OR r.lease_until <= now()))";

/// One statement's text.
#[derive(Debug, Clone)]
pub(crate) struct Stmt(Arc<str>);

impl Stmt {
    fn new(template: &str, schema: &str) -> Self {
        let text = template
            .replace("{poison}", POISON)
            .replace("{expired}", EXPIRED)
            .replace("{lapsed}", LAPSED)
            .replace("{columns}", COLUMNS)
            .replace("{live}", LIVE)
            .replace("{holds}", HOLDS)
            .replace("{schema}", schema);
        Stmt(text.into())
    }

    /// For `sqlx::query`: the text is ours, with only the checked schema name put in.
    pub(crate) fn sql(&self) -> AssertSqlSafe<Arc<str>> {
        AssertSqlSafe(Arc::clone(&self.0))
    }
}

/// Every statement the backend runs.
#[derive(Debug)]
pub(crate) struct Statements {
    pub claim: Stmt,
    pub complete: Stmt,
    pub fail: Stmt,
    pub extend: Stmt,
    pub get: Stmt,
    pub delete: Stmt,
    pub purge: Stmt,
    pub list: Stmt,
    pub store_offset: Stmt,
    pub offsets: Stmt,
}

impl Statements {
    /// The statements for `schema`, an already quoted identifier.
    pub fn new(schema: &str) -> Self {
        let s = |t: &str| Stmt::new(t, schema);
        Statements {
            claim: s(include_str!("../sql/claim.sql")),
            complete: s(include_str!("../sql/complete.sql")),
            fail: s(include_str!("../sql/fail.sql")),
            extend: s(include_str!("../sql/extend.sql")),
            get: s(include_str!("../sql/get.sql")),
            delete: s(include_str!("../sql/delete.sql")),
            purge: s(include_str!("../sql/purge.sql")),
            list: s(include_str!("../sql/list.sql")),
            store_offset: s(include_str!("../sql/store_offset.sql")),
            offsets: s(include_str!("../sql/offsets.sql")),
        }
    }
}
