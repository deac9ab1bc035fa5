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
