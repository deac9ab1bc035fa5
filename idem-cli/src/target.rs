//! Backend URLs: which store a command talks to, and the connection to it.
//!
//! - `memory:`: the in-memory backend (this process only).
//! - `redis://host:port/db` (also `rediss://`; several comma-separated URLs: a cluster);
//!   `?prefix=p` sets the key prefix (default `idem:`).
//! - `postgres://user@host:port/db` (also `postgresql://`); `?schema=name` picks the schema
//!   (default `idem`); other parameters go to the driver.
//! - `dynamodb://<table>?endpoint=http://host:port&region=…`; without `endpoint` the SDK
//!   resolves AWS's, and region and credentials come from the AWS chain (environment,
//!   profile). With an `endpoint` (DynamoDB Local), the region defaults to `us-east-1` and,
//!   when the environment has no `AWS_ACCESS_KEY_ID`, placeholder credentials are used.

use std::fmt;
use std::sync::Arc;

use idem_core::{Backend, MemoryBackend};

use crate::error::{Error, Result, StoreContext};

/// A parsed backend URL whose backend is compiled in.
#[derive(Clone, PartialEq, Eq)]
pub enum Target {
    /// `memory:`
    Memory,
    /// `redis://…` or `rediss://…`, possibly several (a cluster).
    Redis {
        /// The URLs as given, without the `prefix` parameter.
        urls: String,
        /// The key prefix (default `idem:`).
        prefix: String,
    },
    /// `postgres://…`
    Postgres {
        /// The URL without the `schema` parameter.
        url: String,
        /// The schema (default `idem`).
        schema: String,
    },
    /// `dynamodb://<table>?endpoint=…&region=…`
    Dynamo {
        /// The table.
        table: String,
        /// The endpoint, if given.
        endpoint: Option<String>,
        /// The region, if given.
        region: Option<String>,
    },
}

impl Target {
    /// Parses a backend URL. A URL that does not parse, or that names a backend this
    /// build lacks, is an error that says what to do.
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        let bad = |reason: String| Error::BadUrl {
            url: redact(text),
            reason,
        };
        if text == "memory:" || text == "memory://" || text == "memory" {
            return Ok(Target::Memory);
        }
        let first = text.split(',').next().unwrap_or(text).trim();
        let url = url::Url::parse(first).map_err(|e| bad(e.to_string()))?;
        let target = match url.scheme() {
            "redis" | "rediss" | "redis+unix" => {
                require(cfg!(feature = "redis"), "redis:// URLs", "redis")?;
                parse_redis(text).map_err(bad)?
            }
            "postgres" | "postgresql" => {
                require(cfg!(feature = "postgres"), "postgres:// URLs", "postgres")?;
                if text.contains(',') {
                    return Err(bad("one PostgreSQL URL only".into()));
                }
                parse_postgres(url).map_err(bad)?
            }
            "dynamodb" => {
                require(cfg!(feature = "dynamo"), "dynamodb:// URLs", "dynamo")?;
                parse_dynamo(&url).map_err(bad)?
            }
            "memory" => return Err(bad("write memory: with nothing after it".into())),
            other => return Err(bad(format!("unknown scheme {other:?}"))),
        };
        Ok(target)
    }

    /// The backend's short name: `memory`, `redis`, `postgres`, `dynamodb`.
    pub fn kind(&self) -> &'static str {
        match self {
            Target::Memory => "memory",
            Target::Redis { .. } => "redis",
            Target::Postgres { .. } => "postgres",
            Target::Dynamo { .. } => "dynamodb",
        }
    }

    /// Connects to the store.
    pub async fn connect(&self, options: &ConnectOptions) -> Result<Store> {
        let what = format!("connect to {self}");
        match self {
            Target::Memory => Ok(Store::Memory(MemoryBackend::new())),
            #[cfg(feature = "redis")]
            Target::Redis { urls, prefix } => {
                let config = idem_redis::RedisConfig::from_urls(urls).with_prefix(prefix.clone());
                let backend = idem_redis::RedisBackend::connect(config)
                    .await
                    .store(what)?;
                Ok(Store::Redis(backend))
            }
            #[cfg(feature = "dynamo")]
            Target::Dynamo {
                table,
                endpoint,
                region,
            } => {
                let config = dynamo_config(table, endpoint.as_deref(), region.as_deref());
                let backend = idem_dynamo::DynamoBackend::connect(config)
                    .await
                    .store(what)?;
                Ok(Store::Dynamo(backend))
            }
            #[cfg(feature = "postgres")]
            Target::Postgres { url, schema } => {
                let config = idem_postgres::PgConfig::new(url.clone())
                    .with_schema(schema.clone())
                    .with_max_connections(options.pool_size.clamp(1, 128));
                let backend = idem_postgres::PgBackend::connect(config)
                    .await
                    .store(what)?;
                Ok(Store::Postgres(backend))
            }
            // Unreachable: `parse` refuses URLs of backends that are not compiled in.
            #[allow(unreachable_patterns)]
            other => {
                let _ = options;
                Err(Error::Refused(format!(
                    "{} is not compiled into this build",
                    other.kind()
                )))
            }
        }
    }
}

