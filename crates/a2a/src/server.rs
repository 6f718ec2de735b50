//! The gateway's lifecycle: `run` serves the listeners it is given (the
//! ingress and egress over JSON-RPC and gRPC, the authz, the metrics)
//! until `shutdown` resolves, then lets every one of them finish its
//! requests in flight within one bounded drain.

use std::future::Future;
use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::A2aConfig;
use crate::gateway::{Addresses, Upstream};
use crate::{Gateway, authz, card, client, grpc, ingress, jsonrpc};

/// Longest the requests in flight may run once the shutdown was asked,
/// over every listener together: the broker's own default drain
/// (`limits.shutdown_drain_ms`), well inside Kubernetes' default 30 s
/// grace period. A SendMessage still waiting for its task to settle is
/// cut at it; the task's contract is moved on after a restart
/// (`ingress::recover`).
pub const DRAIN: Duration = Duration::from_secs(10);

/// A CheckRequest carries the HTTP body (at most `max_message_bytes`)
/// beside the request's headers and attributes: twice the body's bound
/// leaves them room.
const AUTHZ_DECODE_FACTOR: usize = 2;

/// The gateway's listeners, bound before `run` (`Listeners::bind` binds
/// those the config names; a test may bind port 0). `None`: not served.
#[derive(Debug, Default)]
pub struct Listeners {
    /// `listen`: the ingress over JSON-RPC, and the agent's card.
    pub ingress: Option<TcpListener>,
    /// `grpc_listen`: the ingress over gRPC.
    pub ingress_grpc: Option<TcpListener>,
    /// `egress_listen`: the egress over JSON-RPC, and the peers' cards.
    pub egress: Option<TcpListener>,
    /// `egress_grpc_listen`: the egress over gRPC.
    pub egress_grpc: Option<TcpListener>,
    /// `authz_listen`: Envoy's `Authorization/Check`.
    pub authz: Option<TcpListener>,
    /// `metrics_listen`: `GET /metrics`.
    pub metrics: Option<TcpListener>,
}

impl Listeners {
    /// Binds every listener the config names.
    pub async fn bind(config: &A2aConfig) -> anyhow::Result<Self> {
        Ok(Self {
            ingress: bind(config.listen.as_deref(), "listen").await?,
            egress: bind(config.egress_listen.as_deref(), "egress_listen").await?,
            metrics: bind(config.metrics_listen.as_deref(), "metrics_listen").await?,
            ingress_grpc: bind(config.grpc_listen.as_deref(), "grpc_listen").await?,
            egress_grpc: bind(config.egress_grpc_listen.as_deref(), "egress_grpc_listen").await?,
            authz: bind(config.authz_listen.as_deref(), "authz_listen").await?,
        })
    }

    /// The URLs the served cards name.
    fn addresses(&self, config: &A2aConfig) -> anyhow::Result<Addresses> {
        let addr = |listener: &Option<TcpListener>| {
            listener
                .as_ref()
                .map(|l| l.local_addr())
                .transpose()
                .map(|a| a.map(|a| a.to_string()))
        };
        if let Some(listener) = &self.egress
            && !listener.local_addr()?.ip().is_loopback()
        {
            // Whoever reaches the egress delegates with the agent's key.
            tracing::warn!(
                addr = %listener.local_addr()?,
                "egress_listen is not a loopback address: only the fronted agent may reach it"
            );
        }
        let http = |addr: Option<String>| addr.map(|a| format!("http://{a}"));
        Ok(Addresses {
            public_url: match &config.public_url {
                Some(url) => url.clone(),
                None => http(addr(&self.ingress)?).unwrap_or_default(),
            },
            egress_url: http(addr(&self.egress)?).unwrap_or_default(),
            grpc_url: addr(&self.ingress_grpc)?,
            egress_grpc_url: addr(&self.egress_grpc)?,
        })
    }
}

async fn bind(addr: Option<&str>, key: &str) -> anyhow::Result<Option<TcpListener>> {
    let Some(addr) = addr else { return Ok(None) };
    TcpListener::bind(addr)
        .await
        .map(Some)
        .map_err(|e| anyhow::anyhow!("{key} {addr}: {e}"))
}

