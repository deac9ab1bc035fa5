//! The Redis backend against raw commands through the same client, at the same
//! concurrency, in one run: claim+complete against `SET NX PX` then `SET`, a replay
//! against `GET`, a batch of 128 claimed and settled (`claim_many` + `settle_many`)
//! against 128 pipelined `SET NX PX` then 128 pipelined `SET`, and batched claims against
//! unpipelined `SET`. Throughput is messages (or raw cycles) per second; after each case
//! the server's CPU time per message and each command's calls per message and time per
//! call (a script's nested commands are counted in its own time too, and so are the
//! commands an `EXEC` runs in its).
//!
//! `design_watch_multi` measures a design the backend does not use (issue 18): a complete
//! by `WATCH`/`GET`, a prefix check on the client, then `MULTI`/`SET`/`PUBLISH`/`EXEC`, on
//! a connection of each worker's own (watches are connection state), with the claim on
//! it too or (`design_watch_multi_claim_shared`) on the shared connection, as the backend
//! claims; `raw_set_nx_px_then_set_conns` is the raw cycle on such connections;
//! `design_watch_multi_128` is the same for a batch, against `claim_settle_many_128`.
//! Before it
//! runs, a takeover between the `GET` and the `EXEC` is checked to fail the `EXEC`.
//! On servers with compare-and-set, `SET … IFEQ` (Valkey 8.1, Redis 8.4), the backend's
//! single complete is one (`claim_complete` there); `design_ifeq` sends the same commands
//! by hand, and `design_ifeq_lean` drops the claim's `PEXPIRETIME` and the complete's
//! `PUBLISH` (`support/redis_ifeq.rs`). `design_replay_by_hand` sends a single claim's
//! commands by hand for a key that holds a record (a replay's wire cost without the
//! backend's code) and `design_replay_lean` only its `SET … NX PX … GET`. The
//! single-key cases also print the server's time per message summed over the top-level
//! calls, and a summary of them against the raw cycle at the end.
//!
//! `IDEM_REDIS_URL=redis://127.0.0.1:6379/ cargo bench -p benches --bench redis`
//! Without `IDEM_REDIS_URL` it prints one line and skips.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group};
use idem_core::backend::{Claim, ClaimOutcome, Settlement};
use idem_core::{Backend, Fingerprint, Key};
use idem_redis::{RedisBackend, RedisConfig};
use redis::aio::{ConnectionManager, MultiplexedConnection};

#[path = "support/redis_ifeq.rs"]
mod ifeq;

/// Tasks issuing requests at once, for the backend and the raw baselines alike.
const CONCURRENCY: u64 = 16;
/// Short, so that the keys a run creates do not pile up in the server.
const RETENTION: Duration = Duration::from_secs(60);
const LEASE: Duration = Duration::from_secs(30);

fn url() -> Option<String> {
    std::env::var("IDEM_REDIS_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
}

/// Fresh ids for every run and call.
struct Ids {
    run: String,
    next: AtomicU64,
}

impl Ids {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Ids {
            run: format!("bench-{nanos:x}"),
            next: AtomicU64::new(0),
        }
    }

    fn take(&self, n: u64) -> u64 {
        self.next.fetch_add(n, Ordering::Relaxed)
    }

    fn key(&self, id: u64) -> Key {
        Key::new(self.run.clone(), id.to_string()).expect("key")
    }

    fn raw(&self, id: u64) -> String {
        format!("raw:{}:{id}", self.run)
    }
}

fn claim(key: Key) -> Claim {
    Claim {
        key,
        owner: "bench".into(),
        lease_ttl: LEASE,
        fingerprint: Some(Fingerprint::of(b"payload")),
        max_attempts: 5,
        retention: RETENTION,
    }
}

/// Claims of the `n` keys numbered from `first`.
fn batch_claims(ids: &Ids, first: u64, n: u64) -> Vec<Claim> {
    (0..n).map(|j| claim(ids.key(first + j))).collect()
}

/// Messages (or raw cycles) done so far, for the server's cost per message.
static ELEMENTS: AtomicU64 = AtomicU64::new(0);

/// Runs `iters` calls of `op` (given the call's number, each worth `weight` messages) on
/// `CONCURRENCY` tasks that take the next number until `iters` are done; returns the wall
/// time.
async fn spread<F, Fut>(iters: u64, weight: u64, op: F) -> Duration
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (op, next) = (Arc::clone(&op), Arc::clone(&next));
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= iters {
                        break;
                    }
                    op(i).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    ELEMENTS.fetch_add(iters * weight, Ordering::Relaxed);
    start.elapsed()
}

