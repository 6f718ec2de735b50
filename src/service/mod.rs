//! The tonic adapter: decodes and authenticates requests, converts them to
//! core types, calls the store, and maps every error in one place
//! (`error`). The only module that knows tonic. This file holds the
//! service's state and wiring; each request family is a file:
//! `issuance` (OpenRoot, Delegate), `lifecycle` (the seven transitions),
//! `reads`, `watch`, `audit`, `keys` (keys and sessions); `access` is who
//! may read or act.

mod access;
pub mod audit;
pub mod auth;
pub mod convert;
pub mod error;
pub mod floor;
mod gate;
pub mod health;
mod identity;
mod issuance;
mod keys;
mod lifecycle;
mod limits;
mod reads;
pub mod session;
pub mod transport;
mod watch;
mod watch_contracts;

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::clock::Clock;
use crate::config::Config;
use crate::pb;
use crate::pb::broker_server::Broker;
use crate::store::Store;
use error::ServiceError;

pub use crate::core::limits::KEYS_MAX_AGE_MS;
pub use keys::PublishedKeys;

/// The broker's gRPC service over a store.
pub struct BrokerService<S> {
    store: Arc<S>,
    config: Arc<Config>,
    clock: Arc<dyn Clock>,
    /// Published verifying keys, current first: this broker's (rotation
    /// happens offline), or, on a replicated broker, every replica's,
    /// refreshed from the shared database.
    keys: PublishedKeys,
    /// Attestation envelopes whose signature already verified.
    verified: Arc<convert::VerifiedAttestations>,
    /// Issues and checks read sessions (who is reading).
    sessions: session::Sessions,
    /// (contract, agent) pairs already found to be a party of the
    /// contract's tree: being a party never ends, so a hit needs no read.
    parties: std::sync::Mutex<std::collections::HashSet<(crate::core::Id, crate::core::AgentKey)>>,
    /// Threads that convert Delegate bodies (schema compilation, predicate
    /// composition), MAX_CONCURRENT_CONVERSIONS at once.
    converters: crate::pool::WorkPool,
    /// Watch streams, broker-wide and per caller (session key).
    watch_callers: Arc<crate::slots::Slots<crate::core::AgentKey>>,
    /// Watch streams per tree (root id).
    watch_trees: Arc<crate::slots::Slots<crate::core::Id>>,
    /// Watch streams per client connection (peer address).
    watch_connections: Arc<crate::slots::Slots<std::net::SocketAddr>>,
    /// Audit calls running, broker-wide and per caller.
    audits: Arc<crate::slots::Slots<crate::core::AgentKey>>,
    /// Audits running at once, handed out fairly among tenants.
    audit_turns: crate::pool::FairQueue,
    /// Places at work for requests that read or write the store, handed
    /// out by tenant in turn.
    gate: Arc<gate::Gate>,
    /// Turns true when the server shuts down: Watch streams end then, or
    /// graceful shutdown would wait on them forever.
    stopping: tokio::sync::watch::Receiver<bool>,
    /// Counts issuances, refusals and transitions (`/metrics`).
    metrics: Arc<crate::metrics::Metrics>,
    /// The issuers BindIdentity trusts; none when `[identity]` names none.
    identities: Option<Arc<crate::identity::Issuers>>,
}

impl<S> BrokerService<S> {
    pub fn new(
        store: Arc<S>,
        config: Arc<Config>,
        clock: Arc<dyn Clock>,
        keys: PublishedKeys,
        stopping: tokio::sync::watch::Receiver<bool>,
        converters: crate::pool::WorkPool,
        sessions: session::Sessions,
    ) -> Self {
        Self {
            metrics: crate::metrics::Metrics::new(),
            sessions,
            parties: std::sync::Mutex::default(),
            stopping,
            // The broker-wide cap is held here, with a reserve for
            // tenants that hold almost no streams (see `Reserve`).
            watch_callers: crate::slots::Slots::with_reserve(
                config.limits.max_watch_streams,
                crate::config::keys::max_watch_streams,
                config.limits.max_watch_streams_per_caller,
                crate::config::keys::max_watch_streams_per_caller,
                crate::slots::Reserve {
                    slots: config.limits.max_watch_streams / limits::WATCH_RESERVE_DIVISOR,
                    small_share: limits::WATCH_SMALL_SHARE,
                },
            ),
            watch_trees: crate::slots::Slots::new(
                usize::MAX,
                crate::config::keys::max_watch_streams,
                config.limits.max_watch_streams_per_tree,
                crate::config::keys::max_watch_streams_per_tree,
            ),
            watch_connections: crate::slots::Slots::new(
                usize::MAX,
                crate::config::keys::max_watch_streams,
                config.limits.max_watch_streams_per_connection,
                crate::config::keys::max_watch_streams_per_connection,
            ),
            // Per caller only: the broker-wide bound is `audit_turns`.
            audits: crate::slots::Slots::new(
                usize::MAX,
                crate::config::keys::max_concurrent_audits,
                config.limits.max_concurrent_audits_per_caller,
                crate::config::keys::max_concurrent_audits_per_caller,
            ),
            audit_turns: crate::pool::FairQueue::new(config.limits.max_concurrent_audits),
            gate: Arc::new(gate::Gate::new(
                config.limits.max_requests_at_work,
                config.limits.admission_wait_ms,
            )),
            store,
            config,
            clock,
            keys,
            verified: Arc::default(),
            converters,
            identities: None,
        }
    }
}

