//! Running a batch as concurrent single writes while keeping each key's items in order.

use std::future::Future;
use std::hash::Hash;

use futures::{StreamExt, TryStreamExt, stream};
use idem_core::backend::group_by;
use idem_core::{Error, Result};

/// `run` on every item, answers in batch order. At most `parallel` calls are in flight;
/// the items of one key run one after another in batch order, each after the previous one
/// answered, so that each sees the state the earlier left. The first error fails the whole
/// call (calls already made keep their effect).
pub(crate) async fn in_key_order<'a, T, K, A, Fut>(
    items: &'a [T],
    key: impl Fn(&T) -> &K,
    parallel: usize,
    run: impl Fn(&'a T) -> Fut,
) -> Result<Vec<A>>
where
    K: Eq + Hash,
    Fut: Future<Output = Result<A>>,
{
    let run = &run;
    let groups = group_by(0..items.len(), |&i| key(&items[i]));
    let answered: Vec<Vec<(usize, A)>> = stream::iter(groups)
        .map(|group| async move {
            let mut out = Vec::with_capacity(group.len());
            for i in group {
                out.push((i, run(&items[i]).await?));
            }
            Ok::<_, Error>(out)
        })
        .buffer_unordered(parallel.max(1))
        .try_collect()
        .await?;
    let mut out: Vec<Option<A>> = std::iter::repeat_with(|| None).take(items.len()).collect();
    for (i, answer) in answered.into_iter().flatten() {
        out[i] = Some(answer);
    }
    Ok(out.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn a_key_runs_in_order_and_answers_keep_positions() {
        let items = [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("c", 5)];
        let seen = Mutex::new(Vec::new());
        let out = in_key_order(
            &items,
            |(k, _)| k,
            2,
            |&(k, n)| {
                let seen = &seen;
                async move {
                    tokio::task::yield_now().await;
                    seen.lock().expect("lock").push((k, n));
                    Ok(n * 10)
                }
            },
        )
        .await
        .expect("no error");
        assert_eq!(out, [10, 20, 30, 40, 50]);
        let order: Vec<i32> = seen
            .into_inner()
            .expect("lock")
            .into_iter()
            .filter(|(k, _)| *k == "a")
            .map(|(_, n)| n)
            .collect();
        assert_eq!(order, [1, 3, 4]);
    }

    #[tokio::test]
    async fn at_most_parallel_calls_are_in_flight() {
        let items: Vec<usize> = (0..40).collect();
        let (now, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        in_key_order(
            &items,
            |i| i,
            3,
            |_| {
                let (now, most) = (&now, &most);
                async move {
                    let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(n, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    now.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                }
            },
        )
        .await
        .expect("no error");
        assert_eq!(most.into_inner(), 3);
    }

    #[tokio::test]
    async fn an_error_fails_the_batch() {
        let items = ["a", "b", "c"];
        let out = in_key_order(
            &items,
            |s| s,
            16,
            |&s| async move {
                if s == "b" {
                    Err(Error::config("boom"))
                } else {
                    Ok(())
                }
            },
        )
        .await;
        assert!(matches!(out, Err(Error::Config { .. })), "{out:?}");
    }
}
