//! Accepting connections: the one mechanism every listener of the broker
//! (gRPC, console, metrics) and of its gateways (A2A, MCP) uses, so that a
//! socket that never speaks costs nothing.
//!
//! - At most `max_connections` open at once; beyond it new ones wait in
//!   the listen backlog.
//! - At most `max_per_address` of them from one peer address (an IPv6
//!   /64, which one host usually holds whole): one address cannot take
//!   the whole cap. One beyond its address's share is closed at once.
//! - A connection must send its first request within
//!   `first_request_timeout` of its accept, or it is closed and its
//!   permits return: silent sockets, HTTP/2 preface-only ones and TLS
//!   handshakes never finished all end there. "Sent its first request"
//!   is decided at the HTTP layer (a request head reached the service), not
//!   by parsing bytes: SETTINGS, PINGs or a handshake are not requests.
//!
//! After the first request each server bounds idleness itself: HTTP/2
//! keepalive pings with a timeout (`KEEPALIVE_INTERVAL`,
//! `KEEPALIVE_TIMEOUT`), HTTP/1's header read timeout between requests.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

/// HTTP/2 keepalive pings on every gRPC listener: a peer that vanished
/// (no FIN, e.g. a dropped NAT entry) is noticed within interval plus
/// timeout and its connection closed.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a keepalive ping may go unanswered before the connection is
/// closed.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Each listener of the gateways (A2A, MCP): one agent's front, so a
/// quarter of the broker's cap; a quarter of that per address leaves the
/// fronted agent (or Envoy, or a peer's gateway) room while no single
/// address takes the listener.
pub const GATEWAY_BOUNDS: Bounds = Bounds {
    max_connections: 1_024,
    max_per_address: 256,
    first_request_timeout: Duration::from_secs(5),
};
/// The gateways' HTTP/1.1 connections: one kept alive this long without a
/// new request is closed.
pub const HTTP_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections the kernel completes and queues for accept (capped by
/// net.core.somaxconn): tokio binds with 1,024, and a burst of connects
/// past the queue has its SYNs dropped, which costs an honest client in
/// it a second (the SYN's first retransmission).
const LISTEN_BACKLOG: i32 = 4_096;
/// Pause after a failed accept (e.g. no file descriptors left): retrying
/// at once would spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);
/// Bits of an IPv6 address that name one peer: a host is usually given a
/// whole /64, so counting single addresses would let it take any share.
const IPV6_PEER_PREFIX_BITS: u32 = 64;

/// The bounds of one listener.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one peer address (at most
    /// `max_connections`; a larger value means `max_connections`).
    pub max_per_address: usize,
    /// Longest from accept to the first request.
    pub first_request_timeout: Duration,
}

/// `broker_connections_closed_total{reason}`: closed for sending no
/// request within the first-request bound.
pub const CLOSED_SILENT: &str = "silent";
/// `broker_connections_closed_total{reason}`: closed at accept, its
/// address holding its whole share.
pub const CLOSED_ADDRESS_SHARE: &str = "address_share";

/// Where a listener reports its connections; every part optional (the
/// gateways have no broker metrics).
#[derive(Clone, Debug, Default)]
pub struct Counters {
    /// The `listener` label of `closed`.
    pub listener: &'static str,
    /// Connections open now.
    pub open: Option<prometheus::IntGauge>,
    /// Connections the listener closed, by `listener` and `reason`.
    pub closed: Option<prometheus::IntCounterVec>,
}

impl Counters {
    fn closed(&self, reason: &str) {
        if let Some(closed) = &self.closed {
            closed.with_label_values(&[self.listener, reason]).inc();
        }
    }
}

/// What a listener's connections share.
#[derive(Debug)]
struct Shared {
    bounds: Bounds,
    counters: Counters,
    /// Connections open per peer (see `peer`).
    per_address: Mutex<HashMap<IpAddr, usize>>,
    /// Connections yet to send a request, by remote address (unique among
    /// one listener's open connections): how a request layer that sees
    /// only the connection's address finds its flag.
    silent: Mutex<HashMap<SocketAddr, Arc<AtomicBool>>>,
    /// `silent`'s length, read without its lock: once every connection
    /// has spoken, requests cost the layer one atomic load.
    waiting: AtomicUsize,
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The maps stay consistent whatever panicked holding them.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Takes one of `ip`'s share, if it has any left.
    fn take_share(&self, ip: IpAddr) -> bool {
        let most = self.bounds.max_per_address.min(self.bounds.max_connections);
        let mut counts = locked(&self.per_address);
        let held = counts.entry(peer(ip)).or_insert(0);
        if *held >= most {
            return false;
        }
        *held += 1;
        true
    }

