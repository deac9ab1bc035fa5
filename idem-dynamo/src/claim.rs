//! Claims: one conditional `UpdateItem` on the common paths; where its condition cannot
//! express the grant, the state machine decides from the item DynamoDB returned and a
//! compare-and-set `PutItem` writes its answer.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure};
use idem_core::backend::{Claim, ClaimOutcome, machine, millis};
use idem_core::{Error, Record, Result, State, Timestamp};

use crate::backend::{DynamoBackend, ITEM_OVERHEAD, Now};
use crate::error::{WriteError, write_error};
use crate::expr;
use crate::item::{self, Item, b, n, s, secs_ceil};

/// How many compare-and-set rounds a claim tries when its one-write form does not apply
/// and other writers keep changing the item, before it answers [`Error::Unavailable`].
const CAS_ROUNDS: usize = 8;

impl DynamoBackend {
    pub(crate) async fn claim_one(&self, claim: &Claim) -> Result<ClaimOutcome> {
        let mut current = match self.claim_once(claim, self.now()).await? {
            Ok(answer) => return Ok(answer),
            Err(item) => Some(item),
        };
        for _ in 0..CAS_ROUNDS {
            let old = current.as_ref().map(item::decode).transpose()?;
            let (answer, next) = self.decide(old.as_ref(), claim, self.now());
            let Some(next) = next else {
                return Ok(answer);
            };
            match self.put_if_unchanged(&next, current.as_ref()).await? {
                Ok(()) => return Ok(answer),
                Err(now_there) => current = now_there,
            }
        }
        Err(Error::Unavailable {
            message: format!(
                "claim of {}: the item changed under {CAS_ROUNDS} compare-and-set rounds",
                claim.key
            ),
            source: None,
        })
    }

    /// [`machine::claim`] judged at `t.decide`, with the deadlines it writes and reports
    /// moved to `t.now`: a lease lapses for this client only once its clock is the skew
    /// margin past the deadline, and `InProgress` says when that will be.
    pub(crate) fn decide(
        &self,
        current: Option<&Record>,
        claim: &Claim,
        t: Now,
    ) -> (ClaimOutcome, Option<Record>) {
        let (mut answer, mut next) = machine::claim(current, claim, t.decide);
        let skew = t.now.since(t.decide);
        let shift = |at: &mut Timestamp| *at = at.saturating_add(skew);
        match &mut answer {
            ClaimOutcome::Acquired(lease) => shift(&mut lease.lease_until),
            ClaimOutcome::InProgress { lease_until, .. } => shift(lease_until),
            _ => {}
        }
        if let Some(rec) = &mut next {
            for at in [&mut rec.lease_until, &mut rec.expires_at]
                .into_iter()
                .flatten()
            {
                shift(at);
            }
        }
        (answer, next)
    }

    /// The one-write claim. `Ok(Ok(answer))` when it was granted; `Ok(Err(item))` with the
    /// item DynamoDB returned when its condition failed.
    ///
    /// The condition may refuse more than [`machine::claim`] would (the caller then decides
    /// from the returned item with the machine itself: a round trip more, never another
    /// answer), but never less: a grant the machine would not give is reported as
    /// [`Error::Corrupt`] instead of answered.
    pub(crate) async fn claim_once(
        &self,
        claim: &Claim,
        t: Now,
    ) -> Result<Result<ClaimOutcome, Item>> {
        let lease = t.now.saturating_add(claim.lease_ttl);
        let ret = millis(claim.retention);
        let exp = lease.saturating_add(claim.retention).as_millis();
        let (condition, update) = match claim.fingerprint {
            Some(_) => (expr::CLAIM_CONDITION_FP, expr::CLAIM_UPDATE_FP),
            None => (expr::CLAIM_CONDITION, expr::CLAIM_UPDATE),
        };
        let mut values = HashMap::from([
            (":now".to_owned(), n(t.decide.as_millis())),
            (":max".to_owned(), n(u64::from(claim.max_attempts.max(1)))),
            (":failed".to_owned(), s(State::Failed.as_str())),
            (":processing".to_owned(), s(State::Processing.as_str())),
            (":true".to_owned(), AttributeValue::Bool(true)),
            (":owner".to_owned(), s(&*claim.owner)),
            (":zero".to_owned(), n(0)),
            (":one".to_owned(), n(1)),
            (":lease".to_owned(), n(lease.as_millis())),
            (":ret".to_owned(), n(ret)),
            (":ret_s".to_owned(), n(secs_ceil(ret))),
            (":exp".to_owned(), n(exp)),
            (":ttl".to_owned(), n(secs_ceil(exp))),
            (":v".to_owned(), n(item::new_version())),
        ]);
        if let Some(fp) = claim.fingerprint {
            values.insert(":fp".to_owned(), b(fp.0.to_vec()));
        }
        let sent = self
            .inner
            .client
            .update_item()
            .table_name(self.table())
            .set_key(Some(Self::key_value(&claim.key)))
            .condition_expression(condition)
            .update_expression(update)
            .set_expression_attribute_names(Some(expr::names(&[condition, update])))
            .set_expression_attribute_values(Some(values))
            .return_values(ReturnValue::AllOld)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        let old = match sent {
            Ok(out) => out.attributes.filter(|a| !a.is_empty()),
            Err(err) => {
                return match write_error("claim", ITEM_OVERHEAD, err) {
                    WriteError::Condition(Some(item)) => Ok(Err(item)),
                    WriteError::Condition(None) => Err(Error::corrupt(format!(
                        "claim of {}: the condition failed but DynamoDB returned no item",
                        claim.key
                    ))),
                    WriteError::Other(e) => Err(e),
                };
            }
        };
        let old = old.as_ref().map(item::decode).transpose()?;
        match self.decide(old.as_ref(), claim, t) {
            (answer @ ClaimOutcome::Acquired(_), _) => Ok(Ok(answer)),
            (answer, _) => Err(Error::corrupt(format!(
                "claim of {}: DynamoDB granted a claim the state machine answers {answer:?} \
                 (record {old:?})",
                claim.key
            ))),
        }
    }

    /// Writes `next` in place of the item the client decided from (`expected`, or none),
    /// only if that item is unchanged. `Err(item)`: it changed, here is what it is now.
    pub(crate) async fn put_if_unchanged(
        &self,
        next: &Record,
        expected: Option<&Item>,
    ) -> Result<Result<(), Option<Item>>> {
        let mut values = HashMap::new();
        let condition = match expected {
            Some(old) => {
                values.insert(":v".to_owned(), n(item::version(old)?));
                expr::UNCHANGED
            }
            None => expr::ABSENT,
        };
        let written = item::encode(next, item::new_version());
        let size = next.error.as_ref().map_or(0, String::len) + ITEM_OVERHEAD;
        let sent = self
            .inner
            .client
            .put_item()
            .table_name(self.table())
            .set_item(Some(written))
            .condition_expression(condition)
            .set_expression_attribute_names(Some(expr::names(&[condition])))
            .set_expression_attribute_values((!values.is_empty()).then_some(values))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match sent {
            Ok(_) => Ok(Ok(())),
            Err(err) => match write_error("claim", size, err) {
                WriteError::Condition(item) => Ok(Err(item)),
                WriteError::Other(e) => Err(e),
            },
        }
    }
}