/// Serves the gateway fronting the agent `config` names on `listeners`
/// until `shutdown` resolves (or a server fails), then stops every server
/// at once and lets their requests in flight finish within `DRAIN`.
pub async fn run(
    listeners: Listeners,
    config: A2aConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    // The agent's HTTPS client (reqwest without a provider of its own)
    // signs with ring, the process's provider; installed once.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let addresses = listeners.addresses(&config)?;
    // The ingress calls the agent; so does the authz, to read which
    // contract a continued task was started under.
    let calls_agent = listeners.ingress.is_some() || listeners.authz.is_some();
    let follows_tasks = listeners.ingress.is_some();
    let gateway = Arc::new(Gateway::start(config, addresses, calls_agent).await?);
    let stop = CancellationToken::new();
    let servers = spawn_servers(listeners, &gateway, &stop)?;
    if follows_tasks && !matches!(gateway.upstream, Upstream::None) {
        let changes = gateway
            .watch_receiver
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(changes) = changes {
            tokio::spawn(crate::watcher::run(gateway.clone(), changes, stop.clone()));
        }
        tokio::spawn(ingress::recover(gateway.clone()));
    }
    std::io::stdout().flush()?;
    tracing::info!(agent = %hex::encode(gateway.agent_key), "A2A gateway ready");
    drained(servers, stop, shutdown, DRAIN).await
}

/// Starts a server on each listener, each stopping when `stop` is
/// cancelled; prints where each one is.
fn spawn_servers(
    listeners: Listeners,
    gateway: &Arc<Gateway>,
    stop: &CancellationToken,
) -> anyhow::Result<JoinSet<anyhow::Result<()>>> {
    let max_body = gateway.config.max_message_bytes;
    let limit = axum::extract::DefaultBodyLimit::max(max_body);
    let mut servers = JoinSet::new();
    if let Some(listener) = listeners.ingress {
        let router = axum::Router::new()
            .route(client::CARD_PATH, axum::routing::get(card::ingress_card))
            .route("/", axum::routing::post(jsonrpc::ingress_rpc))
            .layer(limit)
            .with_state(gateway.clone());
        println!("a2a ingress on {}", gateway.addresses.public_url);
        // Requests carry the caller's address (ConnectInfo).
        servers.spawn(serve_http(listener, router, stop.clone()));
    }
    if let Some(listener) = listeners.egress {
        let router = axum::Router::new()
            .route(
                "/peers/{peer}/.well-known/agent-card.json",
                axum::routing::get(card::egress_card),
            )
            .route("/peers/{peer}", axum::routing::post(jsonrpc::egress_rpc))
            .route("/peers/{peer}/", axum::routing::post(jsonrpc::egress_rpc))
            .layer(limit)
            .with_state(gateway.clone());
        println!("a2a egress on {}", gateway.addresses.egress_url);
        servers.spawn(serve_http(listener, router, stop.clone()));
    }
    for (listener, url, role) in [
        (
            listeners.ingress_grpc,
            &gateway.addresses.grpc_url,
            "ingress",
        ),
        (
            listeners.egress_grpc,
            &gateway.addresses.egress_grpc_url,
            "egress",
        ),
    ] {
        let Some(listener) = listener else { continue };
        let service = if role == "ingress" {
            grpc::A2aGrpc::ingress(gateway.clone())
        } else {
            grpc::A2aGrpc::egress(gateway.clone())
        };
        let service = a2a_pb::proto::a2a_service_server::A2aServiceServer::new(service)
            .max_decoding_message_size(max_body);
        println!("a2a {role} grpc on {}", url.as_deref().unwrap_or_default());
        servers.spawn(serve_grpc(listener, service, stop.clone()));
    }
    if let Some(listener) = listeners.metrics {
        let router = axum::Router::new()
            .route("/metrics", axum::routing::get(serve_metrics))
            .with_state(gateway.clone());
        println!("a2a metrics on http://{}/metrics", listener.local_addr()?);
        servers.spawn(serve_http(listener, router, stop.clone()));
    }
    if let Some(listener) = listeners.authz {
        use envoy_types::ext_authz::v3::pb::AuthorizationServer;
        let addr = listener.local_addr()?;
        let service = AuthorizationServer::new(authz::Authz {
            gateway: gateway.clone(),
        })
        .max_decoding_message_size(max_body.saturating_mul(AUTHZ_DECODE_FACTOR));
        println!("a2a authz on {addr}");
        servers.spawn(serve_grpc(listener, service, stop.clone()));
    }
    Ok(servers)
}

