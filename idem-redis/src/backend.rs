//! [`RedisBackend`]: the state machine in Lua, one script call per operation.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    Backend, Capabilities, Claim, ClaimOutcome, Error, FailureKind, Key, Lease, ListFilter, Record,
    Result, Timestamp,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_routing::Slot;
use redis::{RedisResult, Script, Value};

use crate::RedisConfig;
use crate::conn::{Conn, Node};
use crate::error::{bad_reply, from_redis, timed_out};
use crate::keys::Layout;
use crate::record::{decode_outcome, decode_record};

/// Durations are sent in milliseconds, at most about a century, so that every deadline
/// stays exact in the scripts' numbers.
const MAX_MILLIS: u64 = 100 * 365 * 24 * 3600 * 1000;
/// Keys asked for per `SCAN` step in `list`.
const SCAN_COUNT: usize = 512;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .min(MAX_MILLIS)
}

/// The scripts, each with `lua/record.lua` in front.
struct Scripts {
    claim: Script,
    complete: Script,
    fail: Script,
    extend: Script,
}

impl Scripts {
    fn new() -> Self {
        let with_record =
            |body: &str| Script::new(&format!("{}\n{body}", include_str!("../lua/record.lua")));
        Scripts {
            claim: with_record(include_str!("../lua/claim.lua")),
            complete: with_record(include_str!("../lua/complete.lua")),
            fail: with_record(include_str!("../lua/fail.lua")),
            extend: with_record(include_str!("../lua/extend.lua")),
        }
    }
}

struct Shared {
    config: RedisConfig,
    layout: Layout,
    scripts: Scripts,
}

