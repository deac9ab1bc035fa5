//! How to reach MySQL or MariaDB and where idem's tables live.

use std::fmt;
use std::time::Duration;

use idem_core::Error;
use idem_core::backend::driver::redact;

/// Connection and naming settings for [`MySqlBackend`](crate::MySqlBackend).
///
/// `Debug` never shows the password.
#[derive(Clone)]
pub struct MySqlConfig {
    url: String,
    schema: Option<String>,
    max_connections: u32,
    connect_timeout: Duration,
    query_timeout: Duration,
    max_response_bytes: usize,
    purge_batch: u32,
}

impl MySqlConfig {
    /// The default bound on getting a connection, from the pool or the server.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    /// The default bound on one call (one transaction of a claim or a settle, the wait for
    /// its connection included).
    pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(10);

    /// Defaults for `url`, a `mysql://user:password@host:port/database` URL.
    pub fn new(url: impl Into<String>) -> Self {
        MySqlConfig {
            url: url.into(),
            schema: None,
            max_connections: 16,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            query_timeout: Self::DEFAULT_QUERY_TIMEOUT,
            max_response_bytes: 64 * 1024,
            purge_batch: 1000,
        }
    }

    /// The schema (in MySQL, a database) holding `idem_records` and `idem_offsets`. By
    /// default the tables live in the URL's database; with a schema,
    /// [`MySqlBackend::migrate`](crate::MySqlBackend::migrate) creates it (which needs the
    /// `CREATE` privilege on it). Two services sharing one server give each its own.
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The pool's size (default 16; 0 is a configuration error).
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// How long to wait for a connection, from the pool or the server (default 5 s).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = idem_core::clock::capped(timeout);
        self
    }

    /// How long one call may take, its wait for a pooled connection included (default
    /// 10 s); a call over it is `Unavailable`, its effect unknown.
    pub fn with_query_timeout(mut self, timeout: Duration) -> Self {
        self.query_timeout = idem_core::clock::capped(timeout);
        self
    }

    /// The largest response `complete` accepts (default 64 KiB). The server's
    /// `max_allowed_packet` must hold a batch of them.
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// Rows per chunk of `purge_expired`'s walk of the table: each chunk is one read and one
    /// delete, which scans and locks no more than it (default 1,000; at least 1).
    pub fn with_purge_batch(mut self, rows: u32) -> Self {
        self.purge_batch = rows.max(1);
        self
    }

    /// The URL as given (with its password: see [`MySqlConfig::redacted_url`]).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The schema, if one is set (else the URL's database holds the tables).
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The pool's size.
    pub fn max_connections(&self) -> u32 {
        self.max_connections
    }

    /// The bound on getting a connection.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The bound on one call.
    pub fn query_timeout(&self) -> Duration {
        self.query_timeout
    }

    /// The largest response `complete` accepts.
    pub fn max_response_bytes(&self) -> usize {
        self.max_response_bytes
    }

    /// Rows per chunk of `purge_expired`'s walk.
    pub fn purge_batch(&self) -> u32 {
        self.purge_batch
    }

    /// The URL with any password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact(&self.url)
    }

    /// The schema as a quoted identifier, after checking it is a plain lower-case name
    /// (letters, digits, `_`, at most 64 bytes): the one name idem puts into SQL text.
    pub(crate) fn quoted_schema(&self) -> Result<Option<String>, Error> {
        let Some(s) = &self.schema else {
            return Ok(None);
        };
        let plain = !s.is_empty()
            && s.len() <= 64
            && s.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !plain {
            return Err(Error::config(format!(
                "schema {s:?} must be lower-case letters, digits and _, at most 64 bytes"
            )));
        }
        Ok(Some(format!("`{s}`")))
    }
}

impl fmt::Debug for MySqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlConfig")
            .field("url", &self.redacted_url())
            .field("schema", &self.schema)
            .field("max_connections", &self.max_connections)
            .field("connect_timeout", &self.connect_timeout)
            .field("query_timeout", &self.query_timeout)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("purge_batch", &self.purge_batch)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_password() {
        let c = MySqlConfig::new("mysql://app:s3cret-pw@db.local:3306/orders");
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(shown.contains("app:***@db.local"), "{shown}");
    }

    #[test]
    fn schema_names_are_checked() {
        assert_eq!(MySqlConfig::new("x").quoted_schema().unwrap(), None);
        let idem = MySqlConfig::new("x").with_schema("idem").quoted_schema();
        assert_eq!(idem.unwrap().as_deref(), Some("`idem`"));
        for bad in ["", "Idem", "a-b", "x`; drop table t; --", "1abc"] {
            let res = MySqlConfig::new("x").with_schema(bad).quoted_schema();
            assert!(matches!(res, Err(Error::Config { .. })), "{bad}: {res:?}");
        }
    }
}
