//! Building an example of a crate, for tests that run it as a process of its own (the
//! SIGKILL tests of the broker bindings).

/// Builds the example `name` of the package `package` whose manifest is `manifest` (a
/// test passes `concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")`), and returns how to
/// run it. The package variables cargo sets for the calling test are removed first: build
/// scripts that watch them (ring's does) would otherwise see them change, and this build
/// and the next `cargo test` would each rebuild ring and all that depends on it. Panics,
/// naming the example, if the build fails.
pub fn build_example(manifest: &str, package: &str, name: &str) -> escargot::CargoRun {
    let mut build = escargot::CargoBuild::new()
        .manifest_path(manifest)
        .package(package)
        .example(name);
    for (var, _) in std::env::vars_os() {
        let set_for_tests = var.to_str().is_some_and(|n| {
            [
                "CARGO_PKG_",
                "CARGO_MANIFEST_",
                "CARGO_CRATE_",
                "CARGO_PRIMARY_",
            ]
            .iter()
            .any(|p| n.starts_with(p))
                || n == "CARGO_TARGET_TMPDIR"
        });
        if set_for_tests {
            build = build.env_remove(var);
        }
    }
    build
        .run()
        .unwrap_or_else(|e| panic!("build the {name} example of {package}: {e}"))
}
