//! The whole conformance suite on the in-memory backend, twice: as itself and as
//! `Arc<dyn Backend>`.

use std::sync::Arc;

use conformance::{Factory, Fixture};
use idem_core::clock::ManualClock;
use idem_core::{Backend, MemoryBackend, Timestamp};

fn fresh() -> (MemoryBackend, ManualClock) {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    (MemoryBackend::with_clock(clock.clone()), clock)
}

/// The backend as its own type.
struct Memory;

impl Factory for Memory {
    type Backend = MemoryBackend;
    async fn setup(&self) -> Fixture<MemoryBackend> {
        let (backend, clock) = fresh();
        Fixture::manual(backend, clock)
    }

    async fn setup_with_response_limit(&self, limit: usize) -> Option<Fixture<MemoryBackend>> {
        let (backend, clock) = fresh();
        Some(Fixture::manual(
            backend.with_max_response_bytes(limit),
            clock,
        ))
    }
}

/// The backend behind `Arc<dyn Backend>`, as a runtime-picked backend is used.
struct Dyn;

impl Factory for Dyn {
    type Backend = Arc<dyn Backend>;
    async fn setup(&self) -> Fixture<Arc<dyn Backend>> {
        let (backend, clock) = fresh();
        Fixture::manual(Arc::new(backend), clock)
    }
}

mod direct {
    conformance::suite!(super::Memory);
}

mod dynamic {
    conformance::suite!(super::Dyn);
}
