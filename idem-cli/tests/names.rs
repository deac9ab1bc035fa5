//! Every text that introduces idem to a user (the READMEs' openings, the crate
//! descriptions, the contract's opening, `idem --help`, `idem migrate --help`) names every
//! store of the registry and every broker binding of the facade, so that a backend or
//! binding added later cannot be left out of one of them.

use std::path::Path;
use std::process::Command;

use idem_once::drivers;

/// How the docs spell a registry name or a broker feature.
fn spelled(name: &str) -> &'static str {
    match name {
        "memory" => "memory",
        "redis" => "Redis",
        "postgres" => "PostgreSQL",
        "mysql" => "MySQL",
        "dynamodb" => "DynamoDB",
        "kafka" => "Kafka",
        "rabbitmq" => "RabbitMQ",
        other => panic!("no spelling for `{other}`: add it to `spelled` in tests/names.rs"),
    }
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
}

fn read(file: &str) -> String {
    std::fs::read_to_string(root().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The stores: every backend of the registry, compiled in or not.
fn stores() -> Vec<&'static str> {
    drivers().iter().map(|r| spelled(r.name)).collect()
}

/// The brokers: each facade feature that adds an `idem-*` crate that is not a store's.
fn brokers() -> Vec<&'static str> {
    let store_features: Vec<_> = drivers().iter().map(|r| r.feature).collect();
    let manifest = read("Cargo.toml");
    let features = manifest
        .split("\n[features]\n")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("the facade's [features]");
    let found: Vec<_> = features
        .lines()
        .filter_map(|line| {
            let (name, deps) = line.split_once(" = ")?;
            deps.contains("\"dep:idem-").then_some(name.trim())
        })
        .filter(|name| !store_features.contains(name))
        .map(spelled)
        .collect();
    assert!(
        found.len() >= 2,
        "brokers read from the facade's features: {found:?}"
    );
    found
}

/// The text of `file` from the line after its first heading to the first blank line
/// after some text: a README's opening paragraph.
fn opening(file: &str) -> String {
    let text = read(file);
    let body = text.lines().skip_while(|l| !l.starts_with("# ")).skip(1);
    body.skip_while(|l| l.trim().is_empty())
        .take_while(|l| !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `description` of the manifest `file`.
fn description(file: &str) -> String {
    read(file)
        .lines()
        .find_map(|l| l.strip_prefix("description = "))
        .unwrap_or_else(|| panic!("{file} has no description"))
        .to_owned()
}

fn idem(args: &[&str]) -> String {
    let out = Command::new(assert_cmd::cargo::cargo_bin!("idem"))
        .args(args)
        .output()
        .expect("run idem");
    assert!(out.status.success(), "idem {args:?}: {:?}", out.status);
    String::from_utf8(out.stdout).expect("UTF-8 help")
}

fn assert_names(place: &str, text: &str, names: &[&str]) {
    let missing: Vec<_> = names.iter().filter(|n| !text.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "{place} does not name {missing:?}:\n{text}"
    );
}

#[test]
fn every_introduction_names_every_store_and_broker() {
    let all: Vec<_> = stores().into_iter().chain(brokers()).collect();
    assert!(all.len() >= 7, "{all:?}");
    let places = [
        ("README.md's opening", opening("README.md")),
        ("the facade's description", description("Cargo.toml")),
        ("idem-cli's description", description("idem-cli/Cargo.toml")),
        ("CONTRACT.md's opening", opening("CONTRACT.md")),
        ("`idem --help`", idem(&["--help"])),
    ];
    for (place, text) in &places {
        assert_names(place, text, &all);
    }
}

#[test]
fn every_list_of_stores_names_every_store() {
    let stores = stores();
    let places = [
        (
            "idem-conformance's opening",
            opening("idem-conformance/README.md"),
        ),
        ("idem-cli's README", read("idem-cli/README.md")),
        ("idem-core's README", read("idem-core/README.md")),
    ];
    for (place, text) in &places {
        assert_names(place, text, &stores);
    }
    // The stores with tables to make, each named by `idem migrate --help`.
    let migrate = idem(&["migrate", "--help"]);
    assert_names("`idem migrate --help`", &migrate, &stores);
}

#[test]
fn a_missing_name_is_caught() {
    // The check itself: a text without one of the stores fails it.
    let text = opening("README.md").replace(spelled("mysql"), "a SQL store");
    let caught = std::panic::catch_unwind(|| assert_names("edited", &text, &stores()));
    assert!(caught.is_err(), "a README without MySQL passed");
}
