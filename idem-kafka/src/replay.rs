//! Sending dead letters back to their topics, each letter once.
//!
//! A replay is itself run through idem: each letter is a key of namespace
//! [`REPLAY_NAMESPACE`] whose id is the letter's position, `<dead-letter
//! topic>/<partition>/<offset>`, in the store the consumer uses. The handler of that key
//! sends the letter and waits for the broker's acknowledgement before the key completes,
//! so a second replay of the same letter finds the key `Completed` and sends nothing, for
//! as long as the store keeps the record (the retention given to [`Replayer::new`]). A
//! send that fails fails the key, and the next replay sends it again.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{Backend, Engine, HandlerError, Key, Outcome, State};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::dead_letter::read::DeadLetter;
use crate::dead_letter::write::{LogContext, producer};
use crate::dead_letter::{DEAD_LETTER_HEADERS, HEADER_REPLAY_OF};
use crate::{Error, Result};

/// The namespace of the records that make replays idempotent.
pub const REPLAY_NAMESPACE: &str = "idem.dlq-replay";

/// Where a replayed letter was written.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sent {
    /// The original topic.
    pub topic: String,
    /// Its partition (the original one).
    pub partition: i32,
    /// The offset of the new copy.
    pub offset: i64,
}

/// What `--reset` did to the dead-lettered message's own record before sending it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reset {
    /// No reset was asked for.
    NotAsked,
    /// The letter names no valid idempotency key (the reason says why).
    NoKey(String),
    /// The `Failed` (poisoned) record was deleted: the handler runs again.
    Deleted,
    /// There was no record (already deleted, or expired).
    NoRecord,
    /// The record is `Completed` or `Processing` and was left alone: deleting it would run
    /// a handler that already ran, or one that is running.
    Kept(State),
}

impl Reset {
    /// One line for people.
    pub fn describe(&self) -> String {
        match self {
            Reset::NotAsked => "no reset".into(),
            Reset::NoKey(why) => format!("nothing reset ({why})"),
            Reset::Deleted => "the failed record was deleted".into(),
            Reset::NoRecord => "there was no record to reset".into(),
            Reset::Kept(s) => format!("the record is {} and was kept", s.as_str()),
        }
    }

    fn as_str(&self) -> &'static str {
        match self {
            Reset::NotAsked => "not-asked",
            Reset::NoKey(_) => "no-key",
            Reset::Deleted => "deleted",
            Reset::NoRecord => "no-record",
            Reset::Kept(State::Completed) => "kept-completed",
            Reset::Kept(_) => "kept-processing",
        }
    }
}

/// What became of one letter's replay.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Replay {
    /// Sent now, and acknowledged by the broker.
    Sent {
        /// Where.
        to: Sent,
        /// What the reset did.
        reset: Reset,
    },
    /// An earlier replay sent it: nothing was sent now.
    AlreadySent(Sent),
    /// The letter cannot be replayed (its origin headers are missing or unreadable).
    Unreplayable(String),
    /// Another replay of this letter is running now (or one died within its lease).
    InProgress {
        /// Who holds it.
        owner: String,
    },
    /// The send or the reset failed; replaying again retries it.
    Failed(String),
}

/// What earlier replays did with a letter, without changing anything (for `--dry-run`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Previous {
    /// Never replayed (or its replay record expired).
    New,
    /// Replayed already.
    Sent(Sent),
    /// A replay holds it now.
    InProgress(String),
    /// Replays failed before; the next one tries again.
    Failed(String),
}

/// Replays dead letters, each once.
pub struct Replayer {
    engine: Engine,
    producer: FutureProducer<LogContext>,
    reset: bool,
}

impl std::fmt::Debug for Replayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replayer")
            .field("engine", &self.engine)
            .field("reset", &self.reset)
            .finish_non_exhaustive()
    }
}

impl Replayer {
    /// A replayer producing with `config` (deliveries give up after
    /// `message.timeout.ms`, 30 s unless set) and recording replays in `backend` (the
    /// consumer's store) for `retention`: within it, a letter is sent once.
    pub fn new(
        config: &ClientConfig,
        backend: Arc<dyn Backend>,
        retention: Duration,
    ) -> Result<Self> {
        let engine = Engine::builder(backend)
            .lease_ttl(Duration::from_secs(60))
            .max_attempts(1_000)
            .retention(retention)
            .fingerprint(false)
            .build()?;
        let producer = producer(config, "creating the replay producer")?;
        Ok(Replayer {
            engine,
            producer,
            reset: false,
        })
    }

    /// Before sending a letter, delete the `Failed` record of its idempotency key, so
    /// that the consumer's handler runs again (a `Completed` or `Processing` record is
    /// kept).
    pub fn reset(mut self, on: bool) -> Self {
        self.reset = on;
        self
    }

    /// The key of the record that remembers `letter`'s replay.
    pub fn record_key(letter: &DeadLetter) -> Result<Key> {
        Ok(Key::new(REPLAY_NAMESPACE, letter.position())?)
    }

    /// What earlier replays did with `letter`.
    pub async fn previous(&self, letter: &DeadLetter) -> Result<Previous> {
        let key = Self::record_key(letter)?;
        let Some(r) = self.engine.backend().get(&key).await? else {
            return Ok(Previous::New);
        };
        Ok(match r.state {
            State::Completed => {
                let sent = r.response.as_deref().map(decode).transpose()?;
                sent.map_or(Previous::New, |(to, _)| Previous::Sent(to))
            }
            State::Processing => Previous::InProgress(r.owner.to_string()),
            State::Failed => Previous::Failed(r.error.unwrap_or_default()),
        })
    }

