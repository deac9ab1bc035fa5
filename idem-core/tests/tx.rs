//! `idem_core::backend::tx` from outside the crate, as a backend in another repository uses
//! it: a toy transactional store over the memory store, whose transaction is a list of
//! writes, and the steps `execute` and `execute_batch` drive it through.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::backend::tx::{self, Savepoint, TxStore};
use idem_core::backend::{
    Capabilities, Claim, ClaimOutcome, OffsetPosition, Settlement, StoredOffset, TxFuture,
    async_trait, machine,
};
use idem_core::{
    Backend, Bytes, HandlerError, Key, Lease, MemoryBackend, Outcome, Record, Result, Timestamp,
    Transactional,
};

/// A transaction: the handlers' writes, and where the last savepoint stands.
#[derive(Default)]
struct Writes {
    writes: Vec<String>,
    mark: usize,
}

#[derive(Default)]
struct Toy {
    mem: MemoryBackend,
    committed: Mutex<Vec<String>>,
    offsets: Mutex<Vec<i64>>,
    steps: Mutex<Vec<String>>,
}

impl Toy {
    fn step(&self, step: impl Into<String>) {
        self.steps.lock().expect("steps").push(step.into());
    }

    fn take_steps(&self) -> Vec<String> {
        std::mem::take(&mut *self.steps.lock().expect("steps"))
    }

    fn committed(&self) -> Vec<String> {
        self.committed.lock().expect("committed").clone()
    }
}

#[async_trait]
impl Backend for Toy {
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.mem.claim_many(claims).await
    }
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.mem.settle_many(items, retention).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        self.mem.extend(lease, ttl).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.mem.get(key).await
    }
    async fn delete(&self, key: &Key) -> Result<bool> {
        self.mem.delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64> {
        self.mem.purge_expired().await
    }
    fn capabilities(&self) -> Capabilities {
        self.mem.capabilities().with_max_response_bytes(8)
    }
}

#[async_trait]
impl Transactional for Toy {
    type Tx = Writes;

    async fn execute_in_transaction<F>(
        &self,
        claim: &Claim,
        retention: Duration,
        offset: Option<&OffsetPosition>,
        handler: F,
    ) -> Result<Outcome>
    where
        F: for<'t> FnOnce(&'t mut Writes, Lease) -> TxFuture<'t> + Send,
    {
        tx::execute(self, claim, retention, offset, handler).await
    }

    async fn execute_batch_in_transaction<H, O>(
        &self,
        claims: &[Claim],
        retention: Duration,
        handler: H,
        offset: O,
    ) -> Result<Vec<Outcome>>
    where
        H: for<'t> FnMut(&'t mut Writes, usize, Lease) -> TxFuture<'t> + Send,
        O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
    {
        tx::execute_batch(self, claims, retention, handler, offset).await
    }

    async fn store_offset(&self, at: &OffsetPosition) -> Result<()> {
        self.step(format!("store offset {}", at.offset));
        self.offsets.lock().expect("offsets").push(at.offset + 1);
        Ok(())
    }

    async fn stored_offsets(&self, _group: &str) -> Result<Vec<StoredOffset>> {
        Ok(Vec::new())
    }
}

#[async_trait]
impl TxStore for Toy {
    async fn begin(&self) -> Result<Writes> {
        self.step("begin");
        Ok(Writes::default())
    }

    async fn begin_locked(
        &self,
        leases: &[Lease],
        savepoints: bool,
    ) -> Result<(Writes, Vec<bool>)> {
        self.step(format!(
            "begin locked {} savepoints {savepoints}",
            leases.len()
        ));
        let mut held = Vec::with_capacity(leases.len());
        for lease in leases {
            let record = self.mem.get(&lease.key).await?;
            held.push(machine::holds(record.as_ref(), lease, Timestamp::now()));
        }
        Ok((Writes::default(), held))
    }

