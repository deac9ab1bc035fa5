//! What a backend author needs: the [`Backend`] trait and everything around it. Broker
//! bindings such as `idem-kafka` build on it too, through the engine's batch calls
//! ([`Engine::claim_many`](crate::Engine::claim_many),
//! [`Engine::run_leased`](crate::Engine::run_leased),
//! [`Engine::settle_batch`](crate::Engine::settle_batch)), and so do tests that check a
//! store against the state machine.
//!
//! A user of the engine needs only the crate's root. What is here is for the people who
//! write a store, a layer, a consumer loop or a test:
//!
//! - the trait and its vocabulary: [`Backend`], [`Capabilities`], [`ListFilter`],
//!   [`Listing`] and [`Skipped`], the requests and answers [`Claim`], [`ClaimOutcome`],
//!   [`Settle`], [`Settlement`], and what [`Engine::run_leased`](crate::Engine::run_leased)
//!   says, [`Ran`];
//! - the checks every store makes alike, written once: [`check_response`],
//!   [`handler_response`], [`millis`] (one cap, [`MAX_MILLIS`]),
//!   [`Error::fenced`], [`per_item`], [`group_by`], [`list_limited`];
//! - the state machine as pure functions ([`machine`]), the reference model over it
//!   ([`Model`]), change notifications ([`watch`]), drivers for tools that know only a URL
//!   ([`driver`]);
//! - panics turned into failures ([`panic_at_poll`], [`panic_text`], [`Unwind`]) and
//!   transactional mode's offsets ([`OffsetPosition`], [`StoredOffset`], [`TxFuture`]);
//! - transactional mode written once over a store's transaction steps ([`tx`]: the
//!   [`TxStore`](tx::TxStore) hooks, [`tx::execute`], [`tx::execute_batch`]), which the
//!   SQL backends answer [`Transactional`](crate::Transactional) with;
//! - [`async_trait`](macro@async_trait), which `Backend` is declared with.
//!
//! Types that a user's own code meets (a [`Lease`] in a handler's
//! [`Context`](crate::Context), a [`Record`] read back,
//! [`Timestamp`], [`State`], [`ClaimKind`](crate::ClaimKind),
//! [`FailureKind`], [`Key`], [`Error`]) live at
//! the root only: a backend imports them from there. One name has two paths: `Backend` is
//! here, where it is documented, and at the root, because a user names it to pick a store
//! at run time (`Arc<dyn Backend>` is what [`Engine::builder`](crate::Engine::builder)
//! takes). `Claim` stays here although [`Engine::claim_for`](crate::Engine::claim_for)
//! returns one: a user passes it on without naming it.
//!
//! # Batch calls first
//!
//! A backend writes the batch calls, [`Backend::claim_many`] and
//! [`Backend::settle_many`]; the single calls [`Backend::claim`], [`Backend::complete`],
//! [`Backend::fail`] and [`Backend::release`] are provided from them, as a batch of one.
//! The engine settles through `settle_many` even for one message, and a consumer claims
//! whole polls, so the batch is the path that has to be fast anyway; a store that answers
//! one claim cheaper than a batch of one (a plain `SET NX`, one conditional write)
//! overrides `claim`, as Redis, DynamoDB and the memory store do; PostgreSQL keeps its
//! single-row settle statements, simpler than a batch of one. Nothing is slower than
//! before: the engine's own calls were batch calls already. A backend so writes one settle
//! path instead of four (the memory, Redis and DynamoDB stores dropped theirs), and a
//! batch that loops over single calls (the old default) can no longer hide in a store.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::{Error, FailureKind, HandlerError, Key, Lease, Record, Result, State, Timestamp};

pub mod driver;
pub mod machine;
mod model;
#[cfg(feature = "rustls")]
pub mod tls;
pub mod tx;
pub mod watch;

pub use crate::engine::Ran;
pub use crate::handler::{Unwind, panic_at_poll, panic_text};
pub use crate::record::{Claim, ClaimOutcome, Settle, Settlement};
pub use crate::transactional::{OffsetPosition, StoredOffset, TxFuture};
pub use async_trait::async_trait;
pub use model::Model;
use watch::Watch;

