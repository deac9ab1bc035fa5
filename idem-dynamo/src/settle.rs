//! Settles (complete, fail, release) and the fencing write they share with `extend`: one
//! conditional `UpdateItem`, fenced by token and owner.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::backend::{Settle, check_response};
use idem_core::{Error, FailureKind, Lease, Result, State};

use crate::backend::{DynamoBackend, ITEM_OVERHEAD, Now};
use crate::error::{WriteError, write_error};
use crate::expr;
use crate::item::{self, b, n, s, secs_ceil};

impl DynamoBackend {
    /// A fencing `UpdateItem`: `update` applies only while `lease` holds the record as
    /// `condition` ([`expr::HOLDS`] or [`expr::HOLDS_LIVE`]) judges it.
    pub(crate) async fn fenced_update(
        &self,
        what: &'static str,
        lease: &Lease,
        (condition, update): (&'static str, &'static str),
        mut values: HashMap<String, AttributeValue>,
        size: usize,
        t: Now,
    ) -> Result<()> {
        values.extend([
            (":tok".to_owned(), n(lease.token)),
            (":owner".to_owned(), s(&*lease.owner)),
            (":processing".to_owned(), s(State::Processing.as_str())),
            (":now".to_owned(), n(t.decide.as_millis())),
            (":v".to_owned(), n(item::new_version())),
        ]);
        let sent = self
            .inner
            .client
            .update_item()
            .table_name(self.table())
            .set_key(Some(Self::key_value(&lease.key)))
            .condition_expression(condition)
            .update_expression(update)
            .set_expression_attribute_names(Some(expr::names(&[condition, update])))
            .set_expression_attribute_values(Some(values))
            .send()
            .await;
        match sent {
            Ok(_) => Ok(()),
            Err(err) => match write_error(what, size, err) {
                WriteError::Condition(_) => Err(Error::fenced(lease)),
                WriteError::Other(e) => Err(e),
            },
        }
    }

    /// `settle` of `lease` as one fencing `UpdateItem`; `TooLarge` before any request for a
    /// response or error text over `max_response_bytes`.
    pub(crate) async fn settle(
        &self,
        lease: &Lease,
        settle: &Settle,
        retention: Duration,
    ) -> Result<()> {
        let t = self.now();
        check_response(settle, self.inner.config.max_response_bytes())?;
        let (what, write, values, size) = match settle {
            Settle::Complete(response) => {
                let mut values = HashMap::from([
                    (":completed".to_owned(), s(State::Completed.as_str())),
                    (":resp".to_owned(), b(response.to_vec())),
                ]);
                values.extend(Self::expiry(retention, t));
                let write = (expr::HOLDS, expr::COMPLETE);
                ("complete", write, values, response.len())
            }
            Settle::Fail { error, kind } => {
                self.fits("error text", error.len())?;
                let mut values = HashMap::from([
                    (":failed".to_owned(), s(State::Failed.as_str())),
                    (":err".to_owned(), s(error.as_str())),
                ]);
                values.extend(Self::expiry(retention, t));
                let update = match kind {
                    FailureKind::Retry => expr::FAIL,
                    FailureKind::Permanent => {
                        values.insert(":true".to_owned(), AttributeValue::Bool(true));
                        expr::FAIL_PERMANENT
                    }
                };
                ("fail", (expr::HOLDS, update), values, error.len())
            }
            Settle::Release => {
                // The lease lapses at the time claims judge by, the expiry keeps its
                // distance to the lease deadline.
                let until = t.decide.as_millis();
                let values = HashMap::from([
                    (":one".to_owned(), n(1)),
                    (":lease".to_owned(), n(until)),
                    (":lease_s".to_owned(), n(secs_ceil(until))),
                ]);
                ("release", (expr::HOLDS_LIVE, expr::RELEASE), values, 0)
            }
        };
        self.fenced_update(what, lease, write, values, size + ITEM_OVERHEAD, t)
            .await
    }

    /// `TooLarge` if an error text of `size` bytes exceeds `max_response_bytes`: a
    /// response is checked by [`check_response`], like every backend's; DynamoDB's item
    /// limit bounds the error text too.
    pub(crate) fn fits(&self, what: &'static str, size: usize) -> Result<()> {
        let limit = self.inner.config.max_response_bytes();
        if size > limit {
            return Err(Error::TooLarge { what, size, limit });
        }
        Ok(())
    }

    /// `:exp` and `:ttl` for a record kept `retention` from `t.now`.
    pub(crate) fn expiry(retention: Duration, t: Now) -> [(String, AttributeValue); 2] {
        let exp = t.now.saturating_add(retention).as_millis();
        [
            (":exp".to_owned(), n(exp)),
            (":ttl".to_owned(), n(secs_ceil(exp))),
        ]
    }
}
