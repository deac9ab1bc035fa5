//! Invariant 9: random operation sequences against a backend and the reference [`Model`]
//! must give the same answers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::backend::{Claim, ClaimOutcome, Model, Settle, Settlement};
use idem_core::{
    Backend, ClaimKind, Error, FailureKind, Fingerprint, Key, Lease, Record, State, Timestamp,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::{Factory, Fixture, Time};

const OWNERS: u8 = 3;
const KEYS: u8 = 2;
/// Low, so that generated sequences reach poisoned keys often.
const MAX_ATTEMPTS: u32 = 2;
/// Retention under real time: longer than any case, so no record expires while the model
/// assumes no time passes between moves.
const RETENTION: Duration = Duration::from_secs(3600);
/// Retention under a manual clock, in leases: short, so that sequences reach expiry.
const RETENTION_LEASES: u32 = 3;

/// One step of a generated sequence.
#[derive(Clone, Debug)]
enum Op {
    Claim {
        owner: u8,
        key: u8,
        payload: u8,
    },
    /// One `claim_many` call: per item an owner, a key and a payload, as in `Claim`.
    ClaimMany {
        items: Vec<(u8, u8, u8)>,
    },
    Complete {
        owner: u8,
        key: u8,
        response: u8,
    },
    Fail {
        owner: u8,
        key: u8,
        permanent: bool,
    },
    Extend {
        owner: u8,
        key: u8,
    },
    Release {
        owner: u8,
        key: u8,
    },
    /// One `settle_many` call: per item an owner, a key and an action (0 complete, 1 fail,
    /// 2 fail permanently, 3 release).
    Settle {
        items: Vec<(u8, u8, u8)>,
    },
    Get {
        key: u8,
    },
    Delete {
        key: u8,
    },
    /// Moves time by `quarters` quarter-leases under a manual clock; under real time any
    /// move sleeps one and a half leases, so no answer depends on a race with the clock.
    Advance {
        quarters: u8,
    },
}

/// Operations; `advance_weight` is how often time moves (each move is a real sleep under
/// [`Time::Real`], so real servers get fewer).
fn op(advance_weight: u32) -> impl Strategy<Value = Op> {
    let owner = 0..OWNERS;
    let key = 0..KEYS;
    prop_oneof![
        6 => (owner.clone(), key.clone(), 0u8..3)
            .prop_map(|(owner, key, payload)| Op::Claim { owner, key, payload }),
        2 => proptest::collection::vec((owner.clone(), key.clone(), 0u8..3), 1..5)
            .prop_map(|items| Op::ClaimMany { items }),
        3 => (owner.clone(), key.clone(), 0u8..4)
            .prop_map(|(owner, key, response)| Op::Complete { owner, key, response }),
        2 => (owner.clone(), key.clone(), any::<bool>())
            .prop_map(|(owner, key, permanent)| Op::Fail { owner, key, permanent }),
        2 => (owner.clone(), key.clone()).prop_map(|(owner, key)| Op::Extend { owner, key }),
        1 => (owner.clone(), key.clone()).prop_map(|(owner, key)| Op::Release { owner, key }),
        3 => proptest::collection::vec((owner.clone(), key.clone(), 0u8..4), 1..5)
            .prop_map(|items| Op::Settle { items }),
        1 => key.clone().prop_map(|key| Op::Get { key }),
        1 => key.prop_map(|key| Op::Delete { key }),
        advance_weight => (1u8..7).prop_map(|quarters| Op::Advance { quarters }),
    ]
}

/// An answer with the deciding clock's timestamps left out, so a model on a manual clock
/// can be compared with a server on its own.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Acquired {
        token: u64,
        attempts: u32,
        kind: ClaimKind,
    },
    Completed(Bytes),
    InProgress {
        owner: Arc<str>,
    },
    Claimed(Vec<Answer>),
    Poisoned {
        attempts: u32,
        error: String,
    },
    Mismatch,
    Done,
    Fenced,
    Settled(Vec<Answer>),
    Record(Option<Seen>),
    Deleted(bool),
}

