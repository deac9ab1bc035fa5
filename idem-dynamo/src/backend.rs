//! [`DynamoBackend`]: the state machine as conditional writes on one item per key.
//!
//! Batches run as concurrent single writes, each key's items in order (`in_key_order`);
//! every request the client sends is counted (`Requests`). Claims are in `claim.rs`,
//! settles in `settle.rs`.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_dynamodb::config::{
    ConfigBag, Credentials, Intercept, RuntimeComponents, SharedHttpClient,
};
use aws_sdk_dynamodb::error::BoxError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use aws_smithy_http_client::tls;
use futures::{StreamExt, TryStreamExt, stream};
use idem_core::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Listing, Settlement, group_by, machine, millis,
    per_item,
};
use idem_core::clock::{Clock, SystemClock};
use idem_core::{Backend, Error, Key, Lease, Record, Result, Timestamp};

use crate::config::DynamoConfig;
use crate::error::{WriteError, sdk_error, write_error};
use crate::item::{Item, n, s, secs_ceil};
use crate::{expr, item};

/// Bytes an item carries besides its key, response or error text (names, numbers, owner).
pub(crate) const ITEM_OVERHEAD: usize = 512;

/// Idempotency records in a DynamoDB table, one item per key.
///
/// A claim is one conditional `UpdateItem` on the common paths (a new key, a duplicate, a
/// lost race, a retry, a takeover); `complete`, `fail` and `extend` are one conditional
/// `UpdateItem` each, fenced by token and owner. Time is this client's clock, judged with
/// the configured skew margin. Cheap to clone: clones share one client.
#[derive(Clone, Debug)]
pub struct DynamoBackend {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) config: DynamoConfig,
    clock: Arc<dyn Clock>,
    requests: Requests,
}

/// The two readings of the clock every operation takes: `now` sets deadlines, `decide`
/// (now minus the skew margin) judges whether deadlines have passed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Now {
    pub(crate) now: Timestamp,
    pub(crate) decide: Timestamp,
}

impl DynamoBackend {
    /// A backend on the table `config` names, with a client built from `config` and the AWS
    /// chain. Sends no request: a missing table shows at the first call (see
    /// [`DynamoBackend::create_table`]).
    pub async fn connect(config: DynamoConfig) -> Result<Self> {
        config.validate()?;
        let timeouts = TimeoutConfig::builder()
            .connect_timeout(config.connect_timeout())
            .operation_attempt_timeout(config.attempt_timeout())
            .operation_timeout(config.operation_timeout())
            .build();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(https_client())
            .retry_config(RetryConfig::standard().with_max_attempts(config.sdk_attempts()))
            .timeout_config(timeouts);
        if let Some(region) = config.region() {
            loader = loader.region(Region::new(region.to_owned()));
        }
        if let Some(endpoint) = config.endpoint() {
            loader = loader.endpoint_url(endpoint);
        }
        if let Some(c) = config.static_credentials() {
            loader = loader.credentials_provider(Credentials::new(
                c.access_key_id.clone(),
                c.secret_access_key.clone(),
                c.session_token.clone(),
                None,
                "idem-static",
            ));
        }
        let shared = loader.load().await;
        if shared.region().is_none() {
            return Err(Error::config(
                "no AWS region: set DynamoConfig::with_region, AWS_REGION or a profile region",
            ));
        }
        Self::with_client(Client::new(&shared), config)
    }

    /// A backend on the table `config` names, through a client built elsewhere. The
    /// client's own endpoint, region, credentials, retry, timeout and HTTP client settings
    /// apply; those in `config` are not used. This crate builds the SDK without its default
    /// HTTPS client: a client built elsewhere brings its own (`aws-config`'s default
    /// features do, or `SdkConfig::builder().http_client(..)`).
    pub fn with_client(client: Client, config: DynamoConfig) -> Result<Self> {
        config.validate()?;
        let requests = Requests::default();
        let counted = client
            .config()
            .to_builder()
            .interceptor(requests.clone())
            .build();
        Ok(DynamoBackend {
            inner: Arc::new(Inner {
                client: Client::from_conf(counted),
                config,
                clock: Arc::new(SystemClock),
                requests,
            }),
        })
    }

