//! Shared helpers: running the `idem` binary, and one operator scenario every store runs.
#![allow(dead_code)]

use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use assert_cmd::cargo::cargo_bin_cmd;
use bytes::Bytes;
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{Backend, ClaimKind, FailureKind, Key, Lease, State};

/// Runs `idem` with `args`, no stdin, and returns what it did.
pub fn idem(args: &[&str]) -> Output {
    cargo_bin_cmd!("idem")
        .args(args)
        .env_remove("IDEM_BACKEND")
        .env_remove("IDEM_DEMO_FORCE_DOUBLE_CHARGE")
        .output()
        .expect("run idem")
}

/// stdout and stderr as text.
pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `idem` and requires success; returns stdout.
pub fn ok(args: &[&str]) -> String {
    let out = idem(args);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "idem {args:?} failed ({:?}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout
}

/// Runs `idem` and requires failure with `code`; returns stderr.
pub fn fails(args: &[&str], code: i32) -> String {
    let out = idem(args);
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(code),
        "idem {args:?}:\n{stdout}\n{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    stderr
}

/// `idem inspect --json` of a key, parsed: `null` (and exit 4) when it has no record.
pub fn inspect(url: &str, key: &Key) -> serde_json::Value {
    let out = idem(&["inspect", "-b", url, key.namespace(), key.id(), "--json"]);
    let (stdout, stderr) = text(&out);
    match out.status.code() {
        Some(0) => {}
        Some(4) => assert!(stderr.contains(&format!("no record for {key}")), "{stderr}"),
        _ => panic!("inspect {key} ({:?}):\n{stdout}\n{stderr}", out.status),
    }
    let json = serde_json::from_str(&stdout).expect("inspect --json is JSON");
    assert_eq!(
        out.status.code() == Some(4),
        json == serde_json::Value::Null,
        "{stdout}"
    );
    json
}

fn claim(key: &Key, owner: &str, lease: Duration) -> Claim {
    Claim {
        key: key.clone(),
        owner: owner.into(),
        lease_ttl: lease,
        fingerprint: None,
        max_attempts: 5,
        retention: Duration::from_secs(600),
    }
}

async fn acquire(b: &dyn Backend, key: &Key, owner: &str, lease: Duration) -> Lease {
    match b.claim(&claim(key, owner, lease)).await.expect("claim") {
        ClaimOutcome::Acquired(l) => l,
        other => panic!("claim of {key}: {other:?}"),
    }
}

