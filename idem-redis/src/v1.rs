//! The first record layout, which this version still reads (`get`, `list`, and the claim
//! function's `lua/load.lua`) and never writes:
//! `<s><t>,<n>,<l>,<x>,<k>,<#o>,<#f>,<#r>,<#e>;<o><f><r><e>`, deadlines inside.

use bytes::Bytes;
use idem_core::{Fingerprint, Key, Record, State, Timestamp};

/// A record in the first layout.
pub(crate) fn decode(key: &Key, raw: &[u8]) -> Result<Record, &'static str> {
    let end = raw
        .iter()
        .position(|&b| b == b';')
        .ok_or("not an idem record")?;
    let (head, mut body) = (&raw[..end], &raw[end + 1..]);
    let (&state, head) = head.split_first().ok_or("not an idem record")?;
    let state = match state {
        b'p' => State::Processing,
        b'c' => State::Completed,
        b'f' => State::Failed,
        _ => return Err("bad state"),
    };
    let parts: Vec<&[u8]> = head.split(|&b| b == b',').collect();
    let [t, n, l, x, k, lo, lf, lr, le] = parts.as_slice() else {
        return Err("not an idem record");
    };
    let num = |text: &[u8]| number(text).ok_or("a field is not a number");
    let opt = |text: &[u8]| {
        if text.is_empty() {
            Ok(None)
        } else {
            num(text).map(Some)
        }
    };
    let len = |n: u64| usize::try_from(n).map_err(|_| "bad length");
    let permanent = match *k {
        b"0" => false,
        b"1" => true,
        _ => return Err("bad permanent flag"),
    };
    let owner_len = len(num(lo)?)?;
    let fp_len = len(num(lf)?)?;
    let resp_len = opt(lr)?.map(len).transpose()?;
    let err_len = opt(le)?.map(len).transpose()?;
    if fp_len != 0 && fp_len != 32 {
        return Err("bad fingerprint length");
    }
    let total = owner_len + fp_len + resp_len.unwrap_or(0) + err_len.unwrap_or(0);
    if total != body.len() {
        return Err("bad length");
    }
    let mut take = |n: usize| {
        let (part, rest) = body.split_at(n);
        body = rest;
        part
    };
    let owner = String::from_utf8(take(owner_len).to_vec()).map_err(|_| "owner is not UTF-8")?;
    let fingerprint = match take(fp_len).try_into() {
        Ok(f) => Some(Fingerprint(f)),
        Err(_) => None, // length 0
    };
    let response = resp_len.map(|n| Bytes::copy_from_slice(take(n)));
    let error = match err_len {
        None => None,
        Some(n) => Some(String::from_utf8(take(n).to_vec()).map_err(|_| "error is not UTF-8")?),
    };
    Ok(Record {
        key: key.clone(),
        state,
        owner: owner.into(),
        token: num(t)?,
        attempts: u32::try_from(num(n)?).map_err(|_| "too many attempts")?,
        lease_until: opt(l)?.map(Timestamp::from_millis),
        fingerprint,
        response,
        error,
        permanent,
        expires_at: Some(Timestamp::from_millis(num(x)?)),
    })
}

/// A decimal of at most 15 digits, as the Lua functions accept it.
pub(crate) fn number(text: &[u8]) -> Option<u64> {
    if text.is_empty() || text.len() > 15 || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}
