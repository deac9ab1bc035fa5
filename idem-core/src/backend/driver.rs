//! Backends that describe themselves. Each backend crate exports one [`Driver`]: the URL
//! schemes it answers to, how to connect from a URL, what to create in the store, the
//! store's raw writes (the write-if-absent and the overwrite that benches measure idem
//! against), and how a test or a bench gets a place of its own. The `idem` facade registers
//! the drivers compiled in (`idem_once::drivers()`, `idem_once::open(url)`); the CLI and the
//! benches iterate them, so adding a backend is its crate, a facade feature and one
//! registration line.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::{Backend, Error, MemoryBackend, Result};

/// How long a raw baseline's keys are kept, where the store expires keys itself.
pub const RAW_RETENTION: Duration = Duration::from_secs(600);

/// How to open a store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// Connections to keep for concurrent calls (a pool's size); 0 keeps the backend's
    /// default.
    pub connections: u32,
    /// A place of the store's own for this tag (a key prefix, a schema, a table), made by
    /// [`Driver::open`] and removed by [`Store::close`]: what a bench or a test opens, so
    /// that nothing another run writes is visible to it.
    pub isolate: Option<String>,
}

impl Options {
    /// The backend's defaults, in the place the URL names.
    pub fn new() -> Self {
        Options::default()
    }

    /// Sets [`Options::connections`].
    pub fn with_connections(mut self, connections: u32) -> Self {
        self.connections = connections;
        self
    }

    /// Sets [`Options::isolate`]: a place of its own, named after `tag` (lower-case
    /// letters, digits and `_`; others are replaced by `_`).
    pub fn with_isolation(mut self, tag: &str) -> Self {
        let tag: String = tag
            .chars()
            .map(|c| match c {
                'a'..='z' | '0'..='9' | '_' => c,
                'A'..='Z' => c.to_ascii_lowercase(),
                _ => '_',
            })
            .collect();
        self.isolate = Some(tag);
        self
    }
}

/// A backend, as a tool that knows only its URL sees it.
#[async_trait]
pub trait Driver: Send + Sync + 'static {
    /// The short name: `memory`, `redis`, `postgres`, `dynamodb`.
    fn name(&self) -> &'static str;

    /// The URL schemes it opens (`redis`, `rediss`), without `://`.
    fn schemes(&self) -> &'static [&'static str];

    /// The URL's form, for help texts and errors: one line.
    fn usage(&self) -> &'static str;

    /// Checks `url` without connecting and answers it as it may be shown (passwords hidden,
    /// defaults spelled out). A URL that does not parse is [`Error::Config`] with the
    /// reason.
    fn check(&self, url: &str) -> Result<String>;

    /// Connects to the store `url` names.
    async fn open(&self, url: &str, options: &Options) -> Result<Box<dyn Store>>;

    /// The URL of the server the tests and benches use, from the environment
    /// (`IDEM_REDIS_URL`, …), or [`Error::Config`] naming the variable and the command that
    /// starts the server.
    fn test_url(&self) -> Result<String>;
}

/// A store opened by a [`Driver`].
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug {
    /// The store as a backend.
    fn backend(&self) -> Arc<dyn Backend>;

    /// Creates what the store needs (tables, a schema) if it is missing; says what it did.
    async fn migrate(&self) -> Result<String>;

    /// The store's own writes through the same client, creating what they need: the
    /// baselines a bench measures idem against.
    async fn raw(&self) -> Result<Arc<dyn RawWrite>>;

    /// Removes the place [`Options::isolate`] made (and what the raw baseline wrote
    /// there); nothing for a store opened without isolation.
    async fn close(self: Box<Self>) -> Result<()>;

    /// The consumer offsets the store keeps in transactional mode; `None` (the default)
    /// for a store without that mode.
    fn offsets(&self) -> Option<Arc<dyn crate::Offsets>> {
        None
    }
}

/// A store's plain writes, with no state machine around them: what a bench measures idem
/// against. [`RawWrite::insert`] alone is the single raw write, the floor of any scheme
/// that records keys; [`RawWrite::insert`] then [`RawWrite::settle`] of the same keys is
/// idem's claim and complete written by hand (no leases, tokens, fencing or attempts).
#[async_trait]
pub trait RawWrite: Send + Sync {
    /// What [`RawWrite::insert`] is, for reports: `SET NX PX`, `INSERT … ON CONFLICT DO
    /// NOTHING`.
    fn name(&self) -> &'static str;