/// The operator commands against a real store at `url`, with `backend` (the same store)
/// used to set records up and check what the commands did. Keys live in `namespace`.
pub async fn operator_scenario(url: &str, backend: Arc<dyn Backend>, namespace: &str) {
    let b = backend.as_ref();
    let key = |id: &str| Key::new(namespace, id).expect("key");
    let long = Duration::from_secs(60);

    // inspect: a live Processing record, readable and as JSON.
    let held = key("held");
    let lease = acquire(b, &held, "worker-1", long).await;
    let shown = ok(&["inspect", "-b", url, namespace, "held"]);
    assert!(shown.contains("state: processing (lease live)"), "{shown}");
    assert!(shown.contains("owner: worker-1"), "{shown}");
    let json = inspect(url, &held);
    assert_eq!(json["state"], "processing");
    assert_eq!(json["token"], lease.token);
    assert_eq!(json["lease_lapsed"], false);

    // release: refused without --yes (no terminal), and while the lease is live.
    let args = ["release", "-b", url, namespace, "held"];
    let err = fails(&[&args[..], &["--force"]].concat(), 2);
    assert!(
        err.contains("without confirmation") && err.contains("--yes"),
        "{err}"
    );
    let err = fails(&[&args[..], &["--yes"]].concat(), 1);
    assert!(err.contains("lease on") && err.contains("is live"), "{err}");
    let rec = b.get(&held).await.expect("get").expect("record");
    assert_eq!((rec.state, rec.token), (State::Processing, lease.token));

    // release --force --yes: Failed and retryable, and the old holder is fenced.
    let out = ok(&[
        &args[..],
        &["--force", "--yes", "--reason", "stuck in test"],
    ]
    .concat());
    assert!(out.contains("now failed and retryable"), "{out}");
    let rec = b.get(&held).await.expect("get").expect("record");
    assert_eq!(rec.state, State::Failed);
    assert_eq!(rec.error.as_deref(), Some("stuck in test"));
    assert!(!rec.permanent);
    let late = b.complete(&lease, Bytes::from_static(b"late"), long).await;
    assert!(
        matches!(late, Err(e) if e.is_fenced()),
        "old holder not fenced"
    );
    let retry = acquire(b, &held, "worker-2", long).await;
    assert_eq!(
        (retry.kind, retry.token),
        (ClaimKind::Retry, lease.token + 1)
    );

    // release refuses a record that is not Processing, and a missing one.
    let done = key("done");
    let l = acquire(b, &done, "worker-1", long).await;
    b.complete(&l, Bytes::from_static(b"receipt r-1"), long)
        .await
        .expect("complete");
    let err = fails(&["release", "-b", url, namespace, "done", "--yes"], 1);
    assert!(err.contains("is completed, not processing"), "{err}");
    let err = fails(&["release", "-b", url, namespace, "nothing", "--yes"], 4);
    assert!(err.contains("no record"), "{err}");
    let shown = ok(&["inspect", "-b", url, namespace, "done"]);
    assert!(
        shown.contains("response: 11 bytes: \"receipt r-1\""),
        "{shown}"
    );

    // delete: refused without --yes; then gone.
    let err = fails(&["delete", "-b", url, namespace, "done"], 2);
    assert!(err.contains("refusing to delete"), "{err}");
    assert!(b.get(&done).await.expect("get").is_some());
    let out = ok(&["delete", "-b", url, namespace, "done", "--yes"]);
    assert!(out.contains(&format!("deleted {done}")), "{out}");
    assert!(b.get(&done).await.expect("get").is_none());
    assert_eq!(inspect(url, &done), serde_json::Value::Null);
    let err = fails(&["delete", "-b", url, namespace, "done", "--yes"], 4);
    assert!(err.contains("nothing to delete"), "{err}");

    // A lease that lapses and a record that expires, for list --stuck and purge.
    let stuck = key("stuck");
    acquire(b, &stuck, "worker-dead", Duration::from_millis(300)).await;
    let expired = key("expired");
    let l = acquire(b, &expired, "worker-1", long).await;
    b.complete(&l, Bytes::from_static(b"old"), Duration::from_millis(1))
        .await
        .expect("complete");
    tokio::time::sleep(Duration::from_millis(600)).await;

    // list --state processing --stuck: only the lapsed lease.
    let list = [
        "list",
        "-b",
        url,
        "-n",
        namespace,
        "--state",
        "processing",
        "--stuck",
    ];
    if b.capabilities().list {
        let out = ok(&[&list[..], &["--json"]].concat());
        let rows: serde_json::Value = serde_json::from_str(&out).expect("list JSON");
        let ids: Vec<&str> = rows
            .as_array()
            .expect("array")
            .iter()
            .filter_map(|r| r["id"].as_str())
            .collect();
        assert_eq!(ids, ["stuck"], "{out}");
        let table = ok(&list);
        assert!(
            table.contains("processing (lease lapsed)") && table.contains("1 record(s)"),
            "{table}"
        );
    } else {
        let err = fails(&list, 1);
        assert!(err.contains("cannot list records"), "{err}");
    }
    let err = fails(&["list", "-b", url, "--state", "failed", "--stuck"], 2);
    assert!(err.contains("--stuck"), "{err}");

    // list --poisoned: a permanent failure always; a retryable failure or a lapsed lease
    // once its attempts reach --max-attempts. And a listing cut by --limit says so.
    let bad = key("bad");
    let l = acquire(b, &bad, "worker-1", long).await;
    b.fail(&l, "card refused", FailureKind::Permanent, long)
        .await
        .expect("fail");
    let spent = key("spent");
    let l = acquire(b, &spent, "worker-1", long).await;
    b.fail(&l, "timeout", FailureKind::Retry, long)
        .await
        .expect("fail");
    let poisoned = |more: &[&str]| {
        let args = [
            &["list", "-b", url, "-n", namespace, "--poisoned", "--json"],
            more,
        ]
        .concat();
        let rows: serde_json::Value = serde_json::from_str(&ok(&args)).expect("list JSON");
        let mut ids: Vec<String> = rows
            .as_array()
            .expect("array")
            .iter()
            .filter_map(|r| r["id"].as_str().map(str::to_owned))
            .collect();
        ids.sort();
        ids
    };
    if b.capabilities().list {
        assert_eq!(poisoned(&[]), ["bad"]);
        // At one attempt, the retryable failure and the lapsed lease are spent too.
        let spent_too = poisoned(&["--max-attempts", "1"]);
        assert_eq!(spent_too, ["bad", "spent", "stuck"]);
        let cut = ok(&["list", "-b", url, "-n", namespace, "--limit", "1"]);
        assert!(cut.contains("1 record(s) shown; more match"), "{cut}");
        let whole = ok(&["list", "-b", url, "-n", namespace, "--limit", "0"]);
        assert!(!whole.contains("more match"), "{whole}");
    }
    let err = fails(
        &["list", "-b", url, "--poisoned", "--state", "completed"],
        2,
    );
    assert!(err.contains("--poisoned"), "{err}");

    // purge: refused without --yes, then runs.
    let err = fails(&["purge", "-b", url], 2);
    assert!(err.contains("refusing to purge"), "{err}");
    let out = ok(&["purge", "-b", url, "--yes"]);
    if b.capabilities().native_expiry {
        assert!(out.contains("purged "), "{out}");
    } else {
        assert!(out.contains("purged 1 expired record(s)"), "{out}");
    }
    assert_eq!(inspect(url, &expired), serde_json::Value::Null);
}

