//! Maps sqlx errors to idem's error kinds.

use idem_core::Error;

/// SQLSTATE codes that mean "try again": serialization failure, deadlock, lock not
/// available, query cancelled (statement timeout), too many connections, and the
/// connection-exception class.
fn transient(code: &str) -> bool {
    matches!(
        code,
        "40001" | "40P01" | "55P03" | "57014" | "53300" | "57P01" | "57P03"
    ) || code.starts_with("08")
}

/// Maps a driver error: unreachable, timed out and transient server errors are
/// `Unavailable` (retryable); a value that does not decode is `Corrupt`.
pub(crate) fn map(what: &str, e: sqlx::Error) -> Error {
    match &e {
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_) => Error::Corrupt {
            message: format!("{what}: a row does not decode"),
            source: Some(Box::new(e)),
        },
        sqlx::Error::Configuration(_) => Error::Config {
            message: format!("{what}: bad PostgreSQL configuration"),
            source: Some(Box::new(e)),
        },
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            if code == "42P01" || code == "3F000" {
                return Error::Config {
                    message: format!("{what}: idem's tables are missing; run PgBackend::migrate"),
                    source: Some(Box::new(e)),
                };
            }
            let message = if transient(&code) {
                format!("{what}: transient PostgreSQL error {code}, retry")
            } else {
                format!("{what}: PostgreSQL error {code}")
            };
            Error::Unavailable {
                message,
                source: Some(Box::new(e)),
            }
        }
        _ => Error::Unavailable {
            message: format!("{what}: PostgreSQL unreachable or failing"),
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
