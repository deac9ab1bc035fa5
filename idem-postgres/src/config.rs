//! How to reach PostgreSQL and where idem's tables live.

use std::fmt;
use std::time::Duration;

use idem_core::Error;
use idem_core::backend::driver::redact;

/// Connection and naming settings for [`PgBackend`](crate::PgBackend).
///
/// `Debug` never shows the password.
#[derive(Clone)]
pub struct PgConfig {
    /// A `postgres://user:password@host:port/database` URL.
    pub url: String,
    /// The schema holding `idem_records` and `idem_offsets` (default `idem`). Two services
    /// sharing one database give each its own schema.
    pub schema: String,
    /// The pool's size (default 16; 0 is a configuration error).
    pub max_connections: u32,
    /// How long to wait for a connection from the pool or the server (default 5 s).
    pub connect_timeout: Duration,
    /// The largest response `complete` accepts (default 64 KiB).
    pub max_response_bytes: usize,
    /// Rows deleted per `purge_expired` batch (default 1,000).
    pub purge_batch: i64,
    /// The `application_name` the connections report in `pg_stat_activity` (default `idem`).
    pub application_name: String,
}

impl PgConfig {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        PgConfig {
            url: url.into(),
            schema: "idem".into(),
            max_connections: 16,
            connect_timeout: Duration::from_secs(5),
            max_response_bytes: 64 * 1024,
            purge_batch: 1000,
            application_name: "idem".into(),
        }
    }

    /// Sets the schema.
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Sets the pool size.
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets the connect timeout.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = idem_core::clock::capped(timeout);
        self
    }

    /// Sets the application name shown in `pg_stat_activity`.
    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = name.into();
        self
    }

    /// Sets the largest response `complete` accepts.
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// The schema as a quoted SQL identifier, after checking it is a plain lower-case name
    /// (letters, digits, `_`, at most 63 bytes): the one name idem puts into SQL text.
    pub(crate) fn quoted_schema(&self) -> Result<String, Error> {
        let s = &self.schema;
        let plain = !s.is_empty()
            && s.len() <= 63
            && s.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !plain {
            return Err(Error::config(format!(
                "schema {s:?} must be lower-case letters, digits and _, at most 63 bytes"
            )));
        }
        Ok(format!("\"{s}\""))
    }

    /// The URL with any password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact(&self.url)
    }
}

impl fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgConfig")
            .field("url", &self.redacted_url())
            .field("schema", &self.schema)
            .field("max_connections", &self.max_connections)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("purge_batch", &self.purge_batch)
            .field("application_name", &self.application_name)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_password() {
        let c = PgConfig::new("postgres://app:s3cret-pw@db.local:5432/orders");
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(shown.contains("app:***@db.local"), "{shown}");
    }

    #[test]
    fn schema_names_are_checked() {
        assert_eq!(PgConfig::new("x").quoted_schema().unwrap(), "\"idem\"");
        for bad in ["", "Idem", "a-b", "x\"; drop table t; --", "1abc"] {
            let res = PgConfig::new("x").with_schema(bad).quoted_schema();
            assert!(matches!(res, Err(Error::Config { .. })), "{bad}: {res:?}");
        }
    }
}
