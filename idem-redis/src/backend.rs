//! [`RedisBackend`]: connections, slot grouping, the operations that are one call each, and
//! `list`, walking the records under the prefix with `SCAN` on every primary of a cluster.
//! Claims are in `claim.rs`, settles in `settle.rs`.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::backend::watch::{Feed, Watch};
use idem_core::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Listing, Settlement, millis,
};
use idem_core::{Backend, Error, Key, Lease, Record, Result, Timestamp};
use redis::cluster_routing::Slot;
use redis::{RedisResult, Value};

use crate::RedisConfig;
use crate::conn::{Conn, Node, within};
use crate::error::{bad_reply, from_redis};
use crate::keys::Layout;
use crate::library::{Function, Library};
use crate::record::{Fence, decode_record, decode_string, int};

pub(crate) struct Shared {
    pub(crate) config: RedisConfig,
    pub(crate) layout: Layout,
    pub(crate) library: Library,
    /// The channel the settle function announces settled keys on: `<prefix>settled`.
    pub(crate) channel: String,
    /// The subscriber feeding [`Backend::watch`], started by the first watch.
    pub(crate) feed: OnceLock<Feed>,
    /// False once the server refused `SET … IFEQ` (Redis before 8.4, Valkey before 8.1):
    /// a complete then goes straight to the settle function.
    pub(crate) compare_and_set: AtomicBool,
}

/// Idempotency records in Redis, standalone or cluster.
///
/// A fresh key is claimed with a plain `SET NX`; every other operation is an atomic Lua
/// function of one Redis Functions library (complete, fail, release, extend, and a claim
/// of a key that has a record), one round trip each or per batch. The server's clock
/// decides lease lapse, and Redis expires records itself. Cloning is cheap and shares the
/// connection.
#[derive(Clone)]
pub struct RedisBackend {
    pub(crate) conn: Conn,
    pub(crate) shared: Arc<Shared>,
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
        let conn = Conn::connect(&config).await?;
        Ok(Self::with_conn(config, conn))
    }

    /// Like [`RedisBackend::connect`], but connects on the first call instead of now: for
    /// processes that must start while Redis is down. Calls fail with
    /// [`Error::Unavailable`] until it answers. Needs a running tokio runtime.
    pub fn connect_lazy(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        let conn = Conn::connect_lazy(&config)?;
        Ok(Self::with_conn(config, conn))
    }

    fn with_conn(config: RedisConfig, conn: Conn) -> Self {
        let layout = Layout::new(config.prefix());
        RedisBackend {
            conn,
            shared: Arc::new(Shared {
                channel: format!("{}settled", config.prefix()),
                config,
                layout,
                library: Library::new(),
                feed: OnceLock::new(),
                compare_and_set: AtomicBool::new(true),
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

    /// The name of the Redis Functions library this version of idem loads (on every
    /// primary of a cluster, where a call finds it missing): `idem_v2_` and a hash of its
    /// sources, so that another version's library, loaded beside it, is another name. An
    /// operator may `FUNCTION DELETE` the libraries of versions no longer running.
    pub fn function_library(&self) -> &str {
        self.shared.library.name()
    }

    /// Runs `fut` within the configured timeout, mapping its error.
    pub(crate) async fn call<T>(
        &self,
        what: &str,
        fut: impl Future<Output = RedisResult<T>>,
    ) -> Result<T> {
        // Boxed once here: the client's futures are large, and each layer of the timeout
        // would otherwise move (copy) the whole of it.
        within(what, self.shared.config.timeout(), Box::pin(fut)).await
    }

    /// Whether each of `keys` is met only once among them (a batch's repeated key is
    /// answered in order by a function, never by a plain command).
    pub(crate) fn met_once(keys: &[String]) -> Vec<bool> {
        let mut count: HashMap<&str, usize, foldhash::fast::RandomState> =
            HashMap::with_capacity_and_hasher(keys.len(), Default::default());
        for k in keys {
            *count.entry(k.as_str()).or_default() += 1;
        }
        keys.iter().map(|k| count[k.as_str()] == 1).collect()
    }

    /// `indices` grouped by the cluster slot of their Redis key (`keys[i]`), in order of
    /// first appearance; one group standalone, none if `indices` is empty.
    pub(crate) fn by_slot(
        &self,
        keys: &[String],
        indices: impl Iterator<Item = usize>,
    ) -> Vec<Vec<usize>> {
        if !matches!(self.conn, Conn::Cluster(_)) {
            let all: Vec<usize> = indices.collect();
            return if all.is_empty() {
                Vec::new()
            } else {
                vec![all]
            };
        }
        idem_core::backend::group_by(indices, |&i| Slot::for_key(&keys[i]))
    }
}

#[async_trait]
impl Backend for RedisBackend {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        self.claim_one(claim).await
    }

    /// A pipeline of `SET NX` for the batch, then, for the keys that had a record and need
    /// a decision, one function call; in a cluster, each per slot, sent together.
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.claim_all(claims).await
    }

    /// One function call for the whole batch standalone; in a cluster, one per slot, sent
    /// together. Oversized responses are refused here and never sent.
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.settle_all(items, retention).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        let key = self.record_key(&lease.key);
        let bytes = key.len() + lease.owner.len() + 48;
        let mut cmd = self.shared.library.fcall(Function::Extend, 1, 3, bytes);
        cmd.arg(key).arg(Fence(lease)).arg(millis(ttl));
        let until = self.fcall("extend", cmd).await?;
        let until = int(&until).ok_or_else(|| bad_reply("extend", format!("{until:?}")))?;
        u64::try_from(until)
            .map(Timestamp::from_millis)
            .map_err(|_| Error::fenced(lease))
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let record = self.record_key(key);
        let mut cmd = self.shared.library.fcall(Function::Get, 1, 1, record.len());
        cmd.arg(&record);
        match self.fcall("get", cmd).await? {
            Value::Array(mut parts) if parts.len() == 2 => {
                let expire = parts.pop().as_ref().and_then(int);
                let value = parts.pop().unwrap_or(Value::Nil);
                let expire = expire.ok_or_else(|| bad_reply("get", "no expiry time"))?;
                decode_record(key, &record, value, expire)
            }
            other => Err(bad_reply("get", format!("{other:?}"))),
        }
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
    /// page. Not a snapshot: records written during the scan may or may not appear. A key
    /// under the prefix that is not an idem record (a name idem does not write, a value of
    /// another type, a string that does not decode) is skipped and counted.
    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        self.scan_records(filter).await
    }

    /// One subscriber connection per backend (and its clones), started here the first
    /// time, fanned out in process; see `notify.rs`.
    async fn watch(&self, key: &Key) -> Watch {
        let feed = self.shared.feed.get_or_init(|| self.feed());
        feed.watch(self.record_key(key), self.shared.config.timeout())
            .await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_native_expiry(true)
            .with_list(true)
            .with_notify(true)
            .with_max_response_bytes(self.shared.config.max_response_bytes())
    }
}

