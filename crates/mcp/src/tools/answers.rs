//! The broker's answers as the model reads them: receipts, refusals,
//! issued and held contracts, ledgers. Codes and statuses are named by
//! `broker_client::names`.

use prost::Message as _;
use rmcp::model::CallToolResult;
use serde_json::{Value, json};

use broker_client::BrokerError;
use broker_client::names::{
    code_name, cut, listed_violations, receipt_kind_name, status_name, verdict_name,
};
use broker_wire::pb;

use super::Tools;

/// Most bytes of each held contract's task `whoami` shows (get_contract
/// has all of it): a model's context is small.
const MAX_HELD_TASK_BYTES: usize = 512;

/// What a refused delegation tells the model to do.
const REFUSAL_HINT: &str = "The broker refused this delegation and reserved nothing. Change the named terms to within what is allowed (or ask for less) and call delegate again.";

/// The contract a sealed envelope carries (the default when it does not
/// decode).
pub fn decoded(sealed: Option<&pb::Sealed>) -> pb::Contract {
    broker_client::terms(sealed).unwrap_or_default()
}

/// A ledger as the model reads it (`null` when there is none).
pub fn ledger(ledger: Option<&pb::Ledger>) -> Value {
    ledger.map_or(Value::Null, |l| {
        json!({
            "budget": l.budget, "reserved": l.reserved, "spent": l.spent,
            "residual": l.residual, "open_children": l.open_children,
        })
    })
}

/// A lifecycle receipt as the model reads it.
pub fn receipt(contract_id: &[u8], sealed: Option<pb::Sealed>) -> Result<Value, BrokerError> {
    let sealed = sealed
        .ok_or_else(|| BrokerError::new("INTERNAL", "the broker answered without a receipt"))?;
    let receipt_id = broker_wire::crypto::sha256(&sealed.payload);
    let receipt = pb::Receipt::decode(sealed.payload.as_slice())
        .map_err(|e| BrokerError::new("INTERNAL", format!("undecodable receipt: {e}")))?;
    let kind = receipt_kind_name(receipt.kind);
    // The contract's status after it, as get_contract shows it.
    let status = if receipt.kind == pb::ReceiptKind::Escalated as i32 {
        "UNRESOLVABLE".to_owned()
    } else {
        kind.clone()
    };
    let mut out = json!({
        "contract_id": hex::encode(contract_id),
        "status": status,
        "receipt_kind": kind,
        "receipt_id": hex::encode(receipt_id),
    });
    if let Some(c) = &receipt.completion {
        out["verdict"] = json!(verdict_name(c.verdict));
        out["refused_criteria"] = json!(
            c.refused_criteria
                .iter()
                .map(|r| r.criterion.clone())
                .collect::<Vec<_>>()
        );
        out["consumed"] = json!(c.consumed);
        out["returned"] = json!(c.returned);
        out["claimed_excess"] = json!(c.claimed_excess);
        out["within_scope"] = json!(c.within_scope);
        out["schema_valid"] = json!(c.schema_valid);
        out["out_of_scope_paths"] = json!(c.out_of_scope_paths);
    }
    if let Some(e) = &receipt.escalation {
        out["escalation"] = json!({
            "principal_residual": e.principal_residual,
            "retry_feasible": e.retry_feasible,
        });
    }
    Ok(out)
}

/// A refusal receipt as a tool error the model can act on.
pub fn refusal(refused: pb::Refusal) -> CallToolResult {
    let Some(sealed) = refused.receipt else {
        return crate::tool_result(BrokerError::new(
            "INTERNAL",
            "a refusal without its receipt",
        ));
    };
    let receipt = pb::Receipt::decode(sealed.payload.as_slice()).unwrap_or_default();
    let violations: Vec<Value> = receipt
        .violations
        .iter()
        .map(|v| {
            json!({
                "code": code_name(v.code),
                "requested": v.requested,
                "allowed": v.allowed,
                "detail": v.detail,
            })
        })
        .collect();
    let value = json!({
        "refused": true,
        "receipt_id": hex::encode(broker_wire::crypto::sha256(&sealed.payload)),
        "primary": code_name(receipt.primary),
        "violations": violations,
        "hint": REFUSAL_HINT,
    });
    let mut result = CallToolResult::structured_error(value);
    result.content = vec![rmcp::model::ContentBlock::text(format!(
        "Refused: {}. {REFUSAL_HINT}",
        listed_violations(&receipt).join("; ")
    ))];
    result
}

/// One contract of `whoami`'s list.
pub fn held(state: &pb::ContractState) -> Value {
    let contract = decoded(state.contract.as_ref());
    json!({
        "contract_id": hex::encode(&state.contract_id),
        "status": status_name(state.status),
        "depth": contract.depth,
        "ledger": ledger(state.ledger.as_ref()),
        "deadline": broker_client::tree::rfc3339(contract.deadline_ms),
        "task": cut(&contract.task, MAX_HELD_TASK_BYTES),
    })
}

impl Tools {
    /// A contract as `get_contract` and the `contract://` resource show it.
    pub(super) fn state_json(&self, contract_id: &[u8], state: &pb::ContractState) -> Value {
        let contract = decoded(state.contract.as_ref());
        json!({
            "contract_id": hex::encode(contract_id),
            "status": status_name(state.status),
            "depth": contract.depth,
            "delegate": self.who(&contract.delegate_public_key),
            "budget": contract.budget,
            "ledger": ledger(state.ledger.as_ref()),
            "deadline_ms": contract.deadline_ms,
            "deadline": broker_client::tree::rfc3339(contract.deadline_ms),
            "effective_predicate": state.effective_predicate,
            "write_scope": contract.write_scope,
            "task": contract.task,
            "cumulative_trust_ppm": contract.cumulative_trust_ppm,
        })
    }

    /// A contract just issued (OpenRoot, Delegate).
    pub(super) fn issued(&self, issued: &pb::IssuedContract) -> Value {
        let contract = decoded(issued.contract.as_ref());
        json!({
            "contract_id": hex::encode(&issued.contract_id),
            "depth": contract.depth,
            "delegate": self.who(&contract.delegate_public_key),
            "budget": contract.budget,
            "deadline_ms": contract.deadline_ms,
            "cumulative_trust_ppm": contract.cumulative_trust_ppm,
        })
    }
}