/// `idem offsets show --json` of `group`: (topic, partition, next offset), sorted.
fn shown_offsets(url: &str, group: &str) -> Vec<(String, i64, i64)> {
    let out = ok(&["offsets", "show", "-b", url, "-g", group, "--json"]);
    let json: serde_json::Value = serde_json::from_str(&out).expect("offsets show --json is JSON");
    let mut rows: Vec<(String, i64, i64)> = json
        .as_array()
        .expect("a JSON array")
        .iter()
        .map(|o| {
            (
                o["topic"].as_str().expect("topic").to_owned(),
                o["partition"].as_i64().expect("partition"),
                o["next_offset"].as_i64().expect("next_offset"),
            )
        })
        .collect();
    rows.sort();
    rows
}

/// `idem offsets show|reset` against a transactional store at `url`, with `offsets` (the
/// same store) to seed and read them; `group` is the test's own.
pub async fn offsets_scenario(url: &str, offsets: Arc<dyn idem_core::Offsets>, group: &str) {
    let out = ok(&["offsets", "show", "-b", url, "-g", group]);
    assert!(out.contains("no offsets stored"), "{out}");

    let other = format!("{group}-other");
    for (g, topic, partition, next) in [
        (group, "payments", 0, 40),
        (group, "payments", 1, 7),
        (group, "refunds", 0, 3),
        (other.as_str(), "payments", 0, 99),
    ] {
        let to = idem_core::backend::StoredOffset {
            topic: topic.into(),
            partition,
            next_offset: next,
        };
        offsets.set_offset(g, &to).await.expect("seed an offset");
    }
    let out = ok(&["offsets", "show", "-b", url, "-g", group]);
    assert!(out.contains("payments") && out.contains("40"), "{out}");
    assert_eq!(
        shown_offsets(url, group),
        [
            ("payments".into(), 0, 40),
            ("payments".into(), 1, 7),
            ("refunds".into(), 0, 3)
        ]
    );

    // Moving one partition back: refused without --yes, then done.
    let to = [
        "offsets", "reset", "-b", url, "-g", group, "-t", "payments", "-p", "0", "--to", "5",
    ];
    let err = fails(&to, 2);
    assert!(err.contains("refusing to store 5"), "{err}");
    assert!(ok(&[&to[..], &["--yes"]].concat()).contains("offset 5"));
    assert_eq!(shown_offsets(url, group)[0], ("payments".into(), 0, 5));

    // --to names one partition.
    let err = fails(
        &[
            "offsets", "reset", "-b", url, "-g", group, "--to", "5", "--yes",
        ],
        2,
    );
    assert!(err.contains("--topic and --partition"), "{err}");

    // Deleting a topic's offsets, then the rest; the other group keeps its own.
    let out = ok(&[
        "offsets", "reset", "-b", url, "-g", group, "-t", "payments", "--delete", "--yes",
    ]);
    assert!(out.contains("deleted 2"), "{out}");
    assert_eq!(shown_offsets(url, group), [("refunds".into(), 0, 3)]);
    let out = ok(&[
        "offsets", "reset", "-b", url, "-g", group, "--delete", "--yes",
    ]);
    assert!(out.contains("deleted 1"), "{out}");
    assert!(shown_offsets(url, group).is_empty());
    let left = offsets.offsets(&other).await.expect("read the other group");
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].next_offset, 99);
}