/// What a backend can do beyond the required operations. The conformance suite and the
/// engine read these; nothing asks a backend for what it does not declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The store drops expired records itself; `purge_expired` has little or nothing to do.
    pub native_expiry: bool,
    /// The largest response `complete` accepts, in bytes.
    pub max_response_bytes: usize,
    /// `list` is implemented.
    pub list: bool,
    /// [`Backend::watch`] is woken by the store when a key is settled (completed, failed,
    /// released); without it a watch only times out, and a waiting engine polls.
    pub notify: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            native_expiry: false,
            max_response_bytes: 64 * 1024,
            list: false,
            notify: false,
        }
    }
}

impl Capabilities {
    /// Sets `native_expiry`.
    pub fn with_native_expiry(mut self, yes: bool) -> Self {
        self.native_expiry = yes;
        self
    }

    /// Sets `list`.
    pub fn with_list(mut self, yes: bool) -> Self {
        self.list = yes;
        self
    }

    /// Sets `notify`.
    pub fn with_notify(mut self, yes: bool) -> Self {
        self.notify = yes;
        self
    }

    /// Sets `max_response_bytes`.
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }
}

/// Which records [`Backend::list`] returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Only this namespace (all when `None`).
    pub namespace: Option<String>,
    /// Only this state (all when `None`).
    pub state: Option<State>,
    /// At most this many records (0: no limit).
    pub limit: usize,
}

impl ListFilter {
    /// Whether `record` passes the namespace and state conditions.
    pub fn matches(&self, record: &Record) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| record.key.namespace() == ns)
            && self.state.is_none_or(|s| record.state == s)
    }
}

/// What [`Backend::list`] answers: the live records that pass the filter, and the entries
/// it met where records live that are not idem records (under a Redis prefix, a key of
/// another type or a string that does not decode; in a table, a row or item that does
/// not decode), skipped and counted instead of failing the listing, so that one value
/// idem did not write hides nothing else. The first [`Listing::KEPT`] skipped entries are
/// kept, every one is counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Listing {
    /// The records, in no set order.
    pub records: Vec<Record>,
    /// The first skipped entries, at most [`Listing::KEPT`], in the order met.
    pub skipped: Vec<Skipped>,
    /// How many entries were skipped in all: at least `skipped.len()`.
    pub skipped_total: u64,
}

/// An entry [`Backend::list`] skipped: not an idem record.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Skipped {
    /// The store's own key for it (a Redis key, a row's `namespace/id`, an item's partition
    /// key) as UTF-8, invalid bytes replaced, cut to [`Listing::MAX_TEXT`] bytes.
    pub key: String,
    /// Why it is not an idem record (`holds a Redis hash`, `bad length`), cut likewise.
    pub reason: String,
}

impl Listing {
    /// How many skipped entries a listing keeps (it counts them all).
    pub const KEPT: usize = 20;
    /// The longest key or reason text a skipped entry keeps, in bytes.
    pub const MAX_TEXT: usize = 200;

    /// A listing of `records`, none skipped.
    pub fn of(records: Vec<Record>) -> Self {
        Listing {
            records,
            ..Listing::default()
        }
    }

    /// Counts an entry at `key` (the store's own key, any bytes) that is not an idem
    /// record, for `reason`; keeps it among the first [`Listing::KEPT`].
    pub fn skip(&mut self, key: impl AsRef<[u8]>, reason: impl std::fmt::Display) {
        self.skipped_total += 1;
        if self.skipped.len() < Self::KEPT {
            self.skipped.push(Skipped {
                key: cut(String::from_utf8_lossy(key.as_ref()).into_owned()),
                reason: cut(reason.to_string()),
            });
        }
    }

    /// Adds what a store decoded at `key`: the record, or a skipped entry when it is
    /// [`Error::Corrupt`] (its message, and its source's, as the reason). Any other error
    /// (the store's own, a connection's) is returned: it fails the listing.
    pub fn add(&mut self, key: impl FnOnce() -> String, decoded: Result<Record>) -> Result<()> {
        match decoded {
            Ok(record) => self.records.push(record),
            Err(Error::Corrupt { message, source }) => match source {
                Some(source) => self.skip(key(), format_args!("{message}: {source}")),
                None => self.skip(key(), message),
            },
            Err(e) => return Err(e),
        }
        Ok(())
    }
}