    /// What [`RawWrite::settle`] is, for reports: `SET PX`, `UPDATE`.
    fn settle_name(&self) -> &'static str;

    /// Writes each of `keys` with `value` where absent, in one round trip where the store
    /// can; a key already present is not an error. Kept for [`RAW_RETENTION`] where the
    /// store expires keys.
    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()>;

    /// Writes `value` over each of `keys`, which [`RawWrite::insert`] wrote (the response
    /// stored over the claim), in one round trip where the store can, with no condition.
    /// Kept for [`RAW_RETENTION`] from now where the store expires keys.
    async fn settle(&self, keys: &[String], value: &Bytes) -> Result<()>;
}

/// The environment variable `var`, or [`Error::Config`] naming it and how to set it: in
/// the idem repository, the command that starts the test services; elsewhere, the URL of
/// a server of your own.
pub fn service_url(var: &str) -> Result<String> {
    match std::env::var(var) {
        Ok(value) if !value.trim().is_empty() => Ok(value),
        _ => Err(Error::config(format!(
            "{var} is not set: set it to the URL of a test server (in the idem repository, \
             `eval \"$(scripts/services up)\"` starts them and sets it; scripts/test does \
             this for you)"
        ))),
    }
}

/// `url` (or several, comma-separated) with any password, in the user part or a `pass` or
/// `password` query parameter, replaced by `***`. A URL that does not parse is shown only
/// by its scheme, since its password cannot be found. The one redaction every backend's
/// `Debug`, error and display uses.
pub fn redact(url: &str) -> String {
    if url.contains(',') {
        return url
            .split(',')
            .map(|one| redact(one.trim()))
            .collect::<Vec<_>>()
            .join(",");
    }
    let parsed = url::Url::parse(url).ok();
    // `user:secret@host` without `//` parses as a scheme and a path: hidden as well.
    let Some(mut parsed) = parsed.filter(|p| !(p.cannot_be_a_base() && url.contains('@'))) else {
        return match url.split_once(':') {
            Some((scheme, _)) if is_scheme(scheme) => format!("{scheme}:<unparsable URL>"),
            _ => "<unparsable URL>".to_owned(),
        };
    };
    if parsed.password().is_some() {
        // Fails only for URLs that cannot have a password, which then have none.
        let _ = parsed.set_password(Some("***"));
    }
    let hidden = |k: &str| k == "pass" || k == "password";
    if parsed.query_pairs().any(|(k, _)| hidden(&k)) {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(k, v)| {
                let v = if hidden(&k) {
                    "***".into()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.to_string()
}

/// Removes the query parameter `name` from `url` and returns its last value: how a driver
/// takes its own parameters (`prefix`, `schema`) and leaves the rest to the client.
pub fn take_param(url: &mut url::Url, name: &str) -> Option<String> {
    let mut found = None;
    let mut rest = Vec::new();
    for (k, v) in url.query_pairs() {
        if k == name {
            found = Some(v.into_owned());
        } else {
            rest.push((k.into_owned(), v.into_owned()));
        }
    }
    if found.is_some() {
        if rest.is_empty() {
            url.set_query(None);
        } else {
            url.query_pairs_mut().clear().extend_pairs(rest);
        }
    }
    found
}

/// Refuses a query parameter of `url` that is not in `accepted`: the parameters the driver
/// takes itself (`prefix`, `schema`) and those its client reads from the URL (`sslmode`,
/// `protocol`, …). An entry with a `*` stands for any text there (`options[*]`). The error
/// names the parameter, the accepted ones and, when one is a letter or two away, the one
/// probably meant. Without this check a misspelt parameter (`?prefx=p`) is silently ignored
/// and the store opened with the default.
pub fn check_params(url: &url::Url, accepted: &[&str]) -> Result<()> {
    let Some((name, _)) = url
        .query_pairs()
        .find(|(k, _)| !accepted.iter().any(|a| param_matches(a, k)))
    else {
        return Ok(());
    };
    let known = if accepted.is_empty() {
        "this backend takes no parameters".to_owned()
    } else {
        format!("accepted: {}", accepted.join(", "))
    };
    let hint = closest(&name, accepted)
        .map(|a| format!("; did you mean `{a}`?"))
        .unwrap_or_default();
    Err(Error::config(format!(
        "unknown parameter {name:?} ({known}){hint}"
    )))
}

/// Whether the query key `key` is the accepted parameter `pattern` (a `*` in which stands
/// for any text).
fn param_matches(pattern: &str, key: &str) -> bool {
    match pattern.split_once('*') {
        Some((head, tail)) => {
            key.len() >= head.len() + tail.len() && key.starts_with(head) && key.ends_with(tail)
        }
        None => pattern == key,
    }
}

/// The accepted parameter nearest `name`, if it is at most two edits away (and fewer
/// than `name` has characters, so that a short name is not "close" to everything).
fn closest<'a>(name: &str, accepted: &[&'a str]) -> Option<&'a str> {
    let name = name.to_ascii_lowercase();
    accepted
        .iter()
        .filter(|a| !a.contains('*'))
        .map(|a| (edit_distance(&name, a), *a))
        .filter(|&(d, _)| d <= 2 && d < name.chars().count())
        .min_by_key(|&(d, _)| d)
        .map(|(_, a)| a)
}