    fn give_share(&self, ip: IpAddr) {
        let mut counts = locked(&self.per_address);
        let key = peer(ip);
        if let Some(held) = counts.get_mut(&key) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                counts.remove(&key);
            }
        }
    }

    fn register(&self, remote: SocketAddr, spoke: Arc<AtomicBool>) {
        let mut silent = locked(&self.silent);
        if silent.insert(remote, spoke).is_none() {
            self.waiting.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets `remote`'s entry if it is still `spoke`'s.
    fn forget(&self, remote: SocketAddr, spoke: &Arc<AtomicBool>) {
        let mut silent = locked(&self.silent);
        if silent.get(&remote).is_some_and(|s| Arc::ptr_eq(s, spoke)) {
            silent.remove(&remote);
            self.waiting.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The connection from `remote` has sent a request.
    fn spoke(&self, remote: SocketAddr) {
        if self.waiting.load(Ordering::Relaxed) == 0 {
            return;
        }
        let flag = {
            let mut silent = locked(&self.silent);
            let flag = silent.remove(&remote);
            if flag.is_some() {
                self.waiting.fetch_sub(1, Ordering::Relaxed);
            }
            flag
        };
        if let Some(flag) = flag {
            flag.store(true, Ordering::Release);
        }
    }
}

/// The peer an address counts against: IPv4 (also as IPv4-mapped IPv6)
/// whole, IPv6 by its /64.
fn peer(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mask = u128::MAX << (128 - IPV6_PEER_PREFIX_BITS);
                IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
            }
        },
    }
}

/// Marks connections as having sent a request, for servers that do not
/// hand the connection to their requests (tonic): `layer()` goes on the
/// server and finds the connection by the remote address tonic puts in
/// each request.
#[derive(Clone, Debug)]
pub struct FirstRequest(Arc<Shared>);

impl FirstRequest {
    pub fn layer(&self) -> FirstRequestLayer {
        FirstRequestLayer(self.clone())
    }
}

crate::state_layer! {
    /// See `FirstRequest`.
    #[derive(Debug)]
    pub struct FirstRequestLayer(FirstRequest) => FirstRequestService { first }
}

impl<S, B> tower::Service<http::Request<B>> for FirstRequestService<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if let Some(remote) = remote_addr(request.extensions()) {
            self.first.0.spoke(remote);
        }
        self.inner.call(request)
    }
}

/// The peer's address tonic records on each request, with or without TLS.
fn remote_addr(extensions: &http::Extensions) -> Option<SocketAddr> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    extensions
        .get::<TcpConnectInfo>()
        .and_then(|info| info.remote_addr)
        .or_else(|| {
            extensions
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|info| info.get_ref().remote_addr)
        })
}

/// Accepted connections within `bounds`, with TCP_NODELAY (small gRPC
/// frames would otherwise wait out delayed ACKs, ~40 ms per round trip);
/// and the handle a tonic server's layer needs (`FirstRequest::layer`).
pub fn incoming(
    listener: TcpListener,
    bounds: Bounds,
    counters: Counters,
) -> (
    impl tokio_stream::Stream<Item = std::io::Result<Limited>>,
    FirstRequest,
) {
    let shared = Arc::new(Shared {
        bounds,
        counters,
        per_address: Mutex::default(),
        silent: Mutex::default(),
        waiting: AtomicUsize::new(0),
    });
    // Listening again only resizes the queue.
    if let Err(e) = socket2::SockRef::from(&listener).listen(LISTEN_BACKLOG) {
        tracing::warn!(error = %e, "could not deepen the listen queue; keeping the default");
    }
    let permits = Arc::new(tokio::sync::Semaphore::new(bounds.max_connections));
    // Small: the accept loop waits for the server to take each one.
    let (accepted, queue) = tokio::sync::mpsc::channel(1);
    let accepting = shared.clone();
    tokio::spawn(async move {
        let shared = accepting;
        loop {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            let next = tokio::select! {
                next = listener.accept() => next,
                // The server is gone: stop accepting.
                () = accepted.closed() => return,
            };
            let (stream, remote) = match next {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed; retrying shortly");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    continue;
                }
            };
            // Dropped (closed) at once, its permit back for the next.
            if !shared.take_share(remote.ip()) {
                shared.counters.closed(CLOSED_ADDRESS_SHARE);
                continue;
            }
            let spoke = Arc::new(AtomicBool::new(false));
            shared.register(remote, spoke.clone());
            if let Some(open) = &shared.counters.open {
                open.inc();
            }
            let connection = Limited {
                stream,
                remote,
                first: First::Waiting {
                    spoke,
                    deadline: Box::pin(tokio::time::sleep(bounds.first_request_timeout)),
                },
                shared: shared.clone(),
                _permit: permit,
            };
            if let Err(e) = connection.stream.set_nodelay(true) {
                // The peer is already gone.
                tracing::debug!(error = %e, "a connection closed before it was served");
                continue;
            }
            if accepted.send(Ok(connection)).await.is_err() {
                return;
            }
        }
    });
    (
        tokio_stream::wrappers::ReceiverStream::new(queue),
        FirstRequest(shared),
    )
}

