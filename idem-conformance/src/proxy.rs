//! A TCP proxy with switches, for network-fault tests of a backend or a broker binding: it listens on a free loopback
//! port and forwards each connection to an upstream address, and a test turns faults on
//! and off while traffic flows:
//!
//! - [`Proxy::latency`] delays every chunk by that much, in both directions (a delay line:
//!   chunks keep their order, and throughput is not cut to one chunk per delay);
//! - [`Proxy::reset`] cuts every open connection at once with a TCP reset on both sides,
//!   whatever is in flight (a request may have reached the server, its answer not);
//! - [`Proxy::blackhole`] stops all forwarding in either direction, closes included, until
//!   it is turned off: connections are still accepted and stay open, calls stall silently,
//!   and what was held back flows again afterwards.
//!
//! [`Faults`] is the schedule the tests inject with it, one fault per wave of messages.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The switches, shared by the proxy and its connection tasks.
struct Switches {
    upstream: String,
    /// The delay added to each chunk, in microseconds.
    latency_us: AtomicU64,
    blackhole: watch::Sender<bool>,
    /// Bumped by each reset; a connection opened before the bump is cut.
    resets: watch::Sender<u64>,
    accepted: AtomicUsize,
    open: AtomicUsize,
    /// Connections cut by resets.
    cut: AtomicUsize,
}

/// A running proxy; dropping it stops accepting and cuts every connection.
pub struct Proxy {
    addr: SocketAddr,
    switches: Arc<Switches>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on `127.0.0.1:0` and forwards to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let switches = Arc::new(Switches {
            upstream: upstream.to_owned(),
            latency_us: AtomicU64::new(0),
            blackhole: watch::Sender::new(false),
            resets: watch::Sender::new(0),
            accepted: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
            cut: AtomicUsize::new(0),
        });
        let shared = switches.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                shared.accepted.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(connection(client, shared.clone()));
            }
        });
        Proxy {
            addr,
            switches,
            accept,
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Adds `delay` to every chunk forwarded from now on, both ways (zero turns it off).
    pub fn latency(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.switches.latency_us.store(us, Ordering::Relaxed);
    }

    /// Cuts every open connection with a reset on both sides; answers how many it cut.
    pub fn reset(&self) -> usize {
        let open = self.switches.open.load(Ordering::Relaxed);
        self.switches.resets.send_modify(|n| *n += 1);
        self.switches.cut.fetch_add(open, Ordering::Relaxed);
        open
    }

    /// Connections cut by resets since the start.
    pub fn cut(&self) -> usize {
        self.switches.cut.load(Ordering::Relaxed)
    }

    /// Stops (`true`) or resumes (`false`) all forwarding.
    pub fn blackhole(&self, on: bool) {
        self.switches.blackhole.send_replace(on);
    }

    /// Connections accepted since the start.
    pub fn accepted(&self) -> usize {
        self.switches.accepted.load(Ordering::Relaxed)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.switches.open.load(Ordering::Relaxed)
    }
}

/// The faults of the network-fault tests, one per wave of messages, in rounds of three:
/// none for the first wave; then a latency window, `latency` added to each chunk each way
/// for `latency_for`, with every connection reset halfway through it, when calls are in
/// flight in both directions; then every connection reset again, without latency; then a
/// blackhole for `blackhole_for`. Built from [`Faults::new`] and its `with_…` methods, in
/// a `const` too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Faults {
    /// The delay added to each chunk, each way, in a latency window.
    pub latency: Duration,
    /// How long a latency window lasts.
    pub latency_for: Duration,
    /// How long a blackhole lasts.
    pub blackhole_for: Duration,
}

impl Faults {
    /// No latency, latency windows and blackholes of no length: resets alone.
    pub const fn new() -> Self {
        Faults {
            latency: Duration::ZERO,
            latency_for: Duration::ZERO,
            blackhole_for: Duration::ZERO,
        }
    }

    /// Sets [`Faults::latency`].
    pub const fn with_latency(self, latency: Duration) -> Self {
        Faults { latency, ..self }
    }

    /// Sets [`Faults::latency_for`].
    pub const fn with_latency_for(self, latency_for: Duration) -> Self {
        Faults {
            latency_for,
            ..self
        }
    }

