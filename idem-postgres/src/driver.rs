//! The driver: `postgres://` URLs for tools that know only a URL (the `idem` CLI, benches).

use std::sync::Arc;

use idem_core::backend::async_trait;
use idem_core::backend::driver::{self, Driver, Options, RawWrite, Store};
use idem_core::{Backend, Bytes, Error, Result};

use crate::{PgBackend, PgConfig};

/// The PostgreSQL driver: `postgres://user[:password]@host[:port]/db[?schema=s]` (also
/// `postgresql://`); other parameters go to the driver (`sslmode`, …). `schema` defaults to
/// `idem`. Isolation is a schema of its own, `idem_<tag>`, migrated at open and dropped by
/// [`Store::close`].
pub static DRIVER: PgDriver = PgDriver;

/// See [`DRIVER`].
#[derive(Debug)]
pub struct PgDriver;

/// The parameters of a URL: the driver's `schema`, and those sqlx-postgres reads
/// (`PgConnectOptions::parse_from_url`), each spelling it takes.
const PARAMS: &[&str] = &[
    "schema",
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
    "options[*]",
];

/// A checked URL: without `schema`, and the schema.
fn parse(text: &str) -> Result<(String, String)> {
    let text = text.trim();
    let bad = |reason: String| Error::config(reason);
    if text.contains(',') {
        return Err(bad("one PostgreSQL URL only".into()));
    }
    let mut url = url::Url::parse(text).map_err(|e| bad(e.to_string()))?;
    if !DRIVER.schemes().contains(&url.scheme()) {
        return Err(bad(format!("not a PostgreSQL URL ({})", DRIVER.usage())));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host".into()));
    }
    driver::check_params(&url, PARAMS)?;
    let schema = driver::take_param(&mut url, "schema").unwrap_or_else(|| "idem".into());
    Ok((url.to_string(), schema))
}

#[async_trait]
impl Driver for PgDriver {
    fn name(&self) -> &'static str {
        "postgres"
    }
    fn schemes(&self) -> &'static [&'static str] {
        &["postgres", "postgresql"]
    }
    fn usage(&self) -> &'static str {
        "postgres://user@host:port/db[?schema=s] (also postgresql://)"
    }
    fn check(&self, url: &str) -> Result<String> {
        let (url, schema) = parse(url)?;
        Ok(format!("{} (schema {schema})", driver::redact(&url)))
    }
    async fn open(&self, url: &str, options: &Options) -> Result<Box<dyn Store>> {
        let (url, schema) = parse(url)?;
        let schema = match &options.isolate {
            Some(tag) => format!("idem_{tag}"),
            None => schema,
        };
        let mut config = PgConfig::new(url).with_schema(schema);
        if options.connections > 0 {
            config = config.with_max_connections(options.connections.clamp(1, 128));
        }
        let backend = PgBackend::connect(config).await?;
        if options.isolate.is_some() {
            backend.migrate().await?;
        }
        Ok(Box::new(PgStore {
            backend,
            isolated: options.isolate.is_some(),
        }))
    }
    fn test_url(&self) -> Result<String> {
        driver::service_url("IDEM_POSTGRES_URL")
    }
}

#[derive(Debug)]
struct PgStore {
    backend: PgBackend,
    isolated: bool,
}

impl PgStore {
    async fn execute(&self, what: &str, sql: String) -> Result<()> {
        let query = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(self.backend.pool());
        self.backend.timed(what, query).await.map(drop)
    }

    /// The schema, quoted (its name was checked to be plain at connect).
    fn schema(&self) -> String {
        format!("\"{}\"", self.backend.schema())
    }
}

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }
    async fn migrate(&self) -> Result<String> {
        self.backend.migrate().await?;
        Ok(format!(
            "postgres: schema {} is migrated (idem_records, idem_offsets)",
            self.backend.schema()
        ))
    }
    async fn raw(&self) -> Result<Arc<dyn RawWrite>> {
        let schema = self.schema();
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {schema}.raw_baseline (k text PRIMARY KEY, v bytea NOT NULL)"
        );
        self.execute("CREATE TABLE raw_baseline", create).await?;
        Ok(Arc::new(PgInsert {
            backend: self.backend.clone(),
            insert: Statements {
                one: format!(
                    "INSERT INTO {schema}.raw_baseline (k, v) VALUES ($1, $2) ON CONFLICT DO NOTHING"
                ),
                many: format!(
                    "INSERT INTO {schema}.raw_baseline (k, v) SELECT k, $2 FROM unnest($1::text[]) AS t(k) ON CONFLICT DO NOTHING"
                ),
            },
            update: Statements {
                one: format!("UPDATE {schema}.raw_baseline SET v = $2 WHERE k = $1"),
                many: format!("UPDATE {schema}.raw_baseline SET v = $2 WHERE k = ANY($1::text[])"),
            },
        }))
    }
    fn offsets(&self) -> Option<Arc<dyn idem_core::Offsets>> {
        Some(Arc::new(self.backend.clone()))
    }
    async fn close(self: Box<Self>) -> Result<()> {
        if self.isolated {
            let drop = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema());
            self.execute("DROP SCHEMA", drop).await?;
        }
        Ok(())
    }
}

/// `INSERT … ON CONFLICT DO NOTHING`, and `UPDATE … SET v` of the keys it wrote: one
/// statement per batch (over the array of its keys).
struct PgInsert {
    backend: PgBackend,
    insert: Statements,
    update: Statements,
}

/// A statement for one key (`$1` a key) and one for a batch (`$1` an array of keys); `$2`
/// is the value.
struct Statements {
    one: String,
    many: String,
}

impl PgInsert {
    /// Runs `sql` over `keys` and `value`; answers how many rows it wrote.
    async fn execute(
        &self,
        what: &str,
        sql: &Statements,
        keys: &[String],
        value: &Bytes,
    ) -> Result<u64> {
        let pool = self.backend.pool();
        let done = match keys {
            [one] => {
                let q = sqlx::query(sqlx::AssertSqlSafe(sql.one.as_str()))
                    .bind(one)
                    .bind(value.as_ref());
                self.backend.timed(what, q.execute(pool)).await
            }
            many => {
                let q = sqlx::query(sqlx::AssertSqlSafe(sql.many.as_str()))
                    .bind(many)
                    .bind(value.as_ref());
                self.backend.timed(what, q.execute(pool)).await
            }
        };
        done.map(|d| d.rows_affected())
    }
}

#[async_trait]
impl RawWrite for PgInsert {
    fn name(&self) -> &'static str {
        "INSERT … ON CONFLICT DO NOTHING"
    }
    fn settle_name(&self) -> &'static str {
        "UPDATE"
    }
    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()> {
        self.execute("INSERT … ON CONFLICT", &self.insert, keys, value)
            .await
            .map(drop)
    }
    async fn settle(&self, keys: &[String], value: &Bytes) -> Result<()> {
        let updated = self.execute("UPDATE", &self.update, keys, value).await?;
        // The count comes back with the answer: a key `insert` did not write is a bug of
        // the caller (or of these statements), not a figure to report.
        let distinct = || keys.iter().collect::<std::collections::HashSet<_>>().len();
        if updated != keys.len() as u64 && updated != distinct() as u64 {
            return Err(Error::corrupt(format!(
                "raw baseline: UPDATE wrote {updated} of {} keys: settle only keys insert wrote",
                distinct()
            )));
        }
        Ok(())
    }
}
