//! The key layout: `<prefix>{<namespace length>:<namespace>:<id>}`, for example
//! `idem:{8:payments:order-1042}`. The braces are a Redis Cluster hash tag, so the slot
//! comes from the idem key alone, never from the prefix; the length makes the split
//! between namespace and id unambiguous whatever either contains.

use idem_core::Key;

/// Names the Redis keys under one prefix.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    prefix: String,
}

impl Layout {
    pub(crate) fn new(prefix: &str) -> Self {
        Layout {
            prefix: prefix.to_owned(),
        }
    }

    /// The Redis key holding `key`'s record.
    pub(crate) fn record(&self, key: &Key) -> String {
        let (ns, id) = (key.namespace(), key.id());
        let mut len = itoa::Buffer::new();
        let len = len.format(ns.len());
        // Built by hand: `format!` grows the string in steps, and this runs for every key.
        let mut out =
            String::with_capacity(self.prefix.len() + len.len() + ns.len() + id.len() + 4);
        for part in [&self.prefix, "{", len, ":", ns, ":", id, "}"] {
            out.push_str(part);
        }
        out
    }

    /// The idem key a Redis key names, if it is one of ours.
    pub(crate) fn parse(&self, raw: &[u8]) -> Option<Key> {
        let rest = std::str::from_utf8(raw).ok()?.strip_prefix(&self.prefix)?;
        let inner = rest.strip_prefix('{')?.strip_suffix('}')?;
        let (len, rest) = inner.split_once(':')?;
        let len: usize = len.parse().ok()?;
        let ns = rest.get(..len)?;
        let id = rest.get(len..)?.strip_prefix(':')?;
        Key::new(ns, id).ok()
    }

    /// A `SCAN MATCH` pattern for every record, or those of one namespace.
    pub(crate) fn pattern(&self, namespace: Option<&str>) -> String {
        let mut p = glob_escape(&self.prefix);
        p.push('{');
        if let Some(ns) = namespace {
            p.push_str(&format!("{}:{}:", ns.len(), glob_escape(ns)));
        }
        p.push('*');
        p
    }
}

fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_awkward_keys() {
        let layout = Layout::new("idem:");
        for (ns, id) in [
            ("payments", "order-1"),
            ("a:b", "c"),
            ("a", "b:c"),
            ("n}{", "}{*"),
        ] {
            let key = Key::new(ns, id).unwrap();
            let raw = layout.record(&key);
            assert_eq!(layout.parse(raw.as_bytes()), Some(key), "{raw}");
        }
        assert_eq!(
            layout.record(&Key::new("payments", "order-1").unwrap()),
            "idem:{8:payments:order-1}"
        );
        assert_eq!(layout.parse(b"idem:{9:payments:x}"), None);
        assert_eq!(layout.parse(b"other:{1:a:b}"), None);
        assert_eq!(layout.parse(b"idem:plain"), None);
    }

    #[test]
    fn patterns_escape_glob_characters() {
        let layout = Layout::new("i*:");
        assert_eq!(layout.pattern(None), "i\\*:{*");
        assert_eq!(layout.pattern(Some("a?")), "i\\*:{2:a\\?:*");
    }
}