/// The DynamoDB configuration for `table` on the endpoint and region of a `dynamodb://`
/// URL (see the module docs for the defaults).
#[cfg(feature = "dynamo")]
pub fn dynamo_config(
    table: &str,
    endpoint: Option<&str>,
    region: Option<&str>,
) -> idem_dynamo::DynamoConfig {
    let mut config = idem_dynamo::DynamoConfig::new(table);
    if let Some(endpoint) = endpoint {
        config = config
            .with_endpoint(endpoint)
            .with_region(region.unwrap_or("us-east-1"));
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
            config = config.with_static_credentials("idem", "idem-local", None);
        }
    } else if let Some(region) = region {
        config = config.with_region(region);
    }
    config
}

/// How to connect.
#[derive(Clone, Copy, Debug)]
pub struct ConnectOptions {
    /// Connections to keep for concurrent work (PostgreSQL's pool size).
    pub pool_size: u32,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions { pool_size: 4 }
    }
}

fn require(compiled: bool, what: &'static str, feature: &'static str) -> Result<()> {
    if compiled {
        Ok(())
    } else {
        Err(Error::FeatureMissing { what, feature })
    }
}

fn parse_redis(text: &str) -> Result<Target, String> {
    let mut prefix = "idem:".to_owned();
    let mut urls = Vec::new();
    for one in text.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let mut url = url::Url::parse(one).map_err(|e| e.to_string())?;
        if url.host_str().is_none_or(str::is_empty) && url.scheme() != "redis+unix" {
            return Err("no host".into());
        }
        let (found, rest) = take_param(&url, "prefix");
        if let Some(p) = found {
            prefix = p;
        }
        set_query(&mut url, rest);
        urls.push(url.to_string());
    }
    Ok(Target::Redis {
        urls: urls.join(","),
        prefix,
    })
}

/// The value of query parameter `name`, and the other parameters.
fn take_param(url: &url::Url, name: &str) -> (Option<String>, Vec<(String, String)>) {
    let mut found = None;
    let mut rest = Vec::new();
    for (k, v) in url.query_pairs() {
        if k == name {
            found = Some(v.into_owned());
        } else {
            rest.push((k.into_owned(), v.into_owned()));
        }
    }
    (found, rest)
}

fn set_query(url: &mut url::Url, pairs: Vec<(String, String)>) {
    if pairs.is_empty() {
        url.set_query(None);
    } else {
        url.query_pairs_mut().clear().extend_pairs(pairs);
    }
}

fn parse_postgres(mut url: url::Url) -> Result<Target, String> {
    if url.host_str().is_none_or(str::is_empty) {
        return Err("no host".into());
    }
    let (schema, rest) = take_param(&url, "schema");
    set_query(&mut url, rest);
    Ok(Target::Postgres {
        url: url.to_string(),
        schema: schema.unwrap_or_else(|| "idem".into()),
    })
}

