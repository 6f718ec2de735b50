//! Turns the core's decisions into broker-signed payloads: stamped
//! contracts (each carrying its own hop's trust evidence), receipts and
//! sessions. Owns the broker's current
//! signing key; knows protobuf and crypto, but no storage and no transport.

use std::sync::Arc;

use ed25519_dalek::SigningKey;
use prost::Message;

use crate::command::{NewChild, NewRoot, RequestMeta};
use crate::crypto::{self, payload_type};
use crate::pb;
use broker_domain::lifecycle::ReceiptBody;
use broker_domain::{ChildTerms, Id, Liability, Policy, Refusal, Status};

/// A signed payload ready to store and send.
#[derive(Clone, Debug)]
pub struct Stamped {
    /// SHA-256 of `envelope.payload`.
    pub id: Id,
    pub envelope: pb::Sealed,
}

/// A signed contract, with what storing and caching it needs, computed
/// once where it was signed (often off the store's writer).
#[derive(Clone, Debug)]
pub struct StampedContract {
    pub stamped: Stamped,
    /// The envelope, encoded for the store.
    pub encoded: Vec<u8>,
    /// The signed payload, decoded: stamping its children needs it.
    pub contract: Arc<pb::Contract>,
}

impl StampedContract {
    fn new(stamped: Stamped, contract: pb::Contract) -> Self {
        Self {
            encoded: stamped.envelope.encode_to_vec(),
            stamped,
            contract: Arc::new(contract),
        }
    }
}

/// Signs everything the broker issues with its current key.
pub struct Stamper {
    key: SigningKey,
    /// Cached `crypto::key_id` of `key`, inside every payload it signs.
    key_id: String,
}

