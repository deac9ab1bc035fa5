//! `idem bench`: each backend's claim+complete against the same two writes done by hand on
//! its store (the write-if-absent, then the response over it) and against one raw write,
//! and its replays, measured in the same run through the same client, at each concurrency
//! and batch size.

mod markdown;
mod measure;
mod progress;
mod provenance;
mod report;
mod subject;

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_core::backend::{Claim, ClaimOutcome, Settlement};
use idem_core::{Backend, Fingerprint, Key};

use crate::cli::BenchArgs;
use crate::error::{Error, Result, StoreContext};
use crate::target::Target;

pub use measure::Measure;
use progress::Progress;
pub use report::{Cell, Report};
use subject::{RETENTION, Subject};

/// Completed keys the replay workload picks from.
const REPLAY_KEYS: u64 = 1024;

/// The payload every claim fingerprints and the response every complete stores: about
/// the size of a small JSON receipt.
const RESPONSE: &[u8] = br#"{"receipt":"r-000001","amount_cents":1999,"ok":true}"#;

/// What the by-hand claim writes before the response is written over it.
const CLAIMED: &[u8] = b"processing";

/// Workloads per cell: raw, by hand, claim+complete, replay.
const WORKLOADS: usize = 4;

/// Runs the bench the arguments describe and writes its report.
pub async fn run(args: &BenchArgs) -> Result<()> {
    check(args)?;
    let targets = args
        .backend
        .iter()
        .map(|u| Target::parse(u))
        .collect::<Result<Vec<_>>>()?;
    let tag = format!("{}_{}", std::process::id(), fastrand::u32(..0xfffff));
    let cells_per = args.concurrency.len() * args.batch.len() * (1 + usize::from(args.coalesce));
    let terminal = std::io::stderr().is_terminal();
    let bar = Progress::new(args.quiet, terminal, targets.len() * cells_per);
    let workers = args.concurrency.iter().copied().max().unwrap_or(1);
    // Every store is opened before any is measured, so a bad or unreachable URL fails at
    // once, not after the stores before it ran.
    let mut subjects = Vec::with_capacity(targets.len());
    for target in &targets {
        bar.set_message(format!("{}: setting up", target.kind()));
        match Subject::open(target, &tag, workers).await {
            Ok(subject) => subjects.push(subject),
            Err(e) => {
                // The store that could not be opened is the error to report; the others
                // are closed as well as they can be.
                let _ = close_all(subjects).await;
                return Err(e.within(target.kind()));
            }
        }
    }
    bar.println(&progress::estimate(targets.len(), cells_per, args.duration));
    let mut cells = Vec::new();
    let mut failed = None;
    for subject in &subjects {
        let mut run = bench_one(subject, args, &bar, &mut cells).await;
        if run.is_ok() && args.coalesce {
            run = bench_one(&subject.coalesced(), args, &bar, &mut cells).await;
        }
        if let Err(e) = run {
            failed = Some(e);
            break;
        }
    }
    let closed = close_all(subjects).await;
    bar.finish();
    // A run that failed part way still writes what it measured, then reports the failure.
    // (`take` only when nothing was measured: taken otherwise, the failure was lost, and
    // a run whose second store failed exited 0.)
    if cells.is_empty()
        && let Some(e) = failed.take()
    {
        return Err(e);
    }
    let report = Report::new(args, provenance::Provenance::here(), cells);
    let written = report.write(&args.out)?;
    if let Some(e) = failed {
        eprintln!(
            "idem: kept the cells measured before the failure: {}",
            shown(&written)
        );
        return Err(e);
    }
    closed?;
    let wrote = format!("wrote {}", shown(&written));
    if args.markdown {
        // stdout is the Markdown alone, to paste as it is.
        out!("{}", report.markdown());
        eprintln!("{wrote}");
    } else {
        out!("{}", report.table());
        out!("{wrote}");
    }
    Ok(())
}

/// Closes every subject, each even if another fails; the first failure.
async fn close_all(subjects: Vec<Subject>) -> Result<()> {
    let mut first = Ok(());
    for subject in subjects {
        let closed = subject.close().await;
        if first.is_ok() {
            first = closed;
        }
    }
    first
}

