//! One exit-code rule: 4 when the key a command is about has no record, 2 for arguments
//! that do not go together (as for clap's own usage errors).

mod common;

use common::{fails, idem, text};

/// A Redis URL under a key prefix of this test's own (memory: does not outlive a process).
fn redis_url() -> String {
    let base = idem_conformance::service_env("IDEM_REDIS_URL");
    let prefix = format!("idemcli-exit:{}:{}:", std::process::id(), fastrand::u32(..));
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}prefix={prefix}")
}

#[test]
fn a_missing_key_exits_4_for_every_command_about_one_key() {
    let url = redis_url();
    let key = ["orders", "never-claimed"];
    let err = fails(&[&["inspect", "-b", &url][..], &key].concat(), 4);
    assert!(
        err.contains("no record for orders/never-claimed (never claimed, deleted, or expired)"),
        "{err}"
    );

    // --json prints `null` for it, and exits 4 as well.
    let out = idem(&[&["inspect", "-b", &url][..], &key, &["--json"]].concat());
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(4), "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "null");
    assert!(stderr.contains("no record for"), "{stderr}");

    for (command, then) in [
        ("release", "nothing to release"),
        ("delete", "nothing to delete"),
    ] {
        // With --yes and without: no record is found before anything is asked.
        for yes in [&["--yes"][..], &[]] {
            let args = [&[command, "-b", &url][..], &key, yes].concat();
            let err = fails(&args, 4);
            assert!(
                err.contains("no record for orders/never-claimed") && err.contains(then),
                "{args:?}: {err}"
            );
        }
    }
}

#[test]
fn arguments_that_do_not_go_together_exit_2() {
    for (args, says) in [
        (
            &["list", "-b", "memory:", "--stuck", "--state", "failed"][..],
            "--stuck lists processing records",
        ),
        (
            &[
                "list",
                "-b",
                "memory:",
                "--poisoned",
                "--state",
                "completed",
            ],
            "--poisoned picks failed and lapsed records itself",
        ),
        (
            &["bench", "--batch", "0", "--duration", "10ms"],
            "--batch needs numbers of at least 1",
        ),
        (
            &[
                "dlq",
                "replay",
                "--brokers",
                "127.0.0.1:1",
                "t.dlq",
                "-b",
                "memory:",
            ],
            "select letters",
        ),
        (
            &[
                "dlq",
                "list",
                "--brokers",
                "127.0.0.1:1",
                "t.dlq",
                "-X",
                "no-equals",
            ],
            "write a librdkafka property as KEY=VALUE",
        ),
    ] {
        let err = fails(args, 2);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
