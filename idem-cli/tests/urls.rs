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

/// A parameter that neither the driver nor its client reads is refused (it was silently
/// ignored: `?prefx=` opened the default prefix), with the one probably meant: a case for
/// every backend compiled in.
#[test]
fn an_unknown_url_parameter_is_refused_with_the_one_meant() {
    let cases = [
        ("memory", "memory:?prefix=p", None),
        (
            "redis",
            "redis://:s3cret@127.0.0.1:6379/?prefx=p",
            Some("prefix"),
        ),
        (
            "postgres",
            "postgres://app:s3cret@127.0.0.1/db?schema=s&sslmod=disable",
            Some("sslmode"),
        ),
        (
            "mysql",
            "mysql://app@127.0.0.1/db?ssl-mod=DISABLED",
            Some("ssl-mode"),
        ),
        (
            "dynamodb",
            "dynamodb://t?endpoint=http://h:1&regoin=local",
            Some("region"),
        ),
    ];
    let listing = common::ok(&["backends"]);
    for row in listing.lines().filter(|l| l.contains(" yes ")) {
        assert!(
            cases
                .iter()
                .any(|(name, ..)| row.contains(&format!(" {name} "))),
            "no case for the compiled backend of {row}"
        );
    }
    for (name, url, meant) in cases {
        let err = fails(&["inspect", "-b", url, "ns", "id"], 2);
        let param = url
            .rsplit(['?', '&'])
            .next()
            .and_then(|p| p.split('=').next());
        let param = param.expect("a parameter");
        assert!(
            err.contains(&format!("unknown parameter \"{param}\"")),
            "{name}: {err}"
        );
        match meant {
            Some(meant) => assert!(
                err.contains(&format!("did you mean `{meant}`?")) && err.contains("accepted: "),
                "{name}: {err}"
            ),
            None => assert!(err.contains("takes no parameters"), "{name}: {err}"),
        }
        assert!(!err.contains("s3cret"), "{err}");
    }
}

/// Parameters the drivers' clients read still open the store: `sslmode` on PostgreSQL,
/// `protocol` on Redis (`inspect` reads the store, and finds no record: exit 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_url_parameters_still_open() {
    let tag = format!("{}_{}", std::process::id(), fastrand::u32(..));
    let redis = idem_conformance::service_env("IDEM_REDIS_URL");
    let sep = if redis.contains('?') { '&' } else { '?' };
    let redis = format!("{redis}{sep}protocol=resp2&prefix=idemcli-urls:{tag}:");
    let err = fails(&["inspect", "-b", &redis, "ns", "id"], 4);
    assert!(err.contains("no record for ns/id"), "{err}");

    let base = idem_conformance::service_env("IDEM_POSTGRES_URL");
    let schema = format!("idemcli_urls_{tag}");
    let sep = if base.contains('?') { '&' } else { '?' };
    let pg = format!("{base}{sep}sslmode=disable&schema={schema}");
    let out = common::ok(&["migrate", "-b", &pg, "--yes"]);
    assert!(
        out.contains(&format!("schema {schema} is migrated")),
        "{out}"
    );
    let err = fails(&["inspect", "-b", &pg, "ns", "id"], 4);
    assert!(err.contains("no record for ns/id"), "{err}");
    let config = idem_postgres::PgConfig::new(base).with_schema(schema.clone());
    let backend = idem_postgres::PgBackend::connect(config)
        .await
        .expect("connect to IDEM_POSTGRES_URL");
    let drop = format!("DROP SCHEMA \"{schema}\" CASCADE");
    sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(backend.pool())
        .await
        .expect("drop the test schema");
}