/// Idempotency records in Redis, standalone or cluster.
///
/// Every operation is one Lua script run on the server (claim, complete, fail, extend),
/// so it is atomic and takes one round trip; the server's clock decides lease lapse, and
/// Redis expires records itself. Cloning is cheap and shares the connection.
#[derive(Clone)]
pub struct RedisBackend {
    conn: Conn,
    shared: Arc<Shared>,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl RedisBackend {
    /// Connects, within the configured timeout: [`Error::Unavailable`] if the server does
    /// not answer, [`Error::Config`] if the configuration is unusable.
    pub async fn connect(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        let limit = config.timeout();
        let conn = if config.is_cluster() {
            let client = cluster_client(&config)?;
            let cfg = cluster_config(limit);
            let connect = client.get_async_connection_with_config(cfg);
            Conn::Cluster(within("connect", limit, connect).await?)
        } else {
            let client = single_client(&config)?;
            let connect = ConnectionManager::new_with_config(client, manager_config(limit));
            Conn::Single(within("connect", limit, connect).await?)
        };
        Ok(Self::with_conn(config, conn))
    }

    /// Like [`RedisBackend::connect`], but connects on the first call instead of now: for
    /// processes that must start while Redis is down. Calls fail with
    /// [`Error::Unavailable`] until it answers. Needs a running tokio runtime.
    pub fn connect_lazy(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::config("connect_lazy needs a running tokio runtime"));
        }
        let limit = config.timeout();
        let conn = if config.is_cluster() {
            let client = cluster_client(&config)?;
            Conn::Cluster(client.get_pending_async_connection_with_config(cluster_config(limit)))
        } else {
            let client = single_client(&config)?;
            let manager = ConnectionManager::new_lazy_with_config(client, manager_config(limit))
                .map_err(|e| config_error(&config, e))?;
            Conn::Single(manager)
        };
        Ok(Self::with_conn(config, conn))
    }

    fn with_conn(config: RedisConfig, conn: Conn) -> Self {
        let layout = Layout::new(config.prefix());
        RedisBackend {
            conn,
            shared: Arc::new(Shared {
                config,
                layout,
                scripts: Scripts::new(),
            }),
        }
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &RedisConfig {
        &self.shared.config
    }

    /// The Redis key that holds `key`'s record (see the README for the layout).
    pub fn record_key(&self, key: &Key) -> String {
        self.shared.layout.record(key)
    }

    /// Runs `fut` within the configured timeout, mapping its error.
    async fn call<T>(&self, what: &str, fut: impl Future<Output = RedisResult<T>>) -> Result<T> {
        within(what, self.shared.config.timeout(), fut).await
    }

    /// One claim script call for `claims`, all in one slot when in a cluster.
    async fn claim_group(&self, claims: &[&Claim]) -> Result<Vec<ClaimOutcome>> {
        let mut inv = self.shared.scripts.claim.prepare_invoke();
        for c in claims {
            let fingerprint = c.fingerprint.as_ref().map_or(&[][..], |f| &f.0[..]);
            inv.key(self.record_key(&c.key))
                .arg(&c.owner)
                .arg(millis(c.lease_ttl))
                .arg(fingerprint)
                .arg(c.max_attempts)
                .arg(millis(c.retention));
        }
        let mut conn = self.conn.clone();
        let reply: Value = self.call("claim", inv.invoke_async(&mut conn)).await?;
        let answers = match reply {
            Value::Array(answers) if answers.len() == claims.len() => answers,
            other => return Err(bad_reply("claim", format!("{other:?}"))),
        };
        claims
            .iter()
            .zip(answers)
            .map(|(c, answer)| decode_outcome(c, answer))
            .collect()
    }

    /// `claims` grouped by cluster slot, in order of first appearance; one group standalone.
    fn groups<'a>(&self, claims: &'a [Claim]) -> Vec<Vec<(usize, &'a Claim)>> {
        if !matches!(self.conn, Conn::Cluster(_)) {
            return vec![claims.iter().enumerate().collect()];
        }
        let mut index: HashMap<Slot, usize> = HashMap::new();
        let mut groups: Vec<Vec<(usize, &Claim)>> = Vec::new();
        for (i, c) in claims.iter().enumerate() {
            let slot = Slot::for_key(self.record_key(&c.key));
            let g = *index.entry(slot).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[g].push((i, c));
        }
        groups
    }

    /// A fencing script's reply: `fenced` says which answers mean the lease is not held.
    fn fenced(lease: &Lease) -> Error {
        Error::Fenced {
            key: lease.key.clone(),
            token: lease.token,
        }
    }

    /// The primaries of a cluster, each once; `[None]` standalone.
    async fn scan_nodes(&self) -> Result<Vec<Option<Node>>> {
        if !matches!(self.conn, Conn::Cluster(_)) {
            return Ok(vec![None]);
        }
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let reply = self.call("list", conn.query_on(None, cmd)).await?;
        let mut nodes: Vec<Option<Node>> = Vec::new();
        let Value::Array(ranges) = reply else {
            return Err(bad_reply("CLUSTER SLOTS", format!("{reply:?}")));
        };
        for range in ranges {
            let node = match range {
                Value::Array(parts) => match parts.get(2) {
                    Some(Value::Array(primary)) => match (primary.first(), primary.get(1)) {
                        (Some(Value::BulkString(host)), Some(Value::Int(port))) => {
                            let host = String::from_utf8_lossy(host).into_owned();
                            u16::try_from(*port).ok().map(|port| (host, port))
                        }
                        _ => None,
                    },
                    _ => None,
                },
                _ => None,
            };
            let node =
                node.ok_or_else(|| bad_reply("CLUSTER SLOTS", "a range without a primary"))?;
            if !nodes.contains(&Some(node.clone())) {
                nodes.push(Some(node));
            }
        }
        Ok(nodes)
    }

    /// One `SCAN` step on `node`: the next cursor and the keys found.
    async fn scan(
        &self,
        node: Option<&Node>,
        cursor: u64,
        pattern: &str,
    ) -> Result<(u64, Vec<Vec<u8>>)> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let mut conn = self.conn.clone();
        let reply = self.call("list", conn.query_on(node, cmd)).await?;
        let parsed = match &reply {
            Value::Array(parts) => match (parts.first(), parts.get(1)) {
                (Some(Value::BulkString(c)), Some(Value::Array(keys))) => {
                    let cursor = std::str::from_utf8(c).ok().and_then(|c| c.parse().ok());
                    let keys: Option<Vec<Vec<u8>>> = keys
                        .iter()
                        .map(|k| match k {
                            Value::BulkString(k) => Some(k.clone()),
                            _ => None,
                        })
                        .collect();
                    cursor.zip(keys)
                }
                _ => None,
            },
            _ => None,
        };
        parsed.ok_or_else(|| bad_reply("SCAN", format!("{reply:?}")))
    }
}

