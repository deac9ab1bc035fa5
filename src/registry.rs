//! The backends this build knows: the drivers compiled in, and for each one left out the
//! feature that adds it.

use std::fmt;
use std::sync::OnceLock;

use idem_core::Result;
use idem_core::backend::driver::{Driver, MEMORY, Options, Store};

/// A backend this build knows of.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub struct Registered {
    /// Its name: `memory`, `redis`, `postgres`, `mysql`, `dynamodb`.
    pub name: &'static str,
    /// The facade feature that compiles it in (empty for `memory`, always there).
    pub feature: &'static str,
    /// The URL schemes it opens.
    pub schemes: &'static [&'static str],
    /// The driver, if the feature is on.
    pub driver: Option<&'static dyn Driver>,
}

impl fmt::Debug for Registered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registered")
            .field("name", &self.name)
            .field("feature", &self.feature)
            .field("schemes", &self.schemes)
            .field("compiled", &self.driver.is_some())
            .finish()
    }
}

/// One line per backend: the feature, the driver (a path to its `DRIVER` static), its name
/// and its schemes (these two are also known when the feature is off, for the error).
macro_rules! registry {
    ($($feature:literal => $driver:path, $name:literal [$($scheme:literal),+];)*) => {
        fn registered() -> Vec<Registered> {
            let mut all = vec![Registered {
                name: MEMORY.name(),
                feature: "",
                schemes: MEMORY.schemes(),
                driver: Some(&MEMORY),
            }];
            $(
                #[cfg(feature = $feature)]
                let driver: Option<&'static dyn Driver> = Some(&$driver);
                #[cfg(not(feature = $feature))]
                let driver: Option<&'static dyn Driver> = None;
                all.push(Registered {
                    name: $name,
                    feature: $feature,
                    schemes: &[$($scheme),+],
                    driver,
                });
            )*
            all
        }
    };
}

registry! {
    "redis" => idem_redis::DRIVER, "redis" ["redis", "rediss", "redis+unix"];
    "postgres" => idem_postgres::DRIVER, "postgres" ["postgres", "postgresql"];
    "mysql" => idem_mysql::DRIVER, "mysql" ["mysql", "mariadb"];
    "dynamo" => idem_dynamo::DRIVER, "dynamodb" ["dynamodb"];
}

/// Every backend this build knows, compiled in or not, `memory` first.
pub fn drivers() -> &'static [Registered] {
    static ALL: OnceLock<Vec<Registered>> = OnceLock::new();
    ALL.get_or_init(registered)
}

/// Why no driver opens a URL.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LookupError {
    /// The text has no `scheme:` in front.
    NoScheme,
    /// No backend this build knows opens the scheme.
    UnknownScheme(String),
    /// The backend that opens the scheme is not compiled into this build.
    NotCompiled {
        /// The backend's name.
        name: &'static str,
        /// The feature that adds it.
        feature: &'static str,
    },
}

impl fmt::Display for LookupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LookupError::NoScheme => write!(f, "no scheme (such as redis://) in front"),
            LookupError::UnknownScheme(s) => write!(f, "unknown scheme {s:?}"),
            LookupError::NotCompiled { name, feature } => write!(
                f,
                "the {name} backend is not compiled in: it needs the cargo feature `{feature}`"
            ),
        }
    }
}

impl std::error::Error for LookupError {}

/// The driver that opens `url` (the scheme of its first comma-separated part).
pub fn driver_for(url: &str) -> std::result::Result<&'static dyn Driver, LookupError> {
    let first = url.split(',').next().unwrap_or(url).trim();
    let scheme = match first.split_once(':') {
        Some((scheme, _)) => scheme,
        None if first == "memory" => "memory",
        None => return Err(LookupError::NoScheme),
    };
    let scheme = scheme.to_ascii_lowercase();
    let found = drivers()
        .iter()
        .find(|r| r.schemes.contains(&scheme.as_str()))
        .ok_or(LookupError::UnknownScheme(scheme))?;
    found.driver.ok_or(LookupError::NotCompiled {
        name: found.name,
        feature: found.feature,
    })
}

/// Opens the store `url` names, through its driver. A URL no compiled driver opens is
/// [`Error::Config`](idem_core::Error::Config) saying why (and which feature adds it).
pub async fn open(url: &str, options: &Options) -> Result<Box<dyn Store>> {
    let driver = driver_for(url).map_err(|e| idem_core::Error::config(e.to_string()))?;
    driver.open(url, options).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_registered_backend_answers_to_its_schemes() {
        let names: Vec<_> = drivers().iter().map(|r| r.name).collect();
        assert_eq!(names, ["memory", "redis", "postgres", "mysql", "dynamodb"]);
        for r in drivers() {
            for scheme in r.schemes {
                match (driver_for(&format!("{scheme}://h/x")), r.driver) {
                    (Ok(found), Some(d)) => {
                        assert_eq!(found.name(), r.name);
                        assert_eq!(d.schemes(), r.schemes, "registration of {}", r.name);
                    }
                    (Err(LookupError::NotCompiled { feature, .. }), None) => {
                        assert_eq!(feature, r.feature);
                    }
                    (other, _) => panic!("{scheme}: {:?}", other.map(|d| d.name())),
                }
            }
        }
    }

    #[test]
    fn unknown_and_schemeless_urls_say_so() {
        assert_eq!(
            driver_for("nosuchstore://db/x").err(),
            Some(LookupError::UnknownScheme("nosuchstore".into()))
        );
        assert_eq!(driver_for("nonsense").err(), Some(LookupError::NoScheme));
        assert_eq!(driver_for("memory").map(|d| d.name()).ok(), Some("memory"));
    }
}
