//! Maps sqlx errors to idem's error kinds.

use idem_core::{Error, Refusal};

/// MySQL error numbers.
pub(crate) mod code {
    /// `ER_DUP_ENTRY`: an insert met a key a concurrent transaction inserted first.
    pub const DUPLICATE: u16 = 1062;
    /// `ER_LOCK_DEADLOCK`: InnoDB rolled the transaction back to break a deadlock.
    pub const DEADLOCK: u16 = 1213;
    /// `ER_LOCK_WAIT_TIMEOUT`.
    pub const LOCK_WAIT: u16 = 1205;
    /// `ER_CANT_DROP_FIELD_OR_KEY`: a concurrent migration dropped the index first.
    pub const NO_SUCH_INDEX: u16 = 1091;
    /// `ER_NO_SUCH_TABLE`.
    pub const NO_TABLE: u16 = 1146;
    /// `ER_BAD_DB_ERROR`.
    pub const NO_DATABASE: u16 = 1049;
    /// `ER_ACCESS_DENIED_ERROR`: a wrong user or password, and also MariaDB's answer to a
    /// plaintext login when it requires TLS.
    pub const ACCESS_DENIED: u16 = 1045;
    /// `ER_SECURE_TRANSPORT_REQUIRED` (MySQL): the server accepts only TLS connections.
    pub const SECURE_TRANSPORT_REQUIRED: u16 = 3159;
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

/// Maps an error of the first connection to `server` (`host:port`), made at start. A
/// refusal that no retry cures is [`Error::Refused`], saying which: a wrong user or
/// password, a server certificate not trusted, or TLS on one side only. TLS settings that
/// cannot be used (an unreadable CA file) are `Config`; anything else is [`map`]'s.
/// `plaintext`: the URL turned TLS off (`ssl-mode=DISABLED`).
pub(crate) fn first_contact(what: &str, server: &str, plaintext: bool, e: sqlx::Error) -> Error {
    let refusal = match &e {
        sqlx::Error::Database(db) => match number(&e) {
            // MariaDB answers a plaintext login to a server that requires TLS this way too.
            Some(code::ACCESS_DENIED) if plaintext => Some((
                Refusal::Authentication,
                format!(
                    "{}; or the server requires TLS, which ssl-mode=DISABLED turned off",
                    db.message()
                ),
            )),
            Some(code::ACCESS_DENIED) => Some((Refusal::Authentication, db.message().to_owned())),
            Some(code::SECURE_TRANSPORT_REQUIRED) => Some((
                Refusal::TlsMismatch,
                "the server accepts only TLS connections: use ssl-mode=VERIFY_IDENTITY \
                 (or REQUIRED)"
                    .to_owned(),
            )),
            _ => None,
        },
        sqlx::Error::Tls(inner) if inner.to_string().contains("does not support TLS") => Some((
            Refusal::TlsMismatch,
            "the server does not offer TLS, and the URL's ssl-mode requires it".to_owned(),
        )),
        sqlx::Error::Tls(_) => {
            return Error::Config {
                message: format!("{what}: TLS could not be set up"),
                source: Some(Box::new(e)),
            };
        }
        other => untrusted(other).map(|why| {
            let advice = format!(
                "the server's certificate does not verify ({why}): \
                 name the CA that signed it with ssl-ca=<file>"
            );
            (Refusal::UntrustedCertificate, advice)
        }),
    };
    match refusal {
        Some((why, message)) => Error::refused(server, why, format!("MySQL: {message}"), e),
        None => map(what, e),
    }
}

/// Why the server's certificate was refused, if that is what `e` is (without TLS there is
/// no certificate to refuse).
fn untrusted(e: &sqlx::Error) -> Option<String> {
    #[cfg(feature = "tls")]
    return idem_core::backend::tls::untrusted_certificate(e);
    #[cfg(not(feature = "tls"))]
    {
        let _ = e;
        None
    }
}