    async fn savepoint(&self, tx: &mut Writes, at: Savepoint) -> Result<()> {
        self.step(format!("savepoint {at:?}"));
        tx.mark = tx.writes.len();
        Ok(())
    }

    async fn rollback_to_savepoint(&self, tx: &mut Writes) -> Result<()> {
        self.step("rollback to savepoint");
        tx.writes.truncate(tx.mark);
        Ok(())
    }

    async fn settle_in(
        &self,
        _tx: &mut Writes,
        items: &[Settlement],
        retention: Duration,
        at: Option<&OffsetPosition>,
    ) -> Result<usize> {
        self.step(format!("settle {}", items.len()));
        let answers = self.mem.settle_many(items, retention).await?;
        if let Some(at) = at {
            self.offsets.lock().expect("offsets").push(at.offset + 1);
        }
        Ok(answers.iter().filter(|a| a.is_ok()).count())
    }

    async fn commit(&self, tx: Writes) -> Result<()> {
        self.step("commit");
        self.committed.lock().expect("committed").extend(tx.writes);
        Ok(())
    }

    async fn rollback(&self, _tx: Writes) -> Result<()> {
        self.step("rollback");
        Ok(())
    }
}

fn claim(id: &str) -> Claim {
    Claim {
        key: Key::new("tx", id).expect("key"),
        owner: Arc::from("worker"),
        lease_ttl: Duration::from_secs(30),
        fingerprint: None,
        max_attempts: 2,
        retention: Duration::from_secs(60),
    }
}

fn at(offset: i64) -> OffsetPosition {
    OffsetPosition {
        group: "g".into(),
        topic: "t".into(),
        partition: 0,
        offset,
    }
}

const RETENTION: Duration = Duration::from_secs(60);

/// A handler's run: writes `what` through the transaction, then answers `answer`.
fn write(tx: &mut Writes, what: String, answer: Result<Bytes, HandlerError>) -> TxFuture<'_> {
    tx.writes.push(what);
    Box::pin(async move { answer })
}

/// A handler that writes its key's id and answers `ok`.
fn succeeds(tx: &mut Writes, lease: Lease) -> TxFuture<'_> {
    write(
        tx,
        format!("write {}", lease.key.id()),
        Ok(Bytes::from_static(b"ok")),
    )
}

/// A batch handler for a batch with nothing to run.
fn never_runs(_: &mut Writes, _: usize, _: Lease) -> TxFuture<'_> {
    panic!("nothing to run")
}

/// A batch handler that answers its key's id and writes nothing.
fn answers_id(_: &mut Writes, _: usize, lease: Lease) -> TxFuture<'_> {
    let id = Bytes::from(lease.key.id().to_owned());
    Box::pin(async move { Ok(id) })
}

#[tokio::test]
async fn one_message_commits_its_writes_with_the_record_and_a_replay_stores_the_offset() {
    let store = Toy::default();
    let done = store
        .execute_in_transaction(&claim("a"), RETENTION, Some(&at(7)), succeeds)
        .await
        .expect("execute");
    assert_eq!(done, Outcome::Executed(Bytes::from_static(b"ok")));
    assert_eq!(store.take_steps(), ["begin", "settle 1", "commit"]);
    assert_eq!(store.committed(), ["write a"]);

    let again = store
        .execute_in_transaction(&claim("a"), RETENTION, Some(&at(8)), succeeds)
        .await
        .expect("replay");
    assert_eq!(again, Outcome::Replayed(Bytes::from_static(b"ok")));
    assert_eq!(store.take_steps(), ["store offset 8"]);
    assert_eq!(*store.offsets.lock().expect("offsets"), [8, 9]);
}