/// As [`spread`], but each task owns one of `conns` (one per task) and passes it to every
/// call it makes: per-connection state (a `WATCH`) then belongs to one task at a time.
async fn spread_conns<C, F, Fut>(iters: u64, weight: u64, conns: Vec<C>, op: F) -> Duration
where
    C: Clone + Send + 'static,
    F: Fn(C, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    assert_eq!(conns.len() as u64, CONCURRENCY);
    let op = Arc::new(op);
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|conn| {
            let (op, next) = (Arc::clone(&op), Arc::clone(&next));
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= iters {
                        break;
                    }
                    op(conn.clone(), i).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    ELEMENTS.fetch_add(iters * weight, Ordering::Relaxed);
    start.elapsed()
}

/// What the server reports: per command `(calls, usec)`, and its CPU seconds so far; and
/// the messages done so far.
struct ServerStats {
    commands: HashMap<String, (u64, u64)>,
    cpu: f64,
    at: Instant,
    elements: u64,
}

async fn server_stats(raw: &mut ConnectionManager) -> ServerStats {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .arg("cpu")
        .query_async(raw)
        .await
        .expect("INFO");
    let mut commands = HashMap::new();
    let mut cpu = 0.0;
    for line in info.lines() {
        if let Some(rest) = line.strip_prefix("cmdstat_") {
            let (name, fields) = rest.split_once(':').unwrap_or((rest, ""));
            let field = |f: &str| {
                fields
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(f))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            commands.insert(name.to_owned(), (field("calls="), field("usec=")));
        } else if let Some(v) = line
            .strip_prefix("used_cpu_user:")
            .or_else(|| line.strip_prefix("used_cpu_sys:"))
        {
            cpu += v.trim().parse::<f64>().unwrap_or(0.0);
        }
    }
    ServerStats {
        commands,
        cpu,
        at: Instant::now(),
        elements: ELEMENTS.load(Ordering::Relaxed),
    }
}

/// Prints where the server's time went between two snapshots: its CPU use, its CPU time
/// per message, and per command the calls per message and the time per call (nested
/// script calls included, so a script's time also holds its commands').
fn print_server(name: &str, before: &ServerStats, after: &ServerStats) {
    let wall = after.at.duration_since(before.at).as_secs_f64();
    let elements = after.elements.saturating_sub(before.elements).max(1) as f64;
    let cpu = after.cpu - before.cpu;
    let mut line = format!(
        "  server during {name}: {:.0}% of a core, {:.2} us CPU/msg;",
        100.0 * cpu / wall,
        1e6 * cpu / elements
    );
    let mut rows: Vec<_> = after
        .commands
        .iter()
        .filter_map(|(cmd, (calls, usec))| {
            let (c0, u0) = before.commands.get(cmd).copied().unwrap_or((0, 0));
            let calls = calls.saturating_sub(c0);
            (calls > 1000 && cmd != "info").then(|| (cmd.clone(), calls, usec.saturating_sub(u0)))
        })
        .collect();
    if rows.is_empty() {
        return; // filtered out of this run
    }
    rows.sort();
    for (cmd, calls, usec) in rows {
        line.push_str(&format!(
            " {cmd} {:.3}/msg at {:.2} us,",
            calls as f64 / elements,
            usec as f64 / calls as f64
        ));
    }
    println!("{}", line.trim_end_matches(','));
}

/// Server time per message summed over the top-level calls, by case, for the summary.
static TOP_LEVEL: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());

/// Prints (and keeps for the summary) the server's time per message over the top-level
/// calls: every command's time, less the calls nested in a script or an `EXEC` (whose own
/// time holds theirs). `nested` gives, per command, how many of its calls per message are
/// nested; they are taken at the command's mean time per call (a `SET` that is both a
/// top-level claim and a nested write counts once at the mean of both).
fn print_top_level(name: &str, before: &ServerStats, after: &ServerStats, nested: &[(&str, f64)]) {
    let elements = after.elements.saturating_sub(before.elements);
    if elements == 0 {
        return; // filtered out of this run
    }
    let elements = elements as f64;
    let mut usec = 0.0;
    let mut parts = Vec::new();
    for (cmd, (calls, total)) in &after.commands {
        let (c0, u0) = before.commands.get(cmd).copied().unwrap_or((0, 0));
        let (calls, total) = (calls.saturating_sub(c0), total.saturating_sub(u0));
        if calls <= 1000 || cmd == "info" {
            continue;
        }
        let mean = total as f64 / calls as f64;
        let nested_per_msg = nested
            .iter()
            .find(|(n, _)| n == cmd)
            .map_or(0.0, |(_, n)| *n);
        let top_per_msg = calls as f64 / elements - nested_per_msg;
        if top_per_msg > 0.01 {
            usec += top_per_msg * mean;
            parts.push(format!("{cmd} {top_per_msg:.2} x {mean:.2}"));
        }
    }
    parts.sort();
    println!(
        "  top-level server time during {name}: {usec:.2} us/msg ({})",
        parts.join(" + ")
    );
    TOP_LEVEL
        .lock()
        .expect("lock")
        .push((name.to_owned(), usec));
}

