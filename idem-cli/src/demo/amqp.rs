//! `idem demo --broker amqp://…`: the same story on a real RabbitMQ. Two queues of the
//! run's own get the same payment events. The naive consumer acks every so many messages
//! (one `basic.ack` with `multiple`), and crashes between a charge and its next ack: the
//! server delivers the unacked messages again and they are charged again. The idem
//! consumer (idem-rabbitmq over the backend of `--backend`) crashes after a charge is
//! recorded and before its ack: the redelivered messages are answered from the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use idem_core::{Backend, Bytes, Engine, HandlerError};
use idem_once::rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem_once::rabbitmq::lapin::types::{AMQPValue, FieldTable, LongString};
use idem_once::rabbitmq::lapin::{BasicProperties, Connection, ConnectionProperties};
use idem_once::rabbitmq::{IdemConsumer, Message, Point, Probe, Verdict};
use tokio::sync::Notify;

use super::naive::STALL;
use super::plan::{Ledger, Plan, parse};
use crate::error::{Error, Result};

fn refused(what: &str) -> impl Fn(idem_once::rabbitmq::lapin::Error) -> Error + '_ {
    move |e| Error::Refused(format!("RabbitMQ: {what}: {e}"))
}

/// Runs both consumers on `url` and prints what each charged.
pub async fn run(
    url: &str,
    plan: &Plan,
    crashes: u32,
    backend: Arc<dyn Backend>,
    label: &str,
) -> Result<()> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(refused("connect"))?;
    let run = format!("idem-demo-{}-{}", std::process::id(), fastrand::u32(..));
    let (naive_q, idem_q) = (format!("{run}.naive"), format!("{run}.idem"));
    let ch = conn.create_channel().await.map_err(refused("channel"))?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(refused("confirm.select"))?;
    for q in [&naive_q, &idem_q] {
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(refused("declare a queue"))?;
        for e in &plan.events {
            let mut headers = FieldTable::default();
            let id = AMQPValue::LongString(LongString::from(e.id.as_str()));
            headers.insert(idem_once::rabbitmq::DEFAULT_KEY_HEADER.into(), id);
            let props = BasicProperties::default().with_headers(headers);
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                e.payload.as_bytes(),
                props,
            )
            .await
            .map_err(refused("publish"))?;
        }
    }
    ch.wait_for_confirms()
        .await
        .map_err(refused("publisher confirms"))?;

    let total = plan.events.len() as u64;
    // Each crash falls three quarters of the way between two of the naive side's acks.
    let share = total / (u64::from(crashes) + 1);
    let crash_after = (share / ACK_EVERY).max(1) * ACK_EVERY + ACK_EVERY * 3 / 4;
    let (naive, idem) = (Ledger::default(), Arc::new(Ledger::default()));
    let naive_crashes = run_naive(&conn, &naive_q, total, crashes, crash_after, &naive).await?;
    let idem_crashes = run_idem(url, &idem_q, total, crashes, crash_after, backend, &idem).await?;
    for q in [naive_q.clone(), idem_q.clone(), format!("{idem_q}.dlq")] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let (n, i) = (naive.totals(), idem.totals());
    crate::write_out(format_args!(
        "idem demo on RabbitMQ at {}: {} payment events ({} sent twice, {} poison), \
         {crashes} crashes per side\n\
         naive (ack every {}): {} crashes, {} payments charged {} times, {} charged more than once\n\
         idem ({label}): {} crashes, {} payments charged {} times, {} charged more than once\n",
        redact(url),
        plan.payments,
        plan.duplicates,
        plan.poison,
        ACK_EVERY,
        naive_crashes,
        n.0,
        n.1,
        n.2,
        idem_crashes,
        i.0,
        i.1,
        i.2,
    ));
    match i.2 {
        0 => Ok(()),
        twice => Err(Error::DoubleCharge(u64::from(twice))),
    }
}

/// How many messages the naive consumer handles between two acks.
const ACK_EVERY: u64 = 50;

