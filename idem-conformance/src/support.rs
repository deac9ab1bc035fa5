//! What the cases share: checks of an answer, and a race of claimers.

use std::sync::Arc;
use std::time::Duration;

use idem_core::backend::ClaimOutcome;
use idem_core::{Backend, Error, Lease};

pub(crate) const HOUR: Duration = Duration::from_secs(3600);

pub(crate) fn in_progress_by(answer: &ClaimOutcome, owner: &str) -> bool {
    matches!(answer, ClaimOutcome::InProgress { owner: o, .. } if &**o == owner)
}

/// Panics unless `res` is `Fenced`. The panic names the caller's line, so a mutation run
/// can tell which check failed.
#[track_caller]
pub(crate) fn assert_fenced<T: std::fmt::Debug>(what: &str, res: Result<T, Error>) {
    assert!(
        matches!(res, Err(Error::Fenced { .. })),
        "{what}: expected Fenced, got {res:?}"
    );
}

/// `n` claims of `key` at once, by owners `{prefix}0`, `{prefix}1`, ..., on separate tasks.
pub(crate) async fn race<B: Backend + 'static>(
    backend: &Arc<B>,
    key: &idem_core::Key,
    lease: Duration,
    n: usize,
    prefix: &str,
) -> Vec<ClaimOutcome> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let backend = Arc::clone(backend);
            let claim = crate::claim_of(key, &format!("{prefix}{i}"), lease);
            tokio::spawn(async move { backend.claim(&claim).await })
        })
        .collect();
    let mut answers = Vec::with_capacity(n);
    for t in tasks {
        answers.push(t.await.expect("task").expect("claim"));
    }
    answers
}

/// The granted leases, and the holders the other answers named; anything else panics.
pub(crate) fn split_race(answers: Vec<ClaimOutcome>) -> (Vec<Lease>, Vec<Arc<str>>) {
    let (mut winners, mut holders) = (Vec::new(), Vec::new());
    for answer in answers {
        match answer {
            ClaimOutcome::Acquired(l) => winners.push(l),
            ClaimOutcome::InProgress { owner, .. } => holders.push(owner),
            other => panic!("unexpected answer in a race: {other:?}"),
        }
    }
    (winners, holders)
}