/// `text` cut to at most [`Listing::MAX_TEXT`] bytes, at a character boundary, `…` marking
/// a cut.
fn cut(mut text: String) -> String {
    if text.len() > Listing::MAX_TEXT {
        let mut at = Listing::MAX_TEXT - '…'.len_utf8();
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
        text.push('…');
    }
    text
}

/// [`Backend::list`] for a store whose list query takes a `LIMIT` and returns rows in a
/// fixed order (its primary key's): `fetch(n)` reads at most `n` rows (0: all of them),
/// `decode` adds one row to the listing ([`Listing::add`]). When rows that do not decode
/// leave a full page short of `limit` records (0: no limit), the query runs again with a
/// larger `LIMIT` (at least twice the last), so the limit counts records, not rows; the
/// listing is then cut to `limit` records.
pub async fn list_limited<R, F, Fut>(
    limit: usize,
    mut fetch: F,
    mut decode: impl FnMut(&R, &mut Listing) -> Result<()>,
) -> Result<Listing>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<R>>>,
{
    let mut asked = limit;
    loop {
        let rows = fetch(asked).await?;
        let mut listing = Listing::default();
        for row in &rows {
            decode(row, &mut listing)?;
        }
        if limit == 0 || rows.len() < asked || listing.records.len() >= limit {
            listing
                .records
                .truncate(if limit == 0 { usize::MAX } else { limit });
            return Ok(listing);
        }
        let short = usize::try_from(listing.skipped_total).unwrap_or(usize::MAX);
        asked = limit.saturating_add(short).max(asked.saturating_mul(2));
    }
}

