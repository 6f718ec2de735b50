//! `delegation-broker a2a-gateway`: the mandatory hop for agents that speak
//! A2A. One process fronts one agent: its ingress admits a task
//! only under a broker-issued contract naming that agent and moves the
//! contract through its lifecycle as the task moves; its egress turns the
//! agent's outbound A2A calls into broker Delegates. The extension it
//! speaks is proto/delegation/broker/v1/a2a-extension.md. It is a client of
//! the broker's public API: the broker learns nothing of A2A.

mod authz;
mod broker;
mod client;
pub mod config;
mod egress;
pub mod ext;
mod grpc;
mod ingress;
mod json;
pub mod metrics;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use a2a_pb::protojson as a2a;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use clap::Args;
use serde_json::{Value, json};

use broker_client::Link;
use broker_domain::Id;
use broker_wire::chain::BrokerKeys;
use broker_wire::pb;
use client::A2aClient;
use config::A2aConfig;
use ext::{Refused, code};

#[derive(Args, Debug, Clone)]
pub struct A2aArgs {
    /// The gateway's TOML configuration (docs/a2a.md).
    #[arg(long)]
    pub config: PathBuf,
    /// Export the spans of its calls over OTLP/gRPC to this collector
    /// (e.g. http://127.0.0.1:4317).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

/// Longest wait for the broker's connection.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Longest one call to the broker may take.
const BROKER_CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
/// The broker's keys are read again at most this often when a chain names
/// a key not yet known (a rotation), so a stream of forged key ids costs
/// one read per interval.
const KEYS_REFRESH_MS: u64 = 5_000;
/// The broker's keys are read again at least this often, so a key retired
/// since (its `retired_at_ms`) is seen by the chain check.
const KEYS_MAX_AGE_MS: u64 = 60_000;
/// Most A2A contexts remembered (egress lookups).
const MAX_CONTEXTS: usize = 65_536;
/// Most contracts remembered in one A2A context; past it the context names
/// no parent at all (an egress message in it must name its contract).
const MAX_CONTRACTS_PER_CONTEXT: usize = 8;

pub fn run(args: A2aArgs) -> anyhow::Result<()> {
    let config = A2aConfig::load(&args.config)?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let format = broker_runtime::telemetry::Logging::from_env()?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async {
            let telemetry =
                broker_runtime::telemetry::init(&format, args.otlp_endpoint.as_deref(), None)?;
            let served = serve(config).await;
            telemetry.shutdown().await;
            served
        })
}

/// One admitted task's contract and how far the gateway moved it.
pub(crate) struct Slot {
    pub contract_id: Id,
    /// The broker tenant whose tree the contract is in (its share of
    /// max_tasks is counted by this name).
    pub tenant: String,
    pub deadline_ms: i64,
    /// The trace of the call that started the task: its lifecycle calls
    /// join it.
    pub trace: Option<String>,
    /// Serializes the lifecycle calls of one task.
    pub progress: tokio::sync::Mutex<(ext::Progress, ext::Judged)>,
    /// The latest task seen, decorated: callers waiting for a settled
    /// state watch it.
    pub latest: tokio::sync::watch::Sender<Option<a2a::Task>>,
    /// The follower stopped: waiting callers take the latest task as is.
    pub finished: std::sync::atomic::AtomicBool,
}

/// What the ingress remembers (in memory: a restart reads the broker).
#[derive(Default)]
pub(crate) struct Admitted {
    /// Task id → its slot. Changed only through `follow` and `forget`,
    /// which keep `per_tenant` counted.
    pub tasks: HashMap<String, Arc<Slot>>,
    /// Broker tenant → how many of `tasks` its contracts hold.
    per_tenant: HashMap<String, usize>,
    /// Contracts bound to a task (or being bound: `None`).
    pub contracts: HashMap<Id, Option<String>>,
    /// A2A context id → the contracts of the tasks admitted in it, each
    /// (context, contract) once. Callers choose context ids, so a context
    /// names the parent of the agent's outbound calls in it only while
    /// one of them is live (egress::parent_of).
    pub contexts: HashMap<String, Context>,
}

impl Admitted {
    /// Follows `slot` as task `task_id`, in place of any slot it had.
    pub fn follow(&mut self, task_id: String, slot: Arc<Slot>) {
        *self.per_tenant.entry(slot.tenant.clone()).or_default() += 1;
        if let Some(old) = self.tasks.insert(task_id, slot) {
            self.uncount(&old.tenant);
        }
    }

