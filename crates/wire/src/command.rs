//! The validated commands: what the service makes of a signed request once
//! every field is checked, and what the store and the stamper take. One
//! module, so each command has one definition.

use crate::pb;
use broker_domain::judge::{self, Verdict};
use broker_domain::{AgentKey, ChildAsk, Id, Policy, Predicate, Scope};

/// A span's W3C identity as stored with what it issued: trace id (16
/// bytes), span id (8), trace flags (1).
pub type TraceContext = [u8; 25];

/// Where a hop's trust factor came from, for its contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HopTrust {
    pub source: pb::TrustSource,
    /// SHA-256 of the attestation payload, when one vouched.
    pub attestation_digest: Option<[u8; 32]>,
    pub risk_class: String,
}

/// The signed request a stamp answers, for binding and idempotency.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestMeta {
    /// The signer.
    pub agent: AgentKey,
    /// Idempotency key, unique per agent.
    pub nonce: Vec<u8>,
    /// SHA-256 of PAE(payload_type, payload) of the signed request.
    pub digest: [u8; 32],
    /// The signed header's timestamp (the agent's clock, unix ms).
    pub timestamp_ms: i64,
}

/// A root the orchestrator asked for, validated.
#[derive(Clone, Debug)]
pub struct NewRoot {
    pub request: RequestMeta,
    pub intent: String,
    pub task: String,
    pub budget: i64,
    pub deadline_ms: i64,
    pub policy: Policy,
    pub predicate: Predicate,
    pub write_scope: Scope,
    /// The run's labels, inherited by the whole tree.
    pub labels: std::collections::BTreeMap<String, String>,
    /// The issuing call's trace context, when it was traced (see
    /// `telemetry::TraceContext`).
    pub trace: Option<TraceContext>,
    /// The opener's workload identity, when its key is bound
    /// (BindIdentity): stamped as the root's `delegate_identity`.
    pub identity: Option<String>,
}

/// A child a holder asked for, validated (not yet checked against its
/// parent: that happens in the store's transaction).
#[derive(Clone, Debug)]
pub struct NewChild {
    pub request: RequestMeta,
    pub parent_id: Id,
    pub ask: ChildAsk,
    pub task: String,
    pub delegate_key: AgentKey,
    pub trust: HopTrust,
    /// The host that will execute the delegate, if named at delegation.
    pub host: Option<AgentKey>,
    /// JSON Schema the output must satisfy (validated to compile); empty
    /// for none.
    pub result_schema_json: String,
    /// The issuing call's trace context, when it was traced.
    pub trace: Option<TraceContext>,
    /// The delegate's workload identity, when its key is bound
    /// (BindIdentity): stamped as the child's `delegate_identity`.
    pub identity: Option<String>,
}

/// A lifecycle request, validated by the service.
#[derive(Clone, Debug)]
pub struct LifecycleCommand {
    /// The signed request; `None` for the broker's own expiry sweep.
    pub request: Option<RequestMeta>,
    pub contract_id: Id,
    pub action: Action,
}

#[derive(Clone, Debug)]
pub enum Action {
    Accept {
        host: Option<AgentKey>,
    },
    Decline {
        reason: String,
    },
    Complete(Box<CompleteArgs>),
    Adjudicate {
        verdict: Verdict,
        reason: String,
    },
    Escalate {
        reason: String,
    },
    Revoke {
        reason: String,
    },
    Record {
        observations: Vec<ObservationIn>,
    },
    Expire,
    /// The broker's own: ends the next bounded step of the contract's
    /// drain (`core::lifecycle::Ending`).
    Drain,
}

#[derive(Clone, Debug)]
pub struct CompleteArgs {
    /// SHA-256 of the output exactly as sent (receipted), computed when
    /// the request is converted: never by the store's writer.
    pub output_digest: [u8; 32],
    pub output: serde_json::Value,
    pub has_report: bool,
    pub claim: String,
    pub reported_consumed: i64,
    /// When the broker received the completion: `result.elapsed_ms` is
    /// measured to here, wherever and whenever it is judged (queueing in
    /// the broker does not count against the delegate). `None`: when the
    /// writer handles it.
    pub received_at_ms: Option<i64>,
    /// Judged before the command reached the writer (see `JudgeInputs`);
    /// `None` and the writer judges.
    pub prejudged: Option<PreJudged>,
}

/// A completion judged outside the writer, so that schema validation and
/// CEL evaluation never hold up everyone's writes.
#[derive(Clone, Debug)]
pub struct PreJudged {
    /// The contract's observation count the judgment saw. Observations are
    /// the only input of a judgment that changes after issuance (the
    /// predicate, scope and schema are sealed in the contract, and elapsed
    /// time is measured to `CompleteArgs::received_at_ms`), so the writer
    /// uses the judgment only if the count is still this.
    pub observations: i64,
    pub judgment: judge::Judgment,
}

/// One validated host observation.
#[derive(Clone, Debug)]
pub struct ObservationIn {
    pub kind: pb::ObservationKind,
    pub path: String,
    pub tool: String,
    pub units: i64,
    pub at_ms: i64,
    /// Tool calls: SHA-256 of the arguments, when the host gave it.
    pub arguments_sha256: Option<[u8; 32]>,
    /// Tool calls: how the call ended (UNSPECIFIED when not said).
    pub outcome: pb::ToolOutcome,
}