impl<S> BrokerService<S> {
    /// Counts into `metrics` (the registry `/metrics` serves) instead of a
    /// registry of its own.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Binds keys to workload identities with `issuers` (`[identity]`).
    pub fn with_identities(mut self, issuers: Arc<crate::identity::Issuers>) -> Self {
        self.identities = (!issuers.is_empty()).then_some(issuers);
        self
    }

    /// The broker-wide count of open Watch streams (for a gauge).
    pub fn watch_streams(&self) -> Arc<crate::slots::Slots<crate::core::AgentKey>> {
        self.watch_callers.clone()
    }
}

/// The generated trait's methods, each a call of the handler named
/// beside it (the handlers take the request; each answer is wrapped, each
/// `ServiceError` mapped by its one `From`).
macro_rules! broker_rpcs {
    ($($rpc:ident($request:ident) -> $response:ident = |$this:ident, $req:ident| $handler:expr;)*) => {
        #[tonic::async_trait]
        impl<S: Store> Broker for BrokerService<S> {
            type WatchStream = std::pin::Pin<
                Box<dyn tokio_stream::Stream<Item = Result<pb::WatchResponse, Status>> + Send>,
            >;
            $(
                async fn $rpc(
                    &self,
                    request: Request<pb::$request>,
                ) -> Result<Response<pb::$response>, Status> {
                    let ($this, $req) = (self, request);
                    Ok(Response::new($handler.await?))
                }
            )*
            async fn watch(
                &self,
                request: Request<pb::WatchRequest>,
            ) -> Result<Response<Self::WatchStream>, Status> {
                Ok(Response::new(BrokerService::watch(self, request).await?))
            }
            type WatchContractsStream = watch_contracts::ContractsStream;
            async fn watch_contracts(
                &self,
                request: Request<tonic::Streaming<pb::WatchContractsRequest>>,
            ) -> Result<Response<Self::WatchContractsStream>, Status> {
                Ok(Response::new(BrokerService::watch_contracts(self, request).await?))
            }
        }
    };
}

broker_rpcs! {
    open_root(OpenRootRequest) -> OpenRootResponse = |s, r| BrokerService::open_root(s, r.into_inner());
    delegate(DelegateRequest) -> DelegateResponse = |s, r| BrokerService::delegate(s, r.into_inner());
    accept(AcceptRequest) -> AcceptResponse = |s, r| s.transition(r);
    decline(DeclineRequest) -> DeclineResponse = |s, r| s.transition(r);
    complete(CompleteRequest) -> CompleteResponse = |s, r| s.transition(r);
    adjudicate(AdjudicateRequest) -> AdjudicateResponse = |s, r| s.transition(r);
    escalate(EscalateRequest) -> EscalateResponse = |s, r| s.transition(r);
    revoke(RevokeRequest) -> RevokeResponse = |s, r| s.transition(r);
    record_receipts(RecordReceiptsRequest) -> RecordReceiptsResponse = |s, r| s.transition(r);
    get_contract(GetContractRequest) -> GetContractResponse = |s, r| BrokerService::get_contract(s, r);
    get_chain(GetChainRequest) -> GetChainResponse = |s, r| BrokerService::get_chain(s, r);
    list_children(ListChildrenRequest) -> ListChildrenResponse = |s, r| BrokerService::list_children(s, r);
    list_roots(ListRootsRequest) -> ListRootsResponse = |s, r| BrokerService::list_roots(s, r);
    list_held(ListHeldRequest) -> ListHeldResponse = |s, r| BrokerService::list_held(s, r);
    get_receipt(GetReceiptRequest) -> GetReceiptResponse = |s, r| BrokerService::get_receipt(s, r);
    get_audit(GetAuditRequest) -> GetAuditResponse = |s, r| BrokerService::get_audit(s, r);
    aggregate_audits(AggregateAuditsRequest) -> AggregateAuditsResponse = |s, r| BrokerService::aggregate_audits(s, r);
    open_session(OpenSessionRequest) -> OpenSessionResponse = |s, r| BrokerService::open_session(s, r);
    bind_identity(BindIdentityRequest) -> BindIdentityResponse = |s, r| BrokerService::bind_identity(s, r.into_inner());
    get_broker_keys(GetBrokerKeysRequest) -> GetBrokerKeysResponse = |s, _r| async { Ok::<_, ServiceError>(BrokerService::get_broker_keys(s).await) };
}
