//! Building an example of a crate, for tests that run it as a process of its own (the
//! SIGKILL tests of the broker bindings).

/// Builds the example `name` of the package `package` whose manifest is `manifest` (a
/// test passes `concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")`), and returns how to
/// run it. The package variables cargo sets for the calling test are removed first: build
/// scripts that watch them (ring's does) would otherwise see them change, and this build
/// and the next `cargo test` would each rebuild ring and all that depends on it. Panics,
/// naming the example, if the build fails.
///
/// The build has the package's own features, as `cargo test -p <package>` does; in a
/// workspace tested as a whole, [`build_workspace_example`] is the one that reuses the
/// test build.
pub fn build_example(manifest: &str, package: &str, name: &str) -> escargot::CargoRun {
    run(escargot::CargoBuild::new().package(package), manifest, name)
}

/// Builds the example `name` of whichever member of the workspace of `manifest` has it,
/// with the workspace's features: those `cargo test --workspace` (or `cargo nextest run
/// --workspace`) built the example with, so that after such a test build this one is a
/// no-op instead of a second build of every dependency inside the test's deadline.
/// Otherwise as [`build_example`].
pub fn build_workspace_example(manifest: &str, name: &str) -> escargot::CargoRun {
    run(
        escargot::CargoBuild::new().arg("--workspace"),
        manifest,
        name,
    )
}

fn run(build: escargot::CargoBuild, manifest: &str, name: &str) -> escargot::CargoRun {
    let mut build = build.manifest_path(manifest).example(name);
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
        .unwrap_or_else(|e| panic!("build the {name} example: {e}"))
}