    /// Stops following task `task_id`; returns its slot.
    pub fn forget(&mut self, task_id: &str) -> Option<Arc<Slot>> {
        let slot = self.tasks.remove(task_id)?;
        self.uncount(&slot.tenant);
        Some(slot)
    }

    /// How many followed tasks run under contracts of `tenant`.
    pub fn of_tenant(&self, tenant: &str) -> usize {
        self.per_tenant.get(tenant).copied().unwrap_or(0)
    }

    fn uncount(&mut self, tenant: &str) {
        if let Some(count) = self.per_tenant.get_mut(tenant) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.per_tenant.remove(tenant);
            }
        }
    }
}

/// The contracts admitted in one A2A context.
#[derive(Default)]
pub(crate) struct Context {
    pub contracts: Vec<Id>,
    /// More than MAX_CONTRACTS_PER_CONTEXT were admitted: the context
    /// names no parent from then on.
    pub overflowed: bool,
}

/// A task sent to a peer through the egress.
#[derive(Clone)]
pub(crate) struct Sent {
    pub peer: String,
    pub contract_id: Id,
}

pub(crate) struct Gateway {
    pub config: A2aConfig,
    pub link: Link,
    pub agent_key: [u8; 32],
    /// Peers' gateways (connections kept open).
    pub http: A2aClient,
    /// The fronted agent (A2aClient::new says why connections are not
    /// kept by default).
    pub agent_http: A2aClient,
    /// The agent's card as it serves it, and how to call it.
    pub upstream_card: a2a::AgentCard,
    pub upstream: Upstream,
    /// The gRPC ingress and egress addresses, when served.
    pub grpc_url: Option<String>,
    pub egress_grpc_url: Option<String>,
    pub public_url: String,
    pub egress_url: String,
    keys: tokio::sync::Mutex<(BrokerKeys, Option<tokio::time::Instant>)>,
    pub admitted: Mutex<Admitted>,
    pub sent: Mutex<HashMap<String, Sent>>,
    pub metrics: Arc<metrics::GatewayMetrics>,
    /// Requests in progress: in all, and per caller.
    in_flight: Mutex<InFlight>,
}

/// Requests in progress, in all and per caller.
#[derive(Default)]
pub(crate) struct InFlight {
    total: usize,
    per_caller: HashMap<std::net::IpAddr, usize>,
}

impl InFlight {
    /// Counts one more request, or names the limit it would pass.
    fn take(
        &mut self,
        caller: Option<std::net::IpAddr>,
        per_caller: usize,
        total: usize,
    ) -> Result<(), &'static str> {
        if self.total >= total {
            return Err("max_in_flight");
        }
        if let Some(ip) = caller {
            let count = self.per_caller.entry(ip).or_insert(0);
            if *count >= per_caller {
                return Err("max_in_flight_per_caller");
            }
            *count += 1;
        }
        self.total += 1;
        Ok(())
    }

    fn give(&mut self, caller: Option<std::net::IpAddr>) {
        self.total = self.total.saturating_sub(1);
        if let Some(ip) = caller
            && let Some(count) = self.per_caller.get_mut(&ip)
        {
            *count -= 1;
            if *count == 0 {
                self.per_caller.remove(&ip);
            }
        }
    }
}

/// A request's place among those in progress; given back when dropped.
pub(crate) struct Ticket<'a> {
    gateway: &'a Gateway,
    caller: Option<std::net::IpAddr>,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut in_flight = self
            .gateway
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        in_flight.give(self.caller);
    }
}

/// How the gateway calls the fronted agent.
pub(crate) enum Upstream {
    /// No ingress: nothing to call.
    None,
    JsonRpc(String),
    Grpc(a2a_pb::proto::a2a_service_client::A2aServiceClient<tonic::transport::Channel>),
}