#[derive(Debug, PartialEq, Eq)]
struct Seen {
    state: State,
    owner: Arc<str>,
    token: u64,
    attempts: u32,
    fingerprint: Option<Fingerprint>,
    response: Option<Bytes>,
    error: Option<String>,
    permanent: bool,
}

fn seen(r: Option<&Record>) -> Answer {
    Answer::Record(r.map(|r| Seen {
        state: r.state,
        owner: r.owner.clone(),
        token: r.token,
        attempts: r.attempts,
        fingerprint: r.fingerprint,
        response: r.response.clone(),
        error: r.error.clone(),
        permanent: r.permanent,
    }))
}

fn claimed(out: &ClaimOutcome) -> Answer {
    match out {
        ClaimOutcome::Acquired(l) => Answer::Acquired {
            token: l.token,
            attempts: l.attempts,
            kind: l.kind,
        },
        ClaimOutcome::Completed(b) => Answer::Completed(b.clone()),
        ClaimOutcome::InProgress { owner, .. } => Answer::InProgress {
            owner: owner.clone(),
        },
        ClaimOutcome::Poisoned { attempts, error } => Answer::Poisoned {
            attempts: *attempts,
            error: error.clone(),
        },
        ClaimOutcome::Mismatch => Answer::Mismatch,
    }
}

fn fenced<T>(res: Result<T, Error>) -> Result<Answer, TestCaseError> {
    match res {
        Ok(_) => Ok(Answer::Done),
        Err(Error::Fenced { .. }) => Ok(Answer::Fenced),
        Err(e) => Err(TestCaseError::fail(format!("store error: {e}"))),
    }
}

fn store<T>(res: Result<T, Error>) -> Result<T, TestCaseError> {
    res.map_err(|e| TestCaseError::fail(format!("store error: {e}")))
}

/// Leases each owner holds per key, one map for the backend's and one for the model's.
#[derive(Default)]
struct Leases(HashMap<(u8, u8), Lease>);

impl Leases {
    /// The owner's last lease on the key, or a forged one (token 1) if it never got one:
    /// it must be fenced unless it happens to match the record.
    fn get(&self, owner: u8, key: &Key, k: u8) -> Lease {
        self.0.get(&(owner, k)).cloned().unwrap_or_else(|| Lease {
            key: key.clone(),
            owner: owner_name(owner),
            token: 1,
            attempts: 1,
            lease_until: Timestamp::default(),
            kind: ClaimKind::First,
            fingerprint: None,
        })
    }
}

/// The claim of `(owner, key, payload)` as the property makes it: payloads 0 and 1 carry
/// a fingerprint, 2 none.
fn claim_of(
    keys: &[Key],
    (lease, retention): (Duration, Duration),
    (owner, key, payload): (u8, u8, u8),
) -> Claim {
    Claim {
        key: keys[key as usize].clone(),
        owner: owner_name(owner),
        lease_ttl: lease,
        fingerprint: (payload < 2).then(|| Fingerprint::of(&[payload])),
        max_attempts: MAX_ATTEMPTS,
        retention,
    }
}

fn owner_name(owner: u8) -> Arc<str> {
    format!("owner-{owner}").into()
}

