//! The driver: `redis://` URLs for tools that know only a URL (the `idem` CLI, benches).

use std::sync::Arc;

use idem_core::backend::async_trait;
use idem_core::backend::driver::{self, Driver, Options, RAW_RETENTION, RawWrite, Store};
use idem_core::{Backend, Bytes, Error, Result};

use crate::conn::Conn;
use crate::{RedisBackend, RedisConfig};

/// The Redis driver: `redis://[user][:password@]host[:port][/db][?prefix=p]` (`rediss://`
/// with the `tls` feature); several URLs, comma-separated, name a cluster. `prefix`
/// defaults to `idem:`. Isolation is a prefix of its own, `idem:<tag>:`, whose keys
/// [`Store::close`] deletes (on a cluster they expire by themselves).
pub static DRIVER: RedisDriver = RedisDriver;

/// See [`DRIVER`].
#[derive(Debug)]
pub struct RedisDriver;

/// The parameters of a `redis://` or `rediss://` URL: the driver's `prefix`, and the
/// client's `protocol` (redis-rs reads no other; the database is the path).
const TCP_PARAMS: &[&str] = &["prefix", "protocol"];

/// The parameters of a `redis+unix://` URL: redis-rs also reads `db`, `user` and `pass`
/// there, which a socket path cannot carry.
const UNIX_PARAMS: &[&str] = &["prefix", "protocol", "db", "user", "pass"];

/// A checked URL list: the node URLs without `prefix`, and the prefix.
struct Parsed {
    urls: String,
    prefix: String,
}

fn parse(text: &str) -> Result<Parsed> {
    let mut prefix = "idem:".to_owned();
    let mut urls = Vec::new();
    for one in text.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let bad = |reason: String| Error::config(format!("{}: {reason}", driver::redact(one)));
        let mut url = url::Url::parse(one).map_err(|e| bad(e.to_string()))?;
        if !DRIVER.schemes().contains(&url.scheme()) {
            return Err(bad(format!("not a Redis URL ({})", DRIVER.usage())));
        }
        if url.host_str().is_none_or(str::is_empty) && url.scheme() != "redis+unix" {
            return Err(bad("no host".into()));
        }
        let accepted = if url.scheme() == "redis+unix" {
            UNIX_PARAMS
        } else {
            TCP_PARAMS
        };
        driver::check_params(&url, accepted)?;
        if let Some(p) = driver::take_param(&mut url, "prefix") {
            prefix = p;
        }
        urls.push(url.to_string());
    }
    if urls.is_empty() {
        return Err(Error::config("no Redis URL"));
    }
    Ok(Parsed {
        urls: urls.join(","),
        prefix,
    })
}

#[async_trait]
impl Driver for RedisDriver {
    fn name(&self) -> &'static str {
        "redis"
    }
    fn schemes(&self) -> &'static [&'static str] {
        &["redis", "rediss", "redis+unix"]
    }
    fn usage(&self) -> &'static str {
        "redis://host:port/db[?prefix=p] (also rediss://; several, comma-separated: a cluster)"
    }
    fn check(&self, url: &str) -> Result<String> {
        let parsed = parse(url)?;
        Ok(format!(
            "{} (prefix {})",
            driver::redact(&parsed.urls),
            parsed.prefix
        ))
    }
    async fn open(&self, url: &str, options: &Options) -> Result<Box<dyn Store>> {
        let parsed = parse(url)?;
        let prefix = match &options.isolate {
            Some(tag) => format!("idem:{tag}:"),
            None => parsed.prefix,
        };
        let config = RedisConfig::from_urls(&parsed.urls).with_prefix(prefix.clone());
        let backend = RedisBackend::connect(config).await?;
        Ok(Box::new(RedisStore {
            backend,
            prefix,
            isolated: options.isolate.is_some(),
        }))
    }
    fn test_url(&self) -> Result<String> {
        driver::service_url("IDEM_REDIS_URL")
    }
}

#[derive(Debug)]
struct RedisStore {
    backend: RedisBackend,
    prefix: String,
    isolated: bool,
}

#[async_trait]
impl Store for RedisStore {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }
    async fn migrate(&self) -> Result<String> {
        Ok("redis: nothing to migrate (records are plain keys)".into())
    }
    async fn raw(&self) -> Result<Arc<dyn RawWrite>> {
        Ok(Arc::new(SetNx {
            backend: self.backend.clone(),
            prefix: format!("{}raw:", self.prefix),
        }))
    }
    async fn close(self: Box<Self>) -> Result<()> {
        if self.isolated {
            delete_prefix(&self.backend, &self.prefix).await?;
        }
        Ok(())
    }
}

/// `SET key value NX PX ms`, and `SET key value PX ms` over it: pipelined for a batch on
/// one server, a call per key on a cluster (whose keys spread over nodes), through the
/// backend's own connection.
struct SetNx {
    backend: RedisBackend,
    prefix: String,
}

impl SetNx {
    /// `SET <prefix><key> value [NX] PX <retention>` for each key.
    fn sets(&self, keys: &[String], value: &Bytes, nx: bool) -> Vec<redis::Cmd> {
        keys.iter()
            .map(|k| {
                let mut cmd = redis::cmd("SET");
                cmd.arg(format!("{}{k}", self.prefix)).arg(value.as_ref());
                if nx {
                    cmd.arg("NX");
                }
                cmd.arg("PX").arg(RAW_RETENTION.as_millis() as u64);
                cmd
            })
            .collect()
    }
}

#[async_trait]
impl RawWrite for SetNx {
    fn name(&self) -> &'static str {
        "SET NX PX"
    }
    fn settle_name(&self) -> &'static str {
        "SET PX"
    }
    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()> {
        send_raw(&self.backend, self.name(), self.sets(keys, value, true)).await
    }
    async fn settle(&self, keys: &[String], value: &Bytes) -> Result<()> {
        let sets = self.sets(keys, value, false);
        send_raw(&self.backend, self.settle_name(), sets).await
    }
}

/// Sends `cmds` (named `what` in errors and metrics) as one pipeline on a single server,
/// or concurrently on a cluster.
async fn send_raw(backend: &RedisBackend, what: &'static str, cmds: Vec<redis::Cmd>) -> Result<()> {
    match backend.conn.clone() {
        Conn::Single(mut c) => {
            let mut pipe = redis::pipe();
            for cmd in cmds {
                pipe.add_command(cmd).ignore();
            }
            backend.call(what, pipe.query_async::<()>(&mut c)).await
        }
        Conn::Cluster(c) => {
            let calls = cmds.into_iter().map(|cmd| {
                let mut c = c.clone();
                async move { cmd.query_async::<redis::Value>(&mut c).await }
            });
            let all = futures::future::try_join_all(calls);
            backend.call(what, all).await.map(drop)
        }
    }
}

/// Deletes every key under `prefix` on a single server (`SCAN` and `UNLINK`); on a
/// cluster the keys are left to expire.
async fn delete_prefix(backend: &RedisBackend, prefix: &str) -> Result<()> {
    let Conn::Single(mut conn) = backend.conn.clone() else {
        return Ok(());
    };
    let pattern = format!("{prefix}*");
    let mut cursor = 0u64;
    loop {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000);
        let scan = scan.query_async::<(u64, Vec<String>)>(&mut conn);
        let (next, keys) = backend.call("SCAN", scan).await?;
        if !keys.is_empty() {
            let mut unlink = redis::cmd("UNLINK");
            unlink.arg(&keys);
            backend
                .call("UNLINK", unlink.query_async::<()>(&mut conn))
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}
