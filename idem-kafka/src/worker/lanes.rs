//! Key-ordered concurrency (`in_flight` above one): the chunk's messages in lanes of one
//! ordering key each. Lanes run at once, up to `in_flight` handlers; a lane keeps its
//! key's offset order, and a lane waiting for a busy key holds no other lane up.

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use idem_core::backend::{ClaimOutcome, Ran, Settlement};
use idem_core::binding::Signal;
use idem_core::{Engine, Outcome};

use super::lease::Started;
use super::{Flow, Item, Kind, Worker};
use crate::order::{Settler, Window};
use crate::probe::Point;

/// What the lanes of a chunk share.
struct Lanes {
    answers: std::sync::Mutex<Vec<Option<ClaimOutcome>>>,
    window: std::sync::Mutex<Window>,
    settler: Settler,
}

impl Worker {
    /// One claim for the chunk (none in transactional mode, where each message runs in a
    /// transaction of its own); the results of concurrent handlers are gathered into batch
    /// settles; the offset moves only over the settled prefix (the low-water mark).
    pub(super) async fn process_lanes(&self, chunk: &[Item]) -> Flow {
        let answers = if self.settings().mode.is_transactional() {
            (0..chunk.len()).map(|_| None).collect()
        } else {
            let first = chunk[0].msg.offset();
            if self.probe(Point::BeforeClaim, first) {
                return Flow::Crashed;
            }
            let answers = match self.claim_chunk(chunk).await {
                Ok(answers) => answers,
                Err(flow) => return flow,
            };
            if self.probe(Point::AfterClaim, first) {
                return Flow::Crashed;
            }
            answers
        };
        let lanes = idem_core::binding::lanes(chunk.iter().map(|item| self.lane_key(item)));
        let shared = Lanes {
            answers: std::sync::Mutex::new(answers),
            window: std::sync::Mutex::new(Window::new(chunk.len())),
            settler: Settler::default(),
        };
        let lanes_done = Signal::new();
        let run_lanes = async {
            let mut running: FuturesUnordered<_> = lanes
                .iter()
                .map(|lane| self.run_lane(chunk, lane, &shared))
                .collect();
            let mut flow = Flow::Go;
            while let Some(f) = running.next().await {
                if flow == Flow::Go {
                    flow = f;
                }
            }
            lanes_done.fire();
            flow
        };
        let (flow, flushed) = tokio::join!(run_lanes, self.flush(&shared.settler, &lanes_done));
        let flow = if flow == Flow::Go { flushed } else { flow };
        if flow != Flow::Go {
            let mut left = shared
                .answers
                .into_inner()
                .unwrap_or_else(|e| e.into_inner());
            return self.give_up(&mut left, Vec::new(), flow).await;
        }
        self.counters.low_water_lag.set(0.0);
        self.store_offset_in_tx(&chunk[chunk.len() - 1]).await
    }

    /// One lane: its messages in offset order, each settled before the next starts.
    async fn run_lane(&self, chunk: &[Item], lane: &[usize], shared: &Lanes) -> Flow {
        for &i in lane {
            if let Some(flow) = self.interrupted() {
                return flow;
            }
            let item = &chunk[i];
            let answer = shared.answers.lock().unwrap_or_else(|e| e.into_inner())[i].take();
            let flow = match (&item.kind, answer) {
                (Kind::Keyed(..), Some(ClaimOutcome::Acquired(lease))) => {
                    match self.run_handler(item, &lease).await {
                        Err(flow) => flow,
                        Ok(Started::Ran(Ran::Settle(settle))) => {
                            let reply = shared.settler.submit(Settlement { lease, settle });
                            match reply.await {
                                Ok(Ok(Outcome::Executed(_))) => {
                                    self.counters.executed.increment(1);
                                    item.span.record("outcome", "executed");
                                    Flow::Go
                                }
                                Ok(other) => self.resolve(item, Some(other)).await,
                                Err(_) => self.interrupted().unwrap_or(Flow::Stop),
                            }
                        }
                        Ok(Started::Ran(Ran::Fenced)) => {
                            self.resolve(item, Some(Ok(Outcome::Fenced))).await
                        }
                        Ok(Started::Busy) => self.resolve(item, Some(Ok(self.busy_here()))).await,
                    }
                }
                (Kind::Keyed(..), Some(ClaimOutcome::Completed(_))) => {
                    self.counters.replayed.increment(1);
                    item.span.record("outcome", "replayed");
                    Flow::Go
                }
                (Kind::Keyed(..), other) => {
                    let first = other
                        .and_then(|a| Engine::lease_or_outcome(a).err())
                        .map(Ok);
                    self.resolve(item, first).await
                }
                (Kind::Unkeyed | Kind::DeadLetter(..), _) => self.resolve_keyless(item).await,
            };
            if flow != Flow::Go {
                return flow;
            }
            self.unstall();
            if self.probe(Point::AfterSettle, item.msg.offset()) {
                return Flow::Crashed;
            }
            let (moved, lag) = {
                let mut window = shared.window.lock().unwrap_or_else(|e| e.into_inner());
                (window.settle(i), window.lag())
            };
            self.counters.low_water_lag.set(lag as f64);
            if let Some(mark) = moved {
                self.progress().settled = Some(chunk[mark - 1].msg.offset());
                self.store_offset();
            }
        }
        Flow::Go
    }

    /// Settles what the lanes queue, one store call per flush, until the lanes are done.
    async fn flush(&self, settler: &Settler, lanes_done: &Signal) -> Flow {
        let flow = loop {
            tokio::select! {
                biased;
                () = settler.queued() => {}
                () = lanes_done.fired() => break Flow::Go,
            }
            let (batch, replies): (Vec<Settlement>, Vec<_>) = settler.take().into_iter().unzip();
            if batch.is_empty() {
                continue;
            }
            match self.settle_all(&batch).await {
                Ok(answers) => {
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(answer);
                    }
                }
                Err(flow) => break flow,
            }
        };
        settler.close();
        flow
    }
}
