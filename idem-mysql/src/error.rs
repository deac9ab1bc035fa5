//! Maps sqlx errors to idem's error kinds.

use idem_core::Error;

/// MySQL error numbers.
pub(crate) mod code {
    /// `ER_DUP_ENTRY`: an insert met a key a concurrent transaction inserted first.
    pub const DUPLICATE: u16 = 1062;
    /// `ER_LOCK_DEADLOCK`: InnoDB rolled the transaction back to break a deadlock.
    pub const DEADLOCK: u16 = 1213;
    /// `ER_LOCK_WAIT_TIMEOUT`.
    pub const LOCK_WAIT: u16 = 1205;
    /// `ER_NO_SUCH_TABLE`.
    pub const NO_TABLE: u16 = 1146;
    /// `ER_BAD_DB_ERROR`.
    pub const NO_DATABASE: u16 = 1049;
}

/// The server's error number of `e`, if it is a server error.
pub(crate) fn number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|m| m.number()),
        _ => None,
    }
}

/// Whether running the whole transaction again may succeed: a deadlock, a lock wait
/// timeout, or a duplicate key from a concurrent first insert.
pub(crate) fn retryable(e: &sqlx::Error) -> bool {
    matches!(
        number(e),
        Some(code::DUPLICATE | code::DEADLOCK | code::LOCK_WAIT)
    )
}

/// Maps a driver error: unreachable, timed out and server errors are `Unavailable`
/// (retryable); a value that does not decode is `Corrupt`; missing tables are `Config`.
pub(crate) fn map(what: &str, e: sqlx::Error) -> Error {
    match &e {
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_) => Error::Corrupt {
            message: format!("{what}: a row does not decode"),
            source: Some(Box::new(e)),
        },
        sqlx::Error::Configuration(_) => Error::Config {
            message: format!("{what}: bad MySQL configuration"),
            source: Some(Box::new(e)),
        },
        sqlx::Error::Database(db) => {
            let n = number(&e);
            if matches!(n, Some(code::NO_TABLE | code::NO_DATABASE)) {
                return Error::Config {
                    message: format!(
                        "{what}: idem's tables are missing; run MySqlBackend::migrate"
                    ),
                    source: Some(Box::new(e)),
                };
            }
            let message = format!(
                "{what}: MySQL error {} ({})",
                n.map_or_else(|| "?".to_owned(), |n| n.to_string()),
                db.message()
            );
            Error::Unavailable {
                message,
                source: Some(Box::new(e)),
            }
        }
        _ => Error::Unavailable {
            message: format!("{what}: MySQL unreachable or failing"),
            source: Some(Box::new(e)),
        },
    }
}

/// Runs `fut` within `limit` (idem-core's one timeout): its error mapped by [`map`], a
/// timeout `Unavailable`.
pub(crate) async fn within<T>(
    what: &str,
    limit: std::time::Duration,
    fut: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> idem_core::Result<T> {
    idem_core::layer::within(what, limit, async { fut.await.map_err(|e| map(what, e)) }).await
}