async fn run_case<B: Backend>(fx: &Fixture<B>, ops: &[Op]) -> Result<(), TestCaseError> {
    let real = matches!(fx.time, Time::Real);
    // Under real time the property uses half the fixture's lease, so time moves cost less.
    let lease = if real { fx.lease / 2 } else { fx.lease };
    let retention = if real {
        RETENTION
    } else {
        lease * RETENTION_LEASES
    };
    let times = (lease, retention);
    // Under real time the model assumes no time passes between moves. That holds while
    // every lease granted since the last move is still live: if the operations since then
    // took most of a lease (a loaded machine), the case proves nothing and is rejected,
    // not failed.
    let mut since_move = std::time::Instant::now();
    let start = match &fx.time {
        Time::Manual(clock) => idem_core::clock::Clock::now(clock),
        Time::Real => Timestamp::now(),
    };
    let mut model = Model::new(start);
    let (mut real_leases, mut model_leases) = (Leases::default(), Leases::default());
    let keys: Vec<Key> = (0..KEYS).map(|k| fx.key(&format!("p{k}"))).collect();
    for (step, op) in ops.iter().enumerate() {
        let (got, want) = match *op {
            Op::Claim {
                owner,
                key,
                payload,
            } => {
                let claim = claim_of(&keys, times, (owner, key, payload));
                let got = store(fx.backend.claim(&claim).await)?;
                let want = model.claim(&claim);
                if let ClaimOutcome::Acquired(l) = &got {
                    real_leases.0.insert((owner, key), l.clone());
                }
                if let ClaimOutcome::Acquired(l) = &want {
                    model_leases.0.insert((owner, key), l.clone());
                }
                (claimed(&got), claimed(&want))
            }
            Op::ClaimMany { ref items } => {
                let claims: Vec<Claim> = items
                    .iter()
                    .map(|&item| claim_of(&keys, times, item))
                    .collect();
                let got = store(fx.backend.claim_many(&claims).await)?;
                prop_assert_eq!(
                    got.len(),
                    claims.len(),
                    "claim_many answered a different count"
                );
                // The model answers the items as single claims in turn.
                let want: Vec<ClaimOutcome> = claims.iter().map(|c| model.claim(c)).collect();
                for (&(owner, key, _), (g, w)) in items.iter().zip(got.iter().zip(&want)) {
                    if let ClaimOutcome::Acquired(l) = g {
                        real_leases.0.insert((owner, key), l.clone());
                    }
                    if let ClaimOutcome::Acquired(l) = w {
                        model_leases.0.insert((owner, key), l.clone());
                    }
                }
                (
                    Answer::Claimed(got.iter().map(claimed).collect()),
                    Answer::Claimed(want.iter().map(claimed).collect()),
                )
            }
            Op::Complete {
                owner,
                key,
                response,
            } => {
                let k = &keys[key as usize];
                let body = Bytes::from(vec![response, 0, 0xff]);
                let lease = real_leases.get(owner, k, key);
                let got = fenced(fx.backend.complete(&lease, body.clone(), retention).await)?;
                let lease = model_leases.get(owner, k, key);
                let want = done(model.complete(&lease, body, retention));
                (got, want)
            }
            Op::Fail {
                owner,
                key,
                permanent,
            } => {
                let k = &keys[key as usize];
                let kind = if permanent {
                    FailureKind::Permanent
                } else {
                    FailureKind::Retry
                };
                let error = format!("err-{step}");
                let lease = real_leases.get(owner, k, key);
                let got = fenced(fx.backend.fail(&lease, &error, kind, retention).await)?;
                let lease = model_leases.get(owner, k, key);
                (got, done(model.fail(&lease, &error, kind, retention)))
            }
            Op::Extend { owner, key } => {
                let k = &keys[key as usize];
                let held = real_leases.get(owner, k, key);
                let got = fenced(fx.backend.extend(&held, lease).await)?;
                let held = model_leases.get(owner, k, key);
                (got, done(model.extend(&held, lease)))
            }
            Op::Release { owner, key } => {
                let k = &keys[key as usize];
                let held = real_leases.get(owner, k, key);
                let got = fenced(fx.backend.release(&held).await)?;
                let held = model_leases.get(owner, k, key);
                (got, done(model.release(&held)))
            }
            Op::Settle { ref items } => {
                let batch = |leases: &Leases| -> Vec<Settlement> {
                    items
                        .iter()
                        .enumerate()
                        .map(|(i, &(owner, key, action))| {
                            let lease = leases.get(owner, &keys[key as usize], key);
                            let settle = match action {
                                0 => Settle::Complete(Bytes::from(vec![key, owner, 0xfe])),
                                1 | 2 => Settle::Fail {
                                    error: format!("err-{step}-{i}"),
                                    kind: if action == 1 {
                                        FailureKind::Retry
                                    } else {
                                        FailureKind::Permanent
                                    },
                                },
                                _ => Settle::Release,
                            };
                            Settlement { lease, settle }
                        })
                        .collect()
                };
                let answers = store(
                    fx.backend
                        .settle_many(&batch(&real_leases), retention)
                        .await,
                )?;
                prop_assert_eq!(
                    answers.len(),
                    items.len(),
                    "settle_many answered a different count"
                );
                let got = answers
                    .into_iter()
                    .map(fenced)
                    .collect::<Result<Vec<_>, _>>()?;
                let want = batch(&model_leases)
                    .iter()
                    .map(|item| done(model.settle(item, retention)))
                    .collect();
                (Answer::Settled(got), Answer::Settled(want))
            }
            Op::Get { key } => {
                let k = &keys[key as usize];
                let got = store(fx.backend.get(k).await)?;
                (seen(got.as_ref()), seen(model.get(k)))
            }
            Op::Delete { key } => {
                let k = &keys[key as usize];
                let got = Answer::Deleted(store(fx.backend.delete(k).await)?);
                (got, Answer::Deleted(model.delete(k)))
            }
            Op::Advance { quarters } => {
                let d = match fx.time {
                    Time::Manual(_) => lease * u32::from(quarters) / 4,
                    Time::Real => lease * 3 / 2,
                };
                fx.advance(d).await;
                model.advance(d);
                since_move = std::time::Instant::now();
                continue;
            }
        };
        if real && since_move.elapsed() >= lease * 9 / 10 {
            return Err(TestCaseError::reject(
                "operations outran the lease: inconclusive",
            ));
        }
        prop_assert_eq!(got, want, "step {} ({:?}) of {:?}", step, op, ops);
    }
    let mut finals = Vec::with_capacity(keys.len());
    for k in &keys {
        finals.push(store(fx.backend.get(k).await)?);
    }
    // The final reads count as operations too: a lease may not lapse under them either.
    if real && since_move.elapsed() >= lease * 9 / 10 {
        return Err(TestCaseError::reject(
            "operations outran the lease: inconclusive",
        ));
    }
    for (k, got) in keys.iter().zip(finals) {
        prop_assert_eq!(
            seen(got.as_ref()),
            seen(model.get(k)),
            "final {} of {:?}",
            k,
            ops
        );
    }
    Ok(())
}

fn done(ok: bool) -> Answer {
    if ok { Answer::Done } else { Answer::Fenced }
}

/// Runs the property: `PROPTEST_CASES` sequences (default 256) of up to 40 operations,
/// each on a fresh fixture. Needs a multi-threaded tokio runtime.
///
/// Under [`Time::Real`] time moves are rarer (about one a sequence, each a sleep of one
/// and a half leases) and sequences shorter, so that 256 cases take minutes, not hours.
pub async fn model_agreement<F: Factory>(factory: &F) {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let real = matches!(factory.setup().await.time, Time::Real);
    let (advance_weight, max_len) = if real { (1, 24) } else { (3, 40) };
    let handle = tokio::runtime::Handle::current();
    let result = tokio::task::block_in_place(|| {
        let mut runner = TestRunner::new(config);
        runner.run(
            &proptest::collection::vec(op(advance_weight), 1..max_len),
            |ops| {
                handle.block_on(async {
                    let fx = factory.setup().await;
                    run_case(&fx, &ops).await
                })
            },
        )
    });
    if let Err(e) = result {
        panic!("model agreement failed: {e}");
    }
}
