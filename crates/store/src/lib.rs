//! Durable state: contracts with their ledgers, receipts and the request
//! (nonce) log, behind the `Store` trait. Every mutating call is one
//! transaction in which the core's invariant check and the budget
//! reservation happen together; the answer exists only after commit.
//! Only this crate knows sqlx.

pub mod batch;
pub mod identities;
pub mod known;
pub mod limits;
pub mod metrics;
pub mod phases;
pub mod pool;
pub mod postgres;
pub mod recent;
pub mod slots;
pub(crate) mod sql;
pub mod sqlite;
#[cfg(test)]
pub(crate) mod suite;
mod trees;

pub use trees::{CommittedMark, TreeChanges, TreeVersion};

use std::future::Future;

use broker_domain::lifecycle::{LifecycleError, Refused};
use broker_domain::{Id, Ledger, Status};
use broker_wire::command::{NewChild, NewRoot, RequestMeta};
use broker_wire::pb;

/// A stored contract as the broker holds it now.
#[derive(Clone, Debug)]
pub struct ContractRecord {
    pub id: Id,
    pub parent_id: Option<Id>,
    pub root_id: Id,
    /// The broker-signed contract exactly as issued.
    pub envelope: pb::Sealed,
    /// The effective predicate as the broker derived it at issuance (not
    /// in the signed contract: verifiers derive it from the chain).
    pub effective_predicate: String,
    pub status: Status,
    pub ledger: Ledger,
    /// The host named at Delegate or Accept, if any.
    pub host_key: Option<broker_domain::AgentKey>,
    /// Issuance order; the page cursor of `children`.
    pub seq: i64,
    /// The name of its tree's tenant (`core::tenant::Tenants::name_of`
    /// its root's opener).
    pub tenant: String,
}

/// A key bound to a workload identity (BindIdentity) until
/// `expires_at_ms`, the proving token's expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityBinding {
    pub key: broker_domain::AgentKey,
    /// A SPIFFE ID, or "<iss>#<sub>" of an OIDC issuer.
    pub identity: String,
    /// The configured name of the issuer that vouched for it.
    pub issuer: String,
    pub expires_at_ms: i64,
}

/// Which roots `Store::roots` lists, and how many.
#[derive(Clone, Debug)]
pub struct RootsQuery {
    /// Only roots of trees this key is a party of; `None` lists every root
    /// (a configured reader).
    pub viewer: Option<broker_domain::AgentKey>,
    /// Only roots carrying every one of these labels.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Most roots looked at (whether shown or not): bounds the work of a
    /// viewer who is a party of few trees among many.
    pub scan: u32,
    pub page: PageBounds,
}

/// Where a page of contracts starts and how much it may hold.
#[derive(Clone, Copy, Debug)]
pub struct PageBounds {
    /// Only contracts issued before this sequence number; 0 from the
    /// newest.
    pub before_seq: i64,
    /// Most contracts returned.
    pub limit: u32,
    /// Stop after this many bytes of envelopes (always the first one).
    pub max_bytes: usize,
}

/// One page of contracts (roots, or held ones), newest first.
#[derive(Clone, Debug)]
pub struct ContractsPage {
    pub contracts: Vec<ContractRecord>,
    /// Where the next page starts (`PageBounds::before_seq`); `None` when
    /// no older one remains.
    pub next_before: Option<i64>,
}

/// Whose open contracts `Store::held` lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeldRole {
    /// Contracts whose delegate is the key.
    Delegate,
    /// Contracts whose host is the key.
    Host,
}

/// Which open contracts `Store::held` lists, and how many.
#[derive(Clone, Debug)]
pub struct HeldQuery {
    pub key: broker_domain::AgentKey,
    pub role: HeldRole,
    pub page: PageBounds,
}

/// What the audit of one contract is derived from: all stored facts,
/// nothing computed (the core classifies).
#[derive(Clone, Debug, Default)]
pub struct AuditFacts {
    pub id: Id,
    pub depth: u32,
    /// The task text its parent wrote for it.
    pub task: String,
    pub write_scope: Vec<String>,
    pub completed: bool,
    /// `None` before completion.
    pub has_report: Option<bool>,
    pub downgrades: u32,
    /// Wire value of the verdict (0 before completion).
    pub verdict: i32,
    pub claim: String,
    /// Host observations: (ObservationKind wire value, path).
    pub observations: Vec<(i32, String)>,
    /// The delegate's workload identity as stamped at issuance
    /// (`Contract.delegate_identity`); empty when it had none bound.
    pub delegate_identity: String,
}