impl Gateway {
    /// Takes a place for one request of `caller`, or refuses it OVERLOADED
    /// at once (max_in_flight_per_caller, max_in_flight): a caller holding
    /// many slow calls open cannot take the gateway from the others.
    pub fn ticket(&self, caller: Option<std::net::IpAddr>) -> Result<Ticket<'_>, Refused> {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        in_flight
            .take(
                caller,
                self.config.max_in_flight_per_caller,
                self.config.max_in_flight,
            )
            .map_err(|limit| {
                Refused::new(
                    code::INTERNAL,
                    "OVERLOADED",
                    format!("too many requests in progress ({limit}): try again later"),
                )
                .with("limit", limit)
            })?;
        Ok(Ticket {
            gateway: self,
            caller,
        })
    }

    /// One call to the fronted agent, in its binding.
    pub async fn upstream_call<P, R>(
        &self,
        method: &str,
        params: &P,
        headers: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<R, client::CallError>
    where
        P: serde::Serialize + prost::Message,
        R: serde::de::DeserializeOwned + prost::Message + Default,
    {
        match &self.upstream {
            Upstream::JsonRpc(url) => self.agent_http.call(url, method, params, headers).await,
            Upstream::Grpc(client) => {
                grpc::call_agent(client, method, params, headers, &self.metrics).await
            }
            Upstream::None => {
                Err(Refused::new(code::INTERNAL, "INTERNAL", "no agent to call").into())
            }
        }
    }

    /// The broker's published keys; read again (at most every
    /// KEYS_REFRESH_MS) when `fresh` asks for it.
    pub async fn keys(&self, fresh: bool) -> Result<BrokerKeys, Refused> {
        let mut keys = self.keys.lock().await;
        let due = keys.1.is_none_or(|at| {
            let age = at.elapsed();
            age > std::time::Duration::from_millis(KEYS_MAX_AGE_MS)
                || (fresh && age > std::time::Duration::from_millis(KEYS_REFRESH_MS))
        });
        if due {
            let published = self
                .link
                .read(|mut client| async move {
                    client.get_broker_keys(pb::GetBrokerKeysRequest {}).await
                })
                .await
                .map_err(broker_error)?
                .into_inner()
                .keys;
            *keys = (
                BrokerKeys::from_published(&published),
                Some(tokio::time::Instant::now()),
            );
        }
        Ok(keys.0.clone())
    }

    /// A contract's current state (a read with the gateway's session).
    pub async fn contract(&self, contract_id: &[u8]) -> Result<pb::ContractState, Refused> {
        let id = contract_id.to_vec();
        self.link
            .read(|mut client| {
                let contract_id = id.clone();
                async move {
                    client
                        .get_contract(pb::GetContractRequest { contract_id })
                        .await
                }
            })
            .await
            .map_err(broker_error)?
            .into_inner()
            .contract
            .ok_or_else(|| Refused::new(code::INTERNAL, "INTERNAL", "GetContract answered nothing"))
    }

    pub fn remember_context(&self, context_id: &str, contract_id: Id) {
        if context_id.is_empty() {
            return;
        }
        let mut admitted = self.admitted.lock().unwrap_or_else(|e| e.into_inner());
        if admitted.contexts.len() >= MAX_CONTEXTS && !admitted.contexts.contains_key(context_id) {
            // Oldest-first eviction would need an order; dropping an
            // arbitrary one keeps memory bounded, and a lookup that misses
            // falls back to the agent's one held contract.
            if let Some(key) = admitted.contexts.keys().next().cloned() {
                admitted.contexts.remove(&key);
            }
        }
        let context = admitted.contexts.entry(context_id.to_owned()).or_default();
        if context.contracts.contains(&contract_id) {
            return;
        }
        if context.contracts.len() >= MAX_CONTRACTS_PER_CONTEXT {
            // Dropping one could leave another caller's contract as the
            // only parent named; naming none fails closed.
            context.overflowed = true;
            return;
        }
        context.contracts.push(contract_id);
    }
}

/// A broker error as an A2A error (the broker's reason kept).
pub(crate) fn broker_error(error: broker_client::BrokerError) -> Refused {
    let code = match error.reason.as_str() {
        "UNAVAILABLE" | "OUTCOME_UNKNOWN" | "INTERNAL" | "OVERLOADED" => code::INTERNAL,
        _ => code::INVALID_PARAMS,
    };
    let mut refused = Refused::new(
        code,
        &error.reason,
        format!("the broker: {}", error.message),
    );
    if let Some(field) = error.field {
        refused = refused.with("field", field);
    }
    refused
}

async fn bind(addr: &str, key: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("{key} {addr}: {e}"))
}

/// Serves `router` on `listener` (HTTP/1.1) within the gateways' bounds
/// until `stop` is cancelled. TCP_NODELAY is set: without it a response
/// written in two parts waits for the peer's delayed ACK (tens of ms per
/// hop).
async fn serve_http(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    broker_runtime::listen::serve_gateway_http(listener, router, stop.cancelled_owned()).await;
    Ok(())
}

