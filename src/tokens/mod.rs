//! The token endpoint (`serve --tokens ADDR`, off by default): tokens
//! any resource server checks with a stock JWT library. A holder of an
//! open contract proves possession of its key with a JWT it signs itself
//! and gets an EdDSA JWT signed by the broker, carrying the delegation's
//! terms (RFC 8693 token exchange); resource servers discover the
//! endpoints (RFC 8414), fetch the keys (JWKS) and ask whether a token
//! still stands (RFC 7662 introspection). It owns the HTTP listener, the
//! loading of chains and the replay cache; every rule is
//! `broker_domain::token`.

mod endpoints;
mod memory;
pub mod replay;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::clock::Clock;
use crate::config::TokensConfig;
use crate::service::PublishedKeys;
use crate::stamp::Stamper;
use crate::store::Store;

/// Paths the endpoint serves (the metadata's path is RFC 8414's).
pub const METADATA_PATH: &str = "/.well-known/oauth-authorization-server";
pub const JWKS_PATH: &str = "/jwks";
pub const TOKEN_PATH: &str = "/token";
pub const INTROSPECT_PATH: &str = "/introspect";

/// Most connections open at once, and from one address: resource
/// servers and agents keep a few each.
pub const MAX_TOKEN_CONNECTIONS: usize = 1_024;
pub const MAX_TOKEN_CONNECTIONS_PER_ADDRESS: usize = 64;
/// A connection's first request head, and each next one, must arrive
/// within this.
pub const TOKEN_IDLE: Duration = Duration::from_secs(10);
/// Largest form body read, in bytes: an assertion is under a kilobyte,
/// a minted token under `jwt::MAX_TOKEN_BYTES`.
pub const MAX_FORM_BYTES: usize = 32 * 1024;
/// Longest a request may take to send its body and be answered.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Requests reading the store at once; more wait up to `ADMISSION_WAIT`,
/// then are answered 503.
pub const MAX_TOKEN_REQUESTS_AT_WORK: usize = 64;
pub const ADMISSION_WAIT: Duration = Duration::from_secs(2);

/// What the endpoint needs from the broker's wiring.
pub(crate) struct TokenService<S> {
    pub store: Arc<S>,
    pub stamper: Arc<Stamper>,
    pub keys: PublishedKeys,
    pub clock: Arc<dyn Clock>,
    pub config: TokensConfig,
    /// `iss` of minted tokens and the base of the endpoints' URLs.
    pub issuer: String,
    replay: replay::Replay,
    /// Verified tokens and standing chains, for introspection.
    memory: memory::Memory,
    at_work: tokio::sync::Semaphore,
}

impl<S: Store> TokenService<S> {
    pub(crate) fn new(
        store: Arc<S>,
        stamper: Arc<Stamper>,
        keys: PublishedKeys,
        clock: Arc<dyn Clock>,
        config: TokensConfig,
        address: std::net::SocketAddr,
    ) -> Self {
        let issuer = config
            .issuer
            .clone()
            .unwrap_or_else(|| format!("http://{address}"))
            .trim_end_matches('/')
            .to_owned();
        Self {
            store,
            stamper,
            keys,
            clock,
            config,
            issuer,
            replay: replay::Replay::default(),
            memory: memory::Memory::default(),
            at_work: tokio::sync::Semaphore::new(MAX_TOKEN_REQUESTS_AT_WORK),
        }
    }

    /// The token endpoint's URL: the `aud` every assertion must carry.
    pub(crate) fn token_endpoint(&self) -> String {
        format!("{}{TOKEN_PATH}", self.issuer)
    }
}

/// Serves the endpoint on `listener` until `stopping` turns true.
pub(crate) async fn serve<S: Store>(
    listener: TcpListener,
    service: TokenService<S>,
    connections_closed: prometheus::IntCounterVec,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) {
    let bounds = crate::server::listen::Bounds {
        max_connections: MAX_TOKEN_CONNECTIONS,
        max_per_address: MAX_TOKEN_CONNECTIONS_PER_ADDRESS,
        first_request_timeout: TOKEN_IDLE,
    };
    let counters = crate::server::listen::Counters {
        listener: "tokens",
        open: None,
        closed: Some(connections_closed),
    };
    let router = endpoints::router(Arc::new(service));
    crate::server::listen::serve_http(listener, bounds, counters, TOKEN_IDLE, router, async move {
        let _ = stopping.wait_for(|stop| *stop).await;
    })
    .await;
}