/// Every (contract id, mutated path) host-observed in one tree.
pub type TreeMutations = Vec<(Id, String)>;

/// One run (root) with everything its audits need.
#[derive(Clone, Debug, Default)]
pub struct RunFacts {
    pub root_id: Id,
    pub labels: std::collections::BTreeMap<String, String>,
    /// Who opened the run: the root's stamped workload identity, else its
    /// delegate's key id.
    pub orchestrator: String,
    pub budget: i64,
    pub spent: i64,
    /// Every contract of the tree but the root.
    pub contracts: Vec<AuditFacts>,
    pub escalations: u64,
    /// Primary invariant code of every refusal in the tree.
    pub refusal_codes: Vec<i32>,
}

/// One signed event of a tree, in commit order.
#[derive(Clone, Debug)]
pub enum Event {
    Contract { cursor: i64, envelope: pb::Sealed },
    Receipt { cursor: i64, envelope: pb::Sealed },
}

/// What a mutating call produced.
#[derive(Clone, Debug)]
pub enum Outcome {
    Issued {
        id: Id,
        envelope: pb::Sealed,
    },
    /// A signed receipt: a refusal (Delegate) or a lifecycle transition.
    Receipt {
        receipt_id: Id,
        envelope: pb::Sealed,
        /// What it says, for the call's span and the metrics: nobody
        /// decodes the signed payload back to learn what was decided.
        decided: Decided,
    },
}

/// A receipt's facts the service reports (span facts, metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decided {
    /// `ReceiptKind` wire value.
    pub kind: i32,
    pub root_id: Id,
    /// `Verdict` wire value of a completion (0 otherwise).
    pub verdict: i32,
    /// A completion's consumed and returned units (0 otherwise).
    pub consumed: i64,
    pub returned: i64,
    /// A refusal's violated invariants (`InvariantCode` wire values), and
    /// the primary one among them.
    pub codes: Vec<i32>,
    pub primary: i32,
}

impl Decided {
    /// The facts of `receipt`, as it is signed (or was stored).
    pub fn of(receipt: &pb::Receipt) -> Self {
        let completion = receipt.completion.as_ref();
        Self {
            kind: receipt.kind,
            root_id: Id::try_from(receipt.root_id.as_slice()).unwrap_or_default(),
            verdict: completion.map_or(0, |c| c.verdict),
            consumed: completion.map_or(0, |c| c.consumed),
            returned: completion.map_or(0, |c| c.returned),
            codes: receipt.violations.iter().map(|v| v.code).collect(),
            primary: receipt.primary,
        }
    }
}

/// A mutating call's answer.
#[derive(Clone, Debug)]
pub struct Answer {
    pub outcome: Outcome,
    /// True when this is the stored answer to an earlier request with the
    /// same agent and nonce: nothing was done again.
    pub replayed: bool,
}

/// The immutable terms of a parent that gate a Delegate (see
/// `Store::issuing_parent`).
#[derive(Clone, Debug)]
pub struct IssuingParent {
    /// Only this key may delegate from it (invariant 2).
    pub delegate_key: broker_domain::AgentKey,
    /// What a liability-transferring child's predicate is conjoined to.
    pub effective_predicate: broker_domain::Predicate,
    /// Its tree's root (for the call's span).
    pub root_id: Id,
    /// Its depth: a child's is one more.
    pub depth: u32,
    /// Its tree's tenant, the key that opened the root: whose share of
    /// the converters the Delegate's conversion takes.
    pub tenant: broker_domain::AgentKey,
}

/// What was not found (`ErrorInfo` metadata `what`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entity {
    Contract,
    /// The parent a Delegate names.
    ParentContract,
    Receipt,
    /// A signing key in a replicated broker's registry.
    BrokerKey,
}

impl Entity {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Contract => "contract",
            Self::ParentContract => "parent contract",
            Self::Receipt => "receipt",
            Self::BrokerKey => "broker key",
        }
    }
}

/// Queues `command` for a backend's writer(s) and waits for its answer: a
/// full queue is `Busy` at once (never an unbounded wait), a writer gone
/// is `Closed`.
async fn submit(
    queue: &tokio::sync::mpsc::Sender<(batch::Command, Reply)>,
    command: batch::Command,
) -> Result<Answer, StoreError> {
    use tokio::sync::mpsc::error::TrySendError;
    let (reply, answer) = tokio::sync::oneshot::channel();
    let queued = std::time::Instant::now();
    let reply = Reply {
        to: reply,
        queued_at: queued,
    };
    queue.try_send((command, reply)).map_err(|e| match e {
        TrySendError::Full(_) => StoreError::Busy,
        TrySendError::Closed(_) => StoreError::Closed,
    })?;
    let answered = answer.await.map_err(|_| StoreError::Closed)?;
    phases::SUBMITTED.since(queued);
    answered
}

