//! What the gateway holds while it runs: the link to the broker, the
//! clients of the agent and the peers, the broker's keys, the tasks it
//! follows and the contexts they run in, the tasks sent through the
//! egress, and the requests in progress. Built once at start
//! (`Gateway::start`), shared by every listener.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use a2a_pb::protojson as a2a;

use crate::client::{self, A2aClient};
use crate::config::{self, A2aConfig};
use crate::ext::{self, Refused, code};
use crate::{broker_error, grpc, metrics};
use broker_client::Link;
use broker_domain::{AgentKey, Id};
use broker_wire::chain::BrokerKeys;
use broker_wire::pb;

/// Longest wait for a connection to the broker, the agent or a peer.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest one call to the broker may take.
const BROKER_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// The broker's keys are read again at most this often when a chain names
/// a key not yet known (a rotation), so a stream of forged key ids costs
/// one read per interval.
const KEYS_REFRESH_MS: u64 = 5_000;
/// The broker's keys are read again at least this often, so a key retired
/// since (its `retired_at_ms`) is seen by the chain check.
const KEYS_MAX_AGE_MS: u64 = 60_000;
/// Most A2A contexts remembered (egress lookups).
const MAX_CONTEXTS: usize = 65_536;
/// Contracts whose terms are kept (`Gateway::terms_of`): the parents the
/// egress delegates from.
const MAX_KEPT_TERMS: usize = 1_024;
/// Most contracts remembered in one A2A context; past it the context names
/// no parent at all (an egress message in it must name its contract).
pub(crate) const MAX_CONTRACTS_PER_CONTEXT: usize = 8;

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
    /// The events of a streaming agent's task, relayed with the broker's
    /// word as the follower reads them: callers' streams subscribe.
    pub events: tokio::sync::broadcast::Sender<Arc<a2a::StreamResponse>>,
    /// The contract's status as the gateway's WatchContracts stream last
    /// brought it (`watcher`); `None` before its first state.
    pub status: tokio::sync::watch::Sender<Option<i32>>,
    /// The contract is on its way to the stream (queued, not dropped):
    /// its first state will come while the stream stays open.
    pub watched: std::sync::atomic::AtomicBool,
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
    /// The contract the task was delegated from: the calls about it are
    /// made under it (their token is minted for it).
    pub parent_id: Id,
}

