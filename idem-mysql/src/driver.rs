//! The driver: `mysql://` URLs for tools that know only a URL (the `idem` CLI, benches).

use std::sync::Arc;

use idem_core::backend::async_trait;
use idem_core::backend::driver::{self, Driver, Options, RawWrite, Store};
use idem_core::{Backend, Bytes, Error, Result};
use sqlx::AssertSqlSafe;

use crate::{MySqlBackend, MySqlConfig};

/// The MySQL driver: `mysql://user[:password]@host[:port]/db[?schema=s]` (also
/// `mariadb://`); other parameters go to the driver (`ssl-mode`, …). Without `schema` the
/// tables live in the URL's database. Isolation is a schema (a database) of its own,
/// `idem_<tag>`, migrated at open and dropped by [`Store::close`].
pub static DRIVER: MySqlDriver = MySqlDriver;

/// See [`DRIVER`].
#[derive(Debug)]
pub struct MySqlDriver;

/// The parameters of a URL: the driver's `schema`, and those sqlx-mysql reads
/// (`MySqlConnectOptions::parse_from_url`), each spelling it takes.
const PARAMS: &[&str] = &[
    "schema",
    "sslmode",
    "ssl-mode",
    "sslca",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "charset",
    "collation",
    "statement-cache-capacity",
    "socket",
    "timezone",
    "time-zone",
];

/// A checked URL: without `schema`, and the schema if given.
fn parse(text: &str) -> Result<(String, Option<String>)> {
    let text = text.trim();
    let bad = |reason: String| Error::config(reason);
    if text.contains(',') {
        return Err(bad("one MySQL URL only".into()));
    }
    let mut url = url::Url::parse(text).map_err(|e| bad(e.to_string()))?;
    if !DRIVER.schemes().contains(&url.scheme()) {
        return Err(bad(format!("not a MySQL URL ({})", DRIVER.usage())));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host".into()));
    }
    driver::check_params(&url, PARAMS)?;
    let schema = driver::take_param(&mut url, "schema");
    Ok((url.to_string(), schema))
}

#[async_trait]
impl Driver for MySqlDriver {
    fn name(&self) -> &'static str {
        "mysql"
    }
    fn schemes(&self) -> &'static [&'static str] {
        &["mysql", "mariadb"]
    }
    fn usage(&self) -> &'static str {
        "mysql://user@host:port/db[?schema=s] (also mariadb://)"
    }
    fn check(&self, url: &str) -> Result<String> {
        let (url, schema) = parse(url)?;
        let place = schema.map_or_else(
            || "the URL's database".to_owned(),
            |s| format!("schema {s}"),
        );
        Ok(format!("{} ({place})", driver::redact(&url)))
    }
    async fn open(&self, url: &str, options: &Options) -> Result<Box<dyn Store>> {
        let (url, schema) = parse(url)?;
        let schema = match &options.isolate {
            Some(tag) => Some(format!("idem_{tag}")),
            None => schema,
        };
        let mut config = MySqlConfig::new(url);
        if let Some(schema) = schema {
            config = config.with_schema(schema);
        }
        if options.connections > 0 {
            config = config.with_max_connections(options.connections.clamp(1, 128));
        }
        let backend = MySqlBackend::connect(config).await?;
        if options.isolate.is_some() {
            backend.migrate().await?;
        }
        Ok(Box::new(MySqlStore {
            backend,
            isolated: options.isolate.is_some(),
        }))
    }
    fn test_url(&self) -> Result<String> {
        driver::service_url("IDEM_MYSQL_URL")
    }
}

#[derive(Debug)]
struct MySqlStore {
    backend: MySqlBackend,
    isolated: bool,
}

impl MySqlStore {
    async fn execute(&self, what: &str, sql: String) -> Result<()> {
        let query = sqlx::query(AssertSqlSafe(sql)).execute(self.backend.pool());
        self.backend.timed(what, query).await.map(drop)
    }

