//! The tonic adapter: decodes and authenticates requests, converts them to
//! core types, calls the store, and maps every error in one place
//! (`error`). The only module that knows tonic.

pub mod audit;
pub mod auth;
pub mod convert;
pub mod error;
pub mod session;
pub mod transport;

use std::sync::Arc;

use prost::Message;
use tonic::{Request, Response, Status};

use crate::clock::Clock;
use crate::command::{Action, LifecycleCommand};
use crate::config::{Config, RootDenied};
use crate::core::InputError;
use crate::core::limits::{
    CONVERSION_DEADLINE_MS, DEFAULT_PAGE_SIZE, MAX_DEPTH_CEILING, MAX_PAGE_SIZE,
};
use crate::pb;
use crate::pb::broker_server::Broker;
use crate::store::{Answer, Event, Outcome, Store};
use crate::telemetry::{self, Fact};
use auth::authenticate;
use error::ServiceError;

/// Longest a replicated broker's GetBrokerKeys answers from its copy of
/// the shared key registry.
pub const KEYS_MAX_AGE_MS: u64 = 100;

/// The verifying keys GetBrokerKeys publishes; shared with whatever
/// refreshes them.
#[derive(Clone, Default)]
pub struct PublishedKeys(Arc<std::sync::RwLock<(Vec<pb::BrokerKey>, Option<std::time::Instant>)>>);

impl PublishedKeys {
    pub fn new(keys: Vec<pb::BrokerKey>) -> Self {
        Self(Arc::new(std::sync::RwLock::new((keys, None))))
    }

    pub fn get(&self) -> Vec<pb::BrokerKey> {
        self.read().0.clone()
    }

    /// Whether the list is older than `max_age_ms` (or was never
    /// refreshed); claims the refresh, so one caller at a time reads.
    pub fn stale(&self, max_age_ms: u64) -> bool {
        let now = std::time::Instant::now();
        let max_age = std::time::Duration::from_millis(max_age_ms);
        if self
            .read()
            .1
            .is_some_and(|at| now.duration_since(at) < max_age)
        {
            return false;
        }
        let mut keys = self.write();
        if keys.1.is_some_and(|at| now.duration_since(at) < max_age) {
            return false;
        }
        keys.1 = Some(now);
        true
    }

    pub fn set(&self, keys: Vec<pb::BrokerKey>) {
        let mut published = self.write();
        published.0 = keys;
        published.1 = Some(std::time::Instant::now());
    }

    // Replaced whole: a poisoned lock still holds a complete list.
    fn read(
        &self,
    ) -> std::sync::RwLockReadGuard<'_, (Vec<pb::BrokerKey>, Option<std::time::Instant>)> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(
        &self,
    ) -> std::sync::RwLockWriteGuard<'_, (Vec<pb::BrokerKey>, Option<std::time::Instant>)> {
        self.0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

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
    /// Turns true when the server shuts down: Watch streams end then, or
    /// graceful shutdown would wait on them forever.
    stopping: tokio::sync::watch::Receiver<bool>,
    /// Counts issuances, refusals and transitions (`/metrics`).
    metrics: Arc<crate::metrics::Metrics>,
}

/// (contract, agent) pairs remembered as parties; cleared when full.
const MAX_REMEMBERED_PARTIES: usize = 65_536;

/// Envelope bytes of one ListChildren page: pages of deep contracts went
/// past the 4 MiB response limit as an untyped OUT_OF_RANGE.
const CHILDREN_PAGE_BYTES: usize = 1024 * 1024;

/// Events fetched per Watch query.
const WATCH_PAGE: u32 = 256;
/// Envelope bytes fetched per Watch query: with `WATCH_BUFFER`, what one
/// stream holds in memory however slowly its client reads (unbounded
/// pages of deep contracts held 7 MB per stream).
const WATCH_PAGE_BYTES: usize = 256 * 1024;
/// Events buffered per Watch stream before the reader waits for the client.
const WATCH_BUFFER: usize = 8;
/// Watch streams past `limits.max_watch_streams` kept for tenants holding
/// fewer than `WATCH_SMALL_SHARE`: this fraction of it (an eighth).
const WATCH_RESERVE_DIVISOR: usize = 8;
/// Streams a tenant may hold and still take one from the reserve.
const WATCH_SMALL_SHARE: usize = 2;

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
                    slots: config.limits.max_watch_streams / WATCH_RESERVE_DIVISOR,
                    small_share: WATCH_SMALL_SHARE,
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

fn issued(outcome: Outcome) -> Result<pb::IssuedContract, ServiceError> {
    match outcome {
        Outcome::Issued { id, envelope } => Ok(pb::IssuedContract {
            contract_id: id.to_vec(),
            contract: Some(envelope),
        }),
        Outcome::Receipt { .. } => Err(ServiceError::Internal("a root cannot be refused".into())),
    }
}