/// Waits for `shutdown` (or a server's failure), stops every server, and
/// waits at most `drain` for them to finish their requests; the servers
/// still running then are dropped.
async fn drained(
    mut servers: JoinSet<anyhow::Result<()>>,
    stop: CancellationToken,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) -> anyhow::Result<()> {
    tokio::select! {
        () = shutdown => {}
        Some(done) = servers.join_next() => { done??; }
    }
    stop.cancel();
    let finished = tokio::time::timeout(drain, async {
        while let Some(done) = servers.join_next().await {
            done??;
        }
        anyhow::Ok(())
    })
    .await;
    match finished {
        Ok(served) => served,
        Err(_) => {
            tracing::warn!(
                drain_ms = u64::try_from(drain.as_millis()).unwrap_or(u64::MAX),
                "requests still running after the drain; cut"
            );
            Ok(())
        }
    }
}

/// Serves `router` on `listener` (HTTP/1.1) within the gateways' bounds
/// until `stop` is cancelled. TCP_NODELAY is set: without it a response
/// written in two parts waits for the peer's delayed ACK (tens of ms per
/// hop).
async fn serve_http(
    listener: TcpListener,
    router: axum::Router,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    broker_runtime::listen::serve_gateway_http(listener, router, stop.cancelled_owned()).await;
    Ok(())
}

/// Serves a gRPC `service` on `listener` within the gateways' bounds until
/// `stop` is cancelled.
async fn serve_grpc<S>(
    listener: TcpListener,
    service: S,
    stop: CancellationToken,
) -> anyhow::Result<()>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    use broker_runtime::listen;
    let (incoming, first_request) = listen::incoming(
        listener,
        listen::GATEWAY_BOUNDS,
        listen::Counters::default(),
    );
    Ok(tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(listen::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(listen::KEEPALIVE_TIMEOUT))
        .layer(first_request.layer())
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
        .await?)
}

async fn serve_metrics(State(gateway): State<Arc<Gateway>>) -> Response {
    (
        [(
            http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        gateway.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn run_serves_the_listeners_it_is_given_until_the_shutdown_resolves() {
        // The test's own HTTPS-capable client needs the provider too, and
        // may be built before `run` installs it.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("agent.key");
        broker_client::keys::write_secret(&key, &hex::encode([7u8; 32])).unwrap();
        let config = A2aConfig::parse(&format!(
            "broker = \"http://127.0.0.1:1\"\nkey_file = {:?}\negress_listen = \"127.0.0.1:0\"\n",
            key.display().to_string()
        ))
        .unwrap();
        let egress = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = egress.local_addr().unwrap();
        let listeners = Listeners {
            egress: Some(egress),
            ..Default::default()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(run(listeners, config, async {
            let _ = stopped.await;
        }));
        let card = format!("http://{addr}/peers/nobody/.well-known/agent-card.json");
        let response = reqwest::get(&card).await.unwrap();
        assert_eq!(response.status(), http::StatusCode::NOT_FOUND);
        stop.send(()).unwrap();
        // Nothing in flight: it stops at once, long before the drain's end.
        tokio::time::timeout(DRAIN / 2, served)
            .await
            .expect("stopped")
            .unwrap()
            .unwrap();
        assert!(reqwest::get(&card).await.is_err(), "no longer served");
    }

    #[tokio::test]
    async fn every_server_stops_on_the_one_shutdown_within_one_bounded_drain() {
        // One server finishes its requests in flight after the stop; the
        // other never does: the drain's end cuts it.
        let stop = CancellationToken::new();
        let mut servers = JoinSet::new();
        let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (token, done) = (stop.clone(), finished.clone());
        servers.spawn(async move {
            token.cancelled().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            anyhow::Ok(())
        });
        servers.spawn(std::future::pending());
        let started = tokio::time::Instant::now();
        let drain = Duration::from_millis(300);
        drained(servers, stop.clone(), std::future::ready(()), drain)
            .await
            .unwrap();
        assert!(stop.is_cancelled());
        assert!(finished.load(std::sync::atomic::Ordering::SeqCst));
        let took = started.elapsed();
        assert!(took >= drain && took < drain * 4, "{took:?}");
    }

    #[tokio::test]
    async fn a_server_that_fails_ends_the_run_with_its_error() {
        let stop = CancellationToken::new();
        let mut servers = JoinSet::new();
        servers.spawn(async { Err(anyhow::anyhow!("bind lost")) });
        let token = stop.clone();
        servers.spawn(async move {
            token.cancelled().await;
            anyhow::Ok(())
        });
        let error = drained(servers, stop, std::future::pending(), DRAIN)
            .await
            .unwrap_err();
        assert_eq!(error.to_string(), "bind lost");
    }
}
