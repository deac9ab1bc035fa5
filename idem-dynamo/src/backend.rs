//! [`DynamoBackend`]: the state machine as conditional writes on one item per key.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::Credentials;
use aws_sdk_dynamodb::config::SharedHttpClient;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure};
use aws_smithy_http_client::tls;
use idem_core::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Settle, Settlement, check_response, machine,
    millis, per_item,
};
use idem_core::clock::{Clock, SystemClock};
use idem_core::{Backend, Error, FailureKind, Key, Lease, Record, Result, State, Timestamp};

use crate::batch;
use crate::config::DynamoConfig;
use crate::error::{WriteError, sdk_error, write_error};
use crate::expr;
use crate::item::{self, Item, b, n, s, secs_ceil};
use crate::requests::Requests;

/// How many compare-and-set rounds a claim tries when its one-write form does not apply
/// and other writers keep changing the item, before it answers [`Error::Unavailable`].
const CAS_ROUNDS: usize = 8;

/// Bytes an item carries besides its key, response or error text (names, numbers, owner).
const ITEM_OVERHEAD: usize = 512;

/// Idempotency records in a DynamoDB table, one item per key.
///
/// A claim is one conditional `UpdateItem` on the common paths (a new key, a duplicate, a
/// lost race, a retry, a takeover); `complete`, `fail` and `extend` are one conditional
/// `UpdateItem` each, fenced by token and owner. Time is this client's clock, judged with
/// the configured skew margin. Cheap to clone: clones share one client.
#[derive(Clone, Debug)]
pub struct DynamoBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Client,
    config: DynamoConfig,
    clock: Arc<dyn Clock>,
    requests: Requests,
}

/// The two readings of the clock every operation takes: `now` sets deadlines, `decide`
/// (now minus the skew margin) judges whether deadlines have passed.
#[derive(Clone, Copy, Debug)]
struct Now {
    now: Timestamp,
    decide: Timestamp,
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

    fn now(&self) -> Now {
        let now = self.inner.clock.now();
        let skew = millis(self.inner.config.clock_skew());
        Now {
            now,
            decide: Timestamp::from_millis(now.as_millis().saturating_sub(skew)),
        }
    }

    /// [`machine::claim`] judged at `t.decide`, with the deadlines it writes and reports
    /// moved to `t.now`: a lease lapses for this client only once its clock is the skew
    /// margin past the deadline, and `InProgress` says when that will be.
    fn decide(
        &self,
        current: Option<&Record>,
        claim: &Claim,
        t: Now,
    ) -> (ClaimOutcome, Option<Record>) {
        let (mut answer, mut next) = machine::claim(current, claim, t.decide);
        let skew = t.now.since(t.decide);
        let shift = |at: &mut Timestamp| *at = at.saturating_add(skew);
        match &mut answer {
            ClaimOutcome::Acquired(lease) => shift(&mut lease.lease_until),
            ClaimOutcome::InProgress { lease_until, .. } => shift(lease_until),
            _ => {}
        }
        if let Some(rec) = &mut next {
            for at in [&mut rec.lease_until, &mut rec.expires_at]
                .into_iter()
                .flatten()
            {
                shift(at);
            }
        }
        (answer, next)
    }

    fn key_value(key: &Key) -> HashMap<String, AttributeValue> {
        HashMap::from([(item::PK.to_owned(), s(item::partition_key(key)))])
    }