fn delegate_response(answer: Answer) -> pb::DelegateResponse {
    let outcome = match answer.outcome {
        Outcome::Issued { id, envelope } => {
            pb::delegate_response::Outcome::Issued(pb::IssuedContract {
                contract_id: id.to_vec(),
                contract: Some(envelope),
            })
        }
        Outcome::Receipt {
            receipt_id,
            envelope,
        } => pb::delegate_response::Outcome::Refused(pb::Refusal {
            receipt_id: receipt_id.to_vec(),
            receipt: Some(envelope),
        }),
    };
    pb::DelegateResponse {
        outcome: Some(outcome),
        replayed: answer.replayed,
    }
}

/// Page tokens are the last returned issuance sequence number, big-endian.
fn page_cursor(token: &[u8]) -> Result<i64, InputError> {
    if token.is_empty() {
        return Ok(0);
    }
    let bytes: [u8; 8] = token
        .try_into()
        .map_err(|_| InputError::new("page_token", "is not a token this broker issued"))?;
    Ok(i64::from_be_bytes(bytes))
}

impl<S: Store> BrokerService<S> {
    /// The reading agent of a request (its session), or UNAUTHENTICATED.
    fn caller<T>(&self, request: &Request<T>) -> Result<crate::core::AgentKey, ServiceError> {
        let caller = self
            .sessions
            .caller(request.metadata(), self.clock.now_ms())?;
        telemetry::record(Fact::AgentKey(&caller));
        Ok(caller)
    }

    /// Lets `caller` read `contract`'s tree only if it is a configured
    /// reader or a party of the tree; NOT_FOUND when there is no such
    /// contract.
    /// The tenant of `contract`'s tree: the key that opened its root.
    async fn tenant_of(
        &self,
        contract: crate::core::Id,
    ) -> Result<crate::core::AgentKey, ServiceError> {
        self.store
            .issuing_parent(contract)
            .await?
            .map(|p| p.tenant)
            .ok_or_else(|| ServiceError::NotFound {
                what: crate::store::Entity::Contract,
                id: hex::encode(contract),
            })
    }

    /// A place among the audits running at once, in turn among tenants
    /// (then keys), waiting at most `limits.audit_wait_ms`.
    async fn audit_turn(
        &self,
        tenant: crate::core::AgentKey,
        caller: crate::core::AgentKey,
    ) -> Result<crate::pool::Turn, ServiceError> {
        let wait = std::time::Duration::from_millis(self.config.limits.audit_wait_ms);
        let share = crate::pool::Share {
            tenant,
            key: caller,
        };
        self.audit_turns
            .acquire(share, wait)
            .await
            .map_err(|e| match e {
                crate::pool::PoolError::TimedOut(_) => {
                    ServiceError::Overloaded(crate::config::keys::audit_wait_ms)
                }
                crate::pool::PoolError::Full => {
                    ServiceError::Overloaded(crate::config::keys::max_concurrent_audits)
                }
                other => ServiceError::Internal(format!("an audit's turn: {other}")),
            })
    }

    /// Whether `caller` may learn that `contract` exists: a configured
    /// reader, or a party of its tree. Asked only on refusal paths, so an
    /// honest call pays nothing for it.
    async fn may_know(
        &self,
        caller: &crate::core::AgentKey,
        contract: crate::core::Id,
    ) -> Result<bool, ServiceError> {
        Ok(self.config.readers.contains(caller)
            || self.store.is_party(contract, *caller).await? == Some(true))
    }

    async fn authorize(
        &self,
        caller: &crate::core::AgentKey,
        contract: crate::core::Id,
    ) -> Result<(), ServiceError> {
        if self.config.readers.contains(caller) {
            return Ok(());
        }
        let remembered = |this: &Self| {
            this.parties
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .contains(&(contract, *caller))
        };
        if remembered(self) {
            return Ok(());
        }
        match self.store.is_party(contract, *caller).await? {
            None => Err(ServiceError::NotFound {
                what: crate::store::Entity::Contract,
                id: hex::encode(contract),
            }),
            // Answered as if it did not exist: a stranger cannot tell a
            // real id from a random one.
            Some(false) => Err(ServiceError::NotFound {
                what: crate::store::Entity::Contract,
                id: hex::encode(contract),
            }),
            Some(true) => {
                let mut parties = self
                    .parties
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if parties.len() >= MAX_REMEMBERED_PARTIES {
                    parties.clear();
                }
                parties.insert((contract, *caller));
                Ok(())
            }
        }
    }

    /// A read of the tree of the contract named by `id` (raw bytes from
    /// the request), by the request's session.
    async fn authorize_read<T>(
        &self,
        request: &Request<T>,
        id: &[u8],
        field: &'static str,
    ) -> Result<crate::core::Id, ServiceError> {
        let caller = self.caller(request)?;
        let id = convert::id(id, field)?;
        telemetry::record(Fact::ContractId(&id));
        self.authorize(&caller, id).await?;
        Ok(id)
    }

