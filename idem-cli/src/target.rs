//! Backend URLs: which store a command talks to. Each URL goes to the driver that
//! registered its scheme (`idem_once::drivers()`): `memory:`, `redis://…`, `postgres://…`,
//! `dynamodb://<table>?endpoint=…&region=…`; each driver's docs give its parameters.

use std::fmt;

use idem_once::backend::driver::{Driver, Options, Store, redact};
use idem_once::{LookupError, drivers};

use crate::error::{Error, Result, StoreContext};

/// A checked backend URL whose driver is compiled in.
#[derive(Clone)]
pub struct Target {
    driver: &'static dyn Driver,
    url: String,
    shown: String,
}

impl Target {
    /// Parses a backend URL. A URL that does not parse, or that names a backend this
    /// build lacks, is an error that says what to do.
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        let bad = |reason: String| Error::BadUrl {
            url: redact(text),
            reason,
            expected: expected(),
        };
        let driver = idem_once::driver_for(text).map_err(|e| match e {
            LookupError::NotCompiled { name, feature } => Error::FeatureMissing {
                what: format!("the {name} backend"),
                feature,
            },
            other => bad(other.to_string()),
        })?;
        let shown = driver.check(text).map_err(|e| match e {
            idem_once::Error::Config { message, .. } => bad(message),
            other => bad(other.to_string()),
        })?;
        Ok(Target {
            driver,
            url: text.to_owned(),
            shown,
        })
    }

    /// The backend's short name: `memory`, `redis`, `postgres`, `dynamodb`.
    pub fn kind(&self) -> &'static str {
        self.driver.name()
    }

    /// Connects to the store.
    pub async fn connect(&self, options: &Options) -> Result<Box<dyn Store>> {
        self.driver
            .open(&self.url, options)
            .await
            .store(format!("connect to {self}"))
    }
}

/// `idem backends`: one row per registered backend, compiled in or not.
pub fn listing() -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    table.set_header(["backend", "schemes", "in this build", "URL"]);
    for r in drivers() {
        let (built, usage) = match r.driver {
            Some(d) => ("yes".to_owned(), d.usage().to_owned()),
            None => (format!("no: feature `{}`", r.feature), String::new()),
        };
        let schemes: Vec<String> = r.schemes.iter().map(|s| format!("{s}:")).collect();
        table.add_row([r.name.to_owned(), schemes.join(" "), built, usage]);
    }
    table.to_string()
}

/// The URL forms of the backends compiled in, for errors.
fn expected() -> String {
    let forms: Vec<String> = drivers()
        .iter()
        .filter(|r| r.driver.is_some())
        .map(|r| match r.name {
            "memory" => "memory:".to_owned(),
            _ => format!("{}://…", r.schemes[0]),
        })
        .collect();
    forms.join(", ")
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Target({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the backend `name` is compiled into this build.
    fn compiled(name: &str) -> bool {
        drivers()
            .iter()
            .any(|r| r.name == name && r.driver.is_some())
    }

    fn reason(text: &str) -> String {
        match Target::parse(text) {
            Err(Error::BadUrl { reason, .. }) => reason,
            other => panic!("{text}: expected BadUrl, got {other:?}"),
        }
    }

    #[test]
    fn parses_each_form() {
        assert_eq!(Target::parse("memory:").unwrap().to_string(), "memory:");
        if compiled("redis") {
            let t = Target::parse("redis://:pw@h:6379/0?prefix=svc:, redis://h2:6379/").unwrap();
            assert_eq!(t.kind(), "redis");
            assert_eq!(
                t.to_string(),
                "redis://:***@h:6379/0,redis://h2:6379/ (prefix svc:)"
            );
        }
        if compiled("postgres") {
            let t = Target::parse("postgres://app:pw@db:5432/orders?schema=svc&sslmode=disable")
                .unwrap();
            assert_eq!(
                t.to_string(),
                "postgres://app:***@db:5432/orders?sslmode=disable (schema svc)"
            );
        }
        if compiled("dynamodb") {
            let t = Target::parse("dynamodb://idem?endpoint=http://127.0.0.1:8000&region=local")
                .unwrap();
            assert_eq!(
                t.to_string(),
                "dynamodb://idem?endpoint=http://127.0.0.1:8000&region=local"
            );
        }
    }

    #[test]
    fn refuses_bad_urls_with_a_reason() {
        assert!(reason("localhost:6379").contains("unknown scheme"));
        assert!(reason("nonsense").contains("no scheme"));
        assert!(reason("nosuchstore://db/x").contains("unknown scheme \"nosuchstore\""));
        assert!(reason("memory:x").contains("memory:"));
        if compiled("postgres") {
            assert!(reason("postgres://").contains("no host"));
        }
        if compiled("dynamodb") {
            assert!(reason("dynamodb://?region=x").contains("no table"));
            assert!(reason("dynamodb://t?colour=red").contains("unknown parameter"));
        }
    }

    #[test]
    fn a_missing_feature_names_it() {
        for r in drivers().iter().filter(|r| r.name != "memory") {
            let url = format!("{}://h", r.schemes[0]);
            match Target::parse(&url) {
                Ok(_) => assert!(r.driver.is_some(), "{url}"),
                Err(Error::FeatureMissing { feature, .. }) => {
                    assert!(r.driver.is_none(), "{url}");
                    assert_eq!(feature, r.feature);
                }
                Err(other) => panic!("{url}: {other}"),
            }
        }
    }

    #[test]
    fn passwords_never_show() {
        for url in ["nosuchstore://u:s3cret@db/x", "postgres://u:s3cret@[bad"] {
            let e = Target::parse(url).unwrap_err().to_string();
            assert!(!e.contains("s3cret"), "{e}");
        }
    }
}
