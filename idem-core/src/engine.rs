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
use tokio_util::sync::CancellationToken;

use crate::{
    Backend, Claim, ClaimOutcome, Context, Error, FailureKind, Fingerprint, HandlerError, Key,
    Lease, Result, Timestamp,
};

/// What to do when a claim finds another worker's live lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitPolicy {
    /// Answer [`Outcome::InProgress`] at once (the default; a Kafka loop pauses the
    /// partition instead of blocking).
    Return,
    /// Ask again every `poll` (sooner if the lease is due to lapse) for up to `max`, then
    /// answer [`Outcome::InProgress`].
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
        owner: String,
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

    /// How long a lease lasts without a heartbeat (default 30 s).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// How often a running handler's lease is extended (default a third of the lease).
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = Some(every);
        self
    }

    /// How long completed and failed records are kept (default 24 h).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
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
                owner,
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
    owner: String,
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

    /// The claim request this engine makes for `key` and `payload`.
    pub fn claim_for(&self, key: &Key, payload: &[u8]) -> Claim {
        let i = &self.inner;
        Claim {
            key: key.clone(),
            owner: i.owner.clone(),
            lease_ttl: i.lease_ttl,
            fingerprint: i.fingerprint.then(|| Fingerprint::of(payload)),
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
        self.settle(answer, handler).await
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

    /// Acts on a claim's answer: runs the handler under an acquired lease, or turns any
    /// other answer into its [`Outcome`]. For callers that claim in batches
    /// ([`Backend::claim_many`]) and settle each answer.
    pub async fn settle<F, Fut>(&self, answer: ClaimOutcome, handler: F) -> Result<Outcome>
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<Bytes, HandlerError>> + Send,
    {
        Ok(match answer {
            ClaimOutcome::Acquired(lease) => return self.run(lease, handler).await,
            ClaimOutcome::Completed(bytes) => Outcome::Replayed(bytes),
            ClaimOutcome::InProgress { owner, lease_until } => {
                Outcome::InProgress { owner, lease_until }
            }
            ClaimOutcome::Poisoned { attempts, error } => Outcome::Poisoned { attempts, error },
            ClaimOutcome::Mismatch => Outcome::Mismatch,
        })
    }

    async fn claim_waiting(&self, claim: &Claim) -> Result<ClaimOutcome> {
        let start = tokio::time::Instant::now();
        loop {
            let answer = self.inner.backend.claim(claim).await?;
            let (WaitPolicy::Wait { poll, max }, ClaimOutcome::InProgress { lease_until, .. }) =
                (self.inner.wait, &answer)
            else {
                return Ok(answer);
            };
            let waited = start.elapsed();
            if waited >= max {
                return Ok(answer);
            }
            let until_lapse = lease_until.since(Timestamp::now()) + Duration::from_millis(1);
            tokio::time::sleep(poll.min(until_lapse).min(max - waited)).await;
        }
    }

    /// Runs `handler` under `lease`, heartbeating, then completes or fails the record.
    async fn run<F, Fut>(&self, lease: Lease, handler: F) -> Result<Outcome>
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<Bytes, HandlerError>> + Send,
    {
        let i = &self.inner;
        let signal = CancellationToken::new();
        let work = AssertUnwindSafe(handler(Context::new(lease.clone(), signal.clone())));
        let work = work.catch_unwind();
        tokio::pin!(work);
        // A handler that finishes at its first poll needs no heartbeat timer.
        let result = match futures::poll!(&mut work) {
            std::task::Poll::Ready(done) => done,
            std::task::Poll::Pending => {
                let start = tokio::time::Instant::now() + i.heartbeat;
                let mut ticks = tokio::time::interval_at(start, i.heartbeat);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut extending: Fuse<BoxFuture<'_, Result<Timestamp>>> = Fuse::terminated();
                loop {
                    tokio::select! {
                        biased;
                        done = &mut work => break done,
                        res = &mut extending, if !extending.is_terminated() => match res {
                            Ok(_) => {}
                            Err(e) if e.is_fenced() => signal.cancel(),
                            Err(e) => {
                                tracing::warn!(key = %lease.key, error = %e, "lease extend failed")
                            }
                        },
                        _ = ticks.tick(), if extending.is_terminated() && !signal.is_cancelled() => {
                            extending = i.backend.extend(&lease, i.lease_ttl).fuse();
                        }
                    }
                }
            }
        };
        if signal.is_cancelled() {
            return Ok(Outcome::Fenced);
        }
        let failure = match result {
            Ok(Ok(response)) => {
                let limit = i.backend.capabilities().max_response_bytes;
                if response.len() <= limit {
                    return match i
                        .backend
                        .complete(&lease, response.clone(), i.retention)
                        .await
                    {
                        Ok(()) => Ok(Outcome::Executed(response)),
                        Err(e) if e.is_fenced() => Ok(Outcome::Fenced),
                        Err(e) => Err(e),
                    };
                }
                let too_large = Error::TooLarge {
                    what: "response",
                    size: response.len(),
                    limit,
                };
                HandlerError::permanent(too_large)
            }
            Ok(Err(e)) => e,
            Err(panic) => HandlerError::panicked(panic.as_ref()),
        };
        let kind = failure.kind();
        match i
            .backend
            .fail(&lease, failure.message(), kind, i.retention)
            .await
        {
            Ok(()) => {}
            Err(e) if e.is_fenced() => return Ok(Outcome::Fenced),
            Err(e) => return Err(e),
        }
        let error = failure.message().to_owned();
        Ok(Outcome::after_failure(
            lease.attempts,
            i.max_attempts,
            kind,
            error,
        ))
    }
}
