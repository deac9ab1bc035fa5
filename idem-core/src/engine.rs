//! The engine: wraps a handler in claim, heartbeat, run, and complete or fail.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Fuse, FusedFuture};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::{Claim, ClaimOutcome, Settle, Settlement, handler_response};
use crate::binding::Signal;
use crate::{
    Backend, Context, Error, FailureKind, Fingerprint, HandlerError, Key, Lease, Result, Timestamp,
};

/// What to do when a claim finds another worker's live lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitPolicy {
    /// Answer [`Outcome::InProgress`] at once (the default; a Kafka loop pauses the
    /// partition instead of blocking).
    Return,
    /// Wait for the holder to settle, for up to `max`, then answer
    /// [`Outcome::InProgress`]. On a backend that notifies ([`Backend::watch`],
    /// [`Capabilities::notify`](crate::backend::Capabilities::notify)) the claim is asked again as
    /// soon as the key is settled, and every `poll` in case a notification was lost; on
    /// one that does not, it polls, backing off from `poll / 4` up to `poll`. Either way it
    /// asks again when the holder's lease is due to lapse.
    Wait {
        /// The longest pause between two claims.
        poll: Duration,
        /// The longest total wait.
        max: Duration,
    },
}

/// What became of one `execute`. Every variant tells the caller what to do next.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome<T = Bytes> {
    /// The handler ran now and its response was stored.
    Executed(T),
    /// A duplicate: the handler ran before; this is its stored response.
    Replayed(T),
    /// Another worker holds a live lease: ask again later, do not skip.
    InProgress {
        /// The holder.
        owner: Arc<str>,
        /// When its lease lapses unless extended.
        lease_until: Timestamp,
    },
    /// The handler failed with a retryable error and attempts are left: ask again later.
    Failed {
        /// Attempts made so far.
        attempts: u32,
        /// The handler's error.
        error: String,
    },
    /// The key is poisoned: attempts are spent or a handler failed permanently.
    Poisoned {
        /// Attempts made.
        attempts: u32,
        /// The last error.
        error: String,
    },
    /// The key exists with another payload.
    Mismatch,
    /// This worker lost its lease while the handler ran (a takeover happened); its result
    /// was not stored. The side effect may have happened: see the token.
    Fenced,
    /// The lease was handed back unrun ([`Settle::Release`]): the attempt was taken back
    /// and the next claim runs the handler.
    Released,
}

/// What running one handler under its lease came to. Nothing is written yet: the caller
/// settles it, alone or with a batch, through [`Engine::settle_batch`]. Exhaustive, like
/// [`Settle`]: what is written, or the contract's `Fenced`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ran {
    /// Write this: the handler's response, or its failure (a panic and a response over
    /// the backend's limit are failures too).
    Settle(Settle),
    /// The lease was lost while the handler ran (a heartbeat was fenced): write nothing.
    Fenced,
}

impl<T> Outcome<T> {
    /// Applies `f` to the response, if there is one.
    pub fn try_map<U, E>(self, f: impl FnOnce(T) -> Result<U, E>) -> Result<Outcome<U>, E> {
        Ok(match self {
            Outcome::Executed(t) => Outcome::Executed(f(t)?),
            Outcome::Replayed(t) => Outcome::Replayed(f(t)?),
            Outcome::InProgress { owner, lease_until } => {
                Outcome::InProgress { owner, lease_until }
            }
            Outcome::Failed { attempts, error } => Outcome::Failed { attempts, error },
            Outcome::Poisoned { attempts, error } => Outcome::Poisoned { attempts, error },
            Outcome::Mismatch => Outcome::Mismatch,
            Outcome::Fenced => Outcome::Fenced,
            Outcome::Released => Outcome::Released,
        })
    }