pub(crate) struct Gateway {
    pub config: A2aConfig,
    pub link: Link,
    pub agent_key: AgentKey,
    /// Peers' gateways (connections kept open).
    pub http: A2aClient,
    /// The fronted agent (A2aClient::new says why connections are not
    /// kept by default).
    pub agent_http: A2aClient,
    /// The agent's card as it serves it, and how to call it.
    pub upstream_card: a2a::AgentCard,
    pub upstream: Upstream,
    /// Where the gateway is reached (the URLs its cards name).
    pub addresses: Addresses,
    keys: tokio::sync::Mutex<(BrokerKeys, Option<tokio::time::Instant>)>,
    pub admitted: Mutex<Admitted>,
    pub sent: Mutex<HashMap<String, Sent>>,
    /// Contracts' terms, read once (`terms_of`).
    terms: Mutex<HashMap<Id, Arc<pb::Contract>>>,
    /// Parents' chains, their signed contracts only, read once
    /// (`chain_below`).
    chains: Mutex<crate::chains::KeptChains>,
    /// Tokens for the calls to peers whose routes ask for one.
    pub peer_tokens: HashMap<String, crate::bearer::PeerToken>,
    pub metrics: Arc<metrics::GatewayMetrics>,
    /// Requests in progress: in all, and per caller.
    in_flight: Mutex<InFlight>,
    /// Contracts to start and stop watching (`watcher`), and the receiving
    /// end until the watcher takes it.
    watch_changes: broker_client::watch::Changes,
    pub watch_receiver: Mutex<Option<broker_client::watch::Receiver>>,
    /// The WatchContracts stream is open: slots' statuses are current.
    pub watching: std::sync::atomic::AtomicBool,
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

/// A request's place among those in progress, held by the call (or by
/// its stream, as long as it is served); given back when dropped.
pub(crate) struct OwnedTicket {
    gateway: Arc<Gateway>,
    caller: Option<std::net::IpAddr>,
}

impl Drop for OwnedTicket {
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

/// Where the gateway is reached, from its listeners: the URLs the cards
/// it serves name.
#[derive(Debug, Default)]
pub(crate) struct Addresses {
    /// The ingress (JSON-RPC): `public_url`, else http://<listen>.
    pub public_url: String,
    /// The egress base (http://<egress_listen>); peers are under it.
    pub egress_url: String,
    /// The gRPC ingress and egress addresses, when served.
    pub grpc_url: Option<String>,
    pub egress_grpc_url: Option<String>,
}

impl Gateway {
    /// Reads the agent's key, opens the broker's connection (lazily) and,
    /// when the gateway calls the agent (`calls_agent`: it serves an
    /// ingress or an authz), reads the agent's card to learn how.
    pub async fn start(
        config: A2aConfig,
        addresses: Addresses,
        calls_agent: bool,
    ) -> anyhow::Result<Self> {
        let agent = broker_client::keys::agent_from_key_file(&config.key_file)?;
        let agent_key = agent.public_key();
        // TLS for an https:// broker from BROKER_CA_FILE,
        // BROKER_CLIENT_CERT and BROKER_CLIENT_KEY, read off the workers.
        let tls = tokio::task::spawn_blocking(broker_client::channel::Tls::from_env).await??;
        let channel = broker_client::channel::lazy(
            &config.broker,
            CONNECT_TIMEOUT,
            BROKER_CALL_TIMEOUT,
            &tls,
        )?;
        let link = Link::new(agent, channel);
        let metrics = Arc::new(metrics::GatewayMetrics::new());
        let http = A2aClient::new(
            config.call_timeout_ms,
            config.max_message_bytes,
            true,
            metrics.clone(),
        )?;
        let agent_http = A2aClient::new(
            config.call_timeout_ms,
            config.max_message_bytes,
            config.upstream_keep_alive,
            metrics.clone(),
        )?;
        let (upstream_card, upstream) = match (calls_agent, &config.upstream) {
            (true, Some(base)) => upstream(&config, &http, base).await?,
            _ => (a2a::AgentCard::default(), Upstream::None),
        };
        let peer_tokens = crate::bearer::peer_tokens(&config)?;
        let (watch_changes, watch_receiver) = broker_client::watch::changes();
        Ok(Self {
            config,
            link,
            agent_key,
            http,
            agent_http,
            upstream_card,
            upstream,
            addresses,
            keys: tokio::sync::Mutex::new((BrokerKeys::default(), None)),
            admitted: Mutex::default(),
            sent: Mutex::default(),
            terms: Mutex::default(),
            chains: Mutex::default(),
            peer_tokens,
            metrics,
            in_flight: Mutex::default(),
            watch_changes,
            watch_receiver: Mutex::new(Some(watch_receiver)),
            watching: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Starts or stops watching a contract; a change the queue has no room
    /// for (or that no stream will take: the gateway is stopping) is
    /// dropped, and the contract's follower reads it instead.
    pub fn watch(&self, change: broker_client::watch::Change) -> bool {
        let queued = self.watch_changes.send(change);
        if !queued {
            tracing::warn!(
                "the contract watch queue is full or closed: a follower reads its contract instead"
            );
        }
        queued
    }

    /// A followed contract's status: as the WatchContracts stream brought
    /// it while the stream is open (`None` while its first state is on its
    /// way: nothing is read meanwhile), else read from the broker.
    pub async fn broker_status(&self, slot: &Slot) -> Result<Option<i32>, Refused> {
        use std::sync::atomic::Ordering;
        let watched = *slot.status.borrow();
        if self.watching.load(Ordering::Acquire) {
            match watched {
                Some(status) => return Ok(Some(status)),
                None if slot.watched.load(Ordering::Acquire) => return Ok(None),
                None => {}
            }
        }
        Ok(Some(self.contract(&slot.contract_id).await?.status))
    }

    /// Takes a place for one request of `caller`, or refuses it OVERLOADED
    /// at once (max_in_flight_per_caller, max_in_flight): a caller holding
    /// many slow calls open cannot take the gateway from the others.
    pub fn owned_ticket(
        self: &Arc<Self>,
        caller: Option<std::net::IpAddr>,
    ) -> Result<OwnedTicket, Refused> {
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
        Ok(OwnedTicket {
            gateway: self.clone(),
            caller,
        })
    }

    /// Whether the fronted agent streams (its card says so): its tasks are
    /// followed by their stream, and the gateway's card says streaming.
    pub fn streams_upstream(&self) -> bool {
        self.upstream_card
            .capabilities
            .as_ref()
            .and_then(|c| c.streaming)
            == Some(true)
    }

    /// A streaming call to the fronted agent, in its binding.
    pub async fn upstream_stream<P>(
        &self,
        method: &str,
        params: &P,
        headers: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<crate::stream::Events, client::CallError>
    where
        P: serde::Serialize + prost::Message,
    {
        match &self.upstream {
            Upstream::JsonRpc(url) => self.agent_http.stream(url, method, params, headers).await,
            Upstream::Grpc(client) => {
                grpc::stream_agent(client, method, params, headers, &self.metrics).await
            }
            Upstream::None => {
                Err(Refused::new(code::INTERNAL, "INTERNAL", "no agent to call").into())
            }
        }
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

    /// The agent's task `task_id` (its GetTask); `None` however that
    /// fails: a caller answers it as a task it does not know.
    pub async fn upstream_task(&self, task_id: &str) -> Option<a2a::Task> {
        let get = a2a::GetTaskRequest {
            id: task_id.to_owned(),
            ..Default::default()
        };
        self.upstream_call("GetTask", &get, &[]).await.ok()
    }

    /// The broker's published keys; read again (at most every
    /// KEYS_REFRESH_MS) when `fresh` asks for it.
    pub async fn keys(&self, fresh: bool) -> Result<BrokerKeys, Refused> {
        let mut keys = self.keys.lock().await;
        let due = keys.1.is_none_or(|at| {
            let age = at.elapsed();
            age > Duration::from_millis(KEYS_MAX_AGE_MS)
                || (fresh && age > Duration::from_millis(KEYS_REFRESH_MS))
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

    /// A contract's terms (its signed, unchanging part), read once: from
    /// `state` when the caller has just read it, else from the broker.
    pub async fn terms_of(
        &self,
        id: &Id,
        state: Option<&pb::ContractState>,
    ) -> Result<Arc<pb::Contract>, Refused> {
        let known = self
            .terms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned();
        if let Some(terms) = known {
            return Ok(terms);
        }
        let read;
        let state = match state {
            Some(state) => state,
            None => {
                read = self.contract(id).await?;
                &read
            }
        };
        let terms = broker_client::terms(state.contract.as_ref()).ok_or_else(|| {
            Refused::new(
                code::INTERNAL,
                "INTERNAL",
                "the broker sent a contract that does not decode",
            )
        })?;
        let terms = Arc::new(terms);
        let mut kept = self.terms.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() >= MAX_KEPT_TERMS {
            // Which ones go matters little: a dropped one is read again.
            kept.clear();
        }
        kept.insert(*id, terms.clone());
        Ok(terms)
    }

    /// The chain of a contract just issued below `parent_id`, as a
    /// task-starting message carries it: the parent's chain (read once: a
    /// chain never changes) and the child's signed contract, from the
    /// Delegate's answer. Only the signed contracts go: the rest of a
    /// ContractState is the broker's unsigned word of the moment, which a
    /// receiver reads for itself.
    pub async fn chain_below(
        &self,
        parent_id: &Id,
        child: pb::IssuedContract,
    ) -> Result<pb::GetChainResponse, broker_client::BrokerError> {
        let known = self
            .chains
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(parent_id);
        let above = match known {
            Some(above) => above,
            None => {
                let read = crate::broker::chain(&self.link, parent_id).await?;
                let above: Arc<Vec<_>> =
                    Arc::new(read.chain.into_iter().map(signed_only).collect());
                self.chains
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .keep(*parent_id, above.clone());
                above
            }
        };
        let mut chain = Vec::with_capacity(above.len() + 1);
        chain.extend(above.iter().cloned());
        chain.push(pb::ContractState {
            contract_id: child.contract_id,
            contract: child.contract,
            ..Default::default()
        });
        Ok(pb::GetChainResponse { chain })
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

/// Longest pause between two asks for the agent's card while waiting.
const UPSTREAM_RETRY_CAP_MS: u64 = 2_000;

/// The agent's card, asked again with backoff for up to `wait_ms` while
/// the agent does not answer (it may start after the gateway).
async fn agent_card(http: &A2aClient, base: &str, wait_ms: u64) -> anyhow::Result<a2a::AgentCard> {
    let until = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
    let mut pause_ms = 100;
    loop {
        match http.card(base).await {
            Ok(card) => return Ok(card),
            Err(e) if tokio::time::Instant::now() >= until => {
                anyhow::bail!(
                    "upstream: {} (waited {wait_ms} ms: upstream_wait_ms)",
                    e.message
                )
            }
            Err(e) => {
                if pause_ms == 100 {
                    tracing::warn!(upstream = %base, error = %e.message, "waiting for the agent");
                }
                tokio::time::sleep(Duration::from_millis(pause_ms)).await;
                pause_ms = (pause_ms * 2).min(UPSTREAM_RETRY_CAP_MS);
            }
        }
    }
}

/// The agent's card, read from its base URL, and how to call it: in the
/// binding the config names, else JSON-RPC when the card lists it, else
/// gRPC.
async fn upstream(
    config: &A2aConfig,
    http: &A2aClient,
    base: &str,
) -> anyhow::Result<(a2a::AgentCard, Upstream)> {
    let card = agent_card(http, base, config.upstream_wait_ms).await?;
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
            anyhow::anyhow!(
                "upstream: the agent's card lists no JSONRPC interface (supportedInterfaces)"
            )
        })?),
        config::Binding::Grpc => {
            let url = interface("GRPC").ok_or_else(|| {
                anyhow::anyhow!(
                    "upstream: the agent's card lists no GRPC interface (supportedInterfaces)"
                )
            })?;
            let url = if url.contains("://") {
                url
            } else {
                format!("http://{url}")
            };
            let channel = tonic::transport::Channel::from_shared(url.clone())
                .map_err(|e| anyhow::anyhow!("upstream: the agent's GRPC interface {url:?}: {e}"))?
                .connect_timeout(CONNECT_TIMEOUT)
                .timeout(Duration::from_millis(config.call_timeout_ms))
                .connect_lazy();
            Upstream::Grpc(
                a2a_pb::proto::a2a_service_client::A2aServiceClient::new(channel)
                    .max_decoding_message_size(config.max_message_bytes),
            )
        }
    };
    Ok((card, upstream))
}

/// A chain's hop as a message carries it: its id and signed contract.
fn signed_only(state: pb::ContractState) -> pb::ContractState {
    pb::ContractState {
        contract_id: state.contract_id,
        contract: state.contract,
        ..Default::default()
    }
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
                events: tokio::sync::broadcast::Sender::new(1),
                status: tokio::sync::watch::Sender::new(None),
                watched: std::sync::atomic::AtomicBool::new(false),
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
}