/// Where a writer sends a command's answer, and when it was queued.
pub(crate) struct Reply {
    to: tokio::sync::oneshot::Sender<Result<Answer, StoreError>>,
    /// When `submit` queued the command (`phases::QUEUED`).
    queued_at: std::time::Instant,
}

impl Reply {
    /// Sends the answer; the caller may have gone away (its work is still
    /// committed, and a retry with the same nonce finds it).
    fn send(self, answer: Result<Answer, StoreError>) {
        let _ = self.to.send(answer);
    }
}

/// The `Store` methods both SQL backends answer with the shared SQL
/// (`store::sql`, generic over `store::sql::Backend`): expanded inside each
/// backend's `impl Store`, each a call of one shared function.
macro_rules! sql_store_methods {
    () => {
        async fn open_root(&self, root: NewRoot) -> Result<Answer, StoreError> {
            crate::sql::open_root(self, root).await
        }

        async fn transition(&self, command: LifecycleCommand) -> Result<Answer, StoreError> {
            crate::sql::judge::transition(self, command).await
        }

        async fn audit_facts(
            &self,
            id: Id,
        ) -> Result<Option<(AuditFacts, Vec<(Id, String)>)>, StoreError> {
            crate::sql::audit::audit_facts(self, id).await
        }

        async fn is_party(
            &self,
            contract: Id,
            agent: AgentKey,
        ) -> Result<Option<bool>, StoreError> {
            crate::sql::reads::is_party(self, contract, agent).await
        }

        async fn runs(
            &self,
            orchestrator: Option<AgentKey>,
            selector: &std::collections::BTreeMap<String, String>,
            limit: u32,
        ) -> Result<Vec<(RunFacts, TreeMutations)>, StoreError> {
            crate::sql::audit::runs(self, orchestrator, selector, limit).await
        }

        async fn overdue(&self, now_ms: i64, limit: u32) -> Result<Vec<Id>, StoreError> {
            crate::sql::reads::overdue(self, now_ms, limit).await
        }

        async fn replay(&self, request: &RequestMeta) -> Result<Option<Answer>, StoreError> {
            crate::sql::reads::replay(self, request).await
        }

        async fn issuing_parent(&self, parent: Id) -> Result<Option<IssuingParent>, StoreError> {
            crate::sql::reads::issuing_parent(self, parent).await
        }

        async fn issuance_trace(
            &self,
            id: Id,
        ) -> Result<Option<broker_wire::command::TraceContext>, StoreError> {
            crate::sql::reads::issuance_trace(self, id).await
        }

        async fn contract(&self, id: Id) -> Result<Option<ContractRecord>, StoreError> {
            crate::sql::reads::contract(self, id).await
        }

        async fn children(
            &self,
            parent: Id,
            after_seq: i64,
            limit: u32,
            max_bytes: usize,
        ) -> Result<Vec<ContractRecord>, StoreError> {
            crate::sql::reads::children(self, parent, after_seq, limit, max_bytes).await
        }

        async fn roots(
            &self,
            query: &crate::RootsQuery,
        ) -> Result<crate::ContractsPage, StoreError> {
            crate::sql::reads::roots(self, query).await
        }

        async fn held(&self, query: &crate::HeldQuery) -> Result<crate::ContractsPage, StoreError> {
            crate::sql::reads::held(self, query).await
        }

        async fn receipt(&self, id: Id) -> Result<Option<pb::Sealed>, StoreError> {
            crate::sql::reads::receipt(self, id).await
        }
    };
}
pub(crate) use sql_store_methods;

/// The store's errors. Backend details stay inside as text: callers only
/// need to know the class.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{} {id} not found", what.as_str())]
    NotFound { what: Entity, id: String },
    #[error("nonce already used by this agent for a different request")]
    NonceReused,
    /// The signer may not do this to this contract.
    #[error("{detail}")]
    PermissionDenied {
        reason: pb::ErrorReason,
        detail: String,
    },
    /// The contract is not in a state that allows it (ended, late, …).
    #[error("{detail}")]
    FailedPrecondition {
        reason: pb::ErrorReason,
        detail: String,
    },
    /// Input that is malformed only in the light of stored state.
    #[error(transparent)]
    Invalid(broker_domain::InputError),
    /// A per-request or per-contract limit was reached.
    #[error("limit reached: {0}")]
    Overloaded(&'static str),
    /// The writer's queue is full: retry later with the same nonce.
    #[error("the store is busy: its write queue is full")]
    Busy,
    #[error("the store is shutting down")]
    Closed,
    /// Temporarily unable to answer; nothing was written, so a retry with
    /// the same nonce is safe.
    #[error("{detail}")]
    Unavailable {
        reason: pb::ErrorReason,
        detail: String,
    },
    /// The writer's answer to a completion judged before host observations
    /// it has not seen: judge it again (never leaves the store).
    #[error("the completion's judgment is stale")]
    StaleJudgment,
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("database error: {0}")]
    Backend(String),
}

