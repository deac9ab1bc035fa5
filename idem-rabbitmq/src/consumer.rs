//! The consumer: a connection, a channel to consume on and one to publish dead letters
//! on, made again whenever they are lost, until the shutdown signal.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use idem_core::Key;
use idem_core::binding::{Backoff, Budget};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::handle::{Handled, Received, Session};
use crate::settings::{Mode, Settings};
use crate::{Error, Result};

/// How long a stopping consumer waits for the server to confirm the connection's close.
const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// An effectively-once consumer of one RabbitMQ queue: each delivery's key is claimed,
/// its handler run once under a lease, its result stored, and only then is it acked (or
/// dead-lettered, then acked). Built by [`IdemConsumer::builder`]; [`IdemConsumer::run`]
/// runs it.
pub struct IdemConsumer {
    settings: Arc<Settings>,
    shutdown: Option<BoxFuture<'static, ()>>,
}

impl std::fmt::Debug for IdemConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemConsumer")
            .field("queue", &self.settings.queue)
            .field("namespace", &self.settings.namespace)
            .finish_non_exhaustive()
    }
}

/// How one connection's session ended.
enum Ended {
    /// The shutdown signal: stop.
    Shutdown,
    /// A probe's crash: stop, as a dead process would.
    Crashed,
}

impl IdemConsumer {
    pub(crate) fn new(settings: Settings, shutdown: Option<BoxFuture<'static, ()>>) -> Self {
        IdemConsumer {
            settings: Arc::new(settings),
            shutdown,
        }
    }

    /// Consumes until the shutdown signal (or a probe's crash). A lost connection or
    /// channel is made again after a backoff; the deliveries it had not acked come back
    /// as redeliveries, which the store answers. Returns an error only for what a retry
    /// cannot mend: the queue does not exist, or the server refuses the credentials at
    /// the first connect.
    pub async fn run(self) -> Result<()> {
        let IdemConsumer { settings, shutdown } = self;
        let stop = CancellationToken::new();
        if let Some(signal) = shutdown {
            let stop = stop.clone();
            tokio::spawn(async move {
                signal.await;
                stop.cancel();
            });
        }
        let mut backoff = Backoff::new(settings.backoff);
        let mut connected_once = false;
        loop {
            match session(&settings, &stop, &mut connected_once).await {
                Ok(Ended::Shutdown | Ended::Crashed) => return Ok(()),
                Err(e @ (Error::UnknownQueue(_) | Error::Config(_))) => return Err(e),
                Err(e) if !connected_once => return Err(e),
                Err(e) => {
                    tracing::warn!(queue = %settings.queue, error = %e, "connection lost; connecting again");
                    tokio::select! {
                        () = tokio::time::sleep(backoff.wait()) => {}
                        () = stop.cancelled() => return Ok(()),
                    }
                }
            }
        }
    }
}

/// One connection: consumes until the signal, a crash, or the connection's loss.
async fn session(
    s: &Arc<Settings>,
    stop: &CancellationToken,
    connected_once: &mut bool,
) -> Result<Ended> {
    let props = ConnectionProperties::default().with_connection_name("idem-rabbitmq".into());
    let conn = s.target.connect(props).await?;
    *connected_once = true;
    let ended = consume(s, &conn, stop).await;
    if !matches!(ended, Err(Error::Amqp { .. } | Error::Lost(_))) {
        // Unacked deliveries go back to the queue with the connection. A close the server
        // does not answer is not waited out: dropping the connection closes its socket.
        let close = conn.close(200, "idem consumer stopped".into());
        let _ = tokio::time::timeout(CLOSE_WITHIN, close).await;
    }
    ended
}