/// The naive consumer: charges, acks every `ACK_EVERY` (one ack for all before), and
/// crashes `crashes` times after `crash_after` charges, before its next ack.
async fn run_naive(
    conn: &Connection,
    queue: &str,
    total: u64,
    crashes: u32,
    crash_after: u64,
    ledger: &Ledger,
) -> Result<u32> {
    let (mut acked, mut crashed) = (0u64, 0u32);
    while acked < total {
        let ch = conn.create_channel().await.map_err(refused("channel"))?;
        ch.basic_qos(200, BasicQosOptions::default())
            .await
            .map_err(refused("basic.qos"))?;
        let mut deliveries = ch
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(refused("basic.consume"))?;
        let (mut pending, mut charged) = (0u64, 0u64);
        loop {
            let next = tokio::time::timeout(STALL, deliveries.next()).await;
            let d = match next {
                Ok(Some(Ok(d))) => d,
                _ => return Err(Error::Refused("the naive consumer stalled".into())),
            };
            if let Ok((id, _cents)) = parse(&d.data) {
                ledger.charge(&id).await;
                charged += 1;
            }
            pending += 1;
            if crashed < crashes && charged == crash_after {
                // Dies with `pending` messages unacked: the server sends them again.
                crashed += 1;
                let _ = ch.close(200, "crash".into()).await;
                break;
            }
            if pending == ACK_EVERY || acked + pending == total {
                d.acker
                    .ack(BasicAckOptions { multiple: true })
                    .await
                    .map_err(refused("basic.ack"))?;
                acked += pending;
                pending = 0;
                if acked == total {
                    let _ = ch.close(200, "done".into()).await;
                    break;
                }
            }
        }
    }
    Ok(crashed)
}

/// Counts the idem consumer's acks, and crashes it after a given number of settles.
struct Watch {
    acked: Arc<AtomicU64>,
    settled: AtomicU64,
    crash_at: Option<u64>,
    done: Arc<Notify>,
    total: u64,
}

impl Probe for Watch {
    fn reached(&self, point: Point, _: &Message) -> Verdict {
        match point {
            Point::AfterSettle => {
                let n = self.settled.fetch_add(1, Ordering::SeqCst) + 1;
                if self.crash_at == Some(n) {
                    return Verdict::Crash;
                }
            }
            Point::AfterAck if self.acked.fetch_add(1, Ordering::SeqCst) + 1 == self.total => {
                self.done.notify_one();
            }
            _ => {}
        }
        Verdict::Continue
    }
}

/// The idem consumer, restarted after each crash, until every message is acked.
async fn run_idem(
    url: &str,
    queue: &str,
    total: u64,
    crashes: u32,
    crash_after: u64,
    backend: Arc<dyn Backend>,
    ledger: &Arc<Ledger>,
) -> Result<u32> {
    let acked = Arc::new(AtomicU64::new(0));
    let done = Arc::new(Notify::new());
    let mut crashed = 0;
    loop {
        let watch = Arc::new(Watch {
            acked: acked.clone(),
            settled: AtomicU64::new(0),
            crash_at: (crashed < crashes).then_some(crash_after),
            done: done.clone(),
            total,
        });
        let engine = Engine::builder(backend.clone())
            .build()
            .map_err(|e| Error::Refused(e.to_string()))?;
        let stop = tokio_util::sync::CancellationToken::new();
        let ledger = ledger.clone();
        let consumer = IdemConsumer::builder(url)
            .queue(queue)
            .engine(engine)
            .probe(watch)
            .shutdown(stop.clone().cancelled_owned())
            .handler(move |m, _| {
                let ledger = ledger.clone();
                async move {
                    let (id, cents) = parse(m.payload()).map_err(HandlerError::permanent)?;
                    ledger.charge(&id).await;
                    Ok(Bytes::from(format!("charged {cents}")))
                }
            })
            .build()
            .map_err(|e| Error::Refused(e.to_string()))?;
        let notified = done.notified();
        let mut run = tokio::spawn(consumer.run());
        tokio::select! {
            ended = &mut run => {
                ended.map_err(|e| Error::Refused(e.to_string()))?.map_err(|e| Error::Refused(e.to_string()))?;
                crashed += 1;
                if acked.load(Ordering::SeqCst) >= total { return Ok(crashed); }
            }
            () = notified => {
                stop.cancel();
                run.await.map_err(|e| Error::Refused(e.to_string()))?.map_err(|e| Error::Refused(e.to_string()))?;
                return Ok(crashed);
            }
            () = tokio::time::sleep(STALL) => return Err(Error::Refused("the idem consumer stalled".into())),
        }
    }
}

/// `url` without its password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..s + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}