/// A store of idempotency records. Every method is one atomic step in the store.
///
/// A backend writes the batch calls, [`Backend::claim_many`] and [`Backend::settle_many`];
/// the single calls are provided as a batch of one (see the [module docs](self) for why),
/// and a store with a cheaper single path overrides them.
///
/// Object safe: the backend is often picked at run time, so `Arc<dyn Backend>` works
/// everywhere a backend does.
#[async_trait]
pub trait Backend: Send + Sync {
    /// Claims `claim.key`, atomically: of concurrent claims on one key, at most one returns
    /// [`ClaimOutcome::Acquired`] while its lease is live; the others learn the existing
    /// record's answer in the same call. Granted tokens for a key strictly increase. The
    /// default is [`Backend::claim_many`] of one.
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        let mut answers = self.claim_many(std::slice::from_ref(claim)).await?;
        match (answers.pop(), answers.is_empty()) {
            (Some(answer), true) => Ok(answer),
            _ => Err(Error::corrupt(
                "claim_many of one claim did not answer once",
            )),
        }
    }

    /// Claims each of `claims`, answering in the same order, each with the guarantee of
    /// [`Backend::claim`]: as if made one after another, so a key repeated in the batch is
    /// answered from the state the earlier claim left. The batch is not atomic as a whole.
    /// A store error fails the whole call.
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>>;

    /// Marks the lease's key `Completed` with `response`, kept for `retention`. Succeeds
    /// only while the record is `Processing` with the lease's token; otherwise
    /// [`Error::Fenced`] and nothing changes. A response over
    /// [`Capabilities::max_response_bytes`] is [`Error::TooLarge`].
    /// The default is [`Backend::settle_many`] of one.
    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
        settle_one(
            self,
            Settlement::complete(lease.clone(), response),
            retention,
        )
        .await
    }

    /// Marks the lease's key `Failed` with `error`, kept for `retention`: a later claim
    /// retries it while attempts are left, unless `kind` is permanent. Fenced like
    /// [`Backend::complete`]. The default is [`Backend::settle_many`] of one.
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        let item = Settlement::fail(lease.clone(), error, kind);
        settle_one(self, item, retention).await
    }

    /// Hands back a lease whose handler never started (a revoke, a shutdown): the attempt
    /// it counted is taken back and the lease lapses now, so the next claim takes the key
    /// over at once; the token stays. Only the holder of a live lease can release; a lapsed
    /// or superseded lease is [`Error::Fenced`] and nothing changes.
    /// The default is [`Backend::settle_many`] of one.
    async fn release(&self, lease: &Lease) -> Result<()> {
        settle_one(self, Settlement::release(lease.clone()), Duration::ZERO).await
    }

    /// Settles each item as [`Backend::complete`], [`Backend::fail`] or
    /// [`Backend::release`] would, answering in the same order with what those calls made
    /// in turn would answer: `Ok`, [`Error::Fenced`] or
    /// [`Error::TooLarge`] per item ([`per_item`] sorts them). A key
    /// repeated in the batch is answered from the state the earlier item left; one item's
    /// refusal never changes another item's record. The batch is not atomic as a whole. A
    /// store error fails the whole call (some items may have been written: each is safe to
    /// settle again, which is then fenced or repeats the same write). `retention` is what
    /// completes and failures keep their record for; releases ignore it.
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>>;

    /// Extends the lease to `ttl` from the store's now, returning the new deadline. Fenced
    /// like [`Backend::complete`].
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp>;

    /// The record of `key`, if one exists and has not expired.
    async fn get(&self, key: &Key) -> Result<Option<Record>>;

    /// Removes the record of `key`, whatever its state; says whether one existed. An
    /// operator's tool: it breaks the guarantees for that key.
    async fn delete(&self, key: &Key) -> Result<bool>;

    /// Drops records past their `expires_at`, returning how many. Backends with native
    /// expiry may return 0.
    async fn purge_expired(&self) -> Result<u64>;

    /// Live records passing `filter`, in no set order: an operator's tool (`idem list`),
    /// not for hot paths. `filter.limit` counts records. An entry where records live that
    /// is not an idem record (a value of another type under a Redis prefix, a string, row
    /// or item that does not decode) is skipped and counted in the [`Listing`], which
    /// names the first ones, instead of failing the listing; an error of the store itself
    /// (a connection, a timeout) still fails it. Backends that cannot enumerate keep the
    /// default, which answers [`Error::Unsupported`], and leave [`Capabilities::list`]
    /// false.
    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        let _ = filter;
        Err(Error::Unsupported { operation: "list" })
    }

    /// Starts watching `key`: the [`Watch`] wakes when the record may have changed after
    /// this call (a settle of the key: complete, fail, release, delete), or when its
    /// timeout passes. Take it before reading the record, then read, then wait: a change
    /// between the read and the wait still wakes it. A wake is only a hint to read again; a
    /// lost notification costs the caller one timeout, never a hang. A backend may cover
    /// only a record that exists when the watch is taken (PostgreSQL marks it); the engine
    /// watches a key only after a claim found it in progress. Backends with
    /// [`Capabilities::notify`] override it; the default never wakes (polling).
    async fn watch(&self, key: &Key) -> Watch {
        let _ = key;
        Watch::poll_only()
    }

    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;
}

macro_rules! forward {
    ($($ptr:tt)*) => {
        #[async_trait]
        impl<T: Backend + ?Sized> Backend for $($ptr)*<T> {
            async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
                (**self).claim(claim).await
            }
            async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
                (**self).claim_many(claims).await
            }
            async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
                (**self).complete(lease, response, retention).await
            }
            async fn fail(&self, lease: &Lease, error: &str, kind: FailureKind, retention: Duration) -> Result<()> {
                (**self).fail(lease, error, kind, retention).await
            }
            async fn release(&self, lease: &Lease) -> Result<()> {
                (**self).release(lease).await
            }
            async fn settle_many(&self, items: &[Settlement], retention: Duration) -> Result<Vec<Result<()>>> {
                (**self).settle_many(items, retention).await
            }
            async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
                (**self).extend(lease, ttl).await
            }
            async fn get(&self, key: &Key) -> Result<Option<Record>> {
                (**self).get(key).await
            }
            async fn delete(&self, key: &Key) -> Result<bool> {
                (**self).delete(key).await
            }
            async fn purge_expired(&self) -> Result<u64> {
                (**self).purge_expired().await
            }
            async fn list(&self, filter: &ListFilter) -> Result<Listing> {
                (**self).list(filter).await
            }
            async fn watch(&self, key: &Key) -> Watch {
                (**self).watch(key).await
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
        }
    };
}

