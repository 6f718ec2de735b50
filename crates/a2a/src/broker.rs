//! The broker calls the gateway makes with the fronted agent's key: the
//! lifecycle of the tasks it admits, and Delegate and Revoke for the
//! agent's outbound calls. Each goes through `Link::call`, which fills in
//! the header, signs once, sends again unchanged while the broker is
//! unavailable (the nonce makes that safe) and passes the trace context.

use prost::Message as _;

use crate::Gateway;
use broker_client::Ending as _;
use broker_client::{Body, BrokerError, Link, Sendable};
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
    let body = pb::AcceptBody {
        contract_id: contract_id.to_vec(),
        ..Default::default()
    };
    counted(gateway, "accept", body, trace).await
}

pub async fn complete(
    gateway: &Gateway,
    trace: Option<&str>,
    contract_id: &[u8],
    output_json: String,
    claim: &str,
) -> Result<pb::CompleteResponse, BrokerError> {
    let body = pb::CompleteBody {
        contract_id: contract_id.to_vec(),
        output_json,
        claim: claim.into(),
        ..Default::default()
    };
    counted(gateway, "complete", body, trace).await
}

/// What ends a contract with a reason: the delegate escalating or
/// declining, the principal revoking.
#[derive(Clone, Copy, Debug)]
pub enum Ending {
    Escalate,
    Decline,
    Revoke,
}

/// Ends `contract_id` with `reason`; the receipt's id.
pub async fn end(
    gateway: &Gateway,
    trace: Option<&str>,
    ending: Ending,
    contract_id: &[u8],
    reason: String,
) -> Result<Vec<u8>, BrokerError> {
    let contract_id = contract_id.to_vec();
    Ok(match ending {
        Ending::Escalate => {
            let body = pb::EscalateBody::ending(contract_id, reason);
            counted(gateway, "escalate", body, trace).await?.receipt_id
        }
        Ending::Decline => {
            let body = pb::DeclineBody::ending(contract_id, reason);
            counted(gateway, "decline", body, trace).await?.receipt_id
        }
        Ending::Revoke => {
            let body = pb::RevokeBody::ending(contract_id, reason);
            counted(gateway, "revoke", body, trace).await?.receipt_id
        }
    })
}

/// A Delegate; its header is the link's to fill in.
pub async fn delegate(
    gateway: &Gateway,
    trace: Option<&str>,
    body: pb::DelegateBody,
) -> Result<pb::DelegateResponse, BrokerError> {
    let result = gateway.link.call(body, trace).await;
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

/// A signed call, its outcome counted (a2a_gateway_broker_calls_total).
async fn counted<B: Body>(
    gateway: &Gateway,
    call: &'static str,
    body: B,
    trace: Option<&str>,
) -> Result<<B::Request as Sendable>::Response, BrokerError> {
    let result = gateway.link.call(body, trace).await;
    gateway
        .metrics
        .broker_call(call, if result.is_ok() { "ok" } else { "error" });
    result
}
