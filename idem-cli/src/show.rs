//! Records, readable: as text for people and as JSON for scripts.

use std::time::Duration;

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use idem_core::{Record, State, Timestamp};
use serde::Serialize;

/// A record as JSON shows it.
#[derive(Debug, Serialize)]
pub struct RecordView {
    /// The namespace.
    pub namespace: String,
    /// The id.
    pub id: String,
    /// `processing`, `completed` or `failed`.
    pub state: &'static str,
    /// `Failed` and permanent, or attempts spent: further claims answer `Poisoned`.
    pub permanent: bool,
    /// The lease holder, or last holder.
    pub owner: String,
    /// The fencing token.
    pub token: u64,
    /// Claims granted so far.
    pub attempts: u32,
    /// Lease deadline, ms since the epoch.
    pub lease_until_ms: Option<u64>,
    /// Whether the lease has lapsed (by this machine's clock).
    pub lease_lapsed: Option<bool>,
    /// Payload fingerprint, hex.
    pub fingerprint: Option<String>,
    /// The stored response, as text if it is UTF-8.
    pub response: Option<String>,
    /// The stored response, hex, if it is not UTF-8.
    pub response_hex: Option<String>,
    /// Response size in bytes.
    pub response_bytes: Option<usize>,
    /// The last error.
    pub error: Option<String>,
    /// When the record may be dropped, ms since the epoch.
    pub expires_at_ms: Option<u64>,
}

impl RecordView {
    /// The view of `r`, judging lease lapse at `now`.
    pub fn new(r: &Record, now: Timestamp) -> Self {
        let text = r
            .response
            .as_ref()
            .map(|b| std::str::from_utf8(b).map(str::to_owned));
        RecordView {
            namespace: r.key.namespace().to_owned(),
            id: r.key.id().to_owned(),
            state: r.state.as_str(),
            permanent: r.permanent,
            owner: r.owner.to_string(),
            token: r.token,
            attempts: r.attempts,
            lease_until_ms: r.lease_until.map(Timestamp::as_millis),
            lease_lapsed: lapsed(r, now),
            fingerprint: r.fingerprint.map(|f| f.to_hex()),
            response: text.as_ref().and_then(|t| t.as_ref().ok().cloned()),
            response_hex: match (&text, &r.response) {
                (Some(Err(_)), Some(b)) => Some(hex::encode(b)),
                _ => None,
            },
            response_bytes: r.response.as_ref().map(|b| b.len()),
            error: r.error.clone(),
            expires_at_ms: r.expires_at.map(Timestamp::as_millis),
        }
    }
}

/// For a `Processing` record, whether its lease lapsed by `now`.
pub fn lapsed(r: &Record, now: Timestamp) -> Option<bool> {
    (r.state == State::Processing).then(|| r.lease_until.is_none_or(|until| until <= now))
}

/// A point in time, and how far it is from `now`.
pub fn when(t: Timestamp, now: Timestamp) -> String {
    // RFC 3339 ends at the year 9999 (humantime's formatter fails past it, and `format!`
    // would panic): a later time, from a record edited by hand, is shown in milliseconds.
    const YEAR_10000_MS: u64 = 253_402_300_800_000;
    let at = if t.as_millis() < YEAR_10000_MS {
        humantime::format_rfc3339_millis(t.to_system_time()).to_string()
    } else {
        format!("{} ms after the epoch", t.as_millis())
    };
    let round = |d: Duration| humantime::format_duration(Duration::from_secs(d.as_secs()));
    if t > now {
        format!("{at} (in {})", round(t.since(now)))
    } else {
        format!("{at} ({} ago)", round(now.since(t)))
    }
}