/// The files a report went to, for a line of output.
fn shown(paths: &[std::path::PathBuf]) -> String {
    let names: Vec<_> = paths.iter().map(|p| p.display().to_string()).collect();
    names.join(", ")
}

fn check(args: &BenchArgs) -> Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        return Err(Error::Usage(
            "--concurrency needs numbers of at least 1".into(),
        ));
    }
    if args.batch.is_empty() || args.batch.contains(&0) {
        return Err(Error::Usage("--batch needs numbers of at least 1".into()));
    }
    if args.duration < Duration::from_millis(10) {
        return Err(Error::Usage("--duration must be at least 10ms".into()));
    }
    Ok(())
}

/// Every (concurrency, batch) cell of one backend.
async fn bench_one(
    subject: &Subject,
    args: &BenchArgs,
    bar: &Progress,
    cells: &mut Vec<Cell>,
) -> Result<()> {
    // Each pass over a store keys its own namespace, so its fresh keys are fresh.
    let ns = format!("bench-{}-{}", std::process::id(), cells.len());
    let keys = Arc::new(Keys::new(&ns));
    let done = prepare_replay(subject, &keys)
        .await
        .map_err(|e| e.within(&format!("{}: preparing replays", subject.kind)))?;
    for &c in &args.concurrency {
        for &b in &args.batch {
            let label = |w: &str| format!("{}: {w} ×{c} workers, batch {b}", subject.kind);
            bar.set_message(label("raw"));
            let raw = baseline_workload(subject, &keys, false, (c, b, args.duration))
                .await
                .map_err(|e| e.within(&label("raw")))?;
            bar.inc();
            bar.set_message(label("by hand"));
            let by_hand = baseline_workload(subject, &keys, true, (c, b, args.duration))
                .await
                .map_err(|e| e.within(&label("by hand")))?;
            bar.inc();
            bar.set_message(label("claim+complete"));
            let claim = claim_workload(subject, &keys, c, b, args.duration)
                .await
                .map_err(|e| e.within(&label("claim+complete")))?;
            bar.inc();
            bar.set_message(label("replay"));
            let replay = replay_workload(subject, &done, c, b, args.duration)
                .await
                .map_err(|e| e.within(&label("replay")))?;
            bar.inc();
            let measured = report::Measured {
                raw,
                by_hand,
                claim_complete: claim,
                replay,
            };
            let cell = Cell::new(subject, c, b, measured);
            bar.cell_done(cells.len() + 1, &cell);
            cells.push(cell);
        }
    }
    Ok(())
}

/// Fresh keys: each call gives ids never used before in this run.
struct Keys {
    namespace: String,
    next: AtomicU64,
}

impl Keys {
    fn new(namespace: &str) -> Self {
        Keys {
            namespace: namespace.to_owned(),
            next: AtomicU64::new(0),
        }
    }

    fn ids(&self, n: u32) -> Vec<String> {
        let first = self.next.fetch_add(u64::from(n), Ordering::Relaxed);
        (first..first + u64::from(n))
            .map(|i| format!("k{i}"))
            .collect()
    }

    fn claims(&self, n: u32, worker: u32) -> Result<Vec<Claim>> {
        self.ids(n)
            .into_iter()
            .map(|id| self.claim(id, worker))
            .collect()
    }

    fn claim(&self, id: String, worker: u32) -> Result<Claim> {
        Ok(Claim {
            key: Key::new(self.namespace.clone(), id).map_err(|e| Error::Refused(e.to_string()))?,
            owner: format!("bench-{worker}").into(),
            lease_ttl: Duration::from_secs(30),
            fingerprint: Some(Fingerprint::of(RESPONSE)),
            max_attempts: 5,
            retention: RETENTION,
        })
    }
}

/// Completes [`REPLAY_KEYS`] keys and returns their claims, for the replay workload.
async fn prepare_replay(subject: &Subject, keys: &Keys) -> Result<Arc<Vec<Claim>>> {
    let claims = keys.claims(REPLAY_KEYS as u32, 0)?;
    for chunk in claims.chunks(128) {
        claim_and_complete(&subject.backend, chunk).await?;
    }
    Ok(Arc::new(claims))
}