impl Stamper {
    pub fn new(key: SigningKey) -> Self {
        let key_id = crypto::key_id(&key.verifying_key().to_bytes());
        Self { key, key_id }
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    fn seal(&self, payload_type: &str, payload: Vec<u8>) -> Stamped {
        let id = crypto::sha256(&payload);
        Stamped {
            id,
            envelope: crypto::seal(&self.key, payload_type, payload),
        }
    }

    /// Stamps a root: depth 0, full trust, the tree's intent, policy and
    /// labels (children carry none of them: they commit to the root).
    pub fn root(&self, root: &NewRoot, now_ms: i64) -> StampedContract {
        let contract = pb::Contract {
            broker_key_id: self.key_id.clone(),
            parent_id: Vec::new(),
            depth: 0,
            intent: root.intent.clone(),
            intent_lineage_hash: crypto::sha256(root.intent.as_bytes()).to_vec(),
            task: root.task.clone(),
            delegate_public_key: root.request.agent.to_vec(),
            budget: root.budget,
            deadline_ms: root.deadline_ms,
            issued_at_ms: now_ms,
            liability: Liability::Delegate.as_i32(),
            predicate: root.predicate.as_str().to_owned(),
            escalation_channel: String::new(),
            min_retry_cost: 0,
            min_retry_latency_ms: 0,
            write_scope: root.write_scope.prefixes().to_vec(),
            policy: Some(policy_to_pb(&root.policy)),
            request_digest: root.request.digest.to_vec(),
            host_public_key: Vec::new(),
            result_schema_json: String::new(),
            labels: root.labels.clone().into_iter().collect(),
            factor_ppm: broker_domain::limits::PPM_ONE,
            cumulative_trust_ppm: broker_domain::limits::PPM_ONE,
            trust_source: pb::TrustSource::Root as i32,
            attestation_digest: Vec::new(),
            risk_class: String::new(),
            delegate_identity: root.identity.clone().unwrap_or_default(),
        };
        StampedContract::new(
            self.seal(payload_type::CONTRACT, contract.encode_to_vec()),
            contract,
        )
    }

    /// Stamps a child that passed every invariant: its own hop's terms and
    /// trust evidence, committed to its parent by the parent's id. Its size
    /// does not depend on its depth.
    pub fn child(
        &self,
        intent_lineage_hash: &[u8; 32],
        child: &NewChild,
        terms: &ChildTerms,
        now_ms: i64,
    ) -> StampedContract {
        let contract = pb::Contract {
            broker_key_id: self.key_id.clone(),
            parent_id: child.parent_id.to_vec(),
            depth: terms.depth,
            intent: String::new(),
            intent_lineage_hash: intent_lineage_hash.to_vec(),
            task: child.task.clone(),
            delegate_public_key: child.delegate_key.to_vec(),
            budget: child.ask.budget,
            deadline_ms: terms.deadline_ms,
            issued_at_ms: now_ms,
            liability: child.ask.liability.as_i32(),
            predicate: child.ask.predicate.as_str().to_owned(),
            escalation_channel: child.ask.escalation_channel.clone(),
            min_retry_cost: child.ask.min_retry_cost,
            min_retry_latency_ms: child.ask.min_retry_latency_ms,
            write_scope: child.ask.write_scope.prefixes().to_vec(),
            policy: None,
            request_digest: child.request.digest.to_vec(),
            host_public_key: child.host.map(|h| h.to_vec()).unwrap_or_default(),
            result_schema_json: child.result_schema_json.clone(),
            labels: Default::default(),
            factor_ppm: child.ask.factor_ppm,
            cumulative_trust_ppm: terms.cumulative_trust_ppm,
            trust_source: child.trust.source as i32,
            attestation_digest: child
                .trust
                .attestation_digest
                .map(|d| d.to_vec())
                .unwrap_or_default(),
            risk_class: child.trust.risk_class.clone(),
            delegate_identity: child.identity.clone().unwrap_or_default(),
        };
        StampedContract::new(
            self.seal(payload_type::CONTRACT, contract.encode_to_vec()),
            contract,
        )
    }

    /// Signs a read session (its `broker_key_id` is set here).
    pub fn sign_session(&self, session: &pb::Session) -> pb::Sealed {
        let mut session = session.clone();
        session.broker_key_id = self.key_id.clone();
        crypto::seal(&self.key, payload_type::SESSION, session.encode_to_vec())
    }

    /// Signs a JWT (EdDSA, `kid` the broker key id) for the token
    /// endpoint.
    pub fn sign_jwt(
        &self,
        typ: &str,
        claims: &serde_json::Map<String, serde_json::Value>,
    ) -> String {
        crate::jwt::sign(&self.key, typ, Some(&self.key_id), claims)
    }

    /// Signs any receipt (its `broker_key_id` is set here).
    pub fn sign_receipt(&self, receipt: &pb::Receipt) -> Stamped {
        let mut receipt = receipt.clone();
        receipt.broker_key_id = self.key_id.clone();
        self.seal(payload_type::RECEIPT, receipt.encode_to_vec())
    }

    /// Signs a refusal receipt naming every violated invariant; returns it
    /// with the receipt it signed.
    pub fn refusal(
        &self,
        parent_id: &Id,
        root_id: &Id,
        request: &RequestMeta,
        refusal: &Refusal,
        now_ms: i64,
    ) -> (Stamped, pb::Receipt) {
        let receipt = pb::Receipt {
            broker_key_id: self.key_id.clone(),
            kind: pb::ReceiptKind::Refused as i32,
            contract_id: parent_id.to_vec(),
            root_id: root_id.to_vec(),
            request_digest: request.digest.to_vec(),
            requester_public_key: request.agent.to_vec(),
            at_ms: now_ms,
            primary: refusal.primary() as i32,
            violations: refusal
                .violations()
                .iter()
                .map(|v| pb::Violation {
                    code: v.code as i32,
                    requested: v.requested.clone(),
                    allowed: v.allowed.clone(),
                    detail: v.detail.clone(),
                })
                .collect(),
            ..Default::default()
        };
        let stamped = self.seal(payload_type::RECEIPT, receipt.encode_to_vec());
        (stamped, receipt)
    }
}

pub fn policy_to_pb(policy: &Policy) -> pb::Policy {
    pb::Policy {
        max_depth: policy.max_depth,
        min_cumulative_trust_ppm: policy.min_cumulative_trust_ppm,
        max_children: policy.max_children,
        disable_retry_headroom: !policy.retry_headroom,
        require_host: policy.require_host,
    }
}

/// A lifecycle receipt's content as the core decided it; the store adds
/// the contract, root, time, request binding and key id before signing.
pub fn lifecycle_receipt(body: &ReceiptBody) -> pb::Receipt {
    let ids = |ids: &[Id]| ids.iter().map(|id| id.to_vec()).collect::<Vec<_>>();
    let (kind, mut receipt) = match body {
        ReceiptBody::Expired { ended } => (
            pb::ReceiptKind::Expired,
            pb::Receipt {
                revoked_ids: ids(ended),
                ..Default::default()
            },
        ),
        ReceiptBody::Cascaded { id, status, cause } => (
            if *status == Status::Expired {
                pb::ReceiptKind::Expired
            } else {
                pb::ReceiptKind::Revoked
            },
            pb::Receipt {
                reason: format!("ended with its ancestor {}", hex::encode(cause)),
                revoked_ids: vec![id.to_vec()],
                ..Default::default()
            },
        ),
        ReceiptBody::Accepted => (pb::ReceiptKind::Accepted, pb::Receipt::default()),
        ReceiptBody::Declined { reason, ended } | ReceiptBody::Revoked { reason, ended } => (
            if matches!(body, ReceiptBody::Declined { .. }) {
                pb::ReceiptKind::Declined
            } else {
                pb::ReceiptKind::Revoked
            },
            pb::Receipt {
                reason: reason.clone(),
                revoked_ids: ids(ended),
                ..Default::default()
            },
        ),
        ReceiptBody::Escalated {
            reason,
            ended,
            notice,
        } => (
            pb::ReceiptKind::Escalated,
            pb::Receipt {
                reason: reason.clone(),
                revoked_ids: ids(ended),
                escalation: Some(pb::EscalationNotice {
                    principal_residual: notice.residual,
                    principal_deadline_ms: notice.deadline_ms,
                    retry_feasible: notice.retry_feasible,
                    reason: reason.clone(),
                }),
                ..Default::default()
            },
        ),
        ReceiptBody::Observed { count } => (
            pb::ReceiptKind::Observed,
            pb::Receipt {
                observations: *count,
                ..Default::default()
            },
        ),
        ReceiptBody::Completed(c) => (
            pb::ReceiptKind::Completed,
            pb::Receipt {
                revoked_ids: ids(&c.ended),
                completion: Some(completion(c)),
                ..Default::default()
            },
        ),
        ReceiptBody::Adjudicated { verdict, reason } => (
            pb::ReceiptKind::Adjudicated,
            pb::Receipt {
                reason: reason.clone(),
                completion: Some(pb::Completion {
                    verdict: verdict.as_i32(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
    };
    receipt.kind = kind as i32;
    receipt
}

/// A completion receipt's facts as protobuf.
fn completion(c: &broker_domain::lifecycle::CompletedFacts) -> pb::Completion {
    let ids = |ids: &[Id]| ids.iter().map(|id| id.to_vec()).collect::<Vec<_>>();
    pb::Completion {
        verdict: c.judgment.verdict.as_i32(),
        refused_criteria: c
            .judgment
            .refused
            .iter()
            .map(|r| pb::RefusedCriterion {
                criterion: r.text.clone(),
                reason: r.reason.clone(),
            })
            .collect(),
        claim: c.claim.clone(),
        has_report: c.has_report,
        result_digest: c.result_digest.to_vec(),
        consumed: c.consumed,
        claimed_excess: c.claimed_excess,
        overspend: c.overspend,
        returned: c.returned,
        schema_valid: c.judgment.schema_valid,
        within_scope: c.judgment.within_scope,
        out_of_scope_paths: c.judgment.out_of_scope_paths.clone(),
        out_of_scope_path_count: c.judgment.out_of_scope_path_count,
        attribution: Some(pb::Attribution {
            agent_public_key: c.delegate_key.to_vec(),
            depth: c.depth,
            chain: ids(&c.chain),
        }),
        elapsed_ms: c.elapsed_ms,
    }
}