    /// The outcome of an attempt whose handler failed and whose failure was recorded:
    /// `Poisoned` if the failure was permanent or no attempts are left, else `Failed`.
    pub fn after_failure(
        attempts: u32,
        max_attempts: u32,
        kind: FailureKind,
        error: String,
    ) -> Self {
        if kind == FailureKind::Permanent || attempts >= max_attempts {
            Outcome::Poisoned { attempts, error }
        } else {
            Outcome::Failed { attempts, error }
        }
    }

    /// The response of `Executed` or `Replayed`.
    pub fn response(&self) -> Option<&T> {
        match self {
            Outcome::Executed(t) | Outcome::Replayed(t) => Some(t),
            _ => None,
        }
    }
}

/// Builds an [`Engine`].
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    backend: Arc<dyn Backend>,
    owner: Option<String>,
    lease_ttl: Duration,
    heartbeat: Option<Duration>,
    retention: Duration,
    max_attempts: u32,
    wait: WaitPolicy,
    fingerprint: bool,
}

impl std::fmt::Debug for dyn Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Backend({:?})", self.capabilities())
    }
}

impl EngineBuilder {
    /// The worker id stored as the lease owner (default: host, pid and a random suffix).
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// How long a lease lasts without a heartbeat (default 30 s). This and the other
    /// durations are capped at a century ([`clock::capped`](crate::clock::capped)).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = crate::clock::capped(ttl);
        self
    }

    /// How often a running handler's lease is extended (default a third of the lease).
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = Some(crate::clock::capped(every));
        self
    }

    /// How long completed and failed records are kept (default 24 h).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = crate::clock::capped(retention);
        self
    }

    /// How many times a key's handler may run before the key is poisoned (default 5).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// What to do on [`Outcome::InProgress`] (default [`WaitPolicy::Return`]).
    pub fn wait(mut self, wait: WaitPolicy) -> Self {
        self.wait = wait;
        self
    }

    /// Whether claims carry the payload's fingerprint, so a different payload under a known
    /// key is a [`Outcome::Mismatch`] (default on).
    pub fn fingerprint(mut self, on: bool) -> Self {
        self.fingerprint = on;
        self
    }

    /// Checks the settings and builds the engine.
    pub fn build(self) -> Result<Engine> {
        let heartbeat = self.heartbeat.unwrap_or(self.lease_ttl / 3);
        if self.lease_ttl < Duration::from_millis(10) {
            return Err(Error::config("lease_ttl must be at least 10 ms"));
        }
        if heartbeat.is_zero() || heartbeat >= self.lease_ttl {
            return Err(Error::config(format!(
                "heartbeat ({heartbeat:?}) must be above zero and below lease_ttl ({:?})",
                self.lease_ttl
            )));
        }
        if self.max_attempts == 0 {
            return Err(Error::config("max_attempts must be at least 1"));
        }
        let owner = self.owner.unwrap_or_else(default_owner);
        if owner.is_empty() {
            return Err(Error::config("owner must not be empty"));
        }
        Ok(Engine {
            inner: Arc::new(Inner {
                backend: self.backend,
                owner: owner.into(),
                lease_ttl: self.lease_ttl,
                heartbeat,
                retention: self.retention,
                max_attempts: self.max_attempts,
                wait: self.wait,
                fingerprint: self.fingerprint,
            }),
        })
    }
}

fn default_owner() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let suffix: String = std::iter::repeat_with(fastrand::alphanumeric)
        .take(6)
        .collect();
    format!("{host}-{}-{suffix}", std::process::id())
}

#[derive(Debug)]
struct Inner {
    backend: Arc<dyn Backend>,
    owner: Arc<str>,
    lease_ttl: Duration,
    heartbeat: Duration,
    retention: Duration,
    max_attempts: u32,
    wait: WaitPolicy,
    fingerprint: bool,
}

