//! `idem demo` plays the failure on an in-process MockCluster: the naive consumer charges
//! payments twice, the idem consumer never does, and a forced double charge fails the run;
//! with `--broker` the same on a real RabbitMQ (`IDEM_RABBITMQ_URL`).

mod common;

use assert_cmd::cargo::cargo_bin_cmd;
use common::text;

/// The naive and idem columns of the report row named `name`.
fn row(report: &str, name: &str) -> (String, String) {
    let line = report
        .lines()
        .find(|l| l.contains(name))
        .unwrap_or_else(|| panic!("no row {name:?} in:\n{report}"));
    let cells: Vec<String> = line
        .split(['┆', '│'])
        .map(|c| c.trim().to_owned())
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(cells.len(), 3, "{line}");
    (cells[1].clone(), cells[2].clone())
}

fn number(cell: &str) -> u64 {
    let digits: String = cell.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("not a number: {cell:?}"))
}

fn demo(args: &[&str], force: bool) -> std::process::Output {
    let mut cmd = cargo_bin_cmd!("idem");
    cmd.arg("demo").args(args).env_remove("IDEM_BACKEND");
    if force {
        cmd.env("IDEM_DEMO_FORCE_DOUBLE_CHARGE", "1");
    } else {
        cmd.env_remove("IDEM_DEMO_FORCE_DOUBLE_CHARGE");
    }
    cmd.output().expect("run idem demo")
}

#[test]
fn naive_charges_twice_and_idem_charges_once() {
    let out = demo(
        &["--messages", "400", "--duplicates", "40", "--crashes", "2"],
        false,
    );
    let (report, err) = text(&out);
    assert!(out.status.success(), "{report}\n{err}");
    assert!(
        report.contains(
            "400 payment events, 40 of them sent twice, and 1 poison message(s): 441 messages"
        ),
        "{report}"
    );

    let (naive, idem) = row(&report, "payments charged more than once");
    assert!(
        number(&naive) >= 40,
        "the naive side charges every copy: {report}"
    );
    assert_eq!(number(&idem), 0, "{report}");
    let (naive, idem) = row(&report, "payments charged  ");
    assert_eq!((number(&naive), number(&idem)), (400, 400), "{report}");
    let (naive_charges, idem_charges) = row(&report, "charges in all");
    assert!(number(&naive_charges) > 400, "{report}");
    assert_eq!(number(&idem_charges), 400, "{report}");
    let (_, replayed) = row(&report, "duplicates answered from the store");
    assert!(
        number(&replayed) >= 40,
        "every copy is answered from the store: {report}"
    );
    let (naive, idem) = row(&report, "poison messages");
    assert_eq!(
        (naive.as_str(), idem.as_str()),
        ("1 skipped", "1 dead-lettered"),
        "{report}"
    );
    let (naive, idem) = row(&report, "deliveries (crashes)");
    assert!(naive.ends_with("(2)") && idem.ends_with("(2)"), "{report}");
    assert!(
        report.contains("idem:  every payment charged exactly once (memory:)"),
        "{report}"
    );
    // Dead letters are at least once: a crash after a letter is written and before its
    // offset is committed writes it again. Every letter is a poisoned one.
    let letters = report
        .split("1 poison message(s) dead-lettered to payments.dlq (")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("no dead-letter summary: {report}"));
    let (written, poisoned) = letters
        .split_once(" letters: ")
        .unwrap_or_else(|| panic!("bad dead-letter summary {letters:?}: {report}"));
    let written: u64 = written.parse().expect("letters written");
    assert!(written >= 1, "{report}");
    assert_eq!(poisoned, format!("{written} poisoned"), "{report}");
}

#[test]
fn a_forced_double_charge_fails_the_run() {
    let out = demo(
        &["--messages", "200", "--duplicates", "20", "--crashes", "2"],
        true,
    );
    let (report, err) = text(&out);
    assert_eq!(out.status.code(), Some(3), "{report}\n{err}");
    let (_, idem) = row(&report, "payments charged more than once");
    let twice = number(&idem);
    assert!(twice >= 1, "{report}");
    assert!(report.contains("idem:  FAILED"), "{report}");
    assert!(
        err.contains(&format!(
            "the idem consumer charged {twice} payment(s) more than once"
        )),
        "{err}"
    );
}

#[test]
fn the_idem_side_runs_on_a_real_redis() {
    let redis = idem_conformance::service_env("IDEM_REDIS_URL");
    let out = demo(
        &[
            "--messages",
            "200",
            "--duplicates",
            "20",
            "--crashes",
            "1",
            "--backend",
            &redis,
        ],
        false,
    );
    let (report, err) = text(&out);
    assert!(out.status.success(), "{report}\n{err}");
    let (_, idem) = row(&report, "payments charged more than once");
    assert_eq!(number(&idem), 0, "{report}");
    assert!(
        report.contains("idem:  every payment charged exactly once (redis://"),
        "{report}"
    );
}

#[test]
fn bad_demo_flags_are_refused() {
    let out = demo(&["--messages", "5", "--duplicates", "10"], false);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(2), "a usage error: {err}");
    assert!(
        err.contains("--duplicates cannot exceed --messages"),
        "{err}"
    );
}

#[test]
fn on_rabbitmq_naive_charges_twice_and_idem_charges_once() {
    let url = idem_conformance::service_env("IDEM_RABBITMQ_URL");
    let out = demo(
        &[
            "--broker",
            &url,
            "--messages",
            "300",
            "--duplicates",
            "30",
            "--crashes",
            "2",
        ],
        false,
    );
    let (report, err) = text(&out);
    assert!(out.status.success(), "{report}\n{err}");
    let line = |side: &str| -> Vec<u64> {
        let line = report
            .lines()
            .find(|l| l.starts_with(side))
            .unwrap_or_else(|| panic!("no {side} line in:\n{report}"));
        line.split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse().ok())
            .collect()
    };
    // "<side> (…): <crashes> crashes, <payments> payments charged <charges> times, <twice> …"
    let naive = line("naive");
    let idem = line("idem (");
    let tail = |v: &[u64]| v[v.len() - 4..].to_vec();
    let (n, i) = (tail(&naive), tail(&idem));
    assert_eq!((n[0], i[0]), (2, 2), "each side crashed twice:\n{report}");
    assert_eq!(
        (n[1], i[1]),
        (300, 300),
        "each side charged every payment:\n{report}"
    );
    assert!(
        n[3] > 30,
        "the naive side charged more than the duplicates twice:\n{report}"
    );
    assert_eq!(
        (i[2], i[3]),
        (300, 0),
        "idem charged each payment once:\n{report}"
    );
}
