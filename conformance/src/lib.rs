#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod cases;
mod faulty;
mod property;

use std::future::Future;
use std::time::Duration;

use idem_core::clock::ManualClock;
use idem_core::{Backend, Claim, ClaimOutcome, Fingerprint, Key, Lease};

pub use faulty::{Fault, Faulty};
pub use property::model_agreement;

/// How time moves for a backend under test.
#[derive(Clone, Debug)]
pub enum Time {
    /// The backend reads this clock; the suite moves it.
    Manual(ManualClock),
    /// The backend reads a real clock (its server's); the suite sleeps.
    Real,
}

/// An isolated backend for one case: nothing another case writes is visible to it.
#[derive(Clone, Debug)]
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
        owner: owner.to_owned(),
        lease_ttl: lease,
        fingerprint: Some(Fingerprint::of(b"p")),
        max_attempts: 3,
        retention: Duration::from_secs(3600),
    }
}

/// The value of the environment variable `var` (such as `IDEM_REDIS_URL`), or a panic that
/// names the command starting the test services: a test whose service is not configured
/// fails, it never passes silently.
pub fn service_env(var: &str) -> String {
    match std::env::var(var) {
        Ok(value) if !value.trim().is_empty() => value,
        _ => panic!(
            "{var} is not set: start the test services with `eval \"$(scripts/services up)\"` \
             (scripts/test does this for you)"
        ),
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
}

/// Expands to one `#[tokio::test]` per conformance case, each calling the case with the
/// factory `$factory` (an expression evaluated afresh in each test). The calling crate
/// needs `tokio` with the `macros` and `rt-multi-thread` features as a dev-dependency.
///
/// ```
/// use conformance::{Factory, Fixture};
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
///     conformance::suite!(super::Memory);
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
            response_bytes_round_trip,
            engine_executes_once,
            list_records,
            model_agreement,
        );
    };
    (@cases $factory:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                $crate::cases::$case(&$factory).await;
            }
        )*
    };
}