    async fn open_root(
        &self,
        request: pb::OpenRootRequest,
    ) -> Result<pb::OpenRootResponse, ServiceError> {
        let now_ms = self.clock.now_ms();
        let window_ms = self.config.limits.timestamp_window_ms;
        let signed = authenticate::<pb::OpenRootBody>(request.signed.as_ref(), now_ms, window_ms)?;
        telemetry::record(Fact::AgentKey(&signed.request.agent));
        if !signed.fresh {
            let answer = self.late_retry(&signed, now_ms).await?;
            return Ok(pb::OpenRootResponse {
                replayed: true,
                issued: Some(issued(answer.outcome)?),
            });
        }
        // The allow-list first: a key that may not open roots costs no
        // conversion (predicate parsing) at all.
        if let Err(denied) = self
            .config
            .orchestrators
            .admit(&signed.request.agent, signed.body.budget)
        {
            // A retry of a root admitted before the list changed still
            // gets its answer: one request, one answer.
            if let Some(answer) = self.store.replay(&signed.request).await? {
                return Ok(pb::OpenRootResponse {
                    replayed: answer.replayed,
                    issued: Some(issued(answer.outcome)?),
                });
            }
            return Err(match denied {
                RootDenied::NotListed => ServiceError::PermissionDenied {
                    reason: pb::ErrorReason::NotAnOrchestrator,
                    detail: "this key may not open roots (it is not under [orchestrators] in the broker's configuration)".into(),
                },
                RootDenied::OverAllowance { allowed } => ServiceError::OverAllowance {
                    requested: signed.body.budget,
                    allowed,
                },
            });
        }
        let mut root = convert::new_root(signed.body, signed.request, now_ms, &self.config.limits)?;
        root.trace = telemetry::current_trace_context();
        let answer = self.store.open_root(root).await?;
        if let Outcome::Issued { id, .. } = &answer.outcome {
            telemetry::record(Fact::ContractId(id));
            telemetry::record(Fact::RootId(id));
            telemetry::record(Fact::Depth(0));
            telemetry::record(Fact::Outcome("issued", answer.replayed));
        }
        Ok(pb::OpenRootResponse {
            replayed: answer.replayed,
            issued: Some(issued(answer.outcome)?),
        })
    }

    async fn delegate(
        &self,
        request: pb::DelegateRequest,
    ) -> Result<pb::DelegateResponse, ServiceError> {
        let now_ms = self.clock.now_ms();
        let window_ms = self.config.limits.timestamp_window_ms;
        let signed = authenticate::<pb::DelegateBody>(request.signed.as_ref(), now_ms, window_ms)?;
        telemetry::record(Fact::AgentKey(&signed.request.agent));
        if !signed.fresh {
            return Ok(delegate_response(self.late_retry(&signed, now_ms).await?));
        }
        // Cheap checks first (issue 11, items 5 and 7): the parent exists and
        // the signer holds it, before any of the body is converted. A
        // stranger is answered PERMISSION_DENIED and nothing is stored in
        // anyone's tree.
        let parent_id = convert::id(&signed.body.parent_id, "body.parent_id")?;
        let parent =
            self.store
                .issuing_parent(parent_id)
                .await?
                .ok_or_else(|| ServiceError::NotFound {
                    what: crate::store::Entity::ParentContract,
                    id: hex::encode(parent_id),
                })?;
        telemetry::record(Fact::ParentId(&parent_id));
        telemetry::record(Fact::RootId(&parent.root_id));
        let depth = parent.depth + 1;
        if parent.delegate_key != signed.request.agent {
            // A stranger is told what an unknown parent gets.
            if !self.may_know(&signed.request.agent, parent_id).await? {
                return Err(ServiceError::NotFound {
                    what: crate::store::Entity::ParentContract,
                    id: hex::encode(parent_id),
                });
            }
            return Err(ServiceError::PermissionDenied {
                reason: pb::ErrorReason::NotHolder,
                detail: "the request is not signed by the parent contract's delegate key (only its holder may delegate from it); nothing was recorded".into(),
            });
        }
        let (config, verified) = (self.config.clone(), self.verified.clone());
        let body = signed.body;
        let request = signed.request;
        let deadline = std::time::Duration::from_millis(CONVERSION_DEADLINE_MS);
        let share = crate::pool::Share {
            tenant: parent.tenant,
            key: request.agent,
        };
        let child = self
            .converters
            .run(share, deadline, move || {
                let child = convert::new_child(body, request, now_ms, &config.trust, &verified)?;
                // The effective predicate is parsed here, once, so the writer
                // only concatenates what is known to compose and be judgeable.
                let inherited = match child.ask.liability {
                    crate::core::Liability::Delegate => parent.effective_predicate,
                    crate::core::Liability::Principal => crate::core::Predicate::default(),
                };
                crate::core::Predicate::check_effective(
                    &inherited,
                    &child.ask.predicate,
                    "body.predicate",
                )?;
                Ok::<_, InputError>(child)
            })
            .await
            .map_err(|e| match e {
                crate::pool::PoolError::TimedOut(ms) => ServiceError::Retry {
                    reason: pb::ErrorReason::ConvertersBusy,
                    detail: format!(
                        "the Delegate body could not be checked within {ms} ms (every converter is busy); nothing was recorded: retry with the same nonce"
                    ),
                },
                crate::pool::PoolError::Full => ServiceError::Retry {
                    reason: pb::ErrorReason::ConvertersBusy,
                    detail: format!(
                        "this tree's tenant already has {} Delegates waiting for a converter; nothing was recorded: retry with the same nonce",
                        crate::pool::MAX_WAITING_PER_TENANT
                    ),
                },
                other => ServiceError::Internal(format!("converting the Delegate body: {other}")),
            })??;
        let mut child = child;
        child.trace = telemetry::current_trace_context();
        let budget = child.ask.budget;
        let answer = self.store.delegate(child).await?;
        self.observe_delegation(&answer, budget, depth);
        Ok(delegate_response(answer))
    }