    /// Reads time from `clock` instead of the system clock.
    pub fn with_clock(self, clock: impl Clock) -> Self {
        DynamoBackend {
            inner: Arc::new(Inner {
                client: self.inner.client.clone(),
                config: self.inner.config.clone(),
                clock: Arc::new(clock),
                requests: self.inner.requests.clone(),
            }),
        }
    }

    /// How many HTTP requests this backend and its clones have sent, retries included:
    /// divided by the messages handled, the round trips per message.
    pub fn requests_sent(&self) -> u64 {
        self.inner.requests.sent()
    }

    /// The SDK client, for what this crate does not wrap.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The configuration.
    pub fn config(&self) -> &DynamoConfig {
        &self.inner.config
    }

    pub(crate) fn table(&self) -> &str {
        self.inner.config.table()
    }

    pub(crate) fn now(&self) -> Now {
        let now = self.inner.clock.now();
        let skew = millis(self.inner.config.clock_skew());
        Now {
            now,
            decide: Timestamp::from_millis(now.as_millis().saturating_sub(skew)),
        }
    }

    pub(crate) fn key_value(key: &Key) -> HashMap<String, AttributeValue> {
        HashMap::from([(item::PK.to_owned(), s(item::partition_key(key)))])
    }

    /// The items a scan with `filter` (bound to `values`) returns, handed to `page` a page
    /// at a time until it answers false or the table ends.
    async fn scan(
        &self,
        filter: &str,
        values: HashMap<String, AttributeValue>,
        mut page: impl FnMut(Vec<Item>) -> Result<bool>,
    ) -> Result<()> {
        let mut start: Option<Item> = None;
        loop {
            let found = self
                .inner
                .client
                .scan()
                .table_name(self.table())
                .consistent_read(true)
                .filter_expression(filter)
                .set_expression_attribute_names(Some(expr::names(&[filter])))
                .set_expression_attribute_values(Some(values.clone()))
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| sdk_error("scan", 0, e))?;
            let more = page(found.items.unwrap_or_default())?;
            match found.last_evaluated_key {
                Some(next) if !next.is_empty() && more => start = Some(next),
                _ => return Ok(()),
            }
        }
    }
}

/// The SDK's HTTPS client (hyper, rustls) on ring: the SDK's default is rustls on aws-lc,
/// whose C library takes minutes to build and whose speed a loopback or AWS round trip
/// never shows.
fn https_client() -> SharedHttpClient {
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
}