/// Where a connection stands with its first request.
#[derive(Debug)]
enum First {
    Waiting {
        spoke: Arc<AtomicBool>,
        deadline: Pin<Box<tokio::time::Sleep>>,
    },
    Spoke,
    /// Past the bound without a request: every read fails.
    Expired,
}

/// An accepted connection, holding one of its listener's permits and one
/// of its address's share until it is dropped; reads fail once the
/// first-request bound passes without a request, which makes the server
/// close it.
#[derive(Debug)]
pub struct Limited {
    stream: TcpStream,
    remote: SocketAddr,
    first: First,
    shared: Arc<Shared>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

/// Marks one connection as having sent a request (servers that see the
/// connection when they serve its requests: hyper's).
#[derive(Clone, Debug)]
pub struct Spoke(Option<Arc<AtomicBool>>);

impl Spoke {
    pub fn mark(&self) {
        if let Some(flag) = &self.0 {
            flag.store(true, Ordering::Release);
        }
    }
}

impl Limited {
    pub fn spoke(&self) -> Spoke {
        match &self.first {
            First::Waiting { spoke, .. } => Spoke(Some(spoke.clone())),
            First::Spoke | First::Expired => Spoke(None),
        }
    }

    pub fn remote_addr(&self) -> SocketAddr {
        self.remote
    }

    /// Whether reads may go on; an error once the first request is
    /// overdue.
    fn check_first(&mut self, cx: &mut Context<'_>) -> std::io::Result<()> {
        if let First::Waiting { spoke, deadline } = &mut self.first {
            if spoke.load(Ordering::Acquire) {
                self.shared.forget(self.remote, spoke);
                self.first = First::Spoke;
            } else if deadline.as_mut().poll(cx).is_ready() {
                self.shared.forget(self.remote, spoke);
                self.shared.counters.closed(CLOSED_SILENT);
                self.first = First::Expired;
            }
        }
        match self.first {
            First::Expired => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no request within the first-request bound",
            )),
            First::Waiting { .. } | First::Spoke => Ok(()),
        }
    }
}

impl Drop for Limited {
    fn drop(&mut self) {
        if let First::Waiting { spoke, .. } = &self.first {
            self.shared.forget(self.remote, spoke);
        }
        self.shared.give_share(self.remote.ip());
        if let Some(open) = &self.shared.counters.open {
            open.dec();
        }
    }
}