#[tokio::test]
async fn a_failed_or_oversized_handler_rolls_back_and_counts_its_attempt() {
    let store = Toy::default();
    let first = store
        .execute_in_transaction(&claim("b"), RETENTION, None, |tx, _| {
            write(tx, "lost".into(), Err(HandlerError::retry("nope")))
        })
        .await
        .expect("first");
    assert_eq!(
        first,
        Outcome::Failed {
            attempts: 1,
            error: "nope".into()
        }
    );
    assert_eq!(store.take_steps(), ["begin", "rollback"]);
    // Over the store's 8 bytes: a permanent failure, so poisoned at once.
    let second = store
        .execute_in_transaction(&claim("b"), RETENTION, None, |tx, _| {
            write(tx, "lost".into(), Ok(Bytes::from_static(b"far too large")))
        })
        .await
        .expect("second");
    assert!(
        matches!(second, Outcome::Poisoned { attempts: 2, .. }),
        "{second:?}"
    );
    assert!(store.committed().is_empty());
}

#[tokio::test]
async fn a_batch_runs_again_with_savepoints_after_a_failure_and_commits_only_the_successes() {
    let store = Toy::default();
    let claims = [claim("x"), claim("y"), claim("z")];
    let mut runs = Vec::new();
    let outcomes = store
        .execute_batch_in_transaction(
            &claims,
            RETENTION,
            |tx, i, lease| {
                runs.push(i);
                let answer = if i == 1 {
                    Err(HandlerError::retry("y fails"))
                } else {
                    Ok(Bytes::from(lease.key.id().to_owned()))
                };
                write(tx, format!("write {}", lease.key.id()), answer)
            },
            |outcomes| {
                assert_eq!(outcomes.len(), 3);
                Some(at(41))
            },
        )
        .await
        .expect("batch");
    assert_eq!(
        outcomes,
        [
            Outcome::Executed(Bytes::from_static(b"x")),
            Outcome::Failed {
                attempts: 1,
                error: "y fails".into()
            },
            Outcome::Executed(Bytes::from_static(b"z")),
        ]
    );
    assert_eq!(runs, [0, 1, 0, 1, 2]);
    assert_eq!(
        store.take_steps(),
        [
            "begin locked 3 savepoints false",
            "rollback",
            "begin locked 3 savepoints true",
            "savepoint First",
            "savepoint AfterSuccess",
            "rollback to savepoint",
            "savepoint AfterRollback",
            "settle 3",
            "commit",
        ]
    );
    assert_eq!(store.committed(), ["write x", "write z"]);
    assert_eq!(*store.offsets.lock().expect("offsets"), [42]);
    // Everything settled: a second batch replays x and z and retries y.
    let outcomes = store
        .execute_batch_in_transaction(
            &claims,
            RETENTION,
            |tx, i, _| write(tx, format!("again {i}"), Ok(Bytes::from_static(b"y2"))),
            |_| None,
        )
        .await
        .expect("second batch");
    assert_eq!(outcomes[0], Outcome::Replayed(Bytes::from_static(b"x")));
    assert_eq!(outcomes[1], Outcome::Executed(Bytes::from_static(b"y2")));
    assert_eq!(outcomes[2], Outcome::Replayed(Bytes::from_static(b"z")));
}

#[tokio::test]
async fn a_batch_with_nothing_acquired_stores_its_offset_on_its_own() {
    let store = Toy::default();
    let claims = [claim("p"), claim("p")];
    let first = store
        .execute_batch_in_transaction(&claims[..1], RETENTION, answers_id, |_| None)
        .await
        .expect("first");
    assert_eq!(first, [Outcome::Executed(Bytes::from_static(b"p"))]);
    store.take_steps();
    let outcomes = store
        .execute_batch_in_transaction(&claims, RETENTION, never_runs, |_| Some(at(5)))
        .await
        .expect("replays");
    assert_eq!(
        outcomes,
        [
            Outcome::Replayed(Bytes::from_static(b"p")),
            Outcome::Replayed(Bytes::from_static(b"p")),
        ]
    );
    assert_eq!(store.take_steps(), ["store offset 5"]);
}
