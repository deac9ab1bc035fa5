//! `settle_many`: complete, fail and release many leases, one statement per round of
//! distinct keys.

use std::time::Duration;

use idem_core::backend::{Settle, Settlement, check_response};
use idem_core::{Error, FailureKind, Lease, Result};
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::backend::{PgBackend, PgQuery, millis, sized, token};
use crate::claim::distinct_round;
use crate::error::map;

/// The four arrays every batch statement that checks leases starts with: namespaces, ids,
/// tokens and owners, one element per lease.
#[derive(Default)]
pub(crate) struct Fences<'a> {
    ns: Vec<&'a str>,
    ids: Vec<&'a str>,
    tokens: Vec<i64>,
    owners: Vec<&'a str>,
}

impl<'a> Fences<'a> {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Fences {
            ns: Vec::with_capacity(n),
            ids: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            owners: Vec::with_capacity(n),
        }
    }

    pub(crate) fn push(&mut self, lease: &'a Lease) {
        self.ns.push(lease.key.namespace());
        self.ids.push(lease.key.id());
        self.tokens.push(token(lease));
        self.owners.push(&*lease.owner);
    }

    /// Binds the arrays as the statement's parameters $1 to $4.
    pub(crate) fn bind(self, query: PgQuery<'a>) -> PgQuery<'a> {
        query
            .bind(self.ns)
            .bind(self.ids)
            .bind(self.tokens)
            .bind(self.owners)
    }
}

/// One round's parameters, one element per item, in `settle_many.sql`'s order.
#[derive(Default)]
pub(crate) struct Round<'a> {
    fences: Fences<'a>,
    actions: Vec<&'static str>,
    responses: Vec<Option<&'a [u8]>>,
    errors: Vec<Option<&'a str>>,
    permanent: Vec<bool>,
    retentions: Vec<i64>,
}

impl<'a> Round<'a> {
    pub(crate) fn push(&mut self, item: &'a Settlement, retention: i64) {
        self.fences.push(&item.lease);
        let (action, response, error, permanent) = match &item.settle {
            Settle::Complete(response) => ("complete", Some(response.as_ref()), None, false),
            Settle::Fail { error, kind } => (
                "fail",
                None,
                Some(error.as_str()),
                *kind == FailureKind::Permanent,
            ),
            Settle::Release => ("release", None, None, false),
        };
        self.actions.push(action);
        self.responses.push(response);
        self.errors.push(error);
        self.permanent.push(permanent);
        self.retentions.push(retention);
    }

    /// Binds the round as `settle_many.sql`'s parameters $1 to $9.
    pub(crate) fn bind(self, query: PgQuery<'a>) -> PgQuery<'a> {
        self.fences
            .bind(query)
            .bind(self.actions)
            .bind(self.responses)
            .bind(self.errors)
            .bind(self.permanent)
            .bind(self.retentions)
    }
}

/// The completes at `round` of `items` as `complete_many.sql`'s arrays $1 to $4 and its
/// responses, $5; `None` if an item of the round is not a complete (the round takes
/// `settle_many.sql`).
fn completes<'a>(round: &[usize], items: &'a [Settlement]) -> Option<(Fences<'a>, Vec<&'a [u8]>)> {
    let mut fences = Fences::with_capacity(round.len());
    let mut responses = Vec::with_capacity(round.len());
    for &i in round {
        let Settle::Complete(response) = &items[i].settle else {
            return None;
        };
        fences.push(&items[i].lease);
        responses.push(response.as_ref());
    }
    Some((fences, responses))
}

/// The bytes of an item's text parameters: key, owner, response or error.
fn text_len(item: &Settlement) -> usize {
    let lease = &item.lease;
    lease.key.namespace().len() + lease.key.id().len() + lease.owner.len() + item.settle.text_len()
}

/// The 0-based positions a statement returned as 1-based `n`.
pub(crate) fn positions(rows: &[PgRow], what: &str) -> Result<Vec<usize>> {
    rows.iter()
        .map(|row| {
            let n: i64 = row.try_get("n").map_err(|e| map(what, e))?;
            (n.checked_sub(1).and_then(|i| usize::try_from(i).ok()))
                .ok_or_else(|| Error::corrupt(format!("{what} returned row {n}")))
        })
        .collect()
}

impl PgBackend {
    /// [`idem_core::Backend::settle_many`]: oversized responses are refused on the client;
    /// the rest settle in one `settle_many.sql` statement per round of distinct keys, so a
    /// repeated key is settled against the state the earlier item left.
    pub(crate) async fn settle_rounds(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let mut answers: Vec<Result<()>> = Vec::with_capacity(items.len());
        let mut pending: Vec<usize> = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match check_response(&item.settle, self.max_response_bytes) {
                Ok(()) => {
                    answers.push(Err(Error::fenced(&item.lease)));
                    pending.push(i);
                }
                Err(e) => answers.push(Err(e)),
            }
        }
        let retention = millis(retention);
        while !pending.is_empty() {
            let (round, rest) = distinct_round(&pending, |i| &items[i].lease.key);
            let bytes =
                round.iter().map(|&i| text_len(&items[i])).sum::<usize>() + 64 * round.len();
            let query = match completes(&round, items) {
                Some((fences, responses)) => fences
                    .bind(sized(self.sql.complete_many.sql(), 6, bytes))
                    .bind(responses)
                    .bind(retention),
                None => {
                    let mut p = Round::default();
                    for &i in &round {
                        p.push(&items[i], retention);
                    }
                    p.bind(sized(self.sql.settle_many.sql(), 9, bytes))
                }
            };
            let rows = self.timed("settle", query.fetch_all(&self.pool)).await?;
            for n in positions(&rows, "settle")? {
                let i = round
                    .get(n)
                    .ok_or_else(|| Error::corrupt(format!("settle_many returned row {n}")))?;
                answers[*i] = Ok(());
            }
            pending = rest;
        }
        Ok(answers)
    }
}
