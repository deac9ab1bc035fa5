//! Claims: one transaction per batch. The records of the batch's distinct keys are locked
//! and read in one statement; each claim is answered in order by idem's state machine
//! against the record the earlier claims left (so a key repeated in the batch sees the
//! first claim's lease); the records granted are written in one statement (an insert for
//! new keys, an upsert for existing ones); then COMMIT.

use idem_core::Result;
use idem_core::backend::{Claim, ClaimOutcome, machine};

use crate::backend::MySqlBackend;

impl MySqlBackend {
    /// The body of `claim_many` (see the module docs).
    pub(crate) async fn claim_batch(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<_> = claims.iter().map(|c| &c.key).collect();
        self.transact("claim", &keys, |locked| {
            let now = locked.now;
            claims
                .iter()
                .map(|claim| {
                    let (answer, write) = machine::claim(locked.get(&claim.key), claim, now);
                    if let Some(record) = write {
                        locked.set(record);
                    }
                    answer
                })
                .collect()
        })
        .await
    }
}