fn parse_dynamo(url: &url::Url) -> Result<Target, String> {
    let table = url.host_str().unwrap_or_default();
    if table.is_empty() {
        return Err("no table: write dynamodb://<table>?endpoint=…&region=…".into());
    }
    if !url.path().is_empty() && url.path() != "/" {
        return Err(format!("unexpected path {:?} after the table", url.path()));
    }
    let (mut endpoint, mut region) = (None, None);
    for (k, v) in url.query_pairs() {
        match &*k {
            "endpoint" => {
                url::Url::parse(&v).map_err(|e| format!("endpoint {v:?}: {e}"))?;
                endpoint = Some(v.into_owned());
            }
            "region" if !v.is_empty() => region = Some(v.into_owned()),
            other => return Err(format!("unknown parameter {other:?} (endpoint, region)")),
        }
    }
    Ok(Target::Dynamo {
        table: table.to_owned(),
        endpoint,
        region,
    })
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Memory => write!(f, "memory:"),
            Target::Redis { urls, prefix } => {
                let shown: Vec<String> = urls.split(',').map(|u| redact(u.trim())).collect();
                write!(f, "{} (prefix {prefix})", shown.join(","))
            }
            Target::Postgres { url, schema } => write!(f, "{} (schema {schema})", redact(url)),
            Target::Dynamo {
                table,
                endpoint,
                region,
            } => {
                write!(f, "dynamodb://{table}")?;
                let params: Vec<String> = [("endpoint", endpoint), ("region", region)]
                    .into_iter()
                    .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={v}")))
                    .collect();
                if !params.is_empty() {
                    write!(f, "?{}", params.join("&"))?;
                }
                Ok(())
            }
        }
    }
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Target({self})")
    }
}

/// `url` with any password replaced by `***`; a URL that does not parse is shown only by
/// its scheme, since its password part cannot be found.
pub fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            let hidden = |k: &str| k == "pass" || k == "password";
            if u.query_pairs().any(|(k, _)| hidden(&k)) {
                let pairs: Vec<(String, String)> = u
                    .query_pairs()
                    .map(|(k, v)| {
                        let v = if hidden(&k) { "***".into() } else { v.into() };
                        (k.into_owned(), v)
                    })
                    .collect();
                u.query_pairs_mut().clear().extend_pairs(pairs);
            }
            u.to_string()
        }
        Err(_) if url.contains('@') => match url.split_once(':') {
            Some((scheme, _)) => format!("{scheme}:<unparsable, hidden>"),
            None => "<unparsable, hidden>".into(),
        },
        Err(_) => url.to_owned(),
    }
}

/// A connected backend, with the concrete type kept so that commands can reach what only
/// that backend has (migrations, the raw client for bench baselines).
#[derive(Clone, Debug)]
pub enum Store {
    /// The in-memory backend.
    Memory(MemoryBackend),
    /// Redis.
    #[cfg(feature = "redis")]
    Redis(idem_redis::RedisBackend),
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(idem_postgres::PgBackend),
    /// DynamoDB.
    #[cfg(feature = "dynamo")]
    Dynamo(idem_dynamo::DynamoBackend),
}

impl Store {
    /// The backend behind the trait.
    pub fn backend(&self) -> Arc<dyn Backend> {
        match self {
            Store::Memory(b) => Arc::new(b.clone()),
            #[cfg(feature = "redis")]
            Store::Redis(b) => Arc::new(b.clone()),
            #[cfg(feature = "postgres")]
            Store::Postgres(b) => Arc::new(b.clone()),
            #[cfg(feature = "dynamo")]
            Store::Dynamo(b) => Arc::new(b.clone()),
        }
    }

