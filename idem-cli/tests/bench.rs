//! `idem bench` writes a report with real numbers: every workload ran, on memory, a real
//! Redis (IDEM_REDIS_URL), a real PostgreSQL (IDEM_POSTGRES_URL) and DynamoDB Local
//! (IDEM_DYNAMO_ENDPOINT), and the ratios are those of the numbers; `--markdown` prints
//! them as one table that says where it comes from.

mod common;

use common::ok;
use serde_json::Value;

#[test]
fn bench_writes_json_and_svg_with_real_numbers() {
    let pg = idem_conformance::service_env("IDEM_POSTGRES_URL");
    let redis = idem_conformance::service_env("IDEM_REDIS_URL");
    let endpoint = idem_conformance::service_env("IDEM_DYNAMO_ENDPOINT");
    let dynamo = format!("dynamodb://idem?endpoint={endpoint}");
    let out = tempfile::tempdir().expect("temp dir");
    let dir = out.path().to_str().expect("utf-8 path");
    let table = ok(&[
        "bench",
        "-b",
        "memory:",
        "-b",
        &redis,
        "-b",
        &pg,
        "-b",
        &dynamo,
        "--concurrency",
        "1,4",
        "--batch",
        "1,8",
        "--duration",
        "200ms",
        "--out",
        dir,
        "--quiet",
    ]);
    for header in [
        "idem keys/s",
        "by hand keys/s",
        "idem ÷ by hand",
        "raw keys/s",
        "idem ÷ raw",
        "replay ÷ raw",
    ] {
        assert!(table.contains(header), "{header} in {table}");
    }
    for operations in [
        "postgres: INSERT … ON CONFLICT DO NOTHING, then UPDATE",
        "redis: SET NX PX, then SET PX",
        "dynamodb: conditional PutItem, then UpdateItem",
        "memory: sharded HashMap insert, then sharded HashMap overwrite",
        "postgres: INSERT … ON CONFLICT DO NOTHING;",
        "redis: SET NX PX;",
        "dynamodb: conditional PutItem\n",
    ] {
        assert!(table.contains(operations), "{operations} in {table}");
    }

    let json = std::fs::read_to_string(out.path().join("bench.json")).expect("bench.json");
    let report: Value = serde_json::from_str(&json).expect("bench.json is JSON");
    let cells = report["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), 4 * 2 * 2, "{json}");
    for cell in cells {
        let backend = cell["backend"].as_str().expect("backend");
        assert!(
            ["memory", "redis", "postgres", "dynamodb"].contains(&backend),
            "{cell}"
        );
        let batch = cell["batch"].as_u64().expect("batch");
        for work in ["raw", "by_hand", "claim_complete", "replay"] {
            let m = &cell[work];
            let (keys, calls) = (m["keys"].as_u64().unwrap(), m["calls"].as_u64().unwrap());
            assert!(calls > 0, "{backend} {work}: {m}");
            assert_eq!(keys, calls * batch, "{backend} {work}: {m}");
            let rate = m["keys_per_sec"].as_f64().unwrap();
            let secs = m["seconds"].as_f64().unwrap();
            assert!(secs >= 0.2, "{backend} {work} ran {secs}s");
            assert!((rate - keys as f64 / secs).abs() < 1e-6 * rate, "{m}");
            let (p50, p99) = (m["p50_us"].as_u64().unwrap(), m["p99_us"].as_u64().unwrap());
            assert!(p50 >= 1 && p99 >= p50, "{backend} {work}: {m}");
        }
        let raw = cell["raw"]["keys_per_sec"].as_f64().unwrap();
        let by_hand = cell["by_hand"]["keys_per_sec"].as_f64().unwrap();
        let claim = cell["claim_complete"]["keys_per_sec"].as_f64().unwrap();
        assert!(raw > 0.0 && by_hand > 0.0 && claim > 0.0, "{cell}");
        let ratio = cell["claim_complete_vs_raw"].as_f64().unwrap();
        assert!((ratio - claim / raw).abs() < 1e-9, "{cell}");
        let ratio = cell["claim_complete_vs_by_hand"].as_f64().unwrap();
        assert!((ratio - claim / by_hand).abs() < 1e-9, "{cell}");
        let (raw_op, by_hand_op) = (
            cell["raw_operation"].as_str().unwrap(),
            cell["by_hand_operation"].as_str().unwrap(),
        );
        assert!(
            by_hand_op.starts_with(&format!("{raw_op}, then ")),
            "{cell}"
        );
        if backend != "memory" {
            // A round trip to a server takes longer than a map insert in memory, and two
            // round trips longer than one.
            assert!(cell["raw"]["p50_us"].as_u64().unwrap() > 10, "{cell}");
            assert!(cell["by_hand"]["p50_us"].as_u64().unwrap() > 10, "{cell}");
        }
    }
    assert!(
        report["command"]
            .as_str()
            .is_some_and(|c| c.starts_with("idem bench -b memory: -b ")),
        "{json}"
    );
    let date = report["date"].as_str().expect("date");
    assert!(
        date.len() == 10 && date.as_bytes()[4] == b'-' && date.starts_with("20"),
        "{date}"
    );
    assert!(report["commit"].as_str().is_some_and(|c| !c.is_empty()));

    // bench.md: the same cells, a row each, in the order measured.
    let md = std::fs::read_to_string(out.path().join("bench.md")).expect("bench.md");
    let rows = markdown_rows(&md);
    assert_eq!(rows.len(), cells.len(), "{md}");
    for (row, cell) in rows.iter().zip(cells) {
        assert_eq!(row[0], cell["backend"].as_str().unwrap(), "{md}");
        assert_eq!(row[1], cell["concurrency"].to_string(), "{md}");
        assert_eq!(row[2], cell["batch"].to_string(), "{md}");
        let ratio = cell["claim_complete_vs_by_hand"].as_f64().unwrap();
        assert_eq!(row[5], format!("{ratio:.2}"), "{md}");
    }

    let svg = std::fs::read_to_string(out.path().join("bench.svg")).expect("bench.svg");
    assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
    for label in [
        "batch 1 (claim)",
        "batch 8 (claim_many)",
        "memory idem",
        "redis raw",
        "redis by hand",
        "postgres idem",
        "dynamodb raw",
        "conditional PutItem",
        "SET NX PX, then SET PX",
        "1 = as fast as by hand",
        "concurrent workers",
    ] {
        assert!(svg.contains(label), "plot lacks {label}");
    }
}

/// The data rows of the one Markdown table in `md`, each split into its cells; the table
/// must have the columns `--markdown` promises.
fn markdown_rows(md: &str) -> Vec<Vec<String>> {
    let table: Vec<&str> = md.lines().filter(|l| l.starts_with('|')).collect();
    assert!(table.len() >= 2, "no table: {md}");
    let split = |line: &str| -> Vec<String> {
        let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
        inner.split('|').map(|c| c.trim().to_owned()).collect()
    };
    assert_eq!(
        split(table[0]),
        [
            "backend",
            "workers",
            "batch",
            "idem keys/s",
            "by hand keys/s",
            "idem ÷ by hand",
            "raw keys/s",
            "idem ÷ raw",
            "replay keys/s",
            "replay ÷ raw",
        ],
        "{md}"
    );
    let rows: Vec<Vec<String>> = table[2..].iter().map(|l| split(l)).collect();
    for row in &rows {
        assert_eq!(row.len(), 10, "{md}");
        for rate in [&row[3], &row[4], &row[6], &row[8]] {
            assert!(
                rate.trim_end_matches(['k', 'M'])
                    .parse::<f64>()
                    .is_ok_and(|r| r > 0.0),
                "rate {rate:?} in {md}"
            );
        }
    }
    rows
}

#[test]
fn markdown_prints_one_table_that_says_where_it_comes_from() {
    let redis = idem_conformance::service_env("IDEM_REDIS_URL");
    let out = tempfile::tempdir().expect("temp dir");
    let dir = out.path().to_str().expect("utf-8 path");
    let args = [
        "bench",
        "-b",
        "memory:",
        "-b",
        &redis,
        "--concurrency",
        "1,2",
        "--batch",
        "1,4",
        "--duration",
        "50ms",
        "--out",
        dir,
        "--quiet",
        "--markdown",
    ];
    let md = ok(&args);
    let first = md.lines().next().expect("a first line");
    // The temp dir's name has only characters a shell reads as they are: no quotes.
    let command = format!("`idem {}`", args.join(" "));
    assert!(first.starts_with(&command), "{first}\nnot {command}");
    assert!(first.contains(" cores ("), "{first}");
    assert!(first.contains(", commit `"), "{first}");
    assert!(!md.contains("wrote "), "stdout is the Markdown alone: {md}");
    assert!(!md.contains('┆'), "no terminal table: {md}");
    let rows = markdown_rows(&md);
    assert_eq!(rows.len(), 2 * 2 * 2, "a row per cell: {md}");
    let backends: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(backends.iter().filter(|b| **b == "memory").count(), 4);
    assert_eq!(backends.iter().filter(|b| **b == "redis").count(), 4);
    assert!(
        md.contains("redis `SET NX PX, then SET PX`"),
        "the table says what by hand is: {md}"
    );
    assert!(out.path().join("bench.md").exists());
}

/// Every store is opened before any is measured: a store that cannot be reached, listed
/// last, fails the bench before the first store ran, and no report is written.
#[test]
fn an_unreachable_store_fails_before_any_measurement() {
    // A port nothing listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let out = tempfile::tempdir().expect("temp dir");
    let dir = out.path().to_str().expect("utf-8 path");
    let unreachable = format!("redis://127.0.0.1:{port}/");
    let began = std::time::Instant::now();
    let err = common::fails(
        &[
            "bench",
            "-b",
            "memory:",
            "-b",
            &unreachable,
            "--duration",
            "5s",
            "--out",
            dir,
            "--quiet",
        ],
        1,
    );
    assert!(err.contains("redis"), "{err}");
    // Not a speed check: measured first, memory alone takes 4 workloads × 6 cells × 5 s,
    // so a bench that ran it before opening Redis cannot end within a minute.
    assert!(
        began.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        began.elapsed()
    );
    assert!(
        !out.path().join("bench.json").exists(),
        "a report was written"
    );
}

/// Off a terminal (stderr is a pipe here, where a bar hides itself) the bench says first
/// how long its measurements take, then a line per finished cell; `--quiet` keeps only
/// the first line.
#[test]
fn off_a_terminal_the_bench_says_how_long_then_a_line_per_cell() {
    let out = tempfile::tempdir().expect("temp dir");
    let dir = out.path().to_str().expect("utf-8 path");
    let args = [
        "bench",
        "-b",
        "memory:",
        "--concurrency",
        "1,2",
        "--batch",
        "1",
        "--duration",
        "10ms",
        "--out",
        dir,
    ];
    let run = common::idem(&args);
    let (stdout, stderr) = common::text(&run);
    assert!(run.status.success(), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert_eq!(
        lines[0],
        "idem bench: 1 store(s) × 2 cell(s) × 4 workloads × 10ms = 80ms of measurement, plus set-up and warm-up"
    );
    for (line, head) in lines[1..].iter().zip([
        "[1/2] memory ×1 workers, batch 1: idem ",
        "[2/2] memory ×2 workers, batch 1: idem ",
    ]) {
        assert!(line.starts_with(head), "{line}");
        assert!(
            line.contains(" keys/s (")
                && line.contains(" of by hand), by hand ")
                && line.contains(", replay "),
            "{line}"
        );
    }
    assert!(
        !stderr.contains('\r') && !stderr.contains('\u{1b}'),
        "no bar: {stderr:?}"
    );

    let run = common::idem(&[&args[..], &["--quiet"]].concat());
    let (stdout, stderr) = common::text(&run);
    assert!(run.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stderr.lines().collect::<Vec<_>>(), &lines[..1], "{stderr}");
}

/// A Redis user (on IDEM_REDIS_URL) whose ACL lets it connect but touch no key the bench
/// writes, removed when dropped: a store that opens, then refuses every write.
struct NoKeysUser {
    server: url::Url,
    name: String,
    password: String,
}

impl NoKeysUser {
    fn create(server: &str) -> Self {
        let server = url::Url::parse(server).expect("IDEM_REDIS_URL parses");
        let tag = format!("{}-{}", std::process::id(), fastrand::u32(..));
        let user = NoKeysUser {
            server,
            name: format!("idemcli-bench-{tag}"),
            password: format!("pw-{tag}"),
        };
        let rules = [
            "on",
            &format!(">{}", user.password),
            "~idemcli-none:*",
            "allchannels",
            "+@all",
        ];
        let reply = user.command(&[&["ACL", "SETUSER", &user.name][..], &rules].concat());
        assert_eq!(reply, "+OK", "ACL SETUSER");
        user
    }

    /// `server` as this user.
    fn url(&self) -> String {
        let mut url = self.server.clone();
        url.set_username(&self.name).expect("a user");
        url.set_password(Some(&self.password)).expect("a password");
        url.to_string()
    }

    /// One command as the server URL's own user; the first line of the reply.
    fn command(&self, args: &[&str]) -> String {
        use std::io::{BufRead, BufReader, Write};
        let host = self.server.host_str().expect("a host");
        let port = self.server.port().unwrap_or(6379);
        let stream = std::net::TcpStream::connect((host, port)).expect("connect to Redis");
        let mut reader = BufReader::new(stream.try_clone().expect("clone the stream"));
        let mut stream = stream;
        let mut send = |args: &[&str]| {
            let mut wire = format!("*{}\r\n", args.len());
            for a in args {
                wire.push_str(&format!("${}\r\n{a}\r\n", a.len()));
            }
            stream.write_all(wire.as_bytes()).expect("send to Redis");
            let mut line = String::new();
            reader.read_line(&mut line).expect("a reply from Redis");
            line.trim_end().to_owned()
        };
        if let Some(password) = self.server.password() {
            let user = match self.server.username() {
                "" => "default",
                user => user,
            };
            assert_eq!(send(&["AUTH", user, password]), "+OK", "AUTH");
        }
        send(args)
    }
}

impl Drop for NoKeysUser {
    fn drop(&mut self) {
        let _ = self.command(&["ACL", "DELUSER", &self.name]);
    }
}

/// A store that opens and then fails part way (Redis refusing the bench user's writes)
/// ends the run with its name and a failure, and the report still has the cells measured
/// before it (memory's, listed first).
#[test]
fn a_store_failing_part_way_keeps_the_cells_measured_before() {
    let user = NoKeysUser::create(&idem_conformance::service_env("IDEM_REDIS_URL"));
    let refusing = user.url();
    let out = tempfile::tempdir().expect("temp dir");
    let dir = out.path().to_str().expect("utf-8 path");
    let run = common::idem(&[
        "bench",
        "-b",
        "memory:",
        "-b",
        &refusing,
        "--concurrency",
        "1",
        "--batch",
        "1,2",
        "--duration",
        "10ms",
        "--out",
        dir,
    ]);
    let (stdout, stderr) = common::text(&run);
    assert_eq!(run.status.code(), Some(1), "{stdout}\n{stderr}");
    let last = stderr.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("idem: redis: preparing replays: "),
        "{stderr}"
    );
    assert!(
        last.to_ascii_lowercase().contains("noperm"),
        "the server's refusal: {stderr}"
    );
    assert!(
        stderr.contains("[2/4] memory ×1 workers, batch 2"),
        "{stderr}"
    );
    assert!(!stderr.contains("[3/4]"), "{stderr}");
    assert!(
        stderr.contains("kept the cells measured before the failure"),
        "{stderr}"
    );
    assert!(!stderr.contains(&user.password), "{stderr}");

    let json = std::fs::read_to_string(out.path().join("bench.json")).expect("bench.json");
    let report: Value = serde_json::from_str(&json).expect("bench.json is JSON");
    let cells = report["cells"].as_array().expect("cells");
    let measured: Vec<(&str, u64)> = cells
        .iter()
        .map(|c| (c["backend"].as_str().unwrap(), c["batch"].as_u64().unwrap()))
        .collect();
    assert_eq!(measured, [("memory", 1), ("memory", 2)], "{json}");
    assert!(
        cells
            .iter()
            .all(|c| c["claim_complete"]["calls"].as_u64() > Some(0))
    );
    assert!(out.path().join("bench.md").exists() && out.path().join("bench.svg").exists());
}