async fn consume(s: &Arc<Settings>, conn: &Connection, stop: &CancellationToken) -> Result<Ended> {
    let channel = conn
        .create_channel()
        .await
        .map_err(Error::amqp("channel"))?;
    check_queue(conn, &s.queue).await?;
    channel
        .basic_qos(s.prefetch, BasicQosOptions::default())
        .await
        .map_err(Error::amqp("basic.qos"))?;
    let letters = letters_channel(s, conn).await?;
    let mut deliveries = channel
        .basic_consume(
            (&*s.queue).into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(Error::amqp("basic.consume"))?;
    let tag = deliveries.tag();
    let session = Session {
        settings: Arc::clone(s),
        letters,
        stop: stop.clone(),
        crash: CancellationToken::new(),
    };
    let mut lanes = Lanes::new(s.in_flight, s.max_bytes);
    // One claim and one settle for what arrived together: lease mode, one at a time.
    let batches = s.in_flight == 1 && s.batch_size > 1 && matches!(s.mode, Mode::Lease(_));
    loop {
        // A slot first: at most `in_flight` deliveries are taken from the channel.
        let slots = Arc::clone(&lanes.slots);
        let slot = tokio::select! {
            slot = slot(slots) => slot,
            () = stop.cancelled() => break,
            ended = lanes.next_done() => {
                if let Some(ended) = ended? { return Ok(ended); }
                continue;
            }
        };
        let next = tokio::select! {
            next = deliveries.next() => next,
            () = stop.cancelled() => break,
            ended = lanes.next_done() => {
                if let Some(ended) = ended? { return Ok(ended); }
                continue;
            }
        };
        let delivery = match next {
            Some(Ok(delivery)) => delivery,
            Some(Err(e)) => return Err(Error::amqp("consume")(e)),
            None => return Err(Error::Lost("the server ended the subscription".into())),
        };
        let received = session.receive(delivery);
        // Over the byte budget, what is in hand finishes first (all of it, if need be).
        while lanes.budget.over() && !lanes.is_empty() {
            if let Some(ended) = lanes.next_done().await? {
                return Ok(ended);
            }
        }
        if batches {
            // What else has arrived, without waiting, goes with it.
            let mut batch = vec![received];
            while batch.len() < s.batch_size && !lanes.budget.over() {
                match deliveries.next().now_or_never() {
                    Some(Some(Ok(d))) => batch.push(session.receive(d)),
                    Some(Some(Err(e))) => return Err(Error::amqp("consume")(e)),
                    Some(None) => {
                        return Err(Error::Lost("the server ended the subscription".into()));
                    }
                    None => break,
                }
            }
            lanes.run_batch(&session, batch, slot);
        } else {
            lanes.run(&session, received, slot);
        }
    }
    // The shutdown: no more deliveries; those in hand finish (or are left unacked).
    let _ = channel
        .basic_cancel(tag, BasicCancelOptions::default())
        .await;
    while !lanes.is_empty() {
        if let Some(ended) = lanes.next_done().await? {
            return Ok(ended);
        }
    }
    Ok(Ended::Shutdown)
}

/// A free slot of `slots`, when one is.
async fn slot(slots: Arc<Semaphore>) -> OwnedSemaphorePermit {
    match slots.acquire_owned().await {
        Ok(permit) => permit,
        // The semaphore is never closed.
        Err(_) => std::future::pending().await,
    }
}

/// The deliveries in hand, each on a task of its own: at most `in_flight` at once, and
/// those of one key one at a time, in the order they came (a lane per key).
struct Lanes {
    slots: Arc<Semaphore>,
    /// The bytes of the deliveries in hand.
    budget: Arc<Budget>,
    tasks: JoinSet<(u64, Option<Key>, Result<Handled>)>,
    /// The last delivery of each key in hand: its number, and a signal set when it is done.
    last: HashMap<Key, (u64, watch::Receiver<bool>)>,
    next_id: u64,
}

impl Lanes {
    fn new(in_flight: usize, max_bytes: usize) -> Self {
        Lanes {
            slots: Arc::new(Semaphore::new(in_flight.max(1))),
            budget: Budget::new(max_bytes),
            tasks: JoinSet::new(),
            last: HashMap::new(),
            next_id: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Runs `received` on a task of its own, after the delivery of its key before it.
    fn run(&mut self, session: &Session, received: Received, slot: OwnedSemaphorePermit) {
        let id = self.next_id;
        self.next_id += 1;
        let key = received.lane();
        let ticket = self.budget.hold(received.weight());
        let (done, done_rx) = watch::channel(false);
        let before = key.as_ref().and_then(|k| {
            let before = self.last.get(k).map(|(_, rx)| rx.clone());
            self.last.insert(k.clone(), (id, done_rx));
            before
        });
        let session = session.clone();
        self.tasks.spawn(async move {
            if let Some(mut before) = before {
                // Done, or its task is gone: either way this one may run.
                let _ = before.wait_for(|done| *done).await;
            }
            let handled = session.handle(received).await;
            let _ = done.send(true);
            drop((slot, ticket));
            (id, key, handled)
        });
    }

    /// Runs `batch` (deliveries that arrived together, in order) on a task of its own. With
    /// one slot, the only task: the lanes' order holds by itself.
    fn run_batch(&mut self, session: &Session, batch: Vec<Received>, slot: OwnedSemaphorePermit) {
        let tickets: Vec<_> = batch.iter().map(|r| self.budget.hold(r.weight())).collect();
        let session = session.clone();
        self.tasks.spawn(async move {
            let handled = session.handle_batch(batch).await;
            drop((slot, tickets));
            (u64::MAX, None, handled)
        });
    }

    /// Waits for a delivery's task to end: `Some` when the session must end (a crash),
    /// an error when the connection is lost. Pending while no task runs.
    async fn next_done(&mut self) -> Result<Option<Ended>> {
        let Some(joined) = self.tasks.join_next().await else {
            return std::future::pending().await;
        };
        let (id, key, handled) =
            joined.map_err(|e| Error::Lost(format!("a delivery's task ended: {e}")))?;
        if let Some(key) = key
            && self.last.get(&key).is_some_and(|(last, _)| *last == id)
        {
            self.last.remove(&key);
        }
        match handled? {
            Handled::Acked | Handled::Left => Ok(None),
            Handled::Crashed => Ok(Some(Ended::Crashed)),
        }
    }
}

/// The channel dead letters are published on, in confirm mode, with idem's dead-letter
/// queue declared.
async fn letters_channel(s: &Settings, conn: &Connection) -> Result<Channel> {
    let channel = conn
        .create_channel()
        .await
        .map_err(Error::amqp("channel"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(Error::amqp("confirm.select"))?;
    let (_, _, declare) = s.dead_letters.target(&s.queue);
    crate::dead_letter::declare(&channel, declare.as_deref())
        .await
        .map_err(Error::amqp("declare the dead-letter queue"))?;
    Ok(channel)
}

/// Whether `queue` exists: a passive declare, on a channel of its own (a failed one
/// closes its channel).
async fn check_queue(conn: &Connection, queue: &str) -> Result<()> {
    let channel = conn
        .create_channel()
        .await
        .map_err(Error::amqp("channel"))?;
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    match channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
    {
        Ok(_) => {
            let _ = channel.close(200, "checked".into()).await;
            Ok(())
        }
        Err(e) if is_not_found(&e) => Err(Error::UnknownQueue(queue.to_owned())),
        Err(e) => Err(Error::amqp("check the queue")(e)),
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => amqp.get_id() == 404,
        _ => false,
    }
}