/// Serves a gRPC `service` on `listener` within the gateways' bounds until
/// `stop` is cancelled.
async fn serve_grpc<S>(
    listener: tokio::net::TcpListener,
    service: S,
    stop: tokio_util::sync::CancellationToken,
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

async fn serve(config: A2aConfig) -> anyhow::Result<()> {
    let agent = broker_client::keys::agent_from_key_file(&config.key_file)?;
    let agent_key = agent.public_key();
    let channel = tonic::transport::Channel::from_shared(config.broker.clone())?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(BROKER_CALL_TIMEOUT)
        .connect_lazy();
    let link = Link::new(agent, channel);
    let gateway_metrics = Arc::new(metrics::GatewayMetrics::new());
    let http = A2aClient::new(
        config.call_timeout_ms,
        config.max_message_bytes,
        true,
        gateway_metrics.clone(),
    )?;
    let agent_http = A2aClient::new(
        config.call_timeout_ms,
        config.max_message_bytes,
        config.upstream_keep_alive,
        gateway_metrics.clone(),
    )?;
    // The ingress calls the agent; so does the authz, to read which
    // contract a continued task was started under.
    let calls_agent = config.listen.is_some() || config.authz_listen.is_some();
    let (upstream_card, upstream) = match (calls_agent, &config.upstream) {
        (true, Some(upstream)) => {
            let card = http
                .card(upstream)
                .await
                .map_err(|e| anyhow::anyhow!("upstream: {}", e.message))?;
            let interface = |binding: &str| {
                card.supported_interfaces
                    .iter()
                    .find(|i| i.protocol_binding.eq_ignore_ascii_case(binding))
                    .map(|i| i.url.clone())
            };
            let binding = match config.upstream_binding {
                Some(binding) => binding,
                None if interface("JSONRPC").is_some() => config::Binding::Jsonrpc,
                None => config::Binding::Grpc,
            };
            let upstream = match binding {
                config::Binding::Jsonrpc => Upstream::JsonRpc(interface("JSONRPC").ok_or_else(|| {
                    anyhow::anyhow!("upstream: the agent's card lists no JSONRPC interface (supportedInterfaces)")
                })?),
                config::Binding::Grpc => {
                    let url = interface("GRPC").ok_or_else(|| {
                        anyhow::anyhow!("upstream: the agent's card lists no GRPC interface (supportedInterfaces)")
                    })?;
                    let url = if url.contains("://") { url } else { format!("http://{url}") };
                    let channel = tonic::transport::Channel::from_shared(url.clone())
                        .map_err(|e| anyhow::anyhow!("upstream: the agent's GRPC interface {url:?}: {e}"))?
                        .connect_timeout(CONNECT_TIMEOUT)
                        .timeout(std::time::Duration::from_millis(config.call_timeout_ms))
                        .connect_lazy();
                    Upstream::Grpc(
                        a2a_pb::proto::a2a_service_client::A2aServiceClient::new(channel)
                            .max_decoding_message_size(config.max_message_bytes),
                    )
                }
            };
            (card, upstream)
        }
        _ => (a2a::AgentCard::default(), Upstream::None),
    };
    let ingress = match &config.listen {
        Some(addr) => Some(bind(addr, "listen").await?),
        None => None,
    };
    let egress = match &config.egress_listen {
        Some(addr) => Some(bind(addr, "egress_listen").await?),
        None => None,
    };
    let metrics_listener = match &config.metrics_listen {
        Some(addr) => Some(bind(addr, "metrics_listen").await?),
        None => None,
    };
    let grpc = match &config.grpc_listen {
        Some(addr) => Some(bind(addr, "grpc_listen").await?),
        None => None,
    };
    let egress_grpc = match &config.egress_grpc_listen {
        Some(addr) => Some(bind(addr, "egress_grpc_listen").await?),
        None => None,
    };
    let grpc_url = grpc
        .as_ref()
        .map(|l| l.local_addr())
        .transpose()?
        .map(|a| a.to_string());
    let egress_grpc_url = egress_grpc
        .as_ref()
        .map(|l| l.local_addr())
        .transpose()?
        .map(|a| a.to_string());
    let authz = match &config.authz_listen {
        Some(addr) => Some(bind(addr, "authz_listen").await?),
        None => None,
    };
    if let Some(listener) = &egress
        && !listener.local_addr()?.ip().is_loopback()
    {
        // Whoever reaches the egress delegates with the agent's key.
        tracing::warn!(
            addr = %listener.local_addr()?,
            "egress_listen is not a loopback address: only the fronted agent may reach it"
        );
    }
    let egress_url = match &egress {
        Some(listener) => format!("http://{}", listener.local_addr()?),
        None => String::new(),
    };
    let public_url = match (&config.public_url, &ingress) {
        (Some(url), _) => url.clone(),
        (None, Some(listener)) => format!("http://{}", listener.local_addr()?),
        (None, None) => String::new(),
    };
    let max_body = config.max_message_bytes;
    let gateway = Arc::new(Gateway {
        config,
        link,
        agent_key,
        http,
        agent_http,
        upstream_card,
        upstream,
        grpc_url: grpc_url.clone(),
        egress_grpc_url: egress_grpc_url.clone(),
        public_url: public_url.clone(),
        egress_url: egress_url.clone(),
        keys: tokio::sync::Mutex::new((BrokerKeys::default(), None)),
        admitted: Mutex::default(),
        sent: Mutex::default(),
        metrics: gateway_metrics,
        in_flight: Mutex::default(),
    });
    let limit = axum::extract::DefaultBodyLimit::max(max_body);
    let stop = tokio_util::sync::CancellationToken::new();
    let mut servers: tokio::task::JoinSet<anyhow::Result<()>> = tokio::task::JoinSet::new();
    if let Some(ingress) = ingress {
        let router = axum::Router::new()
            .route(client::CARD_PATH, axum::routing::get(ingress_card))
            .route("/", axum::routing::post(ingress_rpc))
            .layer(limit)
            .with_state(gateway.clone());
        println!("a2a ingress on {public_url}");
        let token = stop.clone();
        // Requests carry the caller's address (ConnectInfo).
        servers.spawn(serve_http(ingress, router, token));
    }
    if let Some(egress) = egress {
        let router = axum::Router::new()
            .route(
                "/peers/{peer}/.well-known/agent-card.json",
                axum::routing::get(egress_card),
            )
            .route("/peers/{peer}", axum::routing::post(egress_rpc))
            .route("/peers/{peer}/", axum::routing::post(egress_rpc))
            .layer(limit)
            .with_state(gateway.clone());
        println!("a2a egress on {egress_url}");
        let token = stop.clone();
        servers.spawn(serve_http(egress, router, token));
    }
    for (listener, url, role) in [
        (grpc, &grpc_url, "ingress"),
        (egress_grpc, &egress_grpc_url, "egress"),
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
        let token = stop.clone();
        servers.spawn(serve_grpc(listener, service, token));
    }
    if let Some(listener) = metrics_listener {
        let router = axum::Router::new()
            .route("/metrics", axum::routing::get(serve_metrics))
            .with_state(gateway.clone());
        println!("a2a metrics on http://{}/metrics", listener.local_addr()?);
        let token = stop.clone();
        servers.spawn(serve_http(listener, router, token));
    }
    if let Some(authz) = authz {
        use envoy_types::ext_authz::v3::pb::AuthorizationServer;
        let addr = authz.local_addr()?;
        let service = AuthorizationServer::new(authz::Authz {
            gateway: gateway.clone(),
        })
        .max_decoding_message_size(max_body.saturating_mul(2));
        println!("a2a authz on {addr}");
        let token = stop.clone();
        servers.spawn(serve_grpc(authz, service, token));
    }
    if gateway.config.listen.is_some() && !matches!(gateway.upstream, Upstream::None) {
        tokio::spawn(ingress::recover(gateway.clone()));
    }
    use std::io::Write as _;
    std::io::stdout().flush()?;
    tracing::info!(agent = %hex::encode(agent_key), "A2A gateway ready");
    tokio::select! {
        () = broker_runtime::shutdown::signal() => {}
        Some(done) = servers.join_next() => { done??; }
    }
    stop.cancel();
    while let Some(done) = servers.join_next().await {
        done??;
    }
    Ok(())
}

/// The card a gateway serves for an agent (its own or a peer's): the
/// agent's, with `url` as its only interface, the extension required, and
/// no streaming or push (the gateway answers SendMessage, GetTask and
/// CancelTask).
fn gateway_card(
    mut card: a2a::AgentCard,
    url: &str,
    grpc: Option<(&str, &str)>,
    agent_key: &[u8],
) -> a2a::AgentCard {
    card.supported_interfaces = vec![a2a::AgentInterface {
        url: url.to_owned(),
        protocol_binding: "JSONRPC".into(),
        tenant: String::new(),
        protocol_version: client::PROTOCOL_VERSION.into(),
    }];
    if let Some((grpc_url, tenant)) = grpc {
        card.supported_interfaces.push(a2a::AgentInterface {
            url: grpc_url.to_owned(),
            protocol_binding: "GRPC".into(),
            tenant: tenant.to_owned(),
            protocol_version: client::PROTOCOL_VERSION.into(),
        });
    }
    let capabilities = card.capabilities.get_or_insert_with(Default::default);
    capabilities.streaming = Some(false);
    capabilities.push_notifications = Some(false);
    capabilities.extended_agent_card = Some(false);
    capabilities.extensions.retain(|e| e.uri != ext::URI);
    capabilities.extensions.push(a2a::AgentExtension {
        uri: ext::URI.into(),
        description: "Tasks run only under a delegation-broker contract naming this agent (proto/delegation/broker/v1/a2a-extension.md).".into(),
        required: true,
        params: serde_json::from_value(json!({ "agentPublicKey": hex::encode(agent_key) })).ok(),
    });
    card
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

async fn ingress_card(State(gateway): State<Arc<Gateway>>) -> Response {
    let card = gateway_card(
        gateway.upstream_card.clone(),
        &gateway.public_url,
        gateway.grpc_url.as_deref().map(|url| (url, "")),
        &gateway.agent_key,
    );
    axum::Json(card).into_response()
}

async fn egress_card(State(gateway): State<Arc<Gateway>>, Path(peer): Path<String>) -> Response {
    match egress::card(&gateway, &peer).await {
        Ok(card) => axum::Json(card).into_response(),
        Err(refused) => (
            http::StatusCode::NOT_FOUND,
            axum::Json(json!({"error": refused.to_jsonrpc()})),
        )
            .into_response(),
    }
}

/// One JSON-RPC request, read within its limits.
pub(crate) struct Rpc {
    pub id: Value,
    pub method: String,
    pub params: Value,
    pub headers: http::HeaderMap,
    /// The `traceparent` of the gateway's span for this call (else the
    /// caller's): every call it makes for it carries this one.
    pub trace: Option<String>,
}

fn parse_rpc(
    body: &[u8],
    headers: http::HeaderMap,
    max_bytes: usize,
) -> Result<Rpc, (Value, Refused)> {
    let mut request: Value = json::parse_strict(body, max_bytes).map_err(|e| {
        (
            Value::Null,
            Refused::new(
                code::PARSE_ERROR,
                "UNDECODABLE_MESSAGE",
                json::refusal_text(&e),
            ),
        )
    })?;
    let id = request
        .get_mut("id")
        .map(Value::take)
        .unwrap_or(Value::Null);
    let method = match request.get("method").and_then(Value::as_str) {
        Some(method) if request.get("jsonrpc") == Some(&json!("2.0")) => method.to_owned(),
        _ => {
            return Err((
                id,
                Refused::new(
                    code::INVALID_REQUEST,
                    "INVALID_FIELD",
                    "not a JSON-RPC 2.0 request (jsonrpc \"2.0\" and a method)",
                ),
            ));
        }
    };
    let params = request
        .get_mut("params")
        .map(Value::take)
        .unwrap_or(json!({}));
    Ok(Rpc {
        id,
        method,
        params,
        headers,
        trace: None,
    })
}

fn answer(
    gateway: &Gateway,
    side: metrics::Side,
    id: Value,
    result: Result<Value, client::CallError>,
) -> Response {
    if let Err(client::CallError::Local(refused)) = &result {
        gateway.metrics.refused(side, &refused.reason);
    }
    let body = match result {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err(client::CallError::Remote(error)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": error})
        }
        Err(client::CallError::Local(refused)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": refused.to_jsonrpc()})
        }
    };
    axum::Json(body).into_response()
}

/// Params of one method, as its A2A type.
pub(crate) fn params<T: serde::de::DeserializeOwned>(rpc: &Rpc) -> Result<T, Refused> {
    serde_json::from_value(rpc.params.clone()).map_err(|e| {
        Refused::new(
            code::INVALID_PARAMS,
            "INVALID_FIELD",
            format!("{}: params are not its A2A v1 request ({e})", rpc.method),
        )
    })
}

/// Methods neither side serves, with the reason.
fn unserved(method: &str) -> Option<Refused> {
    let (code, why) = match method {
        "SendStreamingMessage" | "SubscribeToTask" => (
            code::UNSUPPORTED_OPERATION,
            "streaming is not served through the delegation gateway (its card says streaming: false); use SendMessage and GetTask",
        ),
        "CreateTaskPushNotificationConfig"
        | "GetTaskPushNotificationConfig"
        | "ListTaskPushNotificationConfigs"
        | "DeleteTaskPushNotificationConfig" => (
            code::PUSH_NOT_SUPPORTED,
            "push notifications are not served through the delegation gateway",
        ),
        "ListTasks" | "GetExtendedAgentCard" => (
            code::UNSUPPORTED_OPERATION,
            "not served through the delegation gateway: read each task with GetTask",
        ),
        "SendMessage" | "GetTask" | "CancelTask" => return None,
        _ => (code::METHOD_NOT_FOUND, "no such A2A v1 method"),
    };
    Some(Refused::new(code, "INVALID_FIELD", format!("{method}: {why}")).with("field", "method"))
}

async fn ingress_rpc(
    State(gateway): State<Arc<Gateway>>,
    axum::extract::ConnectInfo(caller): axum::extract::ConnectInfo<std::net::SocketAddr>,
    headers: http::HeaderMap,
    body: Bytes,
) -> Response {
    let _ticket = match gateway.ticket(Some(caller.ip())) {
        Ok(ticket) => ticket,
        Err(refused) => {
            return answer(
                &gateway,
                metrics::Side::Ingress,
                Value::Null,
                Err(refused.into()),
            );
        }
    };
    let rpc = match parse_rpc(&body, headers, gateway.config.max_message_bytes) {
        Ok(rpc) => rpc,
        Err((id, refused)) => {
            return answer(&gateway, metrics::Side::Ingress, id, Err(refused.into()));
        }
    };
    if let Some(refused) = unserved(&rpc.method) {
        return answer(
            &gateway,
            metrics::Side::Ingress,
            rpc.id,
            Err(refused.into()),
        );
    }
    let (id, result) = traced_call("ingress", rpc, async |rpc| {
        let result = ingress::handle(&gateway, &rpc).await;
        (rpc, result)
    })
    .await;
    answer(&gateway, metrics::Side::Ingress, id, result)
}

async fn egress_rpc(
    State(gateway): State<Arc<Gateway>>,
    Path(peer): Path<String>,
    headers: http::HeaderMap,
    body: Bytes,
) -> Response {
    let _ticket = match gateway.ticket(None) {
        Ok(ticket) => ticket,
        Err(refused) => {
            return answer(
                &gateway,
                metrics::Side::Egress,
                Value::Null,
                Err(refused.into()),
            );
        }
    };
    let rpc = match parse_rpc(&body, headers, gateway.config.max_message_bytes) {
        Ok(rpc) => rpc,
        Err((id, refused)) => {
            return answer(&gateway, metrics::Side::Egress, id, Err(refused.into()));
        }
    };
    if let Some(refused) = unserved(&rpc.method) {
        return answer(&gateway, metrics::Side::Egress, rpc.id, Err(refused.into()));
    }
    let (id, result) = traced_call("egress", rpc, async |rpc| {
        let result = egress::handle(&gateway, &peer, &rpc).await;
        (rpc, result)
    })
    .await;
    answer(&gateway, metrics::Side::Egress, id, result)
}

/// Headers passed on to the next hop: the W3C trace context (this call's
/// span as the parent, the caller's `tracestate`).
pub(crate) fn passed_headers(rpc: &Rpc) -> Vec<(http::HeaderName, http::HeaderValue)> {
    let mut headers = Vec::new();
    if let Some(value) = rpc.trace.as_deref().and_then(|t| t.parse().ok()) {
        headers.push((http::HeaderName::from_static("traceparent"), value));
        if let Some(state) = rpc.headers.get("tracestate") {
            headers.push((http::HeaderName::from_static("tracestate"), state.clone()));
        }
    }
    headers
}

/// Runs one JSON-RPC call in a span of its own when spans are exported: a
/// child of the caller's `traceparent`, the parent of what the gateway
/// asks the broker, the agent and peers for it.
async fn traced_call<F, Fut>(
    side: &'static str,
    mut rpc: Rpc,
    call: F,
) -> (Value, Result<Value, client::CallError>)
where
    F: FnOnce(Rpc) -> Fut,
    Fut: std::future::Future<Output = (Rpc, Result<Value, client::CallError>)>,
{
    let sent = rpc
        .headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .filter(|v| broker_client::trace::valid_traceparent(v))
        .map(str::to_owned);
    let name = match (side, rpc.method.as_str()) {
        ("ingress", "SendMessage") => "a2a.gateway/ingress/SendMessage",
        ("ingress", "GetTask") => "a2a.gateway/ingress/GetTask",
        ("ingress", _) => "a2a.gateway/ingress/CancelTask",
        (_, "SendMessage") => "a2a.gateway/egress/SendMessage",
        (_, "GetTask") => "a2a.gateway/egress/GetTask",
        _ => "a2a.gateway/egress/CancelTask",
    };
    let mut span = broker_runtime::telemetry::StepSpan::start(name, sent.as_deref());
    rpc.trace = span.as_ref().map(|s| s.traceparent()).or(sent);
    let (rpc, result) = call(rpc).await;
    if let Some(mut span) = span.take() {
        let outcome = match &result {
            Ok(_) => "ok".to_owned(),
            Err(client::CallError::Local(refused)) => refused.reason.clone(),
            Err(client::CallError::Remote(_)) => "agent_error".to_owned(),
        };
        span.attribute("a2a.outcome", outcome);
        span.end();
    }
    (rpc.id, result)
}

/// Now, in Unix milliseconds.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_caller_cannot_take_every_place() {
        let (a, b): (std::net::IpAddr, std::net::IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut in_flight = InFlight::default();
        assert_eq!(in_flight.take(Some(a), 2, 3), Ok(()));
        assert_eq!(in_flight.take(Some(a), 2, 3), Ok(()));
        assert_eq!(
            in_flight.take(Some(a), 2, 3),
            Err("max_in_flight_per_caller")
        );
        assert_eq!(in_flight.take(Some(b), 2, 3), Ok(()));
        assert_eq!(in_flight.take(Some(b), 2, 3), Err("max_in_flight"));
        in_flight.give(Some(a));
        assert_eq!(in_flight.take(Some(b), 2, 3), Ok(()));
        for ip in [a, b, b] {
            in_flight.give(Some(ip));
        }
        assert_eq!(in_flight.total, 0);
        assert!(in_flight.per_caller.is_empty());
    }

    #[test]
    fn followed_tasks_are_counted_by_tenant() {
        let slot = |tenant: &str| {
            Arc::new(Slot {
                contract_id: [0; 32],
                tenant: tenant.to_owned(),
                deadline_ms: 0,
                trace: None,
                progress: tokio::sync::Mutex::default(),
                latest: tokio::sync::watch::Sender::new(None),
                finished: std::sync::atomic::AtomicBool::new(false),
            })
        };
        let mut admitted = Admitted::default();
        admitted.follow("t1".into(), slot("open"));
        admitted.follow("t2".into(), slot("open"));
        admitted.follow("t3".into(), slot("acme"));
        assert_eq!(
            (admitted.of_tenant("open"), admitted.of_tenant("acme")),
            (2, 1)
        );
        // The same task again, now another tenant's: counted once.
        admitted.follow("t2".into(), slot("acme"));
        assert_eq!(
            (admitted.of_tenant("open"), admitted.of_tenant("acme")),
            (1, 2)
        );
        assert!(admitted.forget("t1").is_some());
        assert!(admitted.forget("t1").is_none());
        assert_eq!(admitted.of_tenant("open"), 0);
        assert!(!admitted.per_tenant.contains_key("open"), "none kept at 0");
    }

    #[test]
    fn a_gateway_card_lists_its_own_interfaces_and_requires_the_extension() {
        let card = a2a::AgentCard {
            name: "worker".into(),
            supported_interfaces: vec![a2a::AgentInterface {
                url: "http://10.0.0.9:1".into(),
                protocol_binding: "JSONRPC".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let served = gateway_card(card, "http://gw:1", Some(("gw:2", "worker-a")), &[7; 32]);
        let urls: Vec<_> = served
            .supported_interfaces
            .iter()
            .map(|i| {
                (
                    i.url.as_str(),
                    i.protocol_binding.as_str(),
                    i.tenant.as_str(),
                )
            })
            .collect();
        assert_eq!(
            urls,
            [("http://gw:1", "JSONRPC", ""), ("gw:2", "GRPC", "worker-a")]
        );
        let capabilities = served.capabilities.unwrap();
        assert_eq!(capabilities.streaming, Some(false));
        let extension = &capabilities.extensions[0];
        assert!(extension.required && extension.uri == ext::URI);
    }
}
