//! Backend URLs that do not parse, and backends this build lacks: one line each, naming
//! what to do, never a panic.

mod common;

use std::process::Command;

use common::fails;

#[test]
fn a_bad_url_gets_one_line_naming_the_forms() {
    for (url, why) in [
        ("localhost:6379", "unknown scheme \"localhost\""),
        ("nonsense", "no scheme"),
        (
            "nosuchstore://u:s3cret@db/x",
            "unknown scheme \"nosuchstore\"",
        ),
        ("postgres://", "no host"),
        ("memory:extra", "write memory: with nothing after it"),
    ] {
        let err = fails(&["inspect", "-b", url, "ns", "id"], 2);
        assert!(err.starts_with("idem: "), "{err}");
        assert!(err.contains(why), "{url}: {err}");
        assert!(err.contains("expected memory:, redis://"), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_bad_key_is_refused() {
    let long = "x".repeat(600);
    let err = fails(&["inspect", "-b", "memory:", "ns", &long], 2);
    assert!(err.contains("invalid key: id is 600 bytes"), "{err}");
}

#[test]
fn list_on_memory_answers_and_bench_flags_are_checked() {
    let out = common::ok(&["list", "-b", "memory:"]);
    assert_eq!(out.trim(), "no records match");
    let err = fails(&["bench", "--concurrency", "0", "--duration", "10ms"], 2);
    assert!(
        err.contains("--concurrency needs numbers of at least 1"),
        "{err}"
    );
}

/// Builds `idem` with no backend features (in a target dir of its own, so the binary the
/// other tests run is not replaced), and asks it for each store.
#[test]
fn a_backend_not_compiled_in_names_its_feature() {
    let dir = concat!(env!("CARGO_TARGET_TMPDIR"), "/idem-no-default-features");
    let built = escargot::CargoBuild::new()
        .manifest_path(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .package("idem-cli")
        .bin("idem")
        .no_default_features()
        .target_dir(dir)
        .run()
        .expect("build idem with --no-default-features");
    for (url, feature) in [
        ("redis://127.0.0.1:6379/", "redis"),
        ("postgres://app@127.0.0.1/db", "postgres"),
        ("dynamodb://idem?region=local", "dynamo"),
    ] {
        let out = Command::new(built.path())
            .args(["inspect", "-b", url, "ns", "id"])
            .output()
            .expect("run the minimal idem");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!("cargo feature `{feature}`"))
                && err.contains(&format!("--features {feature}")),
            "{url}: {err}"
        );
    }
    let out = Command::new(built.path())
        .args(["demo", "--messages", "10"])
        .output()
        .expect("run the minimal idem");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("idem demo needs the cargo feature `kafka`"),
        "{err}"
    );
    let out = Command::new(built.path())
        .args(["list", "-b", "memory:"])
        .output()
        .expect("run the minimal idem");
    assert!(out.status.success(), "memory: works without features");
    let out = Command::new(built.path())
        .args(["backends"])
        .output()
        .expect("run the minimal idem");
    let listing = String::from_utf8_lossy(&out.stdout);
    for (name, feature) in [
        ("redis", "redis"),
        ("postgres", "postgres"),
        ("dynamodb", "dynamo"),
    ] {
        let row = listing.lines().find(|l| l.contains(&format!(" {name} ")));
        let row = row.unwrap_or_else(|| panic!("no {name} row: {listing}"));
        assert!(row.contains(&format!("no: feature `{feature}`")), "{row}");
    }
}

#[test]
fn the_backends_listing_shows_every_registered_backend() {
    let listing = common::ok(&["backends"]);
    for (name, scheme) in [
        ("memory", "memory:"),
        ("redis", "rediss:"),
        ("postgres", "postgresql:"),
        ("dynamodb", "dynamodb:"),
    ] {
        let row = listing.lines().find(|l| l.contains(&format!(" {name} ")));
        let row = row.unwrap_or_else(|| panic!("no {name} row: {listing}"));
        assert!(row.contains(scheme) && row.contains("yes"), "{row}");
    }
}