    /// The Delegate's facts on its span and in the metrics (a replay is
    /// not counted again).
    fn observe_delegation(&self, answer: &crate::store::Answer, budget: i64, depth: u32) {
        match &answer.outcome {
            Outcome::Issued { id, .. } => {
                telemetry::record(Fact::ContractId(id));
                telemetry::record(Fact::Depth(depth));
                telemetry::record(Fact::Outcome("issued", answer.replayed));
                if !answer.replayed {
                    self.metrics.delegations_issued.inc();
                    self.metrics
                        .budget_reserved_units
                        .inc_by(u64::try_from(budget).unwrap_or(0));
                }
            }
            Outcome::Receipt { envelope, .. } => {
                let receipt = pb::Receipt::decode(envelope.payload.as_slice()).unwrap_or_default();
                let code =
                    |c: i32| pb::InvariantCode::try_from(c).map_or("UNKNOWN", |c| c.as_str_name());
                if telemetry::recording() {
                    let codes: Vec<&str> =
                        receipt.violations.iter().map(|v| code(v.code)).collect();
                    telemetry::record(Fact::RefusedCodes(&codes));
                }
                telemetry::record(Fact::Outcome("refused", answer.replayed));
                if !answer.replayed {
                    self.metrics
                        .delegations_refused
                        .with_label_values(&[code(receipt.primary)])
                        .inc();
                }
            }
        }
    }