impl tonic::transport::server::Connected for Limited {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl tokio::io::AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.check_first(cx)?;
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Limited {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// `serve_http` within a gateway's bounds (`GATEWAY_BOUNDS`,
/// `HTTP_IDLE_TIMEOUT`), counting nowhere: the A2A and MCP gateways' HTTP.
pub async fn serve_gateway_http(
    listener: TcpListener,
    router: axum::Router,
    shutdown: impl Future<Output = ()>,
) {
    serve_http(
        listener,
        GATEWAY_BOUNDS,
        Counters::default(),
        HTTP_IDLE_TIMEOUT,
        router,
        shutdown,
    )
    .await;
}

/// Hands each connection accepted on `listener` within `bounds` to
/// `serve` until `shutdown` resolves or the listener fails.
pub async fn each_connection(
    listener: TcpListener,
    bounds: Bounds,
    counters: Counters,
    shutdown: impl Future<Output = ()>,
    mut serve: impl FnMut(Limited),
) {
    use tokio_stream::StreamExt as _;
    let (connections, _) = incoming(listener, bounds, counters);
    tokio::pin!(connections, shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            next = connections.next() => match next {
                Some(Ok(connection)) => serve(connection),
                Some(Err(_)) => continue,
                None => return,
            },
        }
    }
}

/// Serves `router` over HTTP/1.1 on `listener` within `bounds` until
/// `shutdown` resolves, then lets the open connections finish their
/// requests. `idle` bounds the wait for each request's head after the
/// first (hyper's header read timeout), so a kept-alive connection that
/// goes quiet is closed. Requests carry `axum::extract::ConnectInfo` of
/// the peer's address.
pub async fn serve_http(
    listener: TcpListener,
    bounds: Bounds,
    counters: Counters,
    idle: Duration,
    router: axum::Router,
    shutdown: impl Future<Output = ()>,
) {
    let (stop, stopping) = tokio::sync::watch::channel(false);
    each_connection(listener, bounds, counters, shutdown, |connection| {
        let spoke = connection.spoke();
        let remote = connection.remote_addr();
        let router = router.clone();
        let service =
            hyper::service::service_fn(move |mut request: http::Request<hyper::body::Incoming>| {
                spoke.mark();
                request
                    .extensions_mut()
                    .insert(axum::extract::ConnectInfo(remote));
                tower::ServiceExt::oneshot(router.clone(), request.map(axum::body::Body::new))
            });
        let mut stopping = stopping.clone();
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(idle)
                .serve_connection(hyper_util::rt::TokioIo::new(connection), service);
            tokio::pin!(served);
            tokio::select! {
                _ = served.as_mut() => return,
                _ = stopping.wait_for(|stop| *stop) => served.as_mut().graceful_shutdown(),
            }
            let _ = served.await;
        });
    })
    .await;
    let _ = stop.send(true);
    drop(stopping);
    // Each connection's task holds a receiver until it ends.
    stop.closed().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_peers_are_counted_by_their_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().expect("ip");
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().expect("ip");
        let other: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        assert_eq!(peer(a), peer(b));
        assert_ne!(peer(a), peer(other));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().expect("ip");
        assert_eq!(peer(mapped), "10.0.0.1".parse::<IpAddr>().expect("ip"));
    }

    fn shared(max_connections: usize, max_per_address: usize) -> Shared {
        Shared {
            bounds: Bounds {
                max_connections,
                max_per_address,
                first_request_timeout: Duration::from_secs(1),
            },
            counters: Counters::default(),
            per_address: Mutex::default(),
            silent: Mutex::default(),
            waiting: AtomicUsize::new(0),
        }
    }

    #[test]
    fn one_address_gets_its_share_and_no_more() {
        let listener = shared(8, 2);
        let ip: IpAddr = "192.0.2.1".parse().expect("ip");
        assert!(listener.take_share(ip));
        assert!(listener.take_share(ip));
        assert!(!listener.take_share(ip));
        assert!(listener.take_share("192.0.2.2".parse().expect("ip")));
        listener.give_share(ip);
        assert!(listener.take_share(ip));
        // A share above the cap is the cap.
        let small = shared(1, 4);
        assert!(small.take_share(ip));
        assert!(!small.take_share(ip));
    }

    #[test]
    fn a_request_marks_its_connection_once() {
        let listener = shared(8, 8);
        let remote: SocketAddr = "192.0.2.1:40000".parse().expect("addr");
        let flag = Arc::new(AtomicBool::new(false));
        listener.register(remote, flag.clone());
        assert_eq!(listener.waiting.load(Ordering::Relaxed), 1);
        listener.spoke("192.0.2.1:40001".parse().expect("addr"));
        assert!(!flag.load(Ordering::Acquire));
        listener.spoke(remote);
        assert!(flag.load(Ordering::Acquire));
        assert_eq!(listener.waiting.load(Ordering::Relaxed), 0);
        // Forgetting an entry already gone changes nothing.
        listener.forget(remote, &flag);
        assert_eq!(listener.waiting.load(Ordering::Relaxed), 0);
    }
}