/// The Levenshtein distance of `a` and `b`: insertions, deletions and substitutions of
/// one character each.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

fn is_scheme(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// The in-memory backend's driver: `memory:` (this process only).
pub static MEMORY: MemoryDriver = MemoryDriver;

/// See [`MEMORY`].
#[derive(Debug)]
pub struct MemoryDriver;

#[async_trait]
impl Driver for MemoryDriver {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn schemes(&self) -> &'static [&'static str] {
        &["memory"]
    }
    fn usage(&self) -> &'static str {
        "memory: (this process only)"
    }
    fn check(&self, url: &str) -> Result<String> {
        let url = url.trim();
        if let Ok(parsed) = url::Url::parse(url) {
            check_params(&parsed, &[])?;
        }
        match url {
            "memory:" | "memory://" | "memory" => Ok("memory:".into()),
            _ => Err(Error::config("write memory: with nothing after it")),
        }
    }
    async fn open(&self, url: &str, _options: &Options) -> Result<Box<dyn Store>> {
        self.check(url)?;
        Ok(Box::new(MemoryStore(MemoryBackend::new())))
    }
    fn test_url(&self) -> Result<String> {
        Ok("memory:".into())
    }
}

#[derive(Debug)]
struct MemoryStore(MemoryBackend);

#[async_trait]
impl Store for MemoryStore {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.0.clone())
    }
    async fn migrate(&self) -> Result<String> {
        Ok("memory: nothing to migrate".into())
    }
    async fn raw(&self) -> Result<Arc<dyn RawWrite>> {
        Ok(Arc::new(MapInsert::default()))
    }
    async fn close(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

/// The memory baseline: a plain map insert, or overwrite, under the lock of the key's
/// shard, with as many shards as `MemoryBackend` has, so that the ratio compares the
/// records' work and not one lock against 64.
struct MapInsert {
    shards: Vec<Mutex<HashMap<String, Bytes>>>,
    hasher: RandomState,
}

impl Default for MapInsert {
    fn default() -> Self {
        MapInsert {
            shards: (0..MemoryBackend::SHARDS)
                .map(|_| Mutex::default())
                .collect(),
            hasher: RandomState::new(),
        }
    }
}

impl MapInsert {
    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Bytes>> {
        let at = self.hasher.hash_one(key) as usize % self.shards.len();
        self.shards[at].lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl RawWrite for MapInsert {
    fn name(&self) -> &'static str {
        "sharded HashMap insert"
    }
    fn settle_name(&self) -> &'static str {
        "sharded HashMap overwrite"
    }
    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()> {
        for k in keys {
            self.shard(k)
                .entry(k.clone())
                .or_insert_with(|| value.clone());
        }
        Ok(())
    }
    async fn settle(&self, keys: &[String], value: &Bytes) -> Result<()> {
        for k in keys {
            let mut shard = self.shard(k);
            match shard.get_mut(k) {
                Some(slot) => *slot = value.clone(),
                None => {
                    shard.insert(k.clone(), value.clone());
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_hides_every_password() {
        let shown = redact("redis://:s3cret@h:6379/0,redis://u:pw2@h2/?password=pw3&db=1");
        for secret in ["s3cret", "pw2", "pw3"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("db=1"), "{shown}");
        assert_eq!(redact("postgres://app@db/x"), "postgres://app@db/x");
        assert_eq!(
            redact("postgres://u:s3cret@[bad"),
            "postgres:<unparsable URL>"
        );
        assert_eq!(redact("u:s3cret@nowhere"), "u:<unparsable URL>");
        assert_eq!(redact("not a url"), "<unparsable URL>");
    }

    #[test]
    fn take_param_leaves_the_other_parameters() {
        let mut url = url::Url::parse("postgres://h/db?schema=a&sslmode=off&schema=b").unwrap();
        assert_eq!(take_param(&mut url, "schema").as_deref(), Some("b"));
        assert_eq!(url.as_str(), "postgres://h/db?sslmode=off");
        assert_eq!(take_param(&mut url, "schema"), None);
        let mut url = url::Url::parse("redis://h/?prefix=p").unwrap();
        assert_eq!(take_param(&mut url, "prefix").as_deref(), Some("p"));
        assert_eq!(url.as_str(), "redis://h/");
    }

    #[test]
    fn check_params_names_the_unknown_one_and_the_one_meant() {
        let url = |s: &str| url::Url::parse(s).unwrap();
        let accepted = ["prefix", "protocol", "options[*]"];
        assert!(check_params(&url("redis://h/?prefix=p&protocol=3"), &accepted).is_ok());
        assert!(check_params(&url("redis://h/"), &[]).is_ok());
        assert!(check_params(&url("postgres://h/d?options[search_path]=x"), &accepted).is_ok());
        let message = |s: &str, accepted: &[&str]| match check_params(&url(s), accepted) {
            Err(Error::Config { message, .. }) => message,
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(
            message("redis://h/?prefix=a&prefx=p", &accepted),
            "unknown parameter \"prefx\" (accepted: prefix, protocol, options[*]); did you mean `prefix`?"
        );
        // Nothing close: no guess; a short name is close to nothing.
        let far = message("redis://h/?colour=red", &accepted);
        assert!(
            far.starts_with("unknown parameter \"colour\" (accepted: "),
            "{far}"
        );
        assert!(!far.contains("did you mean"), "{far}");
        assert!(!message("redis://h/?x=1", &["db"]).contains("did you mean"));
        assert!(message("redis://h/?PREFIX=p", &accepted).ends_with("did you mean `prefix`?"));
        // `options[` alone is not `options[*]`.
        assert!(message("postgres://h/d?options[=x", &accepted).contains("\"options[\""));
        assert_eq!(
            message("memory:?prefix=p", &[]),
            "unknown parameter \"prefix\" (this backend takes no parameters)"
        );
        assert!(MEMORY.check("memory:?prefx=p").is_err());
    }

    #[test]
    fn edit_distance_counts_single_character_edits() {
        for (a, b, d) in [
            ("prefix", "prefix", 0),
            ("prefx", "prefix", 1),
            ("sslmod", "sslmode", 1),
            ("ssl_mode", "ssl-mode", 1),
            ("protocl", "protocol", 1),
            ("", "db", 2),
            ("kitten", "sitting", 3),
        ] {
            assert_eq!(edit_distance(a, b), d, "{a} {b}");
            assert_eq!(edit_distance(b, a), d, "{b} {a}");
        }
    }

    #[tokio::test]
    async fn the_memory_baseline_inserts_where_absent_and_settles_over() {
        let raw = MapInsert::default();
        let keys = ["a".to_owned(), "b".to_owned()];
        let (first, second) = (Bytes::from_static(b"1"), Bytes::from_static(b"2"));
        raw.insert(&keys, &first).await.unwrap();
        raw.insert(&keys[..1], &second).await.unwrap();
        let get = |k: &str| raw.shard(k).get(k).cloned();
        assert_eq!(get("a"), Some(first.clone()));
        raw.settle(&keys, &second).await.unwrap();
        assert_eq!((get("a"), get("b")), (Some(second.clone()), Some(second)));
    }

    #[test]
    fn isolation_tags_are_plain() {
        let o = Options::new().with_isolation("Bench-1 x");
        assert_eq!(o.isolate.as_deref(), Some("bench_1_x"));
    }
}
