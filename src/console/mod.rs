//! The browser console (`serve --console ADDR`, off by default): a
//! read-only page the broker serves itself, over a listener of its own.
//! It owns the access token, the gate in front of the listener (`gate`)
//! and the embedded page (`assets`). No agent or broker key reaches the
//! browser: it shows the token, receives a short-lived session of the
//! reader named in `[console]` (signed by the broker, as OpenSession
//! would), and calls the read RPCs over gRPC-Web with it.

pub mod assets;
pub mod gate;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::pb;
use crate::service::BrokerService;
use crate::store::Store;

/// `serve --console`: where to serve the console and the token it asks
/// for.
#[derive(Debug)]
pub struct ConsoleOptions {
    pub listener: TcpListener,
    /// The access token (`new_token`); `serve` prints it once, in the URL
    /// it logs.
    pub token: String,
}

/// Bytes of randomness in an access token (printed as hex).
const TOKEN_BYTES: usize = 32;
/// Most connections open on the console at once: a few people's browsers
/// (each holds up to six), not agents. Beyond it, new ones wait.
pub const MAX_CONSOLE_CONNECTIONS: usize = 64;
/// Most of them from one address: a couple of browsers' worth, so one
/// address (no token needed to connect) cannot hold the console.
pub const MAX_CONSOLE_CONNECTIONS_PER_ADDRESS: usize = 16;
/// TCP keepalive on the console's connections, so a vanished browser's
/// connection (and its Watch) is noticed and closed.
const KEEPALIVE: Duration = Duration::from_secs(30);
/// How long the console's connections get to finish once the broker
/// stops; then they are cut, so no client can hold the shutdown.
pub const CONSOLE_DRAIN: Duration = Duration::from_secs(5);

/// A fresh random access token, hex-encoded.
pub fn new_token() -> String {
    let mut token = [0u8; TOKEN_BYTES];
    getrandom::fill(&mut token).expect("the operating system's CSPRNG is available");
    hex::encode(token)
}

/// The origins whose pages may call the console: its own address, its
/// `localhost` spelling on loopback, and the configured extras. Bound to
/// every interface (0.0.0.0, ::) it has no address of its own a browser
/// would send: then only the configured ones, which must exist.
pub fn origins(address: std::net::SocketAddr, extra: &[String]) -> Result<Vec<String>, String> {
    let mut origins = Vec::new();
    if address.ip().is_unspecified() {
        if extra.is_empty() {
            return Err(format!(
                "bound to {address}, the console has no origin of its own: list the URLs browsers use in [console] allowed_origins (e.g. \"http://broker.internal:{}\")",
                address.port()
            ));
        }
    } else {
        origins.push(format!("http://{address}"));
        if address.ip().is_loopback() {
            origins.push(format!("http://localhost:{}", address.port()));
        }
    }
    origins.extend(extra.iter().cloned());
    Ok(origins)
}

/// What the console needs from the broker's wiring.
pub(crate) struct Wiring<S> {
    pub broker: pb::broker_server::BrokerServer<BrokerService<S>>,
    pub limits: crate::config::Limits,
    pub metrics: Arc<crate::metrics::Metrics>,
}

/// Serves the console on `listener` until `stopping` turns true.
pub(crate) async fn serve<S: Store>(
    listener: TcpListener,
    gate: gate::GateState,
    wiring: Wiring<S>,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let Wiring {
        broker,
        limits,
        metrics,
    } = wiring;
    let bounds = crate::server::listen::Bounds {
        max_connections: MAX_CONSOLE_CONNECTIONS,
        max_per_address: MAX_CONSOLE_CONNECTIONS_PER_ADDRESS,
        first_request_timeout: Duration::from_millis(limits.first_request_timeout_ms),
    };
    let (incoming, first_request) =
        crate::server::listen::incoming(listener, bounds, metrics.connection_counters("console"));
    // Idle HTTP/1.1 connections are closed by hyper's header read timeout
    // (30 s, tonic's default), HTTP/2 ones by keepalive pings.
    tonic::transport::Server::builder()
        // gRPC-Web runs over HTTP/1.1 from browsers.
        .accept_http1(true)
        .http2_keepalive_interval(Some(crate::server::listen::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(crate::server::listen::KEEPALIVE_TIMEOUT))
        .tcp_keepalive(Some(KEEPALIVE))
        .concurrency_limit_per_connection(limits.max_concurrent_requests_per_connection)
        .max_concurrent_streams(Some(crate::server::streams_per_connection(&limits)))
        .timeout(Duration::from_millis(limits.request_timeout_ms))
        // Before the gate: a refused request is still a request.
        .layer(first_request.layer())
        // Outermost of the rest: nothing the gate refuses reaches anything
        // else.
        .layer(gate::GateLayer(Arc::new(gate)))
        .layer(tonic_web::GrpcWebLayer::new())
        .layer(crate::metrics::MetricsLayer(metrics))
        .layer(crate::telemetry::CallSpanLayer)
        .layer(tower::util::MapResponseLayer::new(
            crate::service::transport::rewrite_decoder_errors,
        ))
        .add_service(broker)
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = stopping.wait_for(|stop| *stop).await;
        })
        .await
}