/// `g.bench_function(name, f)`, then the server's side of it.
macro_rules! measured {
    ($g:expr, $stats:expr, $raw:expr, $name:expr, $f:expr) => {{
        let name = $name;
        let before = $stats($raw);
        $g.bench_function(name.clone(), $f);
        print_server(&name, &before, &$stats($raw));
    }};
    ($g:expr, $stats:expr, $raw:expr, $name:expr, nested = $nested:expr, $f:expr) => {{
        let name = $name;
        let before = $stats($raw);
        $g.bench_function(name.clone(), $f);
        let after = $stats($raw);
        print_server(&name, &before, &after);
        print_top_level(&name, &before, &after, &$nested);
    }};
}

/// The raw cycle a hand-written dedup pays per key: `SET key NX PX`, then `SET` of the
/// result, on `conn`.
async fn raw_cycle<C: redis::aio::ConnectionLike>(conn: &mut C, key: &str, px: u64) {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg("processing")
        .arg("NX")
        .arg("PX")
        .arg(px)
        .query_async(conn)
        .await
        .expect("SET NX PX");
    assert!(set.is_some(), "fresh key taken");
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("completed")
        .arg("PX")
        .arg(px)
        .query_async(conn)
        .await
        .expect("SET");
}

fn redis_benches(c: &mut Criterion) {
    let Some(url) = url() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let backend = rt
        .block_on(RedisBackend::connect(RedisConfig::new(&url)))
        .expect("connect the backend");
    let raw: ConnectionManager = rt
        .block_on(async {
            let client = redis::Client::open(url.as_str())?;
            ConnectionManager::new(client).await
        })
        .expect("connect the raw client");
    let ids = Arc::new(Ids::new());
    let response = Bytes::from_static(b"{\"status\":\"charged\",\"receipt\":\"r-000042\"}");
    let px = RETENTION.as_millis() as u64;

    let stats = |raw: &ConnectionManager| {
        let mut raw = raw.clone();
        rt.block_on(async move { server_stats(&mut raw).await })
    };
    // A server with compare-and-set completes with a plain `SET … IFEQ` and `PUBLISH`;
    // otherwise the settle function runs them, with an `MGET`, inside its own time.
    let cas = rt.block_on(ifeq::supported(&mut raw.clone()));
    let complete_nested: Vec<(&str, f64)> = if cas {
        Vec::new()
    } else {
        vec![("set", 1.0), ("mget", 1.0), ("publish", 1.0)]
    };
    let mut g = c.benchmark_group(format!("redis_c{CONCURRENCY}"));
    g.throughput(Throughput::Elements(1));

    measured!(
        g,
        stats,
        &raw,
        String::from("raw_set_nx_px_then_set"),
        nested = [],
        |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (raw, ids) = (raw.clone(), Arc::clone(&ids));
                let base = ids.take(iters);
                spread(iters, 1, move |i| {
                    let (mut raw, key) = (raw.clone(), ids.raw(base + i));
                    async move {
                        raw_cycle(&mut raw, &key, px).await;
                    }
                })
            })
        }
    );

    measured!(g, stats, &raw, String::from("raw_set"), |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (raw, ids) = (raw.clone(), Arc::clone(&ids));
            spread(iters, 1, move |i| {
                let (mut raw, key) = (raw.clone(), ids.raw(i % 10_000));
                async move {
                    let _: () = redis::cmd("SET")
                        .arg(&key)
                        .arg("v")
                        .query_async(&mut raw)
                        .await
                        .expect("SET");
                }
            })
        })
    });

    measured!(
        g,
        stats,
        &raw,
        String::from("claim_complete"),
        nested = complete_nested,
        |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (backend, ids, response) =
                    (backend.clone(), Arc::clone(&ids), response.clone());
                let base = ids.take(iters);
                spread(iters, 1, move |i| {
                    let (backend, c, response) =
                        (backend.clone(), claim(ids.key(base + i)), response.clone());
                    async move {
                        let ClaimOutcome::Acquired(lease) = backend.claim(&c).await.expect("claim")
                        else {
                            panic!("fresh key not acquired");
                        };
                        backend
                            .complete(&lease, response, RETENTION)
                            .await
                            .expect("complete");
                    }
                })
            })
        }
    );

    // The WATCH/MULTI design of a fenced complete (issue 18), on a connection per worker.
    let conns: Vec<MultiplexedConnection> = rt
        .block_on(async {
            let client = redis::Client::open(url.as_str())?;
            let mut conns = Vec::new();
            for _ in 0..CONCURRENCY {
                conns.push(client.get_multiplexed_async_connection().await?);
            }
            redis::RedisResult::Ok(conns)
        })
        .expect("connect one connection per worker");
    measured!(
        g,
        stats,
        &raw,
        String::from("raw_set_nx_px_then_set_conns"),
        nested = [],
        |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let ids = Arc::clone(&ids);
                let base = ids.take(iters);
                spread_conns(iters, 1, conns.clone(), move |mut conn, i| {
                    let key = ids.raw(base + i);
                    async move {
                        raw_cycle(&mut conn, &key, px).await;
                    }
                })
            })
        }
    );

    rt.block_on(watch_multi::fences(conns[0].clone(), raw.clone(), &ids));
    measured!(
        g,
        stats,
        &raw,
        String::from("design_watch_multi"),
        nested = [("set", 1.0), ("publish", 1.0)],
        |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (ids, response) = (Arc::clone(&ids), response.clone());
                let base = ids.take(iters);
                spread_conns(iters, 1, conns.clone(), move |mut conn, i| {
                    let (key, response) = (watch_multi::key(&ids, base + i), response.clone());
                    async move {
                        let fence = watch_multi::claim(&mut conn, &key).await;
                        let done =
                            watch_multi::complete(&mut conn, &key, &fence, &response, px).await;
                        assert!(done, "fresh lease fenced");
                    }
                })
            })
        }
    );
    // The same, with the claim on the shared connection (as the backend claims) and only
    // the complete on the worker's own: what a backend with a pool for completes would send.
    measured!(
        g,
        stats,
        &raw,
        String::from("design_watch_multi_claim_shared"),
        nested = [("set", 1.0), ("publish", 1.0)],
        |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (ids, response, raw) = (Arc::clone(&ids), response.clone(), raw.clone());
                let base = ids.take(iters);
                spread_conns(iters, 1, conns.clone(), move |mut conn, i| {
                    let (key, response, mut raw) = (
                        watch_multi::key(&ids, base + i),
                        response.clone(),
                        raw.clone(),
                    );
                    async move {
                        let fence = watch_multi::claim(&mut raw, &key).await;
                        let done =
                            watch_multi::complete(&mut conn, &key, &fence, &response, px).await;
                        assert!(done, "fresh lease fenced");
                    }
                })
            })
        }
    );
    let retries = watch_multi::RETRIES.load(Ordering::Relaxed);
    if retries > 0 {
        println!("  design_watch_multi: {retries} EXEC retries (a nil EXEC, record unchanged)");
    }

    // The compare-and-set design (issue 18), on servers that have `SET … IFEQ`: the
    // backend's fresh claim and a complete by `SET … IFEQ … KEEPTTL`, all on the shared
    // connection as the raw cycle runs; `_lean` also drops the claim's `PEXPIRETIME` and
    // the complete's `PUBLISH`, two commands as the raw cycle sends.
    if cas {
        rt.block_on(ifeq::fences(
            &mut raw.clone(),
            &watch_multi::key(&ids, ids.take(1)),
        ));
        for (name, full) in [("design_ifeq", true), ("design_ifeq_lean", false)] {
            measured!(g, stats, &raw, String::from(name), nested = [], |b| {
                b.to_async(&rt).iter_custom(|iters| {
                    let (raw, ids, response) = (raw.clone(), Arc::clone(&ids), response.clone());
                    let base = ids.take(iters);
                    spread(iters, 1, move |i| {
                        let (mut raw, key, response) = (
                            raw.clone(),
                            watch_multi::key(&ids, base + i),
                            response.clone(),
                        );
                        async move {
                            let held = watch_multi::claim_record(&mut raw, &key, full).await;
                            let done = ifeq::complete(&mut raw, &key, &held, &response, full).await;
                            assert!(done, "fresh lease fenced");
                        }
                    })
                })
            });
        }
    } else {
        println!("  design_ifeq skipped: this server has no SET ... IFEQ (Valkey 8.1, Redis 8.4)");
    }

    let done = claim(ids.key(ids.take(1)));
    rt.block_on(async {
        let ClaimOutcome::Acquired(lease) = backend.claim(&done).await.expect("claim") else {
            panic!("fresh key not acquired");
        };
        backend
            .complete(&lease, response.clone(), Duration::from_secs(3600))
            .await
            .expect("complete");
    });
    let stored = ids.raw(u64::MAX);
    rt.block_on(async {
        let mut raw = raw.clone();
        let _: () = redis::cmd("SET")
            .arg(&stored)
            .arg(&response[..])
            .arg("PX")
            .arg(px)
            .query_async(&mut raw)
            .await
            .expect("SET");
    });
    measured!(g, stats, &raw, String::from("raw_get"), |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (raw, stored) = (raw.clone(), stored.clone());
            spread(iters, 1, move |_| {
                let (mut raw, stored) = (raw.clone(), stored.clone());
                async move {
                    let got: Option<Vec<u8>> = redis::cmd("GET")
                        .arg(&stored)
                        .query_async(&mut raw)
                        .await
                        .expect("GET");
                    assert!(got.is_some());
                }
            })
        })
    });

    measured!(g, stats, &raw, String::from("replay"), |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (backend, done) = (backend.clone(), done.clone());
            spread(iters, 1, move |_| {
                let (backend, done) = (backend.clone(), done.clone());
                async move {
                    let answer = backend.claim(&done).await.expect("claim");
                    assert!(matches!(answer, ClaimOutcome::Completed(_)));
                }
            })
        })
    });

    // The replay's wire cost without idem's client code (issue 18): the commands a single
    // claim sends, by hand on the raw connection, for a key that holds a record; `_lean`
    // drops the `PEXPIRETIME`, the one-command claim a replay could at best be. A replay
    // below 0.9× a `GET` even here is bound by its commands, not by the backend's code.
    for (name, expire) in [
        ("design_replay_by_hand", true),
        ("design_replay_lean", false),
    ] {
        measured!(g, stats, &raw, String::from(name), |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (raw, stored) = (raw.clone(), stored.clone());
                spread(iters, 1, move |_| {
                    let (mut raw, stored) = (raw.clone(), stored.clone());
                    async move {
                        let found = watch_multi::claim_found(&mut raw, &stored, expire).await;
                        assert!(found.is_some(), "the stored key has a record");
                    }
                })
            })
        });
    }

    // Each element is one race: CONCURRENCY claims of one fresh key at once, one wins.
    measured!(g, stats, &raw, String::from("contention_one_key"), |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (backend, ids) = (backend.clone(), Arc::clone(&ids));
            let base = ids.take(iters);
            async move {
                let start = Instant::now();
                for i in 0..iters {
                    let key = ids.key(base + i);
                    let racers = (0..CONCURRENCY).map(|_| {
                        let (backend, c) = (backend.clone(), claim(key.clone()));
                        tokio::spawn(async move { backend.claim(&c).await })
                    });
                    let mut won = 0;
                    for r in racers.collect::<Vec<_>>() {
                        if let ClaimOutcome::Acquired(_) = r.await.expect("task").expect("claim") {
                            won += 1;
                        }
                    }
                    assert_eq!(won, 1);
                }
                ELEMENTS.fetch_add(iters, Ordering::Relaxed);
                start.elapsed()
            }
        })
    });

    const BATCH: u64 = 128;
    g.throughput(Throughput::Elements(BATCH));
    measured!(g, stats, &raw, format!("raw_pipelined_{BATCH}"), |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (raw, ids) = (raw.clone(), Arc::clone(&ids));
            let base = ids.take(iters * BATCH);
            spread(iters, BATCH, move |i| {
                let keys: Vec<String> = (0..BATCH).map(|j| ids.raw(base + i * BATCH + j)).collect();
                let mut raw = raw.clone();
                async move {
                    let mut claim = redis::pipe();
                    for key in &keys {
                        claim
                            .cmd("SET")
                            .arg(key)
                            .arg("processing")
                            .arg("NX")
                            .arg("PX")
                            .arg(px);
                    }
                    let set: Vec<Option<String>> =
                        claim.query_async(&mut raw).await.expect("SET NX PX");
                    assert!(set.iter().all(Option::is_some), "fresh keys taken");
                    let mut done = redis::pipe();
                    for key in &keys {
                        done.cmd("SET")
                            .arg(key)
                            .arg("completed")
                            .arg("PX")
                            .arg(px)
                            .ignore();
                    }
                    let _: () = done.query_async(&mut raw).await.expect("SET");
                }
            })
        })
    });

    measured!(g, stats, &raw, format!("claim_settle_many_{BATCH}"), |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (backend, ids, response) = (backend.clone(), Arc::clone(&ids), response.clone());
            let base = ids.take(iters * BATCH);
            spread(iters, BATCH, move |i| {
                let claims = batch_claims(&ids, base + i * BATCH, BATCH);
                let (backend, response) = (backend.clone(), response.clone());
                async move {
                    let answers = backend.claim_many(&claims).await.expect("claim_many");
                    let items: Vec<Settlement> = answers
                        .into_iter()
                        .map(|a| match a {
                            ClaimOutcome::Acquired(lease) => {
                                Settlement::complete(lease, response.clone())
                            }
                            other => panic!("fresh key not acquired: {other:?}"),
                        })
                        .collect();
                    let done = backend
                        .settle_many(&items, RETENTION)
                        .await
                        .expect("settle_many");
                    assert!(done.iter().all(Result::is_ok));
                }
            })
        })
    });

    // The WATCH/MULTI design for a batch: the claims as the backend sends them, then on
    // the worker's own connection `WATCH` + `MGET` of the batch, the prefix checks on the
    // client, and `MULTI`, a `SET … KEEPTTL` a key, one `PUBLISH`, `EXEC`.
    measured!(g, stats, &raw, format!("design_watch_multi_{BATCH}"), |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (backend, ids, response) = (backend.clone(), Arc::clone(&ids), response.clone());
            let base = ids.take(iters * BATCH);
            spread_conns(iters, BATCH, conns.clone(), move |mut conn, i| {
                let claims = batch_claims(&ids, base + i * BATCH, BATCH);
                let (backend, response) = (backend.clone(), response.clone());
                async move {
                    let answers = backend.claim_many(&claims).await.expect("claim_many");
                    assert!(
                        answers
                            .iter()
                            .all(|a| matches!(a, ClaimOutcome::Acquired(_)))
                    );
                    let keys: Vec<String> =
                        claims.iter().map(|c| backend.record_key(&c.key)).collect();
                    let done = watch_multi::complete_batch(&mut conn, &keys, &response).await;
                    assert_eq!(done, keys.len(), "fresh leases fenced");
                }
            })
        })
    });

    for batch in [1u64, 16, 128] {
        g.throughput(Throughput::Elements(batch));
        measured!(g, stats, &raw, format!("claim_many_{batch}"), |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (backend, ids) = (backend.clone(), Arc::clone(&ids));
                let base = ids.take(iters * batch);
                spread(iters, batch, move |i| {
                    let claims = batch_claims(&ids, base + i * batch, batch);
                    let backend = backend.clone();
                    async move {
                        let answers = backend.claim_many(&claims).await.expect("claim_many");
                        assert!(matches!(answers[0], ClaimOutcome::Acquired(_)));
                    }
                })
            })
        });
    }
    g.finish();

    let top = TOP_LEVEL.lock().expect("lock");
    if let Some((_, raw_usec)) = top.iter().find(|(n, _)| n == "raw_set_nx_px_then_set") {
        for (name, usec) in top.iter() {
            println!(
                "top-level server time per message, {name}: {usec:.2} us, {:.2}x the raw cycle's",
                usec / raw_usec
            );
        }
    }
}