    /// Sets [`Faults::blackhole_for`].
    pub const fn with_blackhole_for(self, blackhole_for: Duration) -> Self {
        Faults {
            blackhole_for,
            ..self
        }
    }

    /// Injects through `proxy` the fault that meets wave `n`; returns once it is over, with
    /// what it did (resets with how many connections they cut).
    pub async fn inject(&self, n: usize, proxy: &Proxy) -> Vec<String> {
        if n == 0 {
            return Vec::new();
        }
        match (n - 1) % 3 {
            0 => {
                proxy.latency(self.latency);
                tokio::time::sleep(self.latency_for / 2).await;
                let cut = proxy.reset();
                tokio::time::sleep(self.latency_for / 2).await;
                proxy.latency(Duration::ZERO);
                let (ms, s) = (self.latency.as_millis(), self.latency_for.as_secs());
                vec![
                    format!("latency {ms} ms for {s} s"),
                    format!("reset under latency ({cut} cut)"),
                ]
            }
            1 => {
                let cut = proxy.reset();
                vec![format!("reset ({cut} cut)")]
            }
            _ => {
                proxy.blackhole(true);
                tokio::time::sleep(self.blackhole_for).await;
                proxy.blackhole(false);
                vec![format!("blackhole {} s", self.blackhole_for.as_secs())]
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.switches.resets.send_modify(|n| *n += 1);
    }
}

/// Counts a connection open for as long as it lives.
struct Open(Arc<Switches>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Forwards one client connection until either side closes or a reset cuts it.
async fn connection(mut client: TcpStream, switches: Arc<Switches>) {
    switches.open.fetch_add(1, Ordering::Relaxed);
    let _open = Open(switches.clone());
    let mut resets = switches.resets.subscribe();
    let born = *resets.borrow_and_update();
    let Ok(mut server) = TcpStream::connect(&switches.upstream).await else {
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let cut = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let up = forward(client_read, server_write, &switches);
        let down = forward(server_read, client_write, &switches);
        tokio::select! {
            _ = futures::future::join(up, down) => false,
            _ = resets.wait_for(|n| *n != born) => true,
        }
    };
    if cut {
        // A zero linger makes the close send a reset rather than a FIN.
        let _ = (client.set_zero_linger(), server.set_zero_linger());
    }
}

/// Copies `from` to `to` through the delay line until `from` closes and everything read
/// was written (then shuts `to` down), or a write fails.
async fn forward(
    mut from: tokio::net::tcp::ReadHalf<'_>,
    mut to: tokio::net::tcp::WriteHalf<'_>,
    switches: &Switches,
) {
    let mut hole = switches.blackhole.subscribe();
    let mut line: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut reading = true;
    loop {
        if *hole.borrow_and_update() {
            // Nothing moves; what the peers sent waits in the kernel's buffers.
            if hole.changed().await.is_err() {
                return;
            }
            continue;
        }
        let due = line.front().map(|(at, _)| *at);
        if !reading && due.is_none() {
            let _ = to.shutdown().await;
            return;
        }
        tokio::select! {
            n = from.read(&mut buf), if reading => match n {
                Ok(0) | Err(_) => reading = false,
                Ok(n) => {
                    let delay = Duration::from_micros(switches.latency_us.load(Ordering::Relaxed));
                    line.push_back((Instant::now() + delay, buf[..n].to_vec()));
                }
            },
            () = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                let Some((_, chunk)) = line.pop_front() else { continue };
                if to.write_all(&chunk).await.is_err() {
                    return;
                }
            }
            _ = hole.changed() => {}
        }
    }
}

/// Splits a URL such as `postgres://user:pw@127.0.0.1:5432/db` into what comes before its
/// `host:port`, the `host:port` (with `default_port` if it names none) and what follows.
pub fn split_url(url: &str, default_port: u16) -> (String, String, String) {
    let scheme_end = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let host_start = authority.rfind('@').map_or(0, |i| i + 1);
    let host = &authority[host_start..];
    let host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:{default_port}")
    };
    let before = &url[..scheme_end + host_start];
    (before.to_owned(), host, rest[authority_end..].to_owned())
}

/// `url` with its `host:port` replaced by the proxy's.
pub fn through(url: &str, default_port: u16, proxy: &Proxy) -> String {
    let (before, _, after) = split_url(url, default_port);
    format!("{before}{}{after}", proxy.addr())
}
