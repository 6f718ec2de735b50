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
mod issuance;
mod keys;
mod lifecycle;
mod limits;
mod reads;
pub mod session;
pub mod transport;
mod watch;

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::clock::Clock;
use crate::config::Config;
use crate::pb;
use crate::pb::broker_server::Broker;
use crate::store::Store;

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

    /// The broker-wide count of open Watch streams (for a gauge).
    pub fn watch_streams(&self) -> Arc<crate::slots::Slots<crate::core::AgentKey>> {
        self.watch_callers.clone()
    }
}

#[tonic::async_trait]
impl<S: Store> Broker for BrokerService<S> {
    async fn open_root(
        &self,
        request: Request<pb::OpenRootRequest>,
    ) -> Result<Response<pb::OpenRootResponse>, Status> {
        Ok(Response::new(
            BrokerService::open_root(self, request.into_inner()).await?,
        ))
    }

    async fn delegate(
        &self,
        request: Request<pb::DelegateRequest>,
    ) -> Result<Response<pb::DelegateResponse>, Status> {
        Ok(Response::new(
            BrokerService::delegate(self, request.into_inner()).await?,
        ))
    }

    async fn accept(
        &self,
        request: Request<pb::AcceptRequest>,
    ) -> Result<Response<pb::AcceptResponse>, Status> {
        Ok(Response::new(self.transition(request).await?))
    }

    async fn decline(
        &self,
        request: Request<pb::DeclineRequest>,
    ) -> Result<Response<pb::DeclineResponse>, Status> {
        Ok(Response::new(self.transition(request).await?))
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        Ok(Response::new(self.transition(request).await?))
    }

    async fn adjudicate(
        &self,
        request: Request<pb::AdjudicateRequest>,
    ) -> Result<Response<pb::AdjudicateResponse>, Status> {
        Ok(Response::new(self.transition(request).await?))
    }

    async fn escalate(
        &self,
        request: Request<pb::EscalateRequest>,
    ) -> Result<Response<pb::EscalateResponse>, Status> {
        Ok(Response::new(self.transition(request).await?))
    }

    async fn revoke(
        &self,
        request: Request<pb::RevokeRequest>,
    ) -> Result<Response<pb::RevokeResponse>, Status> {
        Ok(Response::new(self.transition(request).await?))
    }

    async fn record_receipts(
        &self,
        request: Request<pb::RecordReceiptsRequest>,
    ) -> Result<Response<pb::RecordReceiptsResponse>, Status> {
        Ok(Response::new(self.transition(request).await?))
    }

    type WatchStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::WatchResponse, Status>> + Send>,
    >;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Ok(Response::new(BrokerService::watch(self, request).await?))
    }

    async fn get_contract(
        &self,
        request: Request<pb::GetContractRequest>,
    ) -> Result<Response<pb::GetContractResponse>, Status> {
        Ok(Response::new(
            BrokerService::get_contract(self, request).await?,
        ))
    }

    async fn get_chain(
        &self,
        request: Request<pb::GetChainRequest>,
    ) -> Result<Response<pb::GetChainResponse>, Status> {
        Ok(Response::new(
            BrokerService::get_chain(self, request).await?,
        ))
    }

    async fn list_children(
        &self,
        request: Request<pb::ListChildrenRequest>,
    ) -> Result<Response<pb::ListChildrenResponse>, Status> {
        Ok(Response::new(
            BrokerService::list_children(self, request).await?,
        ))
    }

    async fn list_roots(
        &self,
        request: Request<pb::ListRootsRequest>,
    ) -> Result<Response<pb::ListRootsResponse>, Status> {
        Ok(Response::new(
            BrokerService::list_roots(self, request).await?,
        ))
    }

    async fn list_held(
        &self,
        request: Request<pb::ListHeldRequest>,
    ) -> Result<Response<pb::ListHeldResponse>, Status> {
        Ok(Response::new(
            BrokerService::list_held(self, request).await?,
        ))
    }

    async fn get_receipt(
        &self,
        request: Request<pb::GetReceiptRequest>,
    ) -> Result<Response<pb::GetReceiptResponse>, Status> {
        Ok(Response::new(
            BrokerService::get_receipt(self, request).await?,
        ))
    }

    async fn get_audit(
        &self,
        request: Request<pb::GetAuditRequest>,
    ) -> Result<Response<pb::GetAuditResponse>, Status> {
        Ok(Response::new(
            BrokerService::get_audit(self, request).await?,
        ))
    }

    async fn aggregate_audits(
        &self,
        request: Request<pb::AggregateAuditsRequest>,
    ) -> Result<Response<pb::AggregateAuditsResponse>, Status> {
        Ok(Response::new(
            BrokerService::aggregate_audits(self, request).await?,
        ))
    }

    async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        Ok(Response::new(
            BrokerService::open_session(self, request).await?,
        ))
    }

    async fn get_broker_keys(
        &self,
        _request: Request<pb::GetBrokerKeysRequest>,
    ) -> Result<Response<pb::GetBrokerKeysResponse>, Status> {
        Ok(Response::new(BrokerService::get_broker_keys(self).await))
    }
}
