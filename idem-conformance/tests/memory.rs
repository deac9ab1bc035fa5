//! The whole conformance suite on the in-memory backend, three times: as itself, as
//! `Arc<dyn Backend>`, and wrapped in every layer (chaos with its faults off, timeout,
//! retry, observe), which must change no answer.

use std::sync::Arc;

use idem_conformance::{Factory, Fixture, in_every_layer};
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

/// The backend in every layer (`idem_conformance::in_every_layer`).
struct Layers;

impl Factory for Layers {
    type Backend = Arc<dyn Backend>;
    async fn setup(&self) -> Fixture<Arc<dyn Backend>> {
        let (backend, clock) = fresh();
        Fixture::manual(in_every_layer(backend), clock)
    }

    async fn setup_with_response_limit(&self, limit: usize) -> Option<Fixture<Arc<dyn Backend>>> {
        let (backend, clock) = fresh();
        Some(Fixture::manual(
            in_every_layer(backend.with_max_response_bytes(limit)),
            clock,
        ))
    }
}

mod layers {
    idem_conformance::suite!(super::Layers);
}

mod direct {
    idem_conformance::suite!(super::Memory);
}

mod dynamic {
    idem_conformance::suite!(super::Dyn);
}