/// A database error as the store reports it, for every backend: data that
/// does not decode is corrupt (INTERNAL: retrying cannot help), anything
/// else a backend failure (UNAVAILABLE).
fn backend(e: sqlx::Error) -> StoreError {
    backend_ref(&e)
}

fn backend_ref(e: &sqlx::Error) -> StoreError {
    match e {
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::Protocol(_) => StoreError::Corrupt(e.to_string()),
        _ => StoreError::Backend(e.to_string()),
    }
}

fn denied(reason: pb::ErrorReason, detail: impl Into<String>) -> StoreError {
    StoreError::PermissionDenied {
        reason,
        detail: detail.into(),
    }
}

fn precondition(reason: pb::ErrorReason, detail: impl Into<String>) -> StoreError {
    StoreError::FailedPrecondition {
        reason,
        detail: detail.into(),
    }
}

/// The one place a core lifecycle refusal becomes a store error with its
/// stable reason, for every backend.
impl From<Refused> for StoreError {
    fn from(why: Refused) -> Self {
        let detail = why.to_string();
        match why {
            Refused::NotDelegate(_) => denied(pb::ErrorReason::NotDelegate, detail),
            Refused::NotHost => denied(pb::ErrorReason::NotHost, detail),
            Refused::NotAncestor => denied(pb::ErrorReason::NotAncestor, detail),
            Refused::NotPrincipal => denied(pb::ErrorReason::NotPrincipal, detail),
            Refused::HostMismatch => precondition(pb::ErrorReason::HostMismatch, detail),
            Refused::Invalid(input) => StoreError::Invalid(input),
            Refused::Root => precondition(pb::ErrorReason::Root, detail),
            Refused::Ended(_) => precondition(pb::ErrorReason::Ended, detail),
            Refused::NotPending => precondition(pb::ErrorReason::NotPending, detail),
            Refused::MeteredLimit => precondition(pb::ErrorReason::MeteredLimit, detail),
            Refused::TooManyObservations => StoreError::Overloaded("MAX_OBSERVATIONS_PER_CONTRACT"),
            Refused::RecordingClosed => precondition(pb::ErrorReason::RecordingClosed, detail),
            Refused::Expired { .. } | Refused::Lifecycle(LifecycleError::Late { .. }) => {
                precondition(pb::ErrorReason::Late, detail)
            }
            Refused::NotOverdue
            | Refused::Lifecycle(
                LifecycleError::NotAllowed { .. } | LifecycleError::NotDue { .. },
            ) => precondition(pb::ErrorReason::WrongState, detail),
            Refused::StaleJudgment => StoreError::StaleJudgment,
            Refused::DescendantsEnding => StoreError::Unavailable {
                reason: pb::ErrorReason::DescendantsEnding,
                detail,
            },
            Refused::AncestorEnding { .. } => precondition(pb::ErrorReason::AncestorEnding, detail),
            Refused::Corrupt(what) => StoreError::Corrupt(what),
        }
    }
}