/// Keys asked for per `SCAN` step.
const SCAN_COUNT: usize = 1000;

impl RedisBackend {
    /// [`Backend::list`](idem_core::Backend::list): `SCAN` under the prefix on every node
    /// that holds records, one pipelined `GET` and `PEXPIRETIME` per page; and, for a page
    /// with keys of another type, one pipelined `TYPE` of those, to say what they hold.
    pub(crate) async fn scan_records(&self, filter: &ListFilter) -> Result<Listing> {
        let layout = &self.shared.layout;
        let pattern = layout.pattern(filter.namespace.as_deref());
        let limit = if filter.limit == 0 {
            usize::MAX
        } else {
            filter.limit
        };
        let mut out = Listing::default();
        for node in self.scan_nodes().await? {
            let mut cursor = 0;
            loop {
                let (next, raw_keys) = self.scan(node.as_ref(), cursor, &pattern).await?;
                let mut keys = Vec::with_capacity(raw_keys.len());
                let mut pipe = redis::pipe();
                for raw in raw_keys {
                    let Some(key) = layout.parse(&raw) else {
                        out.skip(&raw, "not a key idem names");
                        continue;
                    };
                    pipe.cmd("GET").arg(&raw);
                    pipe.cmd("PEXPIRETIME").arg(&raw);
                    keys.push((raw, key));
                }
                let mut conn = self.conn.clone();
                let replies = if keys.is_empty() {
                    Vec::new()
                } else {
                    self.call("list", conn.pipe_on(node.as_ref(), pipe)).await?
                };
                if replies.len() != 2 * keys.len() {
                    return Err(bad_reply("list", format!("{replies:?}")));
                }
                let mut replies = replies.into_iter();
                let mut other_types = Vec::new();
                for (raw, key) in &keys {
                    let (value, expire) = (replies.next(), replies.next());
                    let expire = expire.as_ref().and_then(int);
                    let (Some(value), Some(expire)) = (value, expire) else {
                        return Err(bad_reply("list", "a record without its expiry time"));
                    };
                    let decoded = match value {
                        Value::Nil => continue,
                        Value::BulkString(v) => decode_string(key, &v, expire),
                        Value::ServerError(e) if e.code() == "WRONGTYPE" => {
                            other_types.push(raw);
                            continue;
                        }
                        Value::ServerError(e) => return Err(from_redis("list", e.into())),
                        other => return Err(bad_reply("list", format!("{other:?}"))),
                    };
                    match decoded {
                        Ok(Some(rec)) if filter.matches(&rec) && out.records.len() < limit => {
                            out.records.push(rec);
                        }
                        Ok(_) => {}
                        Err(why) => out.skip(raw, why),
                    }
                }
                self.skip_other_types(node.as_ref(), &other_types, &mut out)
                    .await?;
                cursor = next;
                if cursor == 0 || out.records.len() >= limit {
                    break;
                }
            }
            if out.records.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    /// Counts the keys `raw` on `node`, whose `GET` found a value of another type, as
    /// skipped, each with the type it holds (a key gone since is not counted).
    async fn skip_other_types(
        &self,
        node: Option<&Node>,
        raw: &[&Vec<u8>],
        out: &mut Listing,
    ) -> Result<()> {
        if raw.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for key in raw {
            pipe.cmd("TYPE").arg(key.as_slice());
        }
        let mut conn = self.conn.clone();
        let types = self.call("list", conn.pipe_on(node, pipe)).await?;
        if types.len() != raw.len() {
            return Err(bad_reply("list", format!("TYPE: {types:?}")));
        }
        for (key, kind) in raw.iter().zip(types) {
            match kind {
                Value::SimpleString(kind) if kind == "none" => {}
                Value::SimpleString(kind) => out.skip(key, format_args!("holds a Redis {kind}")),
                other => return Err(bad_reply("list", format!("TYPE: {other:?}"))),
            }
        }
        Ok(())
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
