#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod batch;
pub mod cases;
mod counting;
mod failures;
pub mod process;
mod property;
pub mod proxy;
mod records;
mod support;
mod waiting;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::clock::ManualClock;
use idem_core::{Backend, Fingerprint, Key, Lease, Result};

pub use counting::{CallLog, Counting};
pub use property::model_agreement;

/// How time moves for a backend under test.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Time {
    /// The backend reads this clock; the suite moves it.
    Manual(ManualClock),
    /// The backend reads a real clock (its server's); the suite sleeps.
    Real,
}

/// An isolated backend for one case: nothing another case writes is visible to it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Fixture<B> {
    /// The backend.
    pub backend: B,
    /// How time moves for it.
    pub time: Time,
    /// A namespace no other case uses.
    pub namespace: String,
    /// The lease the cases use: long enough that a handful of store calls never outlast it,
    /// short enough that waiting for it to lapse (under [`Time::Real`]) is cheap.
    pub lease: Duration,
}

impl<B: Backend> Fixture<B> {
    /// A fixture on a manual clock with a 10 s lease.
    pub fn manual(backend: B, clock: ManualClock) -> Self {
        Fixture {
            backend,
            time: Time::Manual(clock),
            namespace: unique_namespace(),
            lease: Duration::from_secs(10),
        }
    }

    /// A fixture on real time with the given lease (about 1 s suits a loopback server).
    pub fn real(backend: B, lease: Duration) -> Self {
        Fixture {
            backend,
            time: Time::Real,
            namespace: unique_namespace(),
            lease,
        }
    }

    /// The key `id` in this fixture's namespace.
    pub fn key(&self, id: &str) -> Key {
        Key::new(self.namespace.clone(), id).expect("suite ids are valid")
    }

    /// Moves time forward by `d`: the manual clock, or a real sleep.
    pub async fn advance(&self, d: Duration) {
        match &self.time {
            Time::Manual(clock) => clock.advance(d),
            Time::Real => tokio::time::sleep(d).await,
        }
    }

    /// Moves time past any lease taken so far (one and a half leases).
    pub async fn lapse(&self) {
        self.advance(self.lease * 3 / 2).await
    }

    /// A claim of `key` by `owner` with the fixture's lease, payload `p`, at most 3
    /// attempts and a retention of one hour.
    pub fn claim(&self, key: &Key, owner: &str) -> Claim {
        claim_of(key, owner, self.lease)
    }

    /// Claims and expects `Acquired`.
    pub async fn acquire(&self, claim: &Claim) -> Lease {
        acquire(&self.backend, claim).await
    }
}

/// `backend` in every layer of `idem_core::layer`, stacked as a user would: chaos (every
/// fault off), single calls joined into batch calls, each try bounded by 5 s,
/// `Unavailable` retried, every call observed. The suite over it must answer exactly as
/// over the backend itself.
pub fn in_every_layer<B: Backend + 'static>(backend: B) -> std::sync::Arc<dyn Backend> {
    use idem_core::layer::{
        BackendExt, ChaosLayer, CoalesceLayer, ObserveLayer, RetryLayer, TimeoutLayer,
    };
    std::sync::Arc::new(
        backend
            .layer(ChaosLayer::new())
            .layer(CoalesceLayer)
            .layer(TimeoutLayer::new(Duration::from_secs(5)))
            .layer(RetryLayer::new())
            .layer(ObserveLayer::new()),
    )
}

/// Claims with `backend` and expects `Acquired`; panics naming the key, owner and answer.
pub async fn acquire<B: Backend + ?Sized>(backend: &B, claim: &Claim) -> Lease {
    match backend.claim(claim).await {
        Ok(ClaimOutcome::Acquired(lease)) => lease,
        other => panic!(
            "claim of {} by {}: expected Acquired, got {other:?}",
            claim.key, claim.owner
        ),
    }
}

/// The suite's standard claim: payload `p`, at most 3 attempts, one hour of retention.
pub fn claim_of(key: &Key, owner: &str, lease: Duration) -> Claim {
    Claim {
        key: key.clone(),
        owner: owner.into(),
        lease_ttl: lease,
        fingerprint: Some(Fingerprint::of(b"p")),
        max_attempts: 3,
        retention: Duration::from_secs(3600),
    }
}

/// The value of the environment variable `var` (such as `MY_STORE_URL`), or a panic that
/// says how to set it ([`idem_core::backend::driver::service_url`]'s message): a test
/// whose service is not configured fails, it never passes silently.
pub fn service_env(var: &str) -> String {
    idem_core::backend::driver::service_url(var).unwrap_or_else(|e| panic!("{e}"))
}