#[async_trait]
impl Backend for DynamoBackend {
    /// Atomic: one conditional write decides. Round trips: one for a new key, a duplicate,
    /// a live lease (lost race), a retry, a takeover, a poisoned key and a mismatch; two
    /// when the one-write form cannot express the grant (an expired item not yet removed by
    /// TTL, a record without fingerprint claimed with one) or for the transition of a
    /// lapsed lease with spent attempts to poisoned.
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        self.claim_one(claim).await
    }

    /// Claims concurrently, at most `claim_parallelism` conditional writes in flight; claims
    /// of one key run one after another, in batch order.
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        let parallel = self.inner.config.claim_parallelism();
        in_key_order(claims, |c| &c.key, parallel, |c| self.claim(c)).await
    }

    /// Conditional writes like [`Backend::complete`], [`Backend::fail`] and
    /// [`Backend::release`], at most `claim_parallelism` in flight; items of one key run one
    /// after another, in batch order.
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let parallel = self.inner.config.claim_parallelism();
        in_key_order(
            items,
            |item| &item.lease.key,
            parallel,
            |item| async move { per_item(self.settle(&item.lease, &item.settle, retention).await) },
        )
        .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        let t = self.now();
        let until = t.now.saturating_add(ttl);
        let values = HashMap::from([
            (":lease".to_owned(), n(until.as_millis())),
            (":lease_s".to_owned(), n(secs_ceil(until.as_millis()))),
        ]);
        let write = (expr::HOLDS, expr::EXTEND);
        self.fenced_update("extend", lease, write, values, 0, t)
            .await?;
        Ok(until)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let t = self.now();
        let out = self
            .inner
            .client
            .get_item()
            .table_name(self.table())
            .set_key(Some(Self::key_value(key)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| sdk_error("get", 0, e))?;
        let record = out.item.as_ref().map(item::decode).transpose()?;
        Ok(record.filter(|r| machine::is_live(r, t.decide)))
    }

    async fn delete(&self, key: &Key) -> Result<bool> {
        let t = self.now();
        let out = self
            .inner
            .client
            .delete_item()
            .table_name(self.table())
            .set_key(Some(Self::key_value(key)))
            .return_values(ReturnValue::AllOld)
            .send()
            .await
            .map_err(|e| sdk_error("delete", 0, e))?;
        // An item that does not decode was still there, and is gone now.
        Ok(out
            .attributes
            .filter(|a| !a.is_empty())
            .is_some_and(|a| item::decode(&a).map_or(true, |r| machine::is_live(&r, t.decide))))
    }

    /// Deletes items past their expiry that TTL has not removed yet: a scan of the whole
    /// table, then one conditional delete per expired item (skipped if it changed
    /// meanwhile). An operator's tool; TTL does this for free, only later.
    async fn purge_expired(&self) -> Result<u64> {
        let t = self.now();
        let values = HashMap::from([(":now".to_owned(), n(t.decide.as_millis()))]);
        let mut expired = Vec::new();
        self.scan(expr::EXPIRED, values, |items| {
            expired.extend(items);
            Ok(true)
        })
        .await?;
        let mut purged = 0;
        for found in expired {
            let Some(pk) = found.get(item::PK).cloned() else {
                continue;
            };
            let Ok(version) = item::version(&found) else {
                continue;
            };
            let sent = self
                .inner
                .client
                .delete_item()
                .table_name(self.table())
                .key(item::PK, pk)
                .condition_expression(expr::UNCHANGED)
                .set_expression_attribute_names(Some(expr::names(&[expr::UNCHANGED])))
                .expression_attribute_values(":v", n(version))
                .send()
                .await;
            match sent {
                Ok(_) => purged += 1,
                Err(err) => match write_error("purge", 0, err) {
                    WriteError::Condition(_) => {}
                    WriteError::Other(e) => return Err(e),
                },
            }
        }
        Ok(purged)
    }

    /// A scan of the whole table, filtered in DynamoDB; paid for by the items scanned, not
    /// the items returned. An operator's tool. An item that does not decode is skipped and
    /// counted, named by its partition key; one without a live `exp_ms` is filtered out by
    /// DynamoDB, unseen.
    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        let t = self.now();
        let mut parts = vec![expr::LIVE];
        let mut values = HashMap::from([(":now".to_owned(), n(t.decide.as_millis()))]);
        if let Some(ns) = &filter.namespace {
            parts.push(expr::IN_NAMESPACE);
            values.insert(":prefix".to_owned(), s(item::namespace_prefix(ns)));
        }
        if let Some(state) = filter.state {
            parts.push(expr::IN_STATE);
            values.insert(":st".to_owned(), s(state.as_str()));
        }
        let limit = if filter.limit == 0 {
            usize::MAX
        } else {
            filter.limit
        };
        let mut listing = Listing::default();
        self.scan(&parts.join(" AND "), values, |items| {
            for found in &items {
                if listing.records.len() >= limit {
                    break;
                }
                listing.add(|| item::name(found), item::decode(found))?;
            }
            Ok(listing.records.len() < limit)
        })
        .await?;
        Ok(listing)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_native_expiry(true)
            .with_list(true)
            .with_max_response_bytes(self.inner.config.max_response_bytes())
    }
}

/// `run` on every item, answers in batch order. At most `parallel` calls are in flight;
/// the items of one key run one after another in batch order, each after the previous one
/// answered, so that each sees the state the earlier left. The first error fails the whole
/// call (calls already made keep their effect).
pub(crate) async fn in_key_order<'a, T, K, A, Fut>(
    items: &'a [T],
    key: impl Fn(&T) -> &K,
    parallel: usize,
    run: impl Fn(&'a T) -> Fut,
) -> Result<Vec<A>>
where
    K: Eq + Hash,
    Fut: Future<Output = Result<A>>,
{
    let run = &run;
    let groups = group_by(0..items.len(), |&i| key(&items[i]));
    let answered: Vec<Vec<(usize, A)>> = stream::iter(groups)
        .map(|group| async move {
            let mut out = Vec::with_capacity(group.len());
            for i in group {
                out.push((i, run(&items[i]).await?));
            }
            Ok::<_, Error>(out)
        })
        .buffer_unordered(parallel.max(1))
        .try_collect()
        .await?;
    let mut out: Vec<Option<A>> = std::iter::repeat_with(|| None).take(items.len()).collect();
    for (i, answer) in answered.into_iter().flatten() {
        out[i] = Some(answer);
    }
    Ok(out.into_iter().flatten().collect())
}

