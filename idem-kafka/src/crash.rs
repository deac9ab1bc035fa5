//! A simulated crash: the token every part of the consumer checks before it writes, and
//! the probe that may set it off.

use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::binding::Signal;

use crate::{Point, Probe, Verdict};

/// Set off when the process is to behave as if it died: nothing is stored or committed
/// after it.
pub(crate) struct Crash {
    token: Signal,
    /// Held while committing and while crashing, so no commit starts after a crash.
    gate: Mutex<()>,
    probe: Option<Arc<dyn Probe>>,
}

impl Crash {
    pub fn new(probe: Option<Arc<dyn Probe>>) -> Self {
        Crash {
            token: Signal::new(),
            gate: Mutex::new(()),
            probe,
        }
    }

    /// Behaves as if the process died now.
    pub fn crash(&self) {
        let _gate = self.gate();
        self.token.fire();
    }

    pub fn happened(&self) -> bool {
        self.token.is_fired()
    }

    /// Resolves once the crash happened.
    pub async fn happens(&self) {
        self.token.fired().await;
    }

    /// Held by a commit: no crash completes while it is held, and none starts after one.
    pub fn gate(&self) -> MutexGuard<'_, ()> {
        self.gate.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Crashes while the caller holds the gate.
    pub fn crash_holding_gate(&self) {
        self.token.fire();
    }

    pub fn probe(&self) -> Option<&Arc<dyn Probe>> {
        self.probe.as_ref()
    }

    /// Asks the probe, if any, about `point` for the message at `topic`/`partition`/
    /// `offset`; a crash verdict crashes the consumer. Says whether it did.
    pub fn at(&self, point: Point, topic: &str, partition: i32, offset: i64) -> bool {
        let Some(probe) = &self.probe else {
            return false;
        };
        if probe.reached(point, topic, partition, offset) != Verdict::Crash {
            return false;
        }
        if !self.happened() {
            tracing::info!(?point, topic, partition, offset, "probe: crash");
            self.crash();
        }
        true
    }
}