forward!(Arc);
forward!(Box);

/// `items` grouped by `key`: one group per distinct key, in the order each key first
/// appears, each group in the order of `items`. What a batch call needs to keep the items
/// of one key in order (a backend's rounds of distinct keys, a cluster's slots, a
/// partition's lanes).
///
/// ```
/// let words = ["a", "b", "a", "c", "b"];
/// let groups = idem_core::backend::group_by(0..words.len(), |&i| words[i]);
/// assert_eq!(groups, vec![vec![0, 2], vec![1, 4], vec![3]]);
/// ```
pub fn group_by<T, K: Hash + Eq>(
    items: impl IntoIterator<Item = T>,
    mut key: impl FnMut(&T) -> K,
) -> Vec<Vec<T>> {
    let mut index: HashMap<K, usize, foldhash::fast::FixedState> = HashMap::default();
    let mut groups: Vec<Vec<T>> = Vec::new();
    for item in items {
        let g = *index.entry(key(&item)).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(item);
    }
    groups
}

/// [`Backend::settle_many`] of one item, answered as the single call answers.
async fn settle_one<B: Backend + ?Sized>(
    backend: &B,
    item: Settlement,
    retention: Duration,
) -> Result<()> {
    let mut answers = backend
        .settle_many(std::slice::from_ref(&item), retention)
        .await?;
    match (answers.pop(), answers.is_empty()) {
        (Some(answer), true) => answer,
        _ => Err(Error::corrupt(
            "settle_many of one item did not answer once",
        )),
    }
}

/// One item's answer in a [`Backend::settle_many`]: what a single settle answered, sorted
/// into the item's own refusal (`Ok(Err(..))`: [`Error::Fenced`],
/// [`Error::TooLarge`]) and a store error, which fails the whole
/// call (`Err(..)`).
pub fn per_item(answer: Result<()>) -> Result<Result<()>> {
    match answer {
        Ok(()) => Ok(Ok(())),
        Err(e @ (Error::Fenced { .. } | Error::TooLarge { .. })) => Ok(Err(e)),
        Err(e) => Err(e),
    }
}

/// [`Error::TooLarge`] for a complete whose response is over
/// `limit` bytes (a backend's [`Capabilities::max_response_bytes`]); `Ok` for anything
/// else. Every backend checks this before it sends anything, so an oversized response
/// costs no round trip and never reaches the store.
pub fn check_response(settle: &Settle, limit: usize) -> Result<()> {
    match settle {
        Settle::Complete(response) if response.len() > limit => {
            Err(too_large(response.len(), limit))
        }
        _ => Ok(()),
    }
}

fn too_large(size: usize, limit: usize) -> Error {
    Error::TooLarge {
        what: "response",
        size,
        limit,
    }
}

/// A handler's response as it may be stored: itself if it is at most `limit` bytes, else a
/// permanent failure carrying [`check_response`]'s error (the side effect ran, so the key
/// is not retried blindly). What the engine and a transactional store do with a response
/// before they write it.
pub fn handler_response(response: Bytes, limit: usize) -> Result<Bytes, HandlerError> {
    if response.len() > limit {
        return Err(HandlerError::permanent(too_large(response.len(), limit)));
    }
    Ok(response)
}

/// The longest duration a backend sends its store, in milliseconds: a century, the cap of
/// [`clock::capped`](crate::clock::capped). Every deadline a store computes from it (now
/// plus a lease or a retention) stays exact in a Lua number (2^53) and in PostgreSQL's
/// and DynamoDB's integers, and it fits an `i64` as it is.
pub const MAX_MILLIS: u64 = 100 * 365 * 24 * 3600 * 1000;