fn single_client(config: &RedisConfig) -> Result<redis::Client> {
    let url = config.nodes().first().map_or("", String::as_str);
    #[cfg(feature = "tls")]
    {
        install_crypto_provider();
        if let Some(certs) = tls_certificates(config) {
            return redis::Client::build_with_tls(url, certs).map_err(|e| config_error(config, e));
        }
    }
    redis::Client::open(url).map_err(|e| config_error(config, e))
}

fn cluster_client(config: &RedisConfig) -> Result<ClusterClient> {
    let limit = config.timeout();
    let builder = ClusterClient::builder(config.nodes().iter().map(String::as_str))
        .connection_timeout(limit)
        .response_timeout(limit)
        .retries(2)
        .min_retry_wait(10)
        .max_retry_wait(limit.as_millis().try_into().unwrap_or(u64::MAX));
    #[cfg(feature = "tls")]
    let builder = {
        install_crypto_provider();
        match tls_certificates(config) {
            Some(certs) => builder.certs(certs),
            None => builder,
        }
    };
    builder.build().map_err(|e| config_error(config, e))
}

#[cfg(feature = "tls")]
fn tls_certificates(config: &RedisConfig) -> Option<redis::TlsCertificates> {
    config.tls_root_cert().map(|pem| redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem.to_vec()),
    })
}

/// rustls needs a process-wide crypto provider; install ring's unless one is set.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: a provider is then set.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

fn manager_config(limit: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(limit))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(limit)
}

fn cluster_config(limit: Duration) -> ClusterConfig {
    ClusterConfig::new()
        .set_connection_timeout(limit)
        .set_response_timeout(limit)
}

/// A URL the driver refuses; the message names the URLs with passwords hidden.
fn config_error(config: &RedisConfig, err: redis::RedisError) -> Error {
    let shown: Vec<String> = config
        .nodes()
        .iter()
        .map(|n| crate::config::redact(n))
        .collect();
    Error::Config {
        message: format!(
            "Redis URL refused ({}): {}",
            shown.join(", "),
            err.category()
        ),
        source: Some(Box::new(err)),
    }
}

async fn within<T>(
    what: &str,
    limit: Duration,
    fut: impl Future<Output = RedisResult<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(res) => res.map_err(|e| from_redis(what, e)),
        Err(elapsed) => Err(timed_out(what, limit, elapsed)),
    }
}