/// The broker's persistence. Implementations run the core's checks inside
/// their transactions; they never re-implement an invariant.
pub trait Store: Send + Sync + 'static {
    /// Opens a root contract (idempotent on the request's nonce).
    fn open_root(&self, root: NewRoot) -> impl Future<Output = Result<Answer, StoreError>> + Send;
    /// Checks and, when every invariant holds, issues a child while
    /// reserving its budget; otherwise records a signed refusal.
    /// Idempotent on the request's nonce.
    fn delegate(&self, child: NewChild) -> impl Future<Output = Result<Answer, StoreError>> + Send;
    /// What a Delegate must be checked against before its body is worth
    /// converting: the parent's holder and effective predicate (both fixed
    /// at issuance, so any recent view will do). `None`: no such contract.
    /// A cached or point read, never the writer.
    fn issuing_parent(
        &self,
        parent: Id,
    ) -> impl Future<Output = Result<Option<IssuingParent>, StoreError>> + Send;
    /// The trace context of the call that issued contract `id`, when that
    /// call was traced (`None` too for an unknown contract). One point
    /// read; callers ask only while exporting traces.
    fn issuance_trace(
        &self,
        id: Id,
    ) -> impl Future<Output = Result<Option<broker_wire::command::TraceContext>, StoreError>> + Send;
    /// The stored answer to an earlier request with this agent and nonce:
    /// `NonceReused` when its body differed. Reads only.
    fn replay(
        &self,
        request: &RequestMeta,
    ) -> impl Future<Output = Result<Option<Answer>, StoreError>> + Send;
    /// Applies a lifecycle transition (accept, decline, complete,
    /// adjudicate, escalate, revoke, host observations, expiry) in one
    /// transaction and returns its signed receipt. Idempotent on the
    /// request's nonce.
    fn transition(
        &self,
        command: broker_wire::command::LifecycleCommand,
    ) -> impl Future<Output = Result<Answer, StoreError>> + Send;
    /// Signed events (issued contracts, receipts) of the subtree under
    /// `contract`, after `cursor`, in commit order; at most `limit`, and no
    /// more than `max_bytes` of envelopes (but always the first one).
    fn events(
        &self,
        contract: Id,
        cursor: i64,
        limit: u32,
        max_bytes: usize,
    ) -> impl Future<Output = Result<Vec<Event>, StoreError>> + Send;
    /// Changes after every commit; Watch waits on it for new events.
    fn commits(&self) -> tokio::sync::watch::Receiver<u64>;
    /// Which trees got events recently (see `TreeChanges`).
    fn tree_changes(&self) -> TreeChanges;
    /// Open contracts whose deadline has passed, for the expiry sweeper.
    fn overdue(
        &self,
        now_ms: i64,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Id>, StoreError>> + Send;
    /// The stored facts of one contract's audit, plus every mutation
    /// (contract id, path) of its tree for conflict detection.
    fn audit_facts(
        &self,
        id: Id,
    ) -> impl Future<Output = Result<Option<(AuditFacts, TreeMutations)>, StoreError>> + Send;
    /// Whether `agent` is a party of `contract`'s tree: it opened the root,
    /// or is or was the delegate or the host of one of its contracts.
    /// `None`: no such contract. Index seeks, never a scan of the tree.
    fn is_party(
        &self,
        contract: Id,
        agent: broker_domain::AgentKey,
    ) -> impl Future<Output = Result<Option<bool>, StoreError>> + Send;
    /// Every run (root) whose labels include the selector — and, given an
    /// orchestrator, that it opened — at most `limit`, with their
    /// contracts' facts and their trees' mutations.
    fn runs(
        &self,
        orchestrator: Option<broker_domain::AgentKey>,
        selector: &std::collections::BTreeMap<String, String>,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<(RunFacts, TreeMutations)>, StoreError>> + Send;
    /// One contract.
    fn contract(
        &self,
        id: Id,
    ) -> impl Future<Output = Result<Option<ContractRecord>, StoreError>> + Send;
    /// Children of `parent` issued after `after_seq`, at most `limit`, and
    /// no more than `max_bytes` of envelopes (but always the first one).
    fn children(
        &self,
        parent: Id,
        after_seq: i64,
        limit: u32,
        max_bytes: usize,
    ) -> impl Future<Output = Result<Vec<ContractRecord>, StoreError>> + Send;
    /// Roots, newest first: a page of `query`.
    fn roots(
        &self,
        query: &RootsQuery,
    ) -> impl Future<Output = Result<ContractsPage, StoreError>> + Send;
    /// Open contracts the key is the delegate or host of, newest first.
    fn held(
        &self,
        query: &HeldQuery,
    ) -> impl Future<Output = Result<ContractsPage, StoreError>> + Send;
    /// A stored receipt envelope.
    fn receipt(
        &self,
        id: Id,
    ) -> impl Future<Output = Result<Option<pb::Sealed>, StoreError>> + Send;
    /// The signing keys every replica registered, current first, when the
    /// store is shared by replicas; `None` when the broker's own keyring
    /// is all it publishes (SQLite).
    fn broker_keys(
        &self,
    ) -> impl Future<Output = Result<Option<Vec<pb::BrokerKey>>, StoreError>> + Send;
    /// Binds a key to a workload identity, replacing its earlier binding.
    fn bind_identity(
        &self,
        binding: IdentityBinding,
        now_ms: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// The identity `key` is bound to at `now_ms`, if any.
    fn identity_of(
        &self,
        key: broker_domain::AgentKey,
        now_ms: i64,
    ) -> impl Future<Output = Result<Option<IdentityBinding>, StoreError>> + Send;
}
