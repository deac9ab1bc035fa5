//! Running one workload with N concurrent workers for a while, and what came of it.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::sync::Barrier;

use crate::error::{Error, Result};

/// Throughput and latency of one workload.
#[derive(Clone, Debug, Serialize)]
pub struct Measure {
    /// Keys handled (a call handles `batch` keys).
    pub keys: u64,
    /// Calls made.
    pub calls: u64,
    /// Wall time from the start signal to the last worker's end.
    pub seconds: f64,
    /// `keys / seconds`.
    pub keys_per_sec: f64,
    /// Median latency of one call, microseconds.
    pub p50_us: u64,
    /// 99th percentile latency of one call, microseconds.
    pub p99_us: u64,
}

fn histogram() -> Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, 600_000_000, 3)
        .map_err(|e| Error::Refused(format!("latency histogram: {e}")))
}

/// Runs `op` in `workers` tasks for `duration`. Each worker makes one call first that is
/// not counted (it opens connections and warms caches), then all start together. `op`
/// returns how many keys the call handled. The first error stops every worker.
pub async fn run<F, Fut>(workers: u32, duration: Duration, op: F) -> Result<Measure>
where
    F: Fn(u32) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = Result<u64>> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(workers as usize));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::with_capacity(workers as usize);
    for w in 0..workers {
        let (op, barrier, stop) = (op.clone(), Arc::clone(&barrier), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let warm = op(w).await;
            barrier.wait().await;
            if let Err(e) = warm {
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
            let mut hist = histogram()?;
            let (mut keys, mut calls) = (0u64, 0u64);
            let start = Instant::now();
            let deadline = start + idem_core::clock::capped(duration);
            loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let t0 = Instant::now();
                match op(w).await {
                    Ok(n) => keys += n,
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        return Err(e);
                    }
                }
                let end = Instant::now();
                hist.saturating_record(micros(end - t0));
                calls += 1;
                if end >= deadline {
                    break;
                }
                // Stores that answer without awaiting (memory) would otherwise keep the
                // thread, and the other workers would run only after this one's deadline.
                tokio::task::yield_now().await;
            }
            Ok((hist, keys, calls, start, Instant::now()))
        }));
    }
    let mut total = histogram()?;
    let (mut keys, mut calls) = (0, 0);
    let (mut first, mut last): (Option<Instant>, Option<Instant>) = (None, None);
    let mut failure = None;
    for task in tasks {
        let joined = task
            .await
            .map_err(|e| Error::Refused(format!("bench worker died: {e}")));
        match joined.and_then(|r| r) {
            Ok((hist, k, c, start, end)) => {
                total
                    .add(&hist)
                    .map_err(|e| Error::Refused(format!("latency histogram: {e}")))?;
                keys += k;
                calls += c;
                first = Some(first.map_or(start, |f| f.min(start)));
                last = Some(last.map_or(end, |l| l.max(end)));
            }
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    let seconds = match (first, last) {
        (Some(f), Some(l)) => (l - f).as_secs_f64(),
        _ => 0.0,
    };
    Ok(Measure {
        keys,
        calls,
        seconds,
        keys_per_sec: if seconds > 0.0 {
            keys as f64 / seconds
        } else {
            0.0
        },
        p50_us: total.value_at_quantile(0.50),
        p99_us: total.value_at_quantile(0.99),
    })
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn counts_keys_and_latency() {
        let m = run(4, Duration::from_millis(100), |_| async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(3)
        })
        .await
        .unwrap();
        assert_eq!(m.keys, m.calls * 3);
        assert!(m.calls >= 4, "{m:?}");
        assert!(m.p50_us >= 2000 && m.p99_us >= m.p50_us, "{m:?}");
        assert!(m.seconds >= 0.1, "{m:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_first_error_stops_the_run() {
        let res = run(3, Duration::from_secs(30), |w| async move {
            if w == 1 {
                Err(Error::Refused("boom".into()))
            } else {
                Ok(1)
            }
        })
        .await;
        assert!(matches!(res, Err(Error::Refused(m)) if m == "boom"));
    }
}
