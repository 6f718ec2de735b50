//! The broker calls the gateway makes with the fronted agent's key: the
//! lifecycle of the tasks it admits, and Delegate and Revoke for the
//! agent's outbound calls. Each request is signed once and sent again
//! unchanged while the broker is unavailable (the nonce makes that safe).

use prost::Message as _;

use crate::crypto::payload_type;
use crate::mcp::link::{Link, ToolError};
use crate::pb;

/// A receipt the broker signed, decoded (the broker's own signature is not
/// checked again here: it came over the gateway's own connection).
pub fn receipt(sealed: Option<&pb::Sealed>) -> Option<pb::Receipt> {
    sealed.and_then(|s| pb::Receipt::decode(s.payload.as_slice()).ok())
}

pub async fn accept(link: &Link, contract_id: &[u8]) -> Result<pb::AcceptResponse, ToolError> {
    let body = pb::AcceptBody {
        header: Some(link.agent.header()),
        contract_id: contract_id.to_vec(),
        host_public_key: Vec::new(),
    };
    let request = pb::AcceptRequest {
        signed: link.signed(payload_type::ACCEPT, &body),
    };
    link.send(request, |mut c, r| async move { c.accept(r).await })
        .await
}

pub async fn complete(
    link: &Link,
    contract_id: &[u8],
    output_json: String,
    claim: &str,
) -> Result<pb::CompleteResponse, ToolError> {
    let body = pb::CompleteBody {
        header: Some(link.agent.header()),
        contract_id: contract_id.to_vec(),
        output_json,
        report: None,
        claim: claim.into(),
        consumed: 0,
    };
    let request = pb::CompleteRequest {
        signed: link.signed(payload_type::COMPLETE, &body),
    };
    link.send(request, |mut c, r| async move { c.complete(r).await })
        .await
}

pub async fn escalate(
    link: &Link,
    contract_id: &[u8],
    reason: String,
) -> Result<pb::EscalateResponse, ToolError> {
    let body = pb::EscalateBody {
        header: Some(link.agent.header()),
        contract_id: contract_id.to_vec(),
        reason,
    };
    let request = pb::EscalateRequest {
        signed: link.signed(payload_type::ESCALATE, &body),
    };
    link.send(request, |mut c, r| async move { c.escalate(r).await })
        .await
}

pub async fn decline(
    link: &Link,
    contract_id: &[u8],
    reason: String,
) -> Result<pb::DeclineResponse, ToolError> {
    let body = pb::DeclineBody {
        header: Some(link.agent.header()),
        contract_id: contract_id.to_vec(),
        reason,
    };
    let request = pb::DeclineRequest {
        signed: link.signed(payload_type::DECLINE, &body),
    };
    link.send(request, |mut c, r| async move { c.decline(r).await })
        .await
}

pub async fn revoke(
    link: &Link,
    contract_id: &[u8],
    reason: String,
) -> Result<pb::RevokeResponse, ToolError> {
    let body = pb::RevokeBody {
        header: Some(link.agent.header()),
        contract_id: contract_id.to_vec(),
        reason,
    };
    let request = pb::RevokeRequest {
        signed: link.signed(payload_type::REVOKE, &body),
    };
    link.send(request, |mut c, r| async move { c.revoke(r).await })
        .await
}

pub async fn delegate(
    link: &Link,
    body: pb::DelegateBody,
) -> Result<pb::DelegateResponse, ToolError> {
    let request = pb::DelegateRequest {
        signed: link.signed(payload_type::DELEGATE, &body),
    };
    link.send(request, |mut c, r| async move { c.delegate(r).await })
        .await
}

pub async fn chain(link: &Link, contract_id: &[u8]) -> Result<pb::GetChainResponse, ToolError> {
    let id = contract_id.to_vec();
    Ok(link
        .read(|mut client| {
            let contract_id = id.clone();
            async move { client.get_chain(pb::GetChainRequest { contract_id }).await }
        })
        .await?
        .into_inner())
}
