//! A handler that panics is a retryable failure, whether it panics inside its future or
//! in the call that makes the future (a `|ctx| { ..unwrap()..; async move {..} }` handler).

use std::future::Ready;
use std::sync::Arc;

use idem_core::{Bytes, Context, Engine, HandlerError, Key, MemoryBackend, Outcome};

fn panics_before_its_future(_: Context) -> Ready<Result<Bytes, HandlerError>> {
    panic!("before the future")
}

async fn panics_in_its_future(_: Context) -> Result<Bytes, HandlerError> {
    panic!("inside the future")
}

#[tokio::test]
async fn a_panic_anywhere_in_the_handler_is_a_retryable_failure() {
    let engine = Engine::builder(Arc::new(MemoryBackend::new()))
        .max_attempts(3)
        .build()
        .expect("engine");
    let key = Key::new("t", "k").expect("key");

    let first = engine.execute(&key, b"p", panics_before_its_future).await;
    match first.expect("first attempt") {
        Outcome::Failed { attempts: 1, error } => {
            assert_eq!(error, "handler panicked: before the future")
        }
        other => panic!("expected a failed first attempt, got {other:?}"),
    }
    let second = engine.execute(&key, b"p", panics_in_its_future).await;
    match second.expect("second attempt") {
        Outcome::Failed { attempts: 2, error } => {
            assert_eq!(error, "handler panicked: inside the future")
        }
        other => panic!("expected a failed second attempt, got {other:?}"),
    }
    let third = engine
        .execute(&key, b"p", |_| async { Ok(Bytes::from_static(b"done")) })
        .await;
    assert_eq!(
        third.expect("third attempt"),
        Outcome::Executed(Bytes::from_static(b"done"))
    );
}
