//! Dead letters: the headers idem adds and the reasons it gives; [`write`] sends them,
//! [`read`] reads them back.

pub(crate) mod read;
pub(crate) mod write;

pub use idem_core::binding::{
    HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_NAMESPACE, HEADER_REASON, Reason,
};

/// Header naming the topic the dead letter came from.
pub const HEADER_TOPIC: &str = "idem-original-topic";
/// Header with the original partition, in decimal.
pub const HEADER_PARTITION: &str = "idem-original-partition";
/// Header with the original offset, in decimal.
pub const HEADER_OFFSET: &str = "idem-original-offset";
/// Header of a letter that carries only idem's headers: the whole letter was over the
/// dead-letter producer's size limit (`message.max.bytes`), so the original payload, key
/// and headers were left out. Its value says what was dropped, and where the original
/// stays while its topic retains it. Such a letter cannot be replayed.
pub const HEADER_DROPPED: &str = "idem-dropped";
/// Header a replayed message carries: the dead letter it came from,
/// `<dead-letter topic>/<partition>/<offset>`.
pub const HEADER_REPLAY_OF: &str = "idem-replay-of";

/// The headers idem adds to a dead letter (and takes off again when it replays one).
pub const DEAD_LETTER_HEADERS: &[&str] = &[
    HEADER_TOPIC,
    HEADER_PARTITION,
    HEADER_OFFSET,
    HEADER_KEY,
    HEADER_NAMESPACE,
    HEADER_REASON,
    HEADER_ERROR,
    HEADER_ATTEMPTS,
    HEADER_DROPPED,
    HEADER_REPLAY_OF,
];