/// The `WATCH`/`MULTI` design of a fenced complete, for measuring only (the backend
/// completes with the settle function). Claim is the backend's fast path: `SET <fresh
/// record> NX PX … GET` and `PEXPIRETIME` in one round trip. Complete is two round trips
/// on the worker's own connection: `WATCH key` + `GET key`; the client checks the fencing
/// prefix and builds the completed record; then `MULTI`, `SET key <record> PX
/// <retention>`, `PUBLISH <prefix>settled key`, `EXEC`. A nil `EXEC` means the record
/// changed after the `GET`: read again (a takeover then fails the prefix check).
mod watch_multi {
    use std::sync::atomic::{AtomicU64, Ordering};

    use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};

    use super::{Ids, LEASE, RETENTION};

    const OWNER: &str = "bench";
    pub(super) const CHANNEL: &str = "idem:settled";

    /// `EXEC`s that came back nil.
    pub(super) static RETRIES: AtomicU64 = AtomicU64::new(0);

    pub(super) fn key(ids: &Ids, id: u64) -> String {
        let ns = format!("wm-{}", ids.run);
        format!("idem:{{{}:{ns}:{id}}}", ns.len())
    }

    /// `P<token>:<owner length>:<owner>`.
    pub(super) fn fence(token: u64) -> Vec<u8> {
        format!("P{token}:{}:{OWNER}", OWNER.len()).into_bytes()
    }

    /// The record a fresh claim writes: token 1, a fingerprint, attempts 1, the retention.
    fn fresh(retention_ms: u64) -> Vec<u8> {
        let mut out = fence(1);
        out.push(b'#');
        out.extend_from_slice(&idem_core::Fingerprint::of(b"payload").0);
        out.extend_from_slice(format!("1:{retention_ms};").as_bytes());
        out
    }

    /// The completed record for `value` if it starts with `fence`: `C`, the part up to
    /// `;` (token, owner, fingerprint, attempts, retention), then the response. `None`
    /// when fenced.
    pub(super) fn completed(value: &[u8], fence: &[u8], response: &[u8]) -> Option<Vec<u8>> {
        if !value.starts_with(fence) {
            return None;
        }
        let at = match value.get(fence.len()) {
            Some(b'-') => fence.len() + 1,
            Some(b'#') => fence.len() + 33,
            _ => panic!("corrupt record: bad fingerprint"),
        };
        let semi = at
            + value[at..]
                .iter()
                .position(|&b| b == b';')
                .expect("corrupt record: no ';'");
        let mut out = Vec::with_capacity(semi + 1 + response.len());
        out.push(b'C');
        out.extend_from_slice(&value[1..=semi]);
        out.extend_from_slice(response);
        Some(out)
    }

    /// A claim of a fresh key; the lease's fencing prefix.
    pub(super) async fn claim(conn: &mut impl ConnectionLike, key: &str) -> Vec<u8> {
        claim_record(conn, key, true).await;
        fence(1)
    }

    /// A claim of a fresh key, with the key's `PEXPIRETIME` in the same round trip (as the
    /// backend's single claim) if `expire`; the record it wrote.
    pub(super) async fn claim_record(
        conn: &mut impl ConnectionLike,
        key: &str,
        expire: bool,
    ) -> Vec<u8> {
        let (record, found) = claim_sent(conn, key, expire).await;
        assert!(found.is_none(), "fresh key taken");
        record
    }

    /// The same commands for a key that may hold a record: what `SET … GET` found there.
    pub(super) async fn claim_found(
        conn: &mut impl ConnectionLike,
        key: &str,
        expire: bool,
    ) -> Option<Vec<u8>> {
        claim_sent(conn, key, expire).await.1
    }

    /// The claim's commands: the record it sent, and what the key held.
    async fn claim_sent(
        conn: &mut impl ConnectionLike,
        key: &str,
        expire: bool,
    ) -> (Vec<u8>, Option<Vec<u8>>) {
        let retention = RETENTION.as_millis() as u64;
        let record = fresh(retention);
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(key)
            .arg(&record)
            .arg("NX")
            .arg("PX")
            .arg(LEASE.as_millis() as u64 + retention - 1)
            .arg("GET");
        let found = if expire {
            pipe.cmd("PEXPIRETIME").arg(key);
            let (found, at): (Option<Vec<u8>>, i64) =
                pipe.query_async(conn).await.expect("SET NX PX GET");
            assert!(at > 0, "no expiry");
            found
        } else {
            let (found,): (Option<Vec<u8>>,) = pipe.query_async(conn).await.expect("SET NX PX GET");
            found
        };
        (record, found)
    }

    /// Round trip one: `WATCH key`, `GET key`.
    async fn watch_get(conn: &mut MultiplexedConnection, key: &str) -> Option<Vec<u8>> {
        let (value,): (Option<Vec<u8>>,) = redis::pipe()
            .cmd("WATCH")
            .arg(key)
            .ignore()
            .cmd("GET")
            .arg(key)
            .query_async(conn)
            .await
            .expect("WATCH, GET");
        value
    }

    /// Round trip two: `MULTI`, `SET`, `PUBLISH`, `EXEC`; false if `EXEC` was refused.
    async fn write(conn: &mut MultiplexedConnection, key: &str, record: &[u8], px: u64) -> bool {
        let done: Option<(redis::Value, redis::Value)> = redis::pipe()
            .atomic()
            .cmd("SET")
            .arg(key)
            .arg(record)
            .arg("PX")
            .arg(px)
            .cmd("PUBLISH")
            .arg(CHANNEL)
            .arg(key)
            .query_async(conn)
            .await
            .expect("MULTI, SET, PUBLISH, EXEC");
        done.is_some()
    }

    /// The complete: true if done, false if fenced.
    pub(super) async fn complete(
        conn: &mut MultiplexedConnection,
        key: &str,
        fence: &[u8],
        response: &[u8],
        px: u64,
    ) -> bool {
        loop {
            let record = watch_get(conn, key)
                .await
                .and_then(|v| completed(&v, fence, response));
            let Some(record) = record else {
                // Fenced: drop the watch, or it would fail this connection's next EXEC.
                let _: () = redis::cmd("UNWATCH")
                    .query_async(conn)
                    .await
                    .expect("UNWATCH");
                return false;
            };
            if write(conn, key, &record, px).await {
                return true;
            }
            RETRIES.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A batch of fresh first claims (token 1, owner `bench`) completed in two round trips:
    /// `WATCH` and `MGET` of every key, then `MULTI`, `SET … KEEPTTL` of each record that
    /// still carries the lease's prefix, one `PUBLISH` of those keys, `EXEC`; read again
    /// after a nil `EXEC`. How many were done.
    pub(super) async fn complete_batch(
        conn: &mut MultiplexedConnection,
        keys: &[String],
        response: &[u8],
    ) -> usize {
        let fence = fence(1);
        loop {
            let (values,): (Vec<Option<Vec<u8>>>,) = redis::pipe()
                .cmd("WATCH")
                .arg(keys)
                .ignore()
                .cmd("MGET")
                .arg(keys)
                .query_async(conn)
                .await
                .expect("WATCH, MGET");
            let mut write = redis::pipe();
            write.atomic();
            let mut done = Vec::with_capacity(keys.len());
            for (key, value) in keys.iter().zip(&values) {
                let record = value
                    .as_deref()
                    .and_then(|v| completed(v, &fence, response));
                if let Some(record) = record {
                    write
                        .cmd("SET")
                        .arg(key)
                        .arg(record)
                        .arg("KEEPTTL")
                        .ignore();
                    done.push(key.as_str());
                }
            }
            write.cmd("PUBLISH").arg(CHANNEL).arg(done.join("\0"));
            let exec: Option<(i64,)> = write
                .query_async(conn)
                .await
                .expect("MULTI, SET, PUBLISH, EXEC");
            if exec.is_some() {
                return done.len();
            }
            RETRIES.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The contract, checked once before measuring: a takeover between the `GET` and the
    /// `EXEC` fails the `EXEC`, so the stale complete never lands, and the retry answers
    /// fenced; the holder's own complete lands.
    pub(super) async fn fences(
        mut conn: MultiplexedConnection,
        mut other: ConnectionManager,
        ids: &Ids,
    ) {
        let px = RETENTION.as_millis() as u64;
        let key = key(ids, ids.take(1));
        let lease = claim(&mut conn, &key).await;
        let value = watch_get(&mut conn, &key).await.expect("claimed");
        let stale = completed(&value, &lease, b"stale").expect("held");
        // Another worker takes the lapsed lease over: token 2, same owner.
        let mut taken = b"P2".to_vec();
        taken.extend_from_slice(&value[2..]);
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(&taken)
            .arg("KEEPTTL")
            .query_async(&mut other)
            .await
            .expect("takeover");
        assert!(
            !write(&mut conn, &key, &stale, px).await,
            "EXEC not refused"
        );
        let now: Vec<u8> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut other)
            .await
            .expect("GET");
        assert_eq!(now, taken, "the stale complete landed");
        assert!(!complete(&mut conn, &key, &lease, b"stale", px).await);
        assert!(complete(&mut conn, &key, &fence(2), b"ok", px).await);
        let now: Vec<u8> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut other)
            .await
            .expect("GET");
        assert!(now.starts_with(b"C2:5:bench#") && now.ends_with(b";ok"));
        RETRIES.store(0, Ordering::Relaxed);
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    targets = redis_benches
}

fn main() {
    if url().is_none() {
        println!(
            "redis bench skipped: IDEM_REDIS_URL is not set (eval \"$(scripts/services up redis)\")"
        );
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