    /// Sends `letter` back to its original topic and partition, with its key, payload and
    /// headers (idem's dead-letter headers taken off, [`HEADER_REPLAY_OF`] added), once.
    /// A store error is `Err`: nothing is known to be sent, and replaying again is safe.
    pub async fn replay(&self, letter: &DeadLetter) -> Result<Replay> {
        let (topic, partition) = match letter.destination() {
            Ok(d) => d,
            Err(why) => return Ok(Replay::Unreplayable(why)),
        };
        let key = Self::record_key(letter)?;
        let outcome = self
            .engine
            .execute(&key, &[], |_| async move {
                let reset = if self.reset {
                    self.reset_record(letter).await?
                } else {
                    Reset::NotAsked
                };
                let to = self.send(letter, topic, partition).await?;
                Ok(encode(&to, &reset))
            })
            .await?;
        Ok(match outcome {
            Outcome::Executed(b) => {
                let (to, reset) = decode(&b)?;
                Replay::Sent { to, reset }
            }
            Outcome::Replayed(b) => Replay::AlreadySent(decode(&b)?.0),
            Outcome::InProgress { owner, .. } => Replay::InProgress {
                owner: owner.to_string(),
            },
            Outcome::Failed { error, .. } => Replay::Failed(error),
            Outcome::Poisoned { attempts, error } => Replay::Failed(format!(
                "the replay record {key} is poisoned after {attempts} attempts (last: {error}); \
                 delete it to try again"
            )),
            Outcome::Fenced => Replay::Failed(format!(
                "the lease on {key} was lost while sending: the letter may have been sent; \
                 replay again to find out"
            )),
            other => Replay::Failed(format!("unexpected outcome {other:?}")),
        })
    }

    async fn reset_record(&self, letter: &DeadLetter) -> Result<Reset, HandlerError> {
        let key = match letter.idem_key() {
            None => return Ok(Reset::NoKey("the letter names no key".into())),
            Some(Err(why)) => return Ok(Reset::NoKey(why)),
            Some(Ok(k)) => k,
        };
        let store = self.engine.backend();
        let record = store
            .get(&key)
            .await
            .map_err(|e| HandlerError::retry(format!("reading {key}: {e}")))?;
        Ok(match record.map(|r| r.state) {
            None => Reset::NoRecord,
            Some(State::Failed) => {
                store
                    .delete(&key)
                    .await
                    .map_err(|e| HandlerError::retry(format!("deleting {key}: {e}")))?;
                Reset::Deleted
            }
            Some(s) => Reset::Kept(s),
        })
    }

    async fn send(
        &self,
        letter: &DeadLetter,
        topic: &str,
        partition: i32,
    ) -> Result<Sent, HandlerError> {
        let position = letter.position();
        let headers = letter
            .headers
            .iter()
            .filter(|(k, _)| !DEAD_LETTER_HEADERS.contains(&k.as_str()))
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .chain([(HEADER_REPLAY_OF, Some(position.as_bytes()))])
            .fold(OwnedHeaders::new(), |h, (key, value)| {
                h.insert(Header { key, value })
            });
        let mut record = FutureRecord::to(topic)
            .partition(partition)
            .payload(letter.payload.as_ref())
            .headers(headers);
        if let Some(k) = &letter.message_key {
            record = record.key(k.as_ref());
        }
        let delivery = self
            .producer
            .send(record, Duration::from_secs(5))
            .await
            .map_err(|(e, _)| {
                HandlerError::retry(format!("sending to {topic}/{partition}: {e}"))
            })?;
        Ok(Sent {
            topic: topic.to_owned(),
            partition: delivery.partition,
            offset: delivery.offset,
        })
    }
}

fn encode(to: &Sent, reset: &Reset) -> Bytes {
    let value = serde_json::json!({
        "topic": to.topic,
        "partition": to.partition,
        "offset": to.offset,
        "reset": reset.as_str(),
    });
    Bytes::from(value.to_string())
}

fn decode(bytes: &[u8]) -> Result<(Sent, Reset)> {
    let corrupt = || {
        Error::Core(idem_core::Error::corrupt(
            "a replay record's response is not what idem dlq replay stores",
        ))
    };
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|_| corrupt())?;
    let sent = Sent {
        topic: v["topic"].as_str().ok_or_else(corrupt)?.to_owned(),
        partition: v["partition"]
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(corrupt)?,
        offset: v["offset"].as_i64().ok_or_else(corrupt)?,
    };
    let reset = match v["reset"].as_str() {
        Some("deleted") => Reset::Deleted,
        Some("no-record") => Reset::NoRecord,
        Some("no-key") => Reset::NoKey("the letter names no valid key".into()),
        Some("kept-completed") => Reset::Kept(State::Completed),
        Some("kept-processing") => Reset::Kept(State::Processing),
        _ => Reset::NotAsked,
    };
    Ok((sent, reset))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stored_response_round_trips() {
        let to = Sent {
            topic: "payments".into(),
            partition: 2,
            offset: 41,
        };
        for reset in [
            Reset::NotAsked,
            Reset::Deleted,
            Reset::NoRecord,
            Reset::Kept(State::Completed),
            Reset::Kept(State::Processing),
        ] {
            assert_eq!(decode(&encode(&to, &reset)).unwrap(), (to.clone(), reset));
        }
        assert!(
            matches!(decode(b"not json"), Err(Error::Core(e)) if e.to_string().contains("replay"))
        );
        assert!(decode(br#"{"topic":"t","partition":1e12,"offset":1}"#).is_err());
    }
}
