//! The broker calls the gateway makes with the fronted agent's key: the
//! lifecycle of the tasks it admits, and Delegate and Revoke for the
//! agent's outbound calls. Each request is signed once and sent again
//! unchanged while the broker is unavailable (the nonce makes that safe).

use prost::Message as _;

use super::Gateway;
use broker_client::trace::traced;
use broker_client::{BrokerError, Link};
use broker_wire::crypto::payload_type;
use broker_wire::pb;

/// A receipt the broker signed, decoded (the broker's own signature is not
/// checked again here: it came over the gateway's own connection).
pub fn receipt(sealed: Option<&pb::Sealed>) -> Option<pb::Receipt> {
    sealed.and_then(|s| pb::Receipt::decode(s.payload.as_slice()).ok())
}

pub async fn accept(
    gateway: &Gateway,
    trace: Option<&str>,
    contract_id: &[u8],
) -> Result<pb::AcceptResponse, BrokerError> {
    let link = &gateway.link;
    let body = pb::AcceptBody {
        header: Some(link.agent.header()),
        contract_id: contract_id.to_vec(),
        host_public_key: Vec::new(),
    };
    let request = pb::AcceptRequest {
        signed: link.signed(payload_type::ACCEPT, &body),
    };
    counted(
        gateway,
        "accept",
        link.send(request, |mut c, r| {
            let trace = trace.map(str::to_owned);
            async move { c.accept(traced(r, trace.as_deref())).await }
        })
        .await,
    )
}

pub async fn complete(
    gateway: &Gateway,
    trace: Option<&str>,
    contract_id: &[u8],
    output_json: String,
    claim: &str,
) -> Result<pb::CompleteResponse, BrokerError> {
    let link = &gateway.link;
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
    counted(
        gateway,
        "complete",
        link.send(request, |mut c, r| {
            let trace = trace.map(str::to_owned);
            async move { c.complete(traced(r, trace.as_deref())).await }
        })
        .await,
    )
}

pub async fn escalate(
    gateway: &Gateway,
    trace: Option<&str>,
    contract_id: &[u8],
    reason: String,
) -> Result<pb::EscalateResponse, BrokerError> {
    let link = &gateway.link;
    let body = pb::EscalateBody {
        header: Some(link.agent.header()),
        contract_id: contract_id.to_vec(),
        reason,
    };
    let request = pb::EscalateRequest {
        signed: link.signed(payload_type::ESCALATE, &body),
    };
    counted(
        gateway,
        "escalate",
        link.send(request, |mut c, r| {
            let trace = trace.map(str::to_owned);
            async move { c.escalate(traced(r, trace.as_deref())).await }
        })
        .await,
    )
}

pub async fn decline(
    gateway: &Gateway,
    trace: Option<&str>,
    contract_id: &[u8],
    reason: String,
) -> Result<pb::DeclineResponse, BrokerError> {
    let link = &gateway.link;
    let body = pb::DeclineBody {
        header: Some(link.agent.header()),
        contract_id: contract_id.to_vec(),
        reason,
    };
    let request = pb::DeclineRequest {
        signed: link.signed(payload_type::DECLINE, &body),
    };
    counted(
        gateway,
        "decline",
        link.send(request, |mut c, r| {
            let trace = trace.map(str::to_owned);
            async move { c.decline(traced(r, trace.as_deref())).await }
        })
        .await,
    )
}

pub async fn revoke(
    gateway: &Gateway,
    trace: Option<&str>,
    contract_id: &[u8],
    reason: String,
) -> Result<pb::RevokeResponse, BrokerError> {
    let link = &gateway.link;
    let body = pb::RevokeBody {
        header: Some(link.agent.header()),
        contract_id: contract_id.to_vec(),
        reason,
    };
    let request = pb::RevokeRequest {
        signed: link.signed(payload_type::REVOKE, &body),
    };
    counted(
        gateway,
        "revoke",
        link.send(request, |mut c, r| {
            let trace = trace.map(str::to_owned);
            async move { c.revoke(traced(r, trace.as_deref())).await }
        })
        .await,
    )
}

pub async fn delegate(
    gateway: &Gateway,
    trace: Option<&str>,
    body: pb::DelegateBody,
) -> Result<pb::DelegateResponse, BrokerError> {
    let link = &gateway.link;
    let request = pb::DelegateRequest {
        signed: link.signed(payload_type::DELEGATE, &body),
    };
    let result = link
        .send(request, |mut c, r| {
            let trace = trace.map(str::to_owned);
            async move { c.delegate(traced(r, trace.as_deref())).await }
        })
        .await;
    let outcome = match &result {
        Ok(pb::DelegateResponse {
            outcome: Some(pb::delegate_response::Outcome::Refused(_)),
            ..
        }) => "refused",
        Ok(_) => "ok",
        Err(_) => "error",
    };
    gateway.metrics.broker_call("delegate", outcome);
    result
}

pub async fn chain(link: &Link, contract_id: &[u8]) -> Result<pb::GetChainResponse, BrokerError> {
    let id = contract_id.to_vec();
    Ok(link
        .read(|mut client| {
            let contract_id = id.clone();
            async move { client.get_chain(pb::GetChainRequest { contract_id }).await }
        })
        .await?
        .into_inner())
}

/// Counts a broker call's outcome (a2a_gateway_broker_calls_total).
fn counted<T>(
    gateway: &Gateway,
    call: &'static str,
    result: Result<T, BrokerError>,
) -> Result<T, BrokerError> {
    gateway
        .metrics
        .broker_call(call, if result.is_ok() { "ok" } else { "error" });
    result
}