/// An SDK interceptor that counts every HTTP request sent, retries included.
#[derive(Clone, Debug, Default)]
pub(crate) struct Requests(Arc<AtomicU64>);

impl Requests {
    /// How many were sent so far.
    pub(crate) fn sent(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Intercept for Requests {
    fn name(&self) -> &'static str {
        "idem-dynamo request counter"
    }

    fn read_before_transmit(
        &self,
        _: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::item;

    #[tokio::test]
    async fn debug_never_shows_the_secret() {
        let config = DynamoConfig::local("http://127.0.0.1:9", "idem").with_static_credentials(
            "AKIDEXAMPLE",
            "wJalrXUtnFEMI-s3cret",
            Some("session-s3cret".into()),
        );
        let backend = DynamoBackend::connect(config).await.expect("connect");
        let shown = format!("{backend:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("AKIDEXAMPLE"), "{shown}");
    }

    #[test]
    fn expressions_name_only_stored_attributes() {
        let known = [
            item::PK,
            item::ST,
            item::OWNER,
            item::TOK,
            item::ATT,
            item::LEASE,
            item::RET,
            item::RET_S,
            item::EXP,
            item::TTL,
            item::FP,
            item::RESP,
            item::ERR,
            item::PERM,
            item::VER,
        ];
        let all = [
            expr::CLAIM_CONDITION,
            expr::CLAIM_CONDITION_FP,
            expr::CLAIM_UPDATE,
            expr::CLAIM_UPDATE_FP,
            expr::UNCHANGED,
            expr::ABSENT,
            expr::HOLDS,
            expr::HOLDS_LIVE,
            expr::COMPLETE,
            expr::FAIL,
            expr::FAIL_PERMANENT,
            expr::EXTEND,
            expr::RELEASE,
            expr::EXPIRED,
            expr::LIVE,
            expr::IN_NAMESPACE,
            expr::IN_STATE,
        ];
        for (placeholder, name) in expr::names(&all) {
            assert!(known.contains(&name.as_str()), "{placeholder} names {name}");
        }
    }
}

#[cfg(test)]
mod tests_batch {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn a_key_runs_in_order_and_answers_keep_positions() {
        let items = [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("c", 5)];
        let seen = Mutex::new(Vec::new());
        let out = in_key_order(
            &items,
            |(k, _)| k,
            2,
            |&(k, n)| {
                let seen = &seen;
                async move {
                    tokio::task::yield_now().await;
                    seen.lock().expect("lock").push((k, n));
                    Ok(n * 10)
                }
            },
        )
        .await
        .expect("no error");
        assert_eq!(out, [10, 20, 30, 40, 50]);
        let order: Vec<i32> = seen
            .into_inner()
            .expect("lock")
            .into_iter()
            .filter(|(k, _)| *k == "a")
            .map(|(_, n)| n)
            .collect();
        assert_eq!(order, [1, 3, 4]);
    }

    #[tokio::test]
    async fn at_most_parallel_calls_are_in_flight() {
        let items: Vec<usize> = (0..40).collect();
        let (now, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        in_key_order(
            &items,
            |i| i,
            3,
            |_| {
                let (now, most) = (&now, &most);
                async move {
                    let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(n, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    now.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                }
            },
        )
        .await
        .expect("no error");
        assert_eq!(most.into_inner(), 3);
    }

    #[tokio::test]
    async fn an_error_fails_the_batch() {
        let items = ["a", "b", "c"];
        let out = in_key_order(
            &items,
            |s| s,
            16,
            |&s| async move {
                if s == "b" {
                    Err(Error::config("boom"))
                } else {
                    Ok(())
                }
            },
        )
        .await;
        assert!(matches!(out, Err(Error::Config { .. })), "{out:?}");
    }
}
