//! Maps sqlx errors to idem's error kinds.

use idem_core::{Error, Refusal};

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

/// Maps an error of the first connection to `server` (`host:port`), made at start. A
/// refusal that no retry cures is [`Error::Refused`], saying which: a wrong user or
/// password, a server certificate not trusted, or TLS on one side only. TLS settings that
/// cannot be used (an unreadable CA file) are `Config`; anything else is [`map`]'s.
pub(crate) fn first_contact(what: &str, server: &str, e: sqlx::Error) -> Error {
    let refusal = match &e {
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("28P01") => Some((Refusal::Authentication, db.message().to_owned())),
            Some("28000") if db.message().contains("no encryption") => Some((
                Refusal::TlsMismatch,
                "the server accepts only TLS connections: use sslmode=verify-full (or require)"
                    .to_owned(),
            )),
            // No pg_hba.conf line lets this user in from here (over this transport).
            Some("28000") => Some((Refusal::Authentication, db.message().to_owned())),
            _ => None,
        },
        sqlx::Error::Tls(inner) if inner.to_string().contains("does not support TLS") => Some((
            Refusal::TlsMismatch,
            "the server does not offer TLS, and the URL's sslmode requires it".to_owned(),
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
                 name the CA that signed it with sslrootcert=<file>"
            );
            (Refusal::UntrustedCertificate, advice)
        }),
    };
    match refusal {
        Some((why, message)) => Error::refused(server, why, format!("PostgreSQL: {message}"), e),
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