/// Claims fresh keys and completes them: one `claim` and one `complete` for a single key,
/// one `claim_many` and one `settle_many` for a batch (what a Kafka poll batch costs).
async fn claim_and_complete(backend: &Arc<dyn Backend>, claims: &[Claim]) -> Result<()> {
    let body = Bytes::from_static(RESPONSE);
    let lease = |answer: ClaimOutcome, claim: &Claim| match answer {
        ClaimOutcome::Acquired(lease) => Ok(lease),
        other => Err(Error::Refused(format!(
            "bench: fresh key {} answered {other:?}, not Acquired",
            claim.key
        ))),
    };
    if let [one] = claims {
        let lease = lease(backend.claim(one).await.store("claim")?, one)?;
        return backend
            .complete(&lease, body, RETENTION)
            .await
            .store("complete");
    }
    let answers = backend.claim_many(claims).await.store("claim_many")?;
    let items = answers
        .into_iter()
        .zip(claims)
        .map(|(answer, claim)| Ok(Settlement::complete(lease(answer, claim)?, body.clone())))
        .collect::<Result<Vec<_>>>()?;
    let settled = backend
        .settle_many(&items, RETENTION)
        .await
        .store("settle_many")?;
    for (answer, item) in settled.into_iter().zip(&items) {
        answer.store(format!("settle_many: complete of {}", item.lease.key))?;
    }
    Ok(())
}

/// A baseline through the store's own client, each step one round trip per batch where
/// the store can (as `claim_many` and `settle_many` are): the raw write-if-absent of fresh
/// keys alone, or what idem's claim+complete does by hand: that write, then the response
/// written over the same keys.
async fn baseline_workload(
    s: &Subject,
    keys: &Arc<Keys>,
    by_hand: bool,
    (c, b, d): (u32, u32, Duration),
) -> Result<Measure> {
    let raw = Arc::clone(&s.raw);
    let keys = Arc::clone(keys);
    let first = Bytes::from_static(if by_hand { CLAIMED } else { RESPONSE });
    let response = Bytes::from_static(RESPONSE);
    measure::run(c, d, move |_| {
        let (raw, ids) = (Arc::clone(&raw), keys.ids(b));
        let (first, response) = (first.clone(), response.clone());
        async move {
            raw.insert(&ids, &first).await.store("baseline write")?;
            if by_hand {
                raw.settle(&ids, &response)
                    .await
                    .store("by-hand complete")?;
            }
            Ok(u64::from(b))
        }
    })
    .await
}

async fn claim_workload(
    s: &Subject,
    keys: &Arc<Keys>,
    c: u32,
    b: u32,
    d: Duration,
) -> Result<Measure> {
    let keys = Arc::clone(keys);
    let backend = Arc::clone(&s.backend);
    measure::run(c, d, move |worker| {
        let (keys, backend) = (Arc::clone(&keys), Arc::clone(&backend));
        async move {
            let claims = keys.claims(b, worker)?;
            claim_and_complete(&backend, &claims).await?;
            Ok(u64::from(b))
        }
    })
    .await
}

async fn replay_workload(
    s: &Subject,
    done: &Arc<Vec<Claim>>,
    c: u32,
    b: u32,
    d: Duration,
) -> Result<Measure> {
    let backend = Arc::clone(&s.backend);
    let done = Arc::clone(done);
    measure::run(c, d, move |_| {
        let (backend, done) = (Arc::clone(&backend), Arc::clone(&done));
        async move {
            let picked: Vec<Claim> = (0..b)
                .map(|_| done[fastrand::usize(..done.len())].clone())
                .collect();
            let answers = match picked.as_slice() {
                [one] => vec![backend.claim(one).await.store("claim")?],
                many => backend.claim_many(many).await.store("claim_many")?,
            };
            for (answer, claim) in answers.iter().zip(&picked) {
                if !matches!(answer, ClaimOutcome::Completed(body) if body.as_ref() == RESPONSE) {
                    return Err(Error::Refused(format!(
                        "bench: completed key {} answered {answer:?}, not its response",
                        claim.key
                    )));
                }
            }
            Ok(u64::from(b))
        }
    })
    .await
}
