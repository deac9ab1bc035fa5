//! `idem bench` writes a report with real numbers: every workload ran, on memory, a real
//! Redis (IDEM_REDIS_URL), a real PostgreSQL (IDEM_POSTGRES_URL) and DynamoDB Local
//! (IDEM_DYNAMO_ENDPOINT), and the ratios are those of the numbers.

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
    assert!(
        table.contains("claim+complete keys/s") && table.contains("÷ raw"),
        "{table}"
    );
    assert!(
        table.contains("postgres: INSERT … ON CONFLICT DO NOTHING"),
        "{table}"
    );
    assert!(table.contains("redis: SET NX PX"), "{table}");
    assert!(table.contains("dynamodb: conditional PutItem"), "{table}");

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
        for work in ["raw", "claim_complete", "replay"] {
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
        let claim = cell["claim_complete"]["keys_per_sec"].as_f64().unwrap();
        let ratio = cell["claim_complete_vs_raw"].as_f64().unwrap();
        assert!((ratio - claim / raw).abs() < 1e-9, "{cell}");
        if backend != "memory" {
            // A round trip to a server takes longer than a map insert in memory.
            assert!(cell["raw"]["p50_us"].as_u64().unwrap() > 10, "{cell}");
        }
    }

    let svg = std::fs::read_to_string(out.path().join("bench.svg")).expect("bench.svg");
    assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
    for label in [
        "batch 1 (claim)",
        "batch 8 (claim_many)",
        "memory idem",
        "redis raw",
        "postgres idem",
        "dynamodb raw",
        "conditional PutItem",
        "1 = as fast as raw",
        "concurrent workers",
    ] {
        assert!(svg.contains(label), "plot lacks {label}");
    }
}
