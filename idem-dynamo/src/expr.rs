//! The condition and update expressions, in DynamoDB's expression language. `#name` is the
//! attribute `name` (see [`crate::item`]); `:value` placeholders are bound by the caller.
//! `:now` is always the deciding time: this client's clock minus the skew margin.

use std::collections::HashMap;

/// The one-write claim: the item is absent, or live with attempts left, the same
/// fingerprint (the `_FP` form; the other is for claims without one), and either `Failed`
/// not permanently or `Processing` under a lapsed lease. Expired items, records with no
/// fingerprint claimed with one, and every non-claimable case fail it; DynamoDB then returns
/// the item (`ALL_OLD`) and the client decides from that.
pub(crate) const CLAIM_CONDITION: &str = "attribute_not_exists(#pk) OR (#exp_ms > :now \
     AND #att < :max AND ((#st = :failed AND NOT (#perm = :true)) \
     OR (#st = :processing AND #lease_ms <= :now)))";
/// [`CLAIM_CONDITION`] for a claim with a fingerprint.
pub(crate) const CLAIM_CONDITION_FP: &str = "attribute_not_exists(#pk) OR (#exp_ms > :now \
     AND #att < :max AND #fp = :fp AND ((#st = :failed AND NOT (#perm = :true)) \
     OR (#st = :processing AND #lease_ms <= :now)))";

/// The grant written by the one-write claim: token and attempts grow by one from the stored
/// record (from zero when there is none), the fingerprint stays.
pub(crate) const CLAIM_UPDATE: &str = "SET #st = :processing, #owner = :owner, \
     #tok = if_not_exists(#tok, :zero) + :one, #att = if_not_exists(#att, :zero) + :one, \
     #lease_ms = :lease, #ret_ms = :ret, #ret_s = :ret_s, #exp_ms = :exp, \
     #expires_at = :ttl, #v = :v REMOVE #resp, #err, #perm";
/// [`CLAIM_UPDATE`] for a claim with a fingerprint: a new item gets it (the condition
/// guarantees an existing one already has it).
pub(crate) const CLAIM_UPDATE_FP: &str = "SET #st = :processing, #owner = :owner, \
     #tok = if_not_exists(#tok, :zero) + :one, #att = if_not_exists(#att, :zero) + :one, \
     #lease_ms = :lease, #ret_ms = :ret, #ret_s = :ret_s, #exp_ms = :exp, \
     #expires_at = :ttl, #v = :v, #fp = :fp REMOVE #resp, #err, #perm";

/// Compare-and-set: the item is the version the client decided from.
pub(crate) const UNCHANGED: &str = "#v = :v";
/// Compare-and-set when the client decided from no item.
pub(crate) const ABSENT: &str = "attribute_not_exists(#pk)";

/// `machine::holds`: the lease's token and owner, `Processing`, not expired.
pub(crate) const HOLDS: &str =
    "#tok = :tok AND #owner = :owner AND #st = :processing AND #exp_ms > :now";
/// [`HOLDS`] under a live lease, the condition of `release`: the lease has not lapsed as a
/// claim by this client would judge it (deadline past `:now`, the skew margin included),
/// and an attempt is left to give back (an `extend` after a release revives the lease only).
pub(crate) const HOLDS_LIVE: &str = "#tok = :tok AND #owner = :owner AND #st = :processing \
     AND #exp_ms > :now AND #lease_ms > :now AND #att >= :one";

/// `complete` under [`HOLDS`].
pub(crate) const COMPLETE: &str = "SET #st = :completed, #resp = :resp, #exp_ms = :exp, \
     #expires_at = :ttl, #v = :v REMOVE #lease_ms, #ret_ms, #ret_s, #err";
/// `fail(retry)` under [`HOLDS`].
pub(crate) const FAIL: &str = "SET #st = :failed, #err = :err, #exp_ms = :exp, \
     #expires_at = :ttl, #v = :v REMOVE #lease_ms, #ret_ms, #ret_s, #perm";
/// `fail(permanent)` under [`HOLDS`].
pub(crate) const FAIL_PERMANENT: &str = "SET #st = :failed, #err = :err, #exp_ms = :exp, \
     #expires_at = :ttl, #v = :v, #perm = :true REMOVE #lease_ms, #ret_ms, #ret_s";
/// `extend` under [`HOLDS`]: the expiry keeps its distance to the lease deadline.
pub(crate) const EXTEND: &str = "SET #lease_ms = :lease, #exp_ms = #ret_ms + :lease, \
     #expires_at = #ret_s + :lease_s, #v = :v";

/// `release` under [`HOLDS_LIVE`]: the attempt is taken back (a `Processing` item has at
/// least one, its claim's), the lease lapses at `:lease` and the expiry keeps its distance
/// to it, as in [`EXTEND`].
pub(crate) const RELEASE: &str = "SET #att = #att - :one, #lease_ms = :lease, \
     #exp_ms = #ret_ms + :lease, #expires_at = #ret_s + :lease_s, #v = :v";

/// `purge_expired`'s scan filter.
pub(crate) const EXPIRED: &str = "#exp_ms <= :now";
/// `list`'s scan filter parts.
pub(crate) const LIVE: &str = "#exp_ms > :now";
/// Only one namespace.
pub(crate) const IN_NAMESPACE: &str = "begins_with(#pk, :prefix)";
/// Only one state.
pub(crate) const IN_STATE: &str = "#st = :st";

/// The `ExpressionAttributeNames` for `expressions`: every `#name` in them mapped to
/// `name`. DynamoDB refuses names a request does not use, so they come from the text.
pub(crate) fn names(expressions: &[&str]) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for text in expressions {
        let mut rest = *text;
        while let Some(at) = rest.find('#') {
            let tail = &rest[at + 1..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            out.insert(format!("#{}", &tail[..end]), tail[..end].to_owned());
            rest = &tail[end..];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_text() {
        let n = names(&[HOLDS, EXTEND]);
        let mut keys: Vec<&str> = n.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "#exp_ms",
                "#expires_at",
                "#lease_ms",
                "#owner",
                "#ret_ms",
                "#ret_s",
                "#st",
                "#tok",
                "#v"
            ]
        );
        assert_eq!(n["#ret_s"], "ret_s");
    }
}
