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
use redis::cluster_routing::Slot;
use redis::{RedisResult, Script, ScriptInvocation, Value};

use crate::RedisConfig;
use crate::conn::{Conn, within};
use crate::error::bad_reply;
use crate::keys::Layout;
use crate::record::{decode_outcome, decode_record};

/// Durations are sent in milliseconds, at most about a century, so that every deadline
/// stays exact in the scripts' numbers.
const MAX_MILLIS: u64 = 100 * 365 * 24 * 3600 * 1000;

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

pub(crate) struct Shared {
    pub(crate) config: RedisConfig,
    pub(crate) layout: Layout,
    scripts: Scripts,
}

/// Idempotency records in Redis, standalone or cluster.
///
/// Every operation is one Lua script run on the server (claim, complete, fail, extend),
/// so it is atomic and takes one round trip; the server's clock decides lease lapse, and
/// Redis expires records itself. Cloning is cheap and shares the connection.
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
    pub(crate) async fn call<T>(
        &self,
        what: &str,
        fut: impl Future<Output = RedisResult<T>>,
    ) -> Result<T> {
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

    /// Runs a fencing script for `lease` (KEYS: the record; ARGV: token, owner, then what
    /// `args` adds) and returns its integer reply.
    async fn fencing(
        &self,
        what: &str,
        script: &Script,
        lease: &Lease,
        args: impl FnOnce(&mut ScriptInvocation<'_>),
    ) -> Result<i64> {
        let mut inv = script.key(self.record_key(&lease.key));
        inv.arg(lease.token).arg(&lease.owner);
        args(&mut inv);
        let mut conn = self.conn.clone();
        self.call(what, inv.invoke_async(&mut conn)).await
    }

    /// The error of a fencing call whose lease no longer holds the record.
    fn fenced(lease: &Lease) -> Error {
        Error::Fenced {
            key: lease.key.clone(),
            token: lease.token,
        }
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
        let done = self
            .fencing("complete", &self.shared.scripts.complete, lease, |inv| {
                inv.arg(&response[..]).arg(millis(retention));
            })
            .await?;
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
        let permanent = if kind == FailureKind::Permanent {
            "1"
        } else {
            "0"
        };
        let done = self
            .fencing("fail", &self.shared.scripts.fail, lease, |inv| {
                inv.arg(error).arg(permanent).arg(millis(retention));
            })
            .await?;
        if done == 1 {
            Ok(())
        } else {
            Err(Self::fenced(lease))
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        let until = self
            .fencing("extend", &self.shared.scripts.extend, lease, |inv| {
                inv.arg(millis(ttl));
            })
            .await?;
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
        self.scan_records(filter).await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_native_expiry(true)
            .with_batch_claim(true)
            .with_list(true)
            .with_max_response_bytes(self.shared.config.max_response_bytes())
    }
}