    /// Creates what the store needs (tables, schema); says what was done.
    pub async fn migrate(&self) -> Result<String> {
        match self {
            Store::Memory(_) => Ok("memory: nothing to migrate".into()),
            #[cfg(feature = "redis")]
            Store::Redis(_) => Ok("redis: nothing to migrate (records are plain keys)".into()),
            #[cfg(feature = "postgres")]
            Store::Postgres(b) => {
                b.migrate().await.store("migrate")?;
                Ok(format!(
                    "postgres: schema {} is migrated (idem_records, idem_offsets)",
                    b.schema()
                ))
            }
            #[cfg(feature = "dynamo")]
            Store::Dynamo(b) => {
                b.create_table().await.store("create the table")?;
                Ok(format!(
                    "dynamodb: table {} exists, with TTL on expires_at",
                    b.config().table()
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(text: &str) -> String {
        match Target::parse(text) {
            Err(Error::BadUrl { reason, .. }) => reason,
            other => panic!("{text}: expected BadUrl, got {other:?}"),
        }
    }

    #[test]
    fn parses_each_form() {
        assert_eq!(Target::parse("memory:").unwrap(), Target::Memory);
        if cfg!(feature = "redis") {
            let t = Target::parse("redis://:pw@h:6379/0?prefix=svc:, redis://h2:6379/").unwrap();
            assert_eq!(
                t,
                Target::Redis {
                    urls: "redis://:pw@h:6379/0,redis://h2:6379/".into(),
                    prefix: "svc:".into()
                }
            );
            assert!(!t.to_string().contains("pw"), "{t}");
        }
        if cfg!(feature = "postgres") {
            let t = Target::parse("postgres://app:pw@db:5432/orders?schema=svc&sslmode=disable")
                .unwrap();
            assert_eq!(
                t,
                Target::Postgres {
                    url: "postgres://app:pw@db:5432/orders?sslmode=disable".into(),
                    schema: "svc".into()
                }
            );
            assert!(!t.to_string().contains("pw"), "{t}");
        }
        if cfg!(feature = "dynamo") {
            let t = Target::parse("dynamodb://idem?endpoint=http://127.0.0.1:8000&region=local")
                .unwrap();
            assert_eq!(
                t,
                Target::Dynamo {
                    table: "idem".into(),
                    endpoint: Some("http://127.0.0.1:8000".into()),
                    region: Some("local".into())
                }
            );
        }
    }

    #[test]
    fn refuses_bad_urls_with_a_reason() {
        assert!(reason("localhost:6379").contains("unknown scheme"));
        assert!(reason("nonsense").contains("relative URL"));
        assert!(reason("mysql://db/x").contains("unknown scheme \"mysql\""));
        assert!(reason("memory:x").contains("memory:"));
        if cfg!(feature = "postgres") {
            assert!(reason("postgres://").contains("no host"));
        }
        if cfg!(feature = "dynamo") {
            assert!(reason("dynamodb://?region=x").contains("no table"));
            assert!(reason("dynamodb://t?colour=red").contains("unknown parameter"));
        }
    }

    #[test]
    fn a_missing_feature_names_it() {
        let cases = [
            ("redis://127.0.0.1/", "redis", cfg!(feature = "redis")),
            ("postgres://h/db", "postgres", cfg!(feature = "postgres")),
            ("dynamodb://t", "dynamo", cfg!(feature = "dynamo")),
        ];
        for (url, feature, compiled) in cases {
            match Target::parse(url) {
                Ok(_) => assert!(compiled, "{url}"),
                Err(Error::FeatureMissing { feature: f, .. }) => {
                    assert!(!compiled, "{url}");
                    assert_eq!(f, feature);
                }
                Err(other) => panic!("{url}: {other}"),
            }
        }
    }

    #[test]
    fn passwords_never_show() {
        let e = Target::parse("mysql://u:s3cret@db/x")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
        let e = Target::parse("postgres://u:s3cret@[bad")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
        assert!(!redact("redis://h/?password=s3cret").contains("s3cret"));
    }
}
