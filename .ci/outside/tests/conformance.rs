//! The published conformance suite on this crate's own backend, as a backend in another
//! repository runs it.

use idem_conformance::{Factory, Fixture};
use idem_once::Timestamp;
use idem_once::clock::ManualClock;
use idem_outside::MapBackend;

struct Map;

impl Factory for Map {
    type Backend = MapBackend;
    async fn setup(&self) -> Fixture<MapBackend> {
        let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
        Fixture::manual(MapBackend::new(clock.clone()), clock)
    }
}

idem_conformance::suite!(Map);
