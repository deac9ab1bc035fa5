//! What `idem` prints: to a reader that goes away, and for a command the store cannot serve.

mod common;

use std::process::{Command, Stdio};

use common::fails;

/// A reader that goes away (`idem backends | head -0`) ends idem quietly, with success,
/// as a writer in a shell pipeline ends; before, the first write panicked.
#[test]
fn a_closed_stdout_ends_idem_quietly() {
    let mut child = Command::new(assert_cmd::cargo::cargo_bin!("idem"))
        .arg("backends")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run idem");
    // The read end closes before idem has started, let alone written.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("idem ends");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn offsets_of_a_store_without_transactional_mode_are_refused() {
    let err = fails(&["offsets", "show", "-b", "memory:", "-g", "g"], 1);
    assert!(
        err.contains("keeps no consumer offsets") && err.contains("PostgreSQL's and MySQL's"),
        "{err}"
    );
}