    /// The one-write claim. `Ok(Ok(answer))` when it was granted; `Ok(Err(item))` with the
    /// item DynamoDB returned when its condition failed.
    ///
    /// The condition may refuse more than [`machine::claim`] would (the caller then decides
    /// from the returned item with the machine itself: a round trip more, never another
    /// answer), but never less: a grant the machine would not give is reported as
    /// [`Error::Corrupt`] instead of answered.
    async fn claim_once(&self, claim: &Claim, t: Now) -> Result<Result<ClaimOutcome, Item>> {
        let lease = t.now.saturating_add(claim.lease_ttl);
        let ret = millis(claim.retention);
        let exp = lease.saturating_add(claim.retention).as_millis();
        let (condition, update) = match claim.fingerprint {
            Some(_) => (expr::CLAIM_CONDITION_FP, expr::CLAIM_UPDATE_FP),
            None => (expr::CLAIM_CONDITION, expr::CLAIM_UPDATE),
        };
        let mut values = HashMap::from([
            (":now".to_owned(), n(t.decide.as_millis())),
            (":max".to_owned(), n(u64::from(claim.max_attempts.max(1)))),
            (":failed".to_owned(), s(State::Failed.as_str())),
            (":processing".to_owned(), s(State::Processing.as_str())),
            (":true".to_owned(), AttributeValue::Bool(true)),
            (":owner".to_owned(), s(&*claim.owner)),
            (":zero".to_owned(), n(0)),
            (":one".to_owned(), n(1)),
            (":lease".to_owned(), n(lease.as_millis())),
            (":ret".to_owned(), n(ret)),
            (":ret_s".to_owned(), n(secs_ceil(ret))),
            (":exp".to_owned(), n(exp)),
            (":ttl".to_owned(), n(secs_ceil(exp))),
            (":v".to_owned(), n(item::new_version())),
        ]);
        if let Some(fp) = claim.fingerprint {
            values.insert(":fp".to_owned(), b(fp.0.to_vec()));
        }
        let sent = self
            .inner
            .client
            .update_item()
            .table_name(self.table())
            .set_key(Some(Self::key_value(&claim.key)))
            .condition_expression(condition)
            .update_expression(update)
            .set_expression_attribute_names(Some(expr::names(&[condition, update])))
            .set_expression_attribute_values(Some(values))
            .return_values(ReturnValue::AllOld)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        let old = match sent {
            Ok(out) => out.attributes.filter(|a| !a.is_empty()),
            Err(err) => {
                return match write_error("claim", ITEM_OVERHEAD, err) {
                    WriteError::Condition(Some(item)) => Ok(Err(item)),
                    WriteError::Condition(None) => Err(Error::corrupt(format!(
                        "claim of {}: the condition failed but DynamoDB returned no item",
                        claim.key
                    ))),
                    WriteError::Other(e) => Err(e),
                };
            }
        };
        let old = old.as_ref().map(item::decode).transpose()?;
        match self.decide(old.as_ref(), claim, t) {
            (answer @ ClaimOutcome::Acquired(_), _) => Ok(Ok(answer)),
            (answer, _) => Err(Error::corrupt(format!(
                "claim of {}: DynamoDB granted a claim the state machine answers {answer:?} \
                 (record {old:?})",
                claim.key
            ))),
        }
    }

    /// Writes `next` in place of the item the client decided from (`expected`, or none),
    /// only if that item is unchanged. `Err(item)`: it changed, here is what it is now.
    async fn put_if_unchanged(
        &self,
        next: &Record,
        expected: Option<&Item>,
    ) -> Result<Result<(), Option<Item>>> {
        let mut values = HashMap::new();
        let condition = match expected {
            Some(old) => {
                values.insert(":v".to_owned(), n(item::version(old)?));
                expr::UNCHANGED
            }
            None => expr::ABSENT,
        };
        let written = item::encode(next, item::new_version());
        let size = next.error.as_ref().map_or(0, String::len) + ITEM_OVERHEAD;
        let sent = self
            .inner
            .client
            .put_item()
            .table_name(self.table())
            .set_item(Some(written))
            .condition_expression(condition)
            .set_expression_attribute_names(Some(expr::names(&[condition])))
            .set_expression_attribute_values((!values.is_empty()).then_some(values))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match sent {
            Ok(_) => Ok(Ok(())),
            Err(err) => match write_error("claim", size, err) {
                WriteError::Condition(item) => Ok(Err(item)),
                WriteError::Other(e) => Err(e),
            },
        }
    }

    /// A fencing `UpdateItem`: `update` applies only while `lease` holds the record as
    /// `condition` ([`expr::HOLDS`] or [`expr::HOLDS_LIVE`]) judges it.
    async fn fenced_update(
        &self,
        what: &'static str,
        lease: &Lease,
        (condition, update): (&'static str, &'static str),
        mut values: HashMap<String, AttributeValue>,
        size: usize,
        t: Now,
    ) -> Result<()> {
        values.extend([
            (":tok".to_owned(), n(lease.token)),
            (":owner".to_owned(), s(&*lease.owner)),
            (":processing".to_owned(), s(State::Processing.as_str())),
            (":now".to_owned(), n(t.decide.as_millis())),
            (":v".to_owned(), n(item::new_version())),
        ]);
        let sent = self
            .inner
            .client
            .update_item()
            .table_name(self.table())
            .set_key(Some(Self::key_value(&lease.key)))
            .condition_expression(condition)
            .update_expression(update)
            .set_expression_attribute_names(Some(expr::names(&[condition, update])))
            .set_expression_attribute_values(Some(values))
            .send()
            .await;
        match sent {
            Ok(_) => Ok(()),
            Err(err) => match write_error(what, size, err) {
                WriteError::Condition(_) => Err(Error::fenced(lease)),
                WriteError::Other(e) => Err(e),
            },
        }
    }

