//! The client's context: its log and error callbacks, and the rebalance callback, which
//! starts a worker per assigned partition and stops those of revoked ones.

use std::sync::Arc;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, TopicPartitionList};

use super::{Shared, Tp};
use crate::client::log_to_tracing;

/// The rdkafka context: rebalance and commit callbacks.
pub(crate) struct LoopContext {
    pub(super) shared: Arc<Shared>,
}

impl ClientContext for LoopContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        // The one report of a failed asynchronous commit: librdkafka hands its result
        // only to a commit callback set in its configuration, which rdkafka does not set,
        // and logs it instead.
        if fac == "COMMITFAIL" {
            crate::metrics::commit_failed(&self.shared.settings().group);
        }
        log_to_tracing(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", %error, reason, "client error");
    }
}

impl ConsumerContext for LoopContext {
    /// Revoke: stop dispatching, wait for in-flight handlers, commit what is settled, then
    /// unassign. Assign: in transactional mode set the offsets stored in PostgreSQL, then
    /// assign and start a worker per partition; if the store did not answer, the
    /// partitions are held back (paused, their workers waiting) until it does.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let result = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                tracing::info!(partitions = %listed(tpl), "partitions assigned");
                let positioned = self.shared.seek_to_stored(tpl);
                let r = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if !self.shared.ctx.crash.happened() {
                    self.shared.assign(consumer, tpl, positioned);
                }
                r
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                let tps: Vec<Tp> = tpl
                    .elements()
                    .iter()
                    .map(|e| (Arc::from(e.topic()), e.partition()))
                    .collect();
                tracing::info!(partitions = %listed(tpl), "partitions revoked");
                self.shared.revoke(consumer, &tps);
                if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                }
            }
            other => {
                tracing::warn!(error = ?other, "rebalance error");
                let all = self.shared.all_partitions();
                self.shared.revoke(consumer, &all);
                if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                }
            }
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "assign or unassign failed");
        }
    }
}

/// `topic/partition` for each partition of `tpl`, comma-separated, for the log.
fn listed(tpl: &TopicPartitionList) -> String {
    let each: Vec<String> = tpl
        .elements()
        .iter()
        .map(|e| format!("{}/{}", e.topic(), e.partition()))
        .collect();
    each.join(",")
}