/// `d` in whole milliseconds, at most [`MAX_MILLIS`]: how every backend sends a lease
/// length, a retention or a margin to its store.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .min(MAX_MILLIS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> Record {
        Record {
            key: Key::new("ns", id).expect("key"),
            state: State::Completed,
            owner: "w".into(),
            token: 1,
            attempts: 1,
            lease_until: None,
            fingerprint: None,
            response: Some(Bytes::from_static(b"ok")),
            error: None,
            permanent: false,
            expires_at: None,
        }
    }

    #[test]
    fn a_listing_keeps_the_first_skipped_entries_and_counts_all_of_them() {
        let mut listing = Listing::default();
        for i in 0..Listing::KEPT + 5 {
            listing.skip(format!("k{i}"), "wrong type");
        }
        listing.skip(b"\xffidem:".repeat(100), "é".repeat(300));
        assert_eq!(listing.skipped_total, Listing::KEPT as u64 + 6);
        assert_eq!(listing.skipped.len(), Listing::KEPT);
        assert_eq!(listing.skipped[0].key, "k0");
        assert_eq!(listing.skipped[0].reason, "wrong type");

        let mut one = Listing::default();
        one.skip(b"\xffidem:".repeat(100), "é".repeat(300));
        let Skipped { key, reason } = &one.skipped[0];
        assert!(
            key.starts_with("\u{fffd}idem:") && key.ends_with('…'),
            "{key}"
        );
        assert!(key.len() <= Listing::MAX_TEXT && reason.len() <= Listing::MAX_TEXT);
        assert!(reason.ends_with('…'), "{reason}");
    }

    #[test]
    fn add_skips_what_does_not_decode_and_fails_on_the_store() {
        let mut listing = Listing::default();
        listing
            .add(|| "a".into(), Ok(record("a")))
            .expect("a record");
        let bad = Err(Error::corrupt("bad length"));
        listing.add(|| "ns/b".into(), bad).expect("skipped");
        assert_eq!(listing.records, [record("a")]);
        assert_eq!(listing.skipped_total, 1);
        assert_eq!(listing.skipped[0].key, "ns/b");
        assert_eq!(listing.skipped[0].reason, "bad length");
        let down = Err(Error::unavailable("list", std::io::Error::other("reset")));
        let res = listing.add(|| "c".into(), down);
        assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
    }

    /// Rows `0..total`, the ones in `bad` not decoding; `fetch(n)` the first n (0: all).
    async fn listed(total: usize, bad: &[usize], limit: usize) -> (Listing, Vec<usize>) {
        let mut asked = Vec::new();
        let listing = list_limited(
            limit,
            |n| {
                asked.push(n);
                let n = if n == 0 { total } else { n.min(total) };
                std::future::ready(Ok((0..n).collect::<Vec<usize>>()))
            },
            |&i, listing| {
                let decoded = if bad.contains(&i) {
                    Err(Error::corrupt("bad"))
                } else {
                    Ok(record(&i.to_string()))
                };
                listing.add(|| i.to_string(), decoded)
            },
        )
        .await
        .expect("list");
        (listing, asked)
    }

    #[tokio::test]
    async fn list_limited_counts_records_against_the_limit() {
        let (all, asked) = listed(10, &[1, 2], 0).await;
        assert_eq!(
            (all.records.len(), all.skipped_total, asked),
            (8, 2, vec![0])
        );
        let (clean, asked) = listed(10, &[], 3).await;
        assert_eq!((clean.records.len(), asked), (3, vec![3]));
        // Two of the first three rows do not decode: read again, at least twice as many.
        let (short, asked) = listed(10, &[0, 2], 3).await;
        let ids: Vec<&str> = short.records.iter().map(|r| r.key.id()).collect();
        assert_eq!(
            (ids, short.skipped_total, asked),
            (vec!["1", "3", "4"], 2, vec![3, 6])
        );
        // Fewer good rows than the limit: every row read, all of them listed.
        let (few, asked) = listed(4, &[0, 1, 2], 3).await;
        assert_eq!((few.records.len(), few.skipped_total), (1, 3));
        assert_eq!(asked, [3, 6]);
    }
}