    /// Authenticates a lifecycle request, converts its body and applies it.
    async fn lifecycle<T: auth::SignedBody>(
        &self,
        signed: Option<&pb::Envelope>,
        convert: fn(T) -> Result<(crate::core::Id, Action), InputError>,
    ) -> Result<(Vec<u8>, Option<pb::Sealed>, bool), ServiceError> {
        let now_ms = self.clock.now_ms();
        let window_ms = self.config.limits.timestamp_window_ms;
        let signed = authenticate::<T>(signed, now_ms, window_ms)?;
        telemetry::record(Fact::AgentKey(&signed.request.agent));
        let answer = if signed.fresh {
            let (contract_id, action) = convert(signed.body)?;
            telemetry::record(Fact::ContractId(&contract_id));
            // One task, one connected trace: this call's span links to the
            // one that issued the contract, even when the agents passed no
            // context between them.
            if telemetry::current_trace_context().is_some()
                && let Some(issued) = self.store.issuance_trace(contract_id).await?
            {
                telemetry::link_to(&issued);
            }
            let signer = signed.request.agent;
            let answer = self
                .store
                .transition(LifecycleCommand {
                    request: Some(signed.request),
                    contract_id,
                    action,
                })
                .await;
            match answer {
                Ok(answer) => answer,
                // A stranger is told what an unknown contract gets, however
                // the store refused it (who may act, or its state).
                Err(
                    e @ (crate::store::StoreError::PermissionDenied { .. }
                    | crate::store::StoreError::FailedPrecondition { .. }),
                ) => {
                    return Err(if self.may_know(&signer, contract_id).await? {
                        e.into()
                    } else {
                        ServiceError::NotFound {
                            what: crate::store::Entity::Contract,
                            id: hex::encode(contract_id),
                        }
                    });
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            self.late_retry(&signed, now_ms).await?
        };
        match answer.outcome {
            Outcome::Receipt {
                receipt_id,
                envelope,
            } => {
                self.note_transition(&envelope, answer.replayed);
                Ok((receipt_id.to_vec(), Some(envelope), answer.replayed))
            }
            // A nonce first used for an issuance request.
            Outcome::Issued { .. } => Err(ServiceError::NonceReused),
        }
    }

    /// Names a lifecycle receipt on the call's span and, unless it is a
    /// replayed answer, counts it by kind and verdict (labels from the
    /// enums: bounded).
    fn note_transition(&self, receipt: &pb::Sealed, replayed: bool) {
        let Ok(receipt) = pb::Receipt::decode(receipt.payload.as_slice()) else {
            return;
        };
        let kind = pb::ReceiptKind::try_from(receipt.kind).map_or("UNKNOWN", |k| k.as_str_name());
        telemetry::record(Fact::Outcome(kind, replayed));
        telemetry::record(Fact::RootId(&receipt.root_id));
        if replayed {
            return;
        }
        let verdict = receipt
            .completion
            .as_ref()
            .and_then(|c| pb::Verdict::try_from(c.verdict).ok())
            .map_or("", |v| v.as_str_name());
        self.metrics
            .transitions
            .with_label_values(&[kind, verdict])
            .inc();
        // Adjudications repeat a completion's figures: counted once, here.
        if receipt.kind == pb::ReceiptKind::Completed as i32
            && let Some(completion) = &receipt.completion
        {
            self.metrics
                .budget_spent_units
                .inc_by(u64::try_from(completion.consumed).unwrap_or(0));
            self.metrics
                .budget_returned_units
                .inc_by(u64::try_from(completion.returned).unwrap_or(0));
        }
    }

    async fn watch_stream(
        &self,
        request: pb::WatchRequest,
        caller: crate::core::AgentKey,
        connection: Option<std::net::SocketAddr>,
    ) -> Result<<Self as Broker>::WatchStream, ServiceError> {
        let contract = convert::id(&request.contract_id, "contract_id")?;
        let mut cursor = i64::try_from(request.cursor)
            .map_err(|_| InputError::new("cursor", "is not a cursor this broker issued"))?;
        let Some(record) = self.store.contract(contract).await? else {
            return Err(ServiceError::NotFound {
                what: crate::store::Entity::Contract,
                id: hex::encode(contract),
            });
        };
        // Every cap before anything is started: broker-wide, per caller and
        // per connection, so one client cannot take every stream; the
        // broker-wide one keeps a reserve for tenants holding few streams,
        // so many keys filling it cannot keep another tenant out.
        let tenant = self.tenant_of(contract).await?;
        let by_caller = self
            .watch_callers
            .take_for(caller, tenant)
            .map_err(ServiceError::Overloaded)?;
        // Unknown peers (none on TCP or TLS) are only capped per caller.
        let by_connection = connection
            .map(|peer| {
                self.watch_connections
                    .take(peer)
                    .map_err(ServiceError::Overloaded)
            })
            .transpose()?;
        let root = record.root_id;
        let by_tree = self
            .watch_trees
            .take(root)
            .map_err(ServiceError::Overloaded)?;
        let store = self.store.clone();
        let trees = store.tree_changes();
        let mut commits = store.commits();
        let mut stopping = self.stopping.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(WATCH_BUFFER);
        tokio::spawn(async move {
            let _slots = (by_caller, by_connection, by_tree);
            let mut query = true;
            loop {
                let events = if query {
                    // Mark what we have seen before reading, so a commit
                    // that lands after the read still wakes us.
                    commits.borrow_and_update();
                    match store
                        .events(contract, cursor, WATCH_PAGE, WATCH_PAGE_BYTES)
                        .await
                    {
                        Ok(events) => events,
                        Err(e) => {
                            let _ = tx.send(Err(Status::from(ServiceError::from(e)))).await;
                            return;
                        }
                    }
                } else {
                    Vec::new()
                };
                if events.is_empty() {
                    tokio::select! {
                        changed = commits.changed() => if changed.is_err() { return },
                        () = tx.closed() => return,
                        _ = stopping.wait_for(|stop| *stop) => return,
                    }
                    // Woken by any commit; query only if this tree got an
                    // event after what was sent (see `TreeChanges`). Marked
                    // seen first: a tree is touched before its commit is
                    // announced, so any announcement after this mark wakes
                    // us again, and any before it is visible to the check.
                    commits.borrow_and_update();
                    query = trees.changed_since(&root, cursor);
                    continue;
                }
                query = true;
                for event in events {
                    let (at, event) = match event {
                        Event::Contract { cursor, envelope } => {
                            (cursor, pb::watch_response::Event::Contract(envelope))
                        }
                        Event::Receipt { cursor, envelope } => {
                            (cursor, pb::watch_response::Event::Receipt(envelope))
                        }
                    };
                    cursor = at;
                    let response = pb::WatchResponse {
                        cursor: u64::try_from(at).unwrap_or_default(),
                        event: Some(event),
                    };
                    if tx.send(Ok(response)).await.is_err() {
                        return; // The client went away.
                    }
                }
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    /// A correctly signed request outside the timestamp window: answered
    /// from the idempotency log if it was answered before, refused otherwise.
    async fn late_retry<T: auth::SignedBody>(
        &self,
        signed: &auth::Authenticated<T>,
        now_ms: i64,
    ) -> Result<Answer, ServiceError> {
        if let Some(answer) = self.store.replay(&signed.request).await? {
            return Ok(answer);
        }
        let timestamp_ms = signed.body.header().map_or(0, |h| h.timestamp_ms);
        Err(signed.stale_error(now_ms, self.config.limits.timestamp_window_ms, timestamp_ms))
    }

    async fn record(&self, id: &[u8]) -> Result<crate::store::ContractRecord, ServiceError> {
        let id = convert::id(id, "contract_id")?;
        self.store
            .contract(id)
            .await?
            .ok_or_else(|| ServiceError::NotFound {
                what: crate::store::Entity::Contract,
                id: hex::encode(id),
            })
    }

    async fn chain(&self, id: &[u8]) -> Result<Vec<pb::ContractState>, ServiceError> {
        let mut record = self.record(id).await?;
        let mut chain = Vec::new();
        loop {
            let parent = record.parent_id;
            chain.push(convert::contract_state(record));
            let Some(parent) = parent else { break };
            // Depth is bounded by policy; a longer walk means a cycle.
            if chain.len() > MAX_DEPTH_CEILING as usize + 1 {
                return Err(ServiceError::Internal(
                    "contract chain longer than the depth ceiling".into(),
                ));
            }
            record = self.store.contract(parent).await?.ok_or_else(|| {
                ServiceError::Internal(format!(
                    "parent {} of a stored contract is missing",
                    hex::encode(parent)
                ))
            })?;
        }
        chain.reverse();
        Ok(chain)
    }

    async fn children(
        &self,
        request: pb::ListChildrenRequest,
    ) -> Result<pb::ListChildrenResponse, ServiceError> {
        let id = convert::id(&request.contract_id, "contract_id")?;
        let page_size = match request.page_size {
            0 => DEFAULT_PAGE_SIZE,
            n if n > MAX_PAGE_SIZE => {
                return Err(
                    InputError::new("page_size", format!("{n} is above {MAX_PAGE_SIZE}")).into(),
                );
            }
            n => n,
        };
        let after = page_cursor(&request.page_token)?;
        if self.store.contract(id).await?.is_none() {
            return Err(ServiceError::NotFound {
                what: crate::store::Entity::Contract,
                id: hex::encode(id),
            });
        }
        // Half the response limit leaves room for the states around the
        // envelopes.
        let limit = self.config.limits.max_response_bytes();
        let page_bytes = CHILDREN_PAGE_BYTES.min(limit / 2);
        let children = self
            .store
            .children(id, after, page_size, page_bytes)
            .await?;
        let bytes: usize = children.iter().map(|c| c.envelope.encoded_len()).sum();
        // A page cut by count or by bytes has a next page (perhaps empty).
        let next_page_token = match children.last() {
            Some(last) if children.len() == page_size as usize || bytes >= page_bytes => {
                last.seq.to_be_bytes().to_vec()
            }
            _ => Vec::new(),
        };
        let response = pb::ListChildrenResponse {
            children: children.into_iter().map(convert::contract_state).collect(),
            next_page_token,
        };
        // Only a single child larger than a whole response can get here.
        let size = response.encoded_len();
        if size > limit {
            return Err(ServiceError::ResponseTooLarge {
                size,
                limit,
                hint: "this child alone is larger than a response; read it with GetContract under a larger limits.max_request_bytes",
            });
        }
        Ok(response)
    }

    async fn receipt(
        &self,
        request: pb::GetReceiptRequest,
    ) -> Result<pb::GetReceiptResponse, ServiceError> {
        let id = convert::id(&request.receipt_id, "receipt_id")?;
        let receipt = self
            .store
            .receipt(id)
            .await?
            .ok_or_else(|| ServiceError::NotFound {
                what: crate::store::Entity::Receipt,
                id: hex::encode(id),
            })?;
        Ok(pb::GetReceiptResponse {
            receipt: Some(receipt),
        })
    }
}

#[tonic::async_trait]
impl<S: Store> Broker for BrokerService<S> {
    async fn get_audit(
        &self,
        request: Request<pb::GetAuditRequest>,
    ) -> Result<Response<pb::GetAuditResponse>, Status> {
        let caller = self.caller(&request)?;
        let id = self
            .authorize_read(&request, &request.get_ref().contract_id, "contract_id")
            .await?;
        let _slot = self.audits.take(caller).map_err(ServiceError::Overloaded)?;
        let tenant = self.tenant_of(id).await?;
        let _turn = self.audit_turn(tenant, caller).await?;
        let (facts, mutations) = self
            .store
            .audit_facts(id)
            .await
            .map_err(ServiceError::from)?
            .ok_or_else(|| ServiceError::NotFound {
                what: crate::store::Entity::Contract,
                id: hex::encode(id),
            })?;
        // Classifying a tree's mutations is CPU work: off the async workers.
        let audit = tokio::task::spawn_blocking(move || audit::contract_audit(&facts, &mutations))
            .await
            .map_err(|e| ServiceError::Internal(format!("an audit failed: {e}")))?;
        Ok(Response::new(pb::GetAuditResponse { audit: Some(audit) }))
    }

    async fn aggregate_audits(
        &self,
        request: Request<pb::AggregateAuditsRequest>,
    ) -> Result<Response<pb::AggregateAuditsResponse>, Status> {
        let caller = self.caller(&request)?;
        // A configured reader sees every run; anyone else the runs whose
        // root it opened.
        let orchestrator = (!self.config.readers.contains(&caller)).then_some(caller);
        let (selector, group_by) = audit::parse_request(&request.into_inner())?;
        let _slot = self.audits.take(caller).map_err(ServiceError::Overloaded)?;
        // The runs it reads are the caller's own (or, for a reader, all).
        let _turn = self.audit_turn(caller, caller).await?;
        let runs = self
            .store
            .runs(orchestrator, &selector, audit::MAX_AGGREGATE_RUNS)
            .await
            .map_err(ServiceError::from)?;
        // Classifying thousands of contracts is CPU work (1.9 s for a
        // 4,000-contract tree): off the async workers.
        let groups = tokio::task::spawn_blocking(move || {
            let totals: Vec<_> = runs
                .iter()
                .map(|(run, mutations)| audit::run_totals(run, mutations))
                .collect();
            audit::groups(&totals, &group_by)
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("an aggregate failed: {e}")))?;
        Ok(Response::new(pb::AggregateAuditsResponse { groups }))
    }

    async fn accept(
        &self,
        request: Request<pb::AcceptRequest>,
    ) -> Result<Response<pb::AcceptResponse>, Status> {
        let (receipt_id, receipt, replayed) = self
            .lifecycle::<pb::AcceptBody>(
                request.into_inner().signed.as_ref(),
                convert::lifecycle::accept,
            )
            .await?;
        Ok(Response::new(pb::AcceptResponse {
            receipt_id,
            receipt,
            replayed,
        }))
    }

    async fn decline(
        &self,
        request: Request<pb::DeclineRequest>,
    ) -> Result<Response<pb::DeclineResponse>, Status> {
        let (receipt_id, receipt, replayed) = self
            .lifecycle::<pb::DeclineBody>(
                request.into_inner().signed.as_ref(),
                convert::lifecycle::decline,
            )
            .await?;
        Ok(Response::new(pb::DeclineResponse {
            receipt_id,
            receipt,
            replayed,
        }))
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let (receipt_id, receipt, replayed) = self
            .lifecycle::<pb::CompleteBody>(
                request.into_inner().signed.as_ref(),
                convert::lifecycle::complete,
            )
            .await?;
        Ok(Response::new(pb::CompleteResponse {
            receipt_id,
            receipt,
            replayed,
        }))
    }

    async fn adjudicate(
        &self,
        request: Request<pb::AdjudicateRequest>,
    ) -> Result<Response<pb::AdjudicateResponse>, Status> {
        let (receipt_id, receipt, replayed) = self
            .lifecycle::<pb::AdjudicateBody>(
                request.into_inner().signed.as_ref(),
                convert::lifecycle::adjudicate,
            )
            .await?;
        Ok(Response::new(pb::AdjudicateResponse {
            receipt_id,
            receipt,
            replayed,
        }))
    }

    async fn escalate(
        &self,
        request: Request<pb::EscalateRequest>,
    ) -> Result<Response<pb::EscalateResponse>, Status> {
        let (receipt_id, receipt, replayed) = self
            .lifecycle::<pb::EscalateBody>(
                request.into_inner().signed.as_ref(),
                convert::lifecycle::escalate,
            )
            .await?;
        Ok(Response::new(pb::EscalateResponse {
            receipt_id,
            receipt,
            replayed,
        }))
    }

    async fn revoke(
        &self,
        request: Request<pb::RevokeRequest>,
    ) -> Result<Response<pb::RevokeResponse>, Status> {
        let (receipt_id, receipt, replayed) = self
            .lifecycle::<pb::RevokeBody>(
                request.into_inner().signed.as_ref(),
                convert::lifecycle::revoke,
            )
            .await?;
        Ok(Response::new(pb::RevokeResponse {
            receipt_id,
            receipt,
            replayed,
        }))
    }

    async fn record_receipts(
        &self,
        request: Request<pb::RecordReceiptsRequest>,
    ) -> Result<Response<pb::RecordReceiptsResponse>, Status> {
        let (receipt_id, receipt, replayed) = self
            .lifecycle::<pb::RecordReceiptsBody>(
                request.into_inner().signed.as_ref(),
                convert::lifecycle::record,
            )
            .await?;
        Ok(Response::new(pb::RecordReceiptsResponse {
            receipt_id,
            receipt,
            replayed,
        }))
    }

    type WatchStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::WatchResponse, Status>> + Send>,
    >;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let caller = self.caller(&request)?;
        let id = convert::id(&request.get_ref().contract_id, "contract_id")
            .map_err(ServiceError::from)?;
        self.authorize(&caller, id).await?;
        let connection = request.remote_addr();
        Ok(Response::new(
            self.watch_stream(request.into_inner(), caller, connection)
                .await?,
        ))
    }

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

    async fn get_contract(
        &self,
        request: Request<pb::GetContractRequest>,
    ) -> Result<Response<pb::GetContractResponse>, Status> {
        self.authorize_read(&request, &request.get_ref().contract_id, "contract_id")
            .await?;
        let record = self.record(&request.into_inner().contract_id).await?;
        Ok(Response::new(pb::GetContractResponse {
            contract: Some(convert::contract_state(record)),
        }))
    }

    async fn get_chain(
        &self,
        request: Request<pb::GetChainRequest>,
    ) -> Result<Response<pb::GetChainResponse>, Status> {
        self.authorize_read(&request, &request.get_ref().contract_id, "contract_id")
            .await?;
        let chain = self.chain(&request.into_inner().contract_id).await?;
        let response = pb::GetChainResponse { chain };
        let limit = self.config.limits.max_response_bytes();
        let size = response.encoded_len();
        if size > limit {
            return Err(ServiceError::ResponseTooLarge {
                size,
                limit,
                hint: "read the chain's contracts one by one with GetContract",
            }
            .into());
        }
        Ok(Response::new(response))
    }

    async fn list_children(
        &self,
        request: Request<pb::ListChildrenRequest>,
    ) -> Result<Response<pb::ListChildrenResponse>, Status> {
        self.authorize_read(&request, &request.get_ref().contract_id, "contract_id")
            .await?;
        Ok(Response::new(self.children(request.into_inner()).await?))
    }

    async fn get_receipt(
        &self,
        request: Request<pb::GetReceiptRequest>,
    ) -> Result<Response<pb::GetReceiptResponse>, Status> {
        let caller = self.caller(&request)?;
        let request_id = request.get_ref().receipt_id.clone();
        let response = self.receipt(request.into_inner()).await?;
        // A receipt is read as part of the tree of the contract it is about
        // (for a refusal, the parent asked).
        let about = response
            .receipt
            .as_ref()
            .and_then(|e| {
                use prost::Message;
                pb::Receipt::decode(e.payload.as_slice()).ok()
            })
            .and_then(|r| crate::core::Id::try_from(r.contract_id.as_slice()).ok())
            .ok_or_else(|| ServiceError::Internal("a stored receipt names no contract".into()))?;
        // A stranger is told what an unknown receipt gets.
        match self.authorize(&caller, about).await {
            Ok(()) => Ok(Response::new(response)),
            Err(ServiceError::NotFound { .. }) => Err(ServiceError::NotFound {
                what: crate::store::Entity::Receipt,
                id: hex::encode(&request_id),
            }
            .into()),
            Err(e) => Err(e.into()),
        }
    }

    async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        let now_ms = self.clock.now_ms();
        let window_ms = self.config.limits.timestamp_window_ms;
        let signed = authenticate::<pb::OpenSessionBody>(
            request.into_inner().signed.as_ref(),
            now_ms,
            window_ms,
        )?;
        telemetry::record(Fact::AgentKey(&signed.agent));
        if !signed.fresh {
            let timestamp_ms = signed.body.header.as_ref().map_or(0, |h| h.timestamp_ms);
            return Err(signed.stale_error(now_ms, window_ms, timestamp_ms).into());
        }
        self.sessions.check_audience(&signed.body.broker_key_id)?;
        Ok(Response::new(self.sessions.open(signed.agent, now_ms)))
    }

    async fn get_broker_keys(
        &self,
        _request: Request<pb::GetBrokerKeysRequest>,
    ) -> Result<Response<pb::GetBrokerKeysResponse>, Status> {
        // A replicated broker reads the shared registry (at most
        // `KEYS_MAX_AGE_MS` old, one read at a time): a replica registers
        // its key before it serves, so its contracts verify with the keys
        // of any replica asked after that.
        if self.keys.stale(KEYS_MAX_AGE_MS)
            && let Ok(Some(keys)) = self.store.broker_keys().await
            && !keys.is_empty()
        {
            self.keys.set(keys);
        }
        Ok(Response::new(pb::GetBrokerKeysResponse {
            keys: self.keys.get(),
        }))
    }
}