/// The record as aligned `field: value` lines.
pub fn record_text(r: &Record, now: Timestamp) -> String {
    let v = RecordView::new(r, now);
    let mut lines = vec![
        ("key", format!("{}", r.key)),
        ("state", state_label(r, now)),
        ("owner", v.owner.clone()),
        ("token", v.token.to_string()),
        ("attempts", v.attempts.to_string()),
    ];
    if let Some(until) = r.lease_until {
        lines.push(("lease until", when(until, now)));
    }
    if let Some(f) = &v.fingerprint {
        lines.push(("fingerprint", f.clone()));
    }
    if let Some(n) = v.response_bytes {
        let body = match (&v.response, &v.response_hex) {
            (Some(t), _) => format!("{t:?}"),
            (None, Some(h)) => format!("0x{}", h),
            _ => String::new(),
        };
        lines.push(("response", format!("{n} bytes: {}", clip(&body, 400))));
    }
    if let Some(e) = &v.error {
        lines.push(("error", e.clone()));
    }
    if let Some(at) = r.expires_at {
        lines.push(("expires", when(at, now)));
    }
    let width = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    lines
        .iter()
        .map(|(k, v)| format!("{k:>width$}: {v}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `processing (lease lapsed)`, `failed (permanent)`, etc.
pub fn state_label(r: &Record, now: Timestamp) -> String {
    let s = r.state.as_str();
    match (r.state, lapsed(r, now)) {
        (State::Processing, Some(true)) => format!("{s} (lease lapsed)"),
        (State::Processing, _) => format!("{s} (lease live)"),
        (State::Failed, _) if r.permanent => format!("{s} (permanent)"),
        _ => s.to_owned(),
    }
}

fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_owned();
    }
    let cut: String = s.chars().take(max).collect();
    format!("{cut}…")
}

/// Records as a terminal table.
pub fn records_table(records: &[Record], now: Timestamp) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED).set_header([
        "namespace",
        "id",
        "state",
        "owner",
        "token",
        "attempts",
        "lease until / expires",
    ]);
    for r in records {
        let at = r.lease_until.or(r.expires_at).map(|t| when(t, now));
        t.add_row([
            r.key.namespace().to_owned(),
            clip(r.key.id(), 40),
            state_label(r, now),
            clip(&r.owner, 32),
            r.token.to_string(),
            r.attempts.to_string(),
            at.unwrap_or_default(),
        ]);
    }
    t.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::Key;

    fn processing(until: u64) -> Record {
        Record {
            key: Key::new("payments", "p-1").unwrap(),
            state: State::Processing,
            owner: "w1".into(),
            token: 3,
            attempts: 2,
            lease_until: Some(Timestamp::from_millis(until)),
            fingerprint: None,
            response: None,
            error: None,
            permanent: false,
            expires_at: Some(Timestamp::from_millis(until + 1000)),
        }
    }

    #[test]
    fn a_time_past_the_year_9999_is_shown_in_milliseconds() {
        let now = Timestamp::from_millis(10_000);
        let far = Timestamp::from_millis(253_402_300_800_000);
        assert!(when(far, now).starts_with("253402300800000 ms after the epoch (in "));
        let last = Timestamp::from_millis(253_402_300_799_999);
        assert!(when(last, now).starts_with("9999-12-31T23:59:59.999Z"));
        let max = Timestamp::from_millis(u64::MAX);
        assert!(when(max, now).contains("ms after the epoch"));
    }

    #[test]
    fn lapse_is_judged_at_now() {
        let now = Timestamp::from_millis(10_000);
        assert_eq!(lapsed(&processing(9_000), now), Some(true));
        assert_eq!(lapsed(&processing(11_000), now), Some(false));
        let text = record_text(&processing(9_000), now);
        assert!(text.contains("state: processing (lease lapsed)"), "{text}");
        assert!(text.contains("token: 3"), "{text}");
        assert!(text.contains("(1s ago)"), "{text}");
    }

    #[test]
    fn binary_responses_show_as_hex() {
        let mut r = processing(0);
        r.state = State::Completed;
        r.response = Some(bytes::Bytes::from_static(&[0xff, 0x00]));
        let v = RecordView::new(&r, Timestamp::from_millis(0));
        assert_eq!(v.response, None);
        assert_eq!(v.response_hex.as_deref(), Some("ff00"));
        assert_eq!(v.lease_lapsed, None);
    }
}
