//! Deliveries that arrived together, in lease mode: one claim for their keys and one settle
//! for their results, then each is acked. What the batch cannot settle at once (a key in
//! progress elsewhere, a failed or fenced handler, a poisoned or mismatched key, a keyless
//! message, a key repeated in the batch) takes the one-delivery path, in its turn.

use idem_core::backend::{Claim, ClaimOutcome, Ran, Settlement};
use idem_core::binding::{self, Backoff, Extracted};
use idem_core::{Engine, Outcome};

use crate::handle::{Handled, Received, Session};
use crate::{Point, Result};

/// How the batch's settle ended.
enum Stored {
    /// Each item's outcome.
    Outcomes(Vec<idem_core::Result<Outcome>>),
    /// The shutdown came first: nothing is acked.
    Left,
    /// A probe's crash came first.
    Crashed,
}

/// What became of one delivery in the batch.
enum Fate {
    /// Its key's record is settled (run now, or a duplicate): ack it.
    Settled,
    /// The one-delivery path decides.
    Alone,
}

impl Session {
    /// Settles `batch` (deliveries in the order they came) and acks each settled one.
    pub async fn handle_batch(&self, batch: Vec<Received>) -> Result<Handled> {
        let s = &*self.settings;
        // The first delivery of each key's lane goes in the claim; the rest of a lane, and
        // keyless deliveries, take the one-delivery path in their turn.
        let keys = batch.iter().map(|r| match &r.found {
            Extracted::Key(k) => Some(k),
            _ => None,
        });
        let mut claimed: Vec<usize> = binding::lanes(keys)
            .into_iter()
            .map(|lane| lane[0])
            .filter(|&i| matches!(batch[i].found, Extracted::Key(_)))
            .collect();
        claimed.sort_unstable();
        let claims: Vec<Claim> = claimed
            .iter()
            .filter_map(|&i| match &batch[i].found {
                Extracted::Key(k) => Some(s.engine.claim_for(k, batch[i].msg.payload())),
                _ => None,
            })
            .collect();
        let mut fates: Vec<Fate> = batch.iter().map(|_| Fate::Alone).collect();
        if claimed
            .iter()
            .any(|&i| self.crashes_at(Point::BeforeClaim, &batch[i].msg))
        {
            return Ok(Handled::Crashed);
        }
        // A store error: each delivery takes the one-delivery path, which retries.
        if let Ok(answers) = s.engine.claim_many(&claims).await {
            let mut settlements = Vec::new();
            let mut settled_at = Vec::new();
            for (&i, answer) in claimed.iter().zip(answers) {
                match answer {
                    ClaimOutcome::Acquired(lease) => {
                        let msg = &batch[i].msg;
                        let run = s
                            .engine
                            .run_leased(&lease, |ctx| self.run_handler(msg, Some(ctx)));
                        let ran = tokio::select! {
                            ran = run => ran,
                            () = self.crash.cancelled() => return Ok(Handled::Crashed),
                        };
                        match ran {
                            Ran::Settle(settle) => {
                                settlements.push(Settlement { lease, settle });
                                settled_at.push(i);
                            }
                            Ran::Fenced => {}
                        }
                    }
                    ClaimOutcome::Completed(_) => fates[i] = Fate::Settled,
                    _ => {}
                }
            }
            match self.settle(&s.engine, &settlements).await {
                Stored::Outcomes(outcomes) => {
                    for (i, outcome) in settled_at.into_iter().zip(outcomes) {
                        if matches!(outcome, Ok(Outcome::Executed(_))) {
                            fates[i] = Fate::Settled;
                        }
                    }
                }
                Stored::Left => return Ok(Handled::Left),
                Stored::Crashed => return Ok(Handled::Crashed),
            }
        }
        let mut handled = Handled::Acked;
        for (received, fate) in batch.into_iter().zip(fates) {
            handled = match fate {
                Fate::Settled => self.ack(&received).await?,
                Fate::Alone => self.handle(received).await?,
            };
            if !matches!(handled, Handled::Acked) {
                break;
            }
        }
        Ok(handled)
    }

    /// Stores the batch's results, asking again after a store error (the leases stay
    /// this consumer's, so the handlers do not run again).
    async fn settle(&self, engine: &Engine, items: &[Settlement]) -> Stored {
        if items.is_empty() {
            return Stored::Outcomes(Vec::new());
        }
        let mut backoff = Backoff::new(self.settings.backoff);
        loop {
            match engine.settle_batch(items).await {
                Ok(outcomes) => return Stored::Outcomes(outcomes),
                Err(e) => tracing::warn!(error = %e, "settling a batch failed; retrying"),
            }
            if !self.pause(backoff.wait()).await {
                return if self.crash.is_cancelled() {
                    Stored::Crashed
                } else {
                    Stored::Left
                };
            }
        }
    }
}