/// How long one case may run before [`bounded`] fails it: `IDEM_CONFORMANCE_CASE_SECS`
/// seconds, 600 by default (a real server's slowest case, the model agreement at a high
/// `PROPTEST_CASES`, takes minutes).
pub fn case_limit() -> Duration {
    std::env::var("IDEM_CONFORMANCE_CASE_SECS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .map_or(Duration::from_secs(600), Duration::from_secs)
}

/// Runs the case `name` to its end, or panics once it has run for [`case_limit`]: a
/// backend that breaks the contract can leave a case waiting forever (a waiter never
/// woken, a lease that never lapses), and the suite must fail it, not hang. [`suite!`]
/// wraps every case in it.
pub async fn bounded<F: Future<Output = ()>>(name: &str, case: F) {
    let limit = case_limit();
    if tokio::time::timeout(limit, case).await.is_err() {
        panic!("{name}: still running after {limit:?} (IDEM_CONFORMANCE_CASE_SECS)");
    }
}

/// A namespace unique to this process and call.
pub fn unique_namespace() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("t{}-{}-{n}", std::process::id(), fastrand_suffix())
}

fn fastrand_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{nanos:x}")
}

/// Hands out an isolated [`Fixture`] per case.
pub trait Factory: Send + Sync {
    /// The backend type under test.
    type Backend: Backend + 'static;

    /// A fresh fixture. A factory whose service is not configured panics with a message
    /// naming the command that starts it.
    fn setup(&self) -> impl Future<Output = Fixture<Self::Backend>> + Send;

    /// A fresh fixture whose backend is configured to refuse responses over `limit` bytes,
    /// or `None` if the backend's limit cannot be configured (the `oversized_response`
    /// case then uses its own limit).
    fn setup_with_response_limit(
        &self,
        limit: usize,
    ) -> impl Future<Output = Option<Fixture<Self::Backend>>> + Send {
        let _ = limit;
        std::future::ready(None)
    }
}

/// What a factory for a backend that talks to a server adds, for the failure cases of
/// [`remote_suite!`]: how to point the backend at a dead or silent endpoint, and how to
/// plant a record idem did not write. A backend with no server (memory) has neither, and
/// does not run those cases.
pub trait Remote: Factory {
    /// The backend configured for a server at `addr` (loopback, where nothing listens, or
    /// where a server accepts and never answers), with the timeouts whose bound
    /// [`Remote::unavailable_within`] gives. A backend that connects at once answers that
    /// connect here; the cases accept `Unavailable` from it as the answer.
    fn connect_to(&self, addr: SocketAddr) -> impl Future<Output = Result<Self::Backend>> + Send;

    /// The longest a call (or the connect) against a dead or silent endpoint may take
    /// before it answers `Unavailable`: the configured timeouts, the client's own retries,
    /// and slack for a loaded machine.
    fn unavailable_within(&self) -> Duration;

    /// Writes, where `fixture`'s backend keeps `key`'s record, the `kind`th sort of value
    /// idem never writes (numbered from 0), and says what it is; `None` once `kind` is past
    /// the last sort the factory knows (there must be at least one).
    fn plant_corrupt(
        &self,
        fixture: &Fixture<Self::Backend>,
        key: &Key,
        kind: usize,
    ) -> impl Future<Output = Option<String>> + Send;
}

/// Expands to one `#[tokio::test]` per conformance case, each calling the case with the
/// factory `$factory` (an expression evaluated afresh in each test). The calling crate
/// needs `tokio` with the `macros` and `rt-multi-thread` features as a dev-dependency.
///
/// ```
/// use idem_conformance::{Factory, Fixture};
/// use idem_core::clock::ManualClock;
/// use idem_core::{MemoryBackend, Timestamp};
///
/// struct Memory;
///
/// impl Factory for Memory {
///     type Backend = MemoryBackend;
///     async fn setup(&self) -> Fixture<MemoryBackend> {
///         let clock = ManualClock::new(Timestamp::from_millis(0));
///         Fixture::manual(MemoryBackend::with_clock(clock.clone()), clock)
///     }
/// }
///
/// mod memory {
///     idem_conformance::suite!(super::Memory);
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! suite {
    ($factory:expr) => {
        $crate::suite!(@cases $factory;
            claim_new_key,
            mutual_exclusion,
            claim_race,
            fencing_after_takeover,
            fencing_foreign_lease,
            fencing_same_owner,
            one_winner_replay,
            late_complete_without_takeover,
            tokens_monotonic,
            crash_recovery,
            bounded_attempts_failures,
            bounded_attempts_lapses,
            permanent_failure_poisons,
            fingerprint_mismatch,
            heartbeat_extend,
            retention_expiry,
            delete_and_get,
            claim_many_agrees,
            settle_many_agrees,
            release_hands_back,
            response_bytes_round_trip,
            engine_executes_once,
            list_records,
            oversized_response,
            model_agreement,
            wait_wakes_on_complete,
            wait_survives_lost_notification,
            wait_max_elapses,
            wait_watches_only_a_key_in_progress,
        );
    };
    (@cases $factory:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                $crate::bounded(stringify!($case), $crate::cases::$case(&$factory)).await;
            }
        )*
    };
}

/// Expands to one `#[tokio::test]` per failure case of a backend that talks to a server
/// (closed port, silent server, corrupt record), each calling the case with `$factory`, a
/// [`Remote`] factory. A backend with a server runs it beside [`suite!`].
#[macro_export]
macro_rules! remote_suite {
    ($factory:expr) => {
        $crate::suite!(@cases $factory; closed_port, silent_server, corrupt_record);
    };
}