    /// The baseline table, in the schema (its name was checked to be plain at connect).
    fn table(&self) -> String {
        match self.backend.schema() {
            Some(s) => format!("`{s}`.raw_baseline"),
            None => "raw_baseline".to_owned(),
        }
    }
}

#[async_trait]
impl Store for MySqlStore {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }
    async fn migrate(&self) -> Result<String> {
        self.backend.migrate().await?;
        let place = self.backend.schema().map_or_else(
            || "the URL's database".to_owned(),
            |s| format!("schema {s}"),
        );
        Ok(format!(
            "mysql: {place} is migrated (idem_records, idem_offsets)"
        ))
    }
    async fn raw(&self) -> Result<Arc<dyn RawWrite>> {
        let table = self.table();
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {table} (k VARBINARY(640) PRIMARY KEY, v LONGBLOB NOT NULL) ENGINE = InnoDB"
        );
        self.execute("CREATE TABLE raw_baseline", create).await?;
        Ok(Arc::new(MySqlInsert {
            backend: self.backend.clone(),
            table,
        }))
    }
    fn offsets(&self) -> Option<Arc<dyn idem_core::Offsets>> {
        Some(Arc::new(self.backend.clone()))
    }
    async fn close(self: Box<Self>) -> Result<()> {
        if let (true, Some(schema)) = (self.isolated, self.backend.schema()) {
            let drop = format!("DROP DATABASE IF EXISTS `{schema}`");
            self.execute("DROP DATABASE", drop).await?;
        }
        Ok(())
    }
}

/// `INSERT IGNORE` of the keys, and `UPDATE … SET v` of the keys it wrote: one statement
/// per batch.
struct MySqlInsert {
    backend: MySqlBackend,
    table: String,
}

/// `(?, ?), (?, ?)…` for `n` rows, or `?, ?…` for `n` values.
fn marks(n: usize, row: &str) -> String {
    vec![row; n].join(", ")
}

#[async_trait]
impl RawWrite for MySqlInsert {
    fn name(&self) -> &'static str {
        "INSERT IGNORE"
    }
    fn settle_name(&self) -> &'static str {
        "UPDATE"
    }
    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()> {
        let sql = format!(
            "INSERT IGNORE INTO {} (k, v) VALUES {}",
            self.table,
            marks(keys.len(), "(?, ?)")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for k in keys {
            query = query.bind(k.as_bytes()).bind(value.as_ref());
        }
        let pool = self.backend.pool();
        self.backend
            .timed("INSERT IGNORE", query.execute(pool))
            .await
            .map(drop)
    }
    async fn settle(&self, keys: &[String], value: &Bytes) -> Result<()> {
        let sql = format!(
            "UPDATE {} SET v = ? WHERE k IN ({})",
            self.table,
            marks(keys.len(), "?")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(value.as_ref());
        for k in keys {
            query = query.bind(k.as_bytes());
        }
        let pool = self.backend.pool();
        let updated = self
            .backend
            .timed("UPDATE", query.execute(pool))
            .await?
            .rows_affected();
        // Matched rows (sqlx asks for CLIENT_FOUND_ROWS): a key `insert` did not write is
        // a bug of the caller, not a figure to report.
        let distinct = keys.iter().collect::<std::collections::HashSet<_>>().len();
        if updated != distinct as u64 {
            return Err(Error::corrupt(format!(
                "raw baseline: UPDATE wrote {updated} of {distinct} keys: settle only keys insert wrote"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_redacted() {
        let shown = DRIVER
            .check("mysql://app:pw@db:3306/orders?schema=svc")
            .unwrap();
        assert_eq!(shown, "mysql://app:***@db:3306/orders (schema svc)");
        assert!(DRIVER.check("mysql://").is_err());
        assert!(DRIVER.check("postgres://db/x").is_err());
        assert!(DRIVER.check("mariadb://db/x").is_ok());
    }
}