    /// `settle` of `lease` as one fencing `UpdateItem`; `TooLarge` before any request for a
    /// response or error text over `max_response_bytes`.
    async fn settle(&self, lease: &Lease, settle: &Settle, retention: Duration) -> Result<()> {
        let t = self.now();
        check_response(settle, self.inner.config.max_response_bytes())?;
        let (what, write, values, size) = match settle {
            Settle::Complete(response) => {
                let mut values = HashMap::from([
                    (":completed".to_owned(), s(State::Completed.as_str())),
                    (":resp".to_owned(), b(response.to_vec())),
                ]);
                values.extend(Self::expiry(retention, t));
                let write = (expr::HOLDS, expr::COMPLETE);
                ("complete", write, values, response.len())
            }
            Settle::Fail { error, kind } => {
                self.fits("error text", error.len())?;
                let mut values = HashMap::from([
                    (":failed".to_owned(), s(State::Failed.as_str())),
                    (":err".to_owned(), s(error.as_str())),
                ]);
                values.extend(Self::expiry(retention, t));
                let update = match kind {
                    FailureKind::Retry => expr::FAIL,
                    FailureKind::Permanent => {
                        values.insert(":true".to_owned(), AttributeValue::Bool(true));
                        expr::FAIL_PERMANENT
                    }
                };
                ("fail", (expr::HOLDS, update), values, error.len())
            }
            Settle::Release => {
                // The lease lapses at the time claims judge by, the expiry keeps its
                // distance to the lease deadline.
                let until = t.decide.as_millis();
                let values = HashMap::from([
                    (":one".to_owned(), n(1)),
                    (":lease".to_owned(), n(until)),
                    (":lease_s".to_owned(), n(secs_ceil(until))),
                ]);
                ("release", (expr::HOLDS_LIVE, expr::RELEASE), values, 0)
            }
        };
        self.fenced_update(what, lease, write, values, size + ITEM_OVERHEAD, t)
            .await
    }

    /// `TooLarge` if an error text of `size` bytes exceeds `max_response_bytes`: a
    /// response is checked by [`check_response`], like every backend's; DynamoDB's item
    /// limit bounds the error text too.
    fn fits(&self, what: &'static str, size: usize) -> Result<()> {
        let limit = self.inner.config.max_response_bytes();
        if size > limit {
            return Err(Error::TooLarge { what, size, limit });
        }
        Ok(())
    }

    /// `:exp` and `:ttl` for a record kept `retention` from `t.now`.
    fn expiry(retention: Duration, t: Now) -> [(String, AttributeValue); 2] {
        let exp = t.now.saturating_add(retention).as_millis();
        [
            (":exp".to_owned(), n(exp)),
            (":ttl".to_owned(), n(secs_ceil(exp))),
        ]
    }

    /// Every item a scan with `filter` (bound to `values`) returns, page by page.
    async fn scan(
        &self,
        filter: &str,
        values: HashMap<String, AttributeValue>,
        limit: usize,
    ) -> Result<Vec<Item>> {
        let mut out = Vec::new();
        let mut start: Option<Item> = None;
        loop {
            let page = self
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
            out.extend(page.items.unwrap_or_default());
            match page.last_evaluated_key {
                Some(next) if !next.is_empty() && out.len() < limit => start = Some(next),
                _ => return Ok(out),
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
        let mut current = match self.claim_once(claim, self.now()).await? {
            Ok(answer) => return Ok(answer),
            Err(item) => Some(item),
        };
        for _ in 0..CAS_ROUNDS {
            let old = current.as_ref().map(item::decode).transpose()?;
            let (answer, next) = self.decide(old.as_ref(), claim, self.now());
            let Some(next) = next else {
                return Ok(answer);
            };
            match self.put_if_unchanged(&next, current.as_ref()).await? {
                Ok(()) => return Ok(answer),
                Err(now_there) => current = now_there,
            }
        }
        Err(Error::Unavailable {
            message: format!(
                "claim of {}: the item changed under {CAS_ROUNDS} compare-and-set rounds",
                claim.key
            ),
            source: None,
        })
    }

    /// Claims concurrently, at most `claim_parallelism` conditional writes in flight; claims
    /// of one key run one after another, in batch order.
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        let parallel = self.inner.config.claim_parallelism();
        batch::in_key_order(claims, |c| &c.key, parallel, |c| self.claim(c)).await
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
        batch::in_key_order(
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
        let expired = self.scan(expr::EXPIRED, values, usize::MAX).await?;
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
    /// the items returned. An operator's tool.
    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>> {
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
        let items = self.scan(&parts.join(" AND "), values, limit).await?;
        items.iter().take(limit).map(item::decode).collect()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_native_expiry(true)
            .with_list(true)
            .with_max_response_bytes(self.inner.config.max_response_bytes())
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