/// Runs handlers at most once per key (within the limits the README states), replaying
/// the first result to duplicates. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    /// Starts building an engine over `backend`.
    pub fn builder(backend: Arc<dyn Backend>) -> EngineBuilder {
        EngineBuilder {
            backend,
            owner: None,
            lease_ttl: Duration::from_secs(30),
            heartbeat: None,
            retention: Duration::from_secs(24 * 3600),
            max_attempts: 5,
            wait: WaitPolicy::Return,
            fingerprint: true,
        }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// This worker's owner id.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// How long a lease lasts without a heartbeat.
    pub fn lease_ttl(&self) -> Duration {
        self.inner.lease_ttl
    }

    /// How often a running handler's lease is extended.
    pub fn heartbeat(&self) -> Duration {
        self.inner.heartbeat
    }

    /// How long completed and failed records are kept.
    pub fn retention(&self) -> Duration {
        self.inner.retention
    }

    /// How many times a key's handler may run before the key is poisoned.
    pub fn max_attempts(&self) -> u32 {
        self.inner.max_attempts
    }

    /// What to do when a claim finds another worker's live lease.
    pub fn wait_policy(&self) -> WaitPolicy {
        self.inner.wait
    }

    /// Whether claims carry the payload's fingerprint, so that another payload under a
    /// known key is [`Outcome::Mismatch`] (set by [`EngineBuilder::fingerprint`]).
    pub fn checks_fingerprints(&self) -> bool {
        self.inner.fingerprint
    }

    /// The claim request this engine makes for `key` and `payload`.
    pub fn claim_for(&self, key: &Key, payload: &[u8]) -> Claim {
        self.claim_with(key, self.fingerprint_of(payload))
    }

    /// The fingerprint this engine's claims carry for `payload`: `None` when fingerprints
    /// are off. For a caller that hashes a payload ahead of its claim.
    pub fn fingerprint_of(&self, payload: &[u8]) -> Option<Fingerprint> {
        self.inner.fingerprint.then(|| Fingerprint::of(payload))
    }

    /// The claim request for `key` carrying `fingerprint`, which must be
    /// [`Engine::fingerprint_of`] the payload: [`Engine::claim_for`] without hashing again.
    pub fn claim_with(&self, key: &Key, fingerprint: Option<Fingerprint>) -> Claim {
        let i = &self.inner;
        Claim {
            key: key.clone(),
            owner: i.owner.clone(),
            lease_ttl: i.lease_ttl,
            fingerprint,
            max_attempts: i.max_attempts,
            retention: i.retention,
        }
    }

    /// Claims `key`, runs `handler` if this worker got the lease (extending the lease while
    /// it runs), and stores its result. A duplicate gets the stored response back.
    ///
    /// A store error is returned as `Err`, including a `complete` that failed after the
    /// handler ran: the caller must then not treat the message as done.
    pub async fn execute<F, Fut>(&self, key: &Key, payload: &[u8], handler: F) -> Result<Outcome>
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<Bytes, HandlerError>> + Send,
    {
        let claim = self.claim_for(key, payload);
        let answer = self.claim_waiting(&claim).await?;
        self.execute_claimed(answer, handler).await
    }

    /// [`Engine::execute`] for a handler whose response is any serde type, stored as JSON.
    /// A stored response that no longer decodes as `T` is [`Error::Corrupt`].
    pub async fn execute_json<T, F, Fut>(
        &self,
        key: &Key,
        payload: &[u8],
        handler: F,
    ) -> Result<Outcome<T>>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce(Context) -> Fut + Send,
        Fut: Future<Output = Result<T, HandlerError>> + Send,
    {
        let outcome = self
            .execute(key, payload, |ctx| async move {
                let value = handler(ctx).await?;
                serde_json::to_vec(&value)
                    .map(Bytes::from)
                    .map_err(|e| HandlerError::permanent(format!("response to JSON: {e}")))
            })
            .await?;
        outcome.try_map(|bytes| {
            serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
                message: format!("stored response of {key} is not the expected JSON"),
                source: Some(Box::new(e)),
            })
        })
    }

    /// [`Engine::execute`] after its claim: given a claim's answer, runs the handler under
    /// an acquired lease and stores its result, or turns any other answer into its
    /// [`Outcome`].
    pub async fn execute_claimed<F, Fut>(&self, answer: ClaimOutcome, handler: F) -> Result<Outcome>
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<Bytes, HandlerError>> + Send,
    {
        let lease = match Self::lease_or_outcome(answer) {
            Ok(lease) => lease,
            Err(outcome) => return Ok(outcome),
        };
        let settle = match self.run_leased(&lease, handler).await {
            Ran::Settle(settle) => settle,
            Ran::Fenced => return Ok(Outcome::Fenced),
        };
        let item = Settlement { lease, settle };
        let mut answers = self.settle_batch(std::slice::from_ref(&item)).await?;
        answers
            .pop()
            .unwrap_or_else(|| Err(Error::corrupt("settle_many answered nothing")))
    }

    /// The lease of an `Acquired` answer, or the [`Outcome`] any other answer means.
    pub fn lease_or_outcome(answer: ClaimOutcome) -> std::result::Result<Lease, Outcome> {
        Err(match answer {
            ClaimOutcome::Acquired(lease) => return Ok(lease),
            ClaimOutcome::Completed(bytes) => Outcome::Replayed(bytes),
            ClaimOutcome::InProgress { owner, lease_until } => {
                Outcome::InProgress { owner, lease_until }
            }
            ClaimOutcome::Poisoned { attempts, error } => Outcome::Poisoned { attempts, error },
            ClaimOutcome::Mismatch => Outcome::Mismatch,
        })
    }

    /// Claims a batch in one store call ([`Backend::claim_many`]), answering in order.
    pub async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        let answers = self.inner.backend.claim_many(claims).await?;
        if answers.len() != claims.len() {
            return Err(Error::corrupt(format!(
                "claim_many answered {} outcomes for {} claims",
                answers.len(),
                claims.len()
            )));
        }
        Ok(answers)
    }

    /// Settles a batch in one store call ([`Backend::settle_many`]) with this engine's
    /// retention, answering in order: `Executed` for a stored response, `Failed` or
    /// `Poisoned` for a stored failure, `Released`, or `Fenced` for a lease no longer held.
    /// An item the store refuses alone (a response over its limit) is that item's `Err`;
    /// a store error is the whole call's. Settling again after a store error is safe: what
    /// landed the first time is then `Fenced`.
    pub async fn settle_batch(&self, items: &[Settlement]) -> Result<Vec<Result<Outcome>>> {
        let i = &self.inner;
        let answers = i.backend.settle_many(items, i.retention).await?;
        if answers.len() != items.len() {
            return Err(Error::corrupt(format!(
                "settle_many answered {} results for {} items",
                answers.len(),
                items.len()
            )));
        }
        Ok(items
            .iter()
            .zip(answers)
            .map(|(item, answer)| match answer {
                Ok(()) => Ok(self.settled(item)),
                Err(e) if e.is_fenced() => Ok(Outcome::Fenced),
                Err(e) => Err(e),
            })
            .collect())
    }

    fn settled(&self, item: &Settlement) -> Outcome {
        match &item.settle {
            Settle::Complete(response) => Outcome::Executed(response.clone()),
            Settle::Fail { error, kind } => Outcome::after_failure(
                item.lease.attempts,
                self.inner.max_attempts,
                *kind,
                error.clone(),
            ),
            Settle::Release => Outcome::Released,
        }
    }

    async fn claim_waiting(&self, claim: &Claim) -> Result<ClaimOutcome> {
        let backend = &self.inner.backend;
        let start = tokio::time::Instant::now();
        let first = backend.claim(claim).await?;
        let (WaitPolicy::Wait { poll, max }, ClaimOutcome::InProgress { .. }) =
            (self.inner.wait, &first)
        else {
            return Ok(first);
        };
        // Only a key found in progress is watched, so a free key's claim stays one call.
        // The watch comes before the next read: a settle since the first read shows in
        // that read, and one after it wakes the watch. A backend slow to subscribe (its
        // first connect) gets no more than `max`.
        let mut watch = tokio::time::timeout(max, backend.watch(&claim.key))
            .await
            .unwrap_or_default();
        // Woken by the store, a wait lasts `poll` (the re-read that covers a lost
        // notification); polling, it starts at a quarter of `poll` and doubles up to it.
        let mut pause = if watch.is_notified() { poll } else { poll / 4 };
        loop {
            let answer = backend.claim(claim).await?;
            let ClaimOutcome::InProgress { lease_until, .. } = &answer else {
                return Ok(answer);
            };
            let waited = start.elapsed();
            if waited >= max {
                return Ok(answer);
            }
            let until_lapse = lease_until.since(Timestamp::now()) + Duration::from_millis(1);
            let wait = pause.max(Duration::from_millis(1)).min(poll);
            watch.changed(wait.min(until_lapse).min(max - waited)).await;
            pause = pause.saturating_mul(2);
        }
    }

    /// Runs `handler` under `lease`, extending the lease every heartbeat while it runs, and
    /// says what to write; writes nothing itself. A lease that waited in its batch for more
    /// than half its time is renewed first. A panic is a retryable failure; a response
    /// over the backend's limit a permanent one.
    pub async fn run_leased<F, Fut>(&self, lease: &Lease, handler: F) -> Ran
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<Bytes, HandlerError>> + Send,
    {
        let i = &self.inner;
        if lease.lease_until.since(Timestamp::now()) < i.lease_ttl / 2 {
            match i.backend.extend(lease, i.lease_ttl).await {
                Ok(_) => {}
                Err(e) if e.is_fenced() => return Ran::Fenced,
                Err(e) => tracing::warn!(key = %lease.key, error = %e, "lease renewal failed"),
            }
        }
        let signal = Signal::new();
        let ctx = Context::new(lease.clone(), signal.clone());
        let work = AssertUnwindSafe(crate::backend::panic_at_poll(|| handler(ctx)));
        let work = work.catch_unwind();
        tokio::pin!(work);
        // A handler that finishes at its first poll needs no heartbeat timer.
        let result = match futures::poll!(&mut work) {
            std::task::Poll::Ready(done) => done,
            std::task::Poll::Pending => {
                let start = crate::clock::deadline(i.heartbeat);
                let mut ticks = tokio::time::interval_at(start, i.heartbeat);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut extending: Fuse<BoxFuture<'_, Result<Timestamp>>> = Fuse::terminated();
                loop {
                    tokio::select! {
                        biased;
                        done = &mut work => break done,
                        res = &mut extending, if !extending.is_terminated() => match res {
                            Ok(_) => {}
                            Err(e) if e.is_fenced() => signal.fire(),
                            Err(e) => {
                                tracing::warn!(key = %lease.key, error = %e, "lease extend failed")
                            }
                        },
                        _ = ticks.tick(), if extending.is_terminated() && !signal.is_fired() => {
                            extending = i.backend.extend(lease, i.lease_ttl).fuse();
                        }
                    }
                }
            }
        };
        if signal.is_fired() {
            return Ran::Fenced;
        }
        let failure = match result {
            Ok(Ok(response)) => {
                match handler_response(response, i.backend.capabilities().max_response_bytes) {
                    Ok(response) => return Ran::Settle(Settle::Complete(response)),
                    Err(failure) => failure,
                }
            }
            Ok(Err(e)) => e,
            Err(panic) => HandlerError::panicked(panic.as_ref()),
        };
        Ran::Settle(Settle::Fail {
            kind: failure.kind(),
            error: failure.into_message(),
        })
    }
}