#[async_trait]
impl Backend for RedisBackend {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        let mut answers = self.claim_group(&[claim]).await?;
        answers.pop().ok_or_else(|| bad_reply("claim", "no answer"))
    }

    /// One script call for the whole batch standalone; in a cluster, one per slot, sent
    /// together.
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let groups = self.groups(claims);
        let calls = groups.iter().map(|g| {
            let claims: Vec<&Claim> = g.iter().map(|(_, c)| *c).collect();
            async move { self.claim_group(&claims).await }
        });
        let answers = futures::future::try_join_all(calls).await?;
        let mut out: Vec<Option<ClaimOutcome>> = vec![None; claims.len()];
        for (group, answers) in groups.iter().zip(answers) {
            for ((i, _), answer) in group.iter().zip(answers) {
                out[*i] = Some(answer);
            }
        }
        out.into_iter()
            .map(|a| a.ok_or_else(|| bad_reply("claim", "a claim got no answer")))
            .collect()
    }

    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
        let limit = self.shared.config.max_response_bytes();
        if response.len() > limit {
            return Err(Error::TooLarge {
                what: "response",
                size: response.len(),
                limit,
            });
        }
        let mut conn = self.conn.clone();
        let mut inv = self
            .shared
            .scripts
            .complete
            .key(self.record_key(&lease.key));
        inv.arg(lease.token)
            .arg(&lease.owner)
            .arg(&response[..])
            .arg(millis(retention));
        let done: i64 = self.call("complete", inv.invoke_async(&mut conn)).await?;
        if done == 1 {
            Ok(())
        } else {
            Err(Self::fenced(lease))
        }
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        let mut conn = self.conn.clone();
        let mut inv = self.shared.scripts.fail.key(self.record_key(&lease.key));
        inv.arg(lease.token)
            .arg(&lease.owner)
            .arg(error)
            .arg(if kind == FailureKind::Permanent {
                "1"
            } else {
                "0"
            })
            .arg(millis(retention));
        let done: i64 = self.call("fail", inv.invoke_async(&mut conn)).await?;
        if done == 1 {
            Ok(())
        } else {
            Err(Self::fenced(lease))
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        let mut conn = self.conn.clone();
        let mut inv = self.shared.scripts.extend.key(self.record_key(&lease.key));
        inv.arg(lease.token).arg(&lease.owner).arg(millis(ttl));
        let until: i64 = self.call("extend", inv.invoke_async(&mut conn)).await?;
        u64::try_from(until)
            .map(Timestamp::from_millis)
            .map_err(|_| Self::fenced(lease))
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.record_key(key));
        let reply: Value = self.call("get", cmd.query_async(&mut conn)).await?;
        decode_record(key, reply)
    }

    async fn delete(&self, key: &Key) -> Result<bool> {
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("DEL");
        cmd.arg(self.record_key(key));
        let removed: i64 = self.call("delete", cmd.query_async(&mut conn)).await?;
        Ok(removed > 0)
    }

    /// Redis expires records itself: always 0.
    async fn purge_expired(&self) -> Result<u64> {
        Ok(0)
    }

    /// `SCAN` under the prefix (on every primary of a cluster), a pipelined `GET` per
    /// page. Not a snapshot: records written during the scan may or may not appear.
    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>> {
        let layout = &self.shared.layout;
        let pattern = layout.pattern(filter.namespace.as_deref());
        let limit = if filter.limit == 0 {
            usize::MAX
        } else {
            filter.limit
        };
        let mut out = Vec::new();
        for node in self.scan_nodes().await? {
            let mut cursor = 0;
            loop {
                let (next, raw_keys) = self.scan(node.as_ref(), cursor, &pattern).await?;
                let mut keys = Vec::with_capacity(raw_keys.len());
                let mut pipe = redis::pipe();
                for raw in &raw_keys {
                    let key = layout.parse(raw).ok_or_else(|| {
                        Error::corrupt(format!(
                            "a key under the prefix is not an idem key: {}",
                            String::from_utf8_lossy(raw)
                        ))
                    })?;
                    pipe.cmd("GET").arg(raw);
                    keys.push(key);
                }
                let mut conn = self.conn.clone();
                let replies = if keys.is_empty() {
                    Vec::new()
                } else {
                    self.call("list", conn.pipe_on(node.as_ref(), pipe)).await?
                };
                for (key, reply) in keys.iter().zip(replies) {
                    if let Some(rec) = decode_record(key, reply)? {
                        if filter.matches(&rec) {
                            out.push(rec);
                            if out.len() >= limit {
                                return Ok(out);
                            }
                        }
                    }
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok(out)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_native_expiry(true)
            .with_batch_claim(true)
            .with_list(true)
            .with_max_response_bytes(self.shared.config.max_response_bytes())
    }
}
