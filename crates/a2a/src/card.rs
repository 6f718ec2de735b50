//! The agent cards the gateway serves: the fronted agent's at the
//! ingress, and each peer's at the egress, every one naming the
//! gateway's own interfaces and requiring the delegation extension.

use std::sync::Arc;

use a2a_pb::protojson as a2a;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::{Gateway, client, egress, ext};

/// The card a gateway serves for an agent (its own or a peer's): the
/// agent's, with `url` as its only interface, the extension required,
/// streaming as the agent (or the peer's gateway) says, and no push or
/// extended card.
pub(crate) fn gateway_card(
    mut card: a2a::AgentCard,
    url: &str,
    grpc: Option<(&str, &str)>,
    agent_key: &[u8],
) -> a2a::AgentCard {
    card.supported_interfaces = vec![a2a::AgentInterface {
        url: url.to_owned(),
        protocol_binding: "JSONRPC".into(),
        tenant: String::new(),
        protocol_version: client::PROTOCOL_VERSION.into(),
    }];
    if let Some((grpc_url, tenant)) = grpc {
        card.supported_interfaces.push(a2a::AgentInterface {
            url: grpc_url.to_owned(),
            protocol_binding: "GRPC".into(),
            tenant: tenant.to_owned(),
            protocol_version: client::PROTOCOL_VERSION.into(),
        });
    }
    let capabilities = card.capabilities.get_or_insert_with(Default::default);
    capabilities.streaming = Some(capabilities.streaming == Some(true));
    capabilities.push_notifications = Some(false);
    capabilities.extended_agent_card = Some(false);
    capabilities.extensions.retain(|e| e.uri != ext::URI);
    capabilities.extensions.push(a2a::AgentExtension {
        uri: ext::URI.into(),
        description: "Tasks run only under a delegation-broker contract naming this agent (proto/delegation/broker/v1/a2a-extension.md).".into(),
        required: true,
        params: serde_json::from_value(json!({ "agentPublicKey": hex::encode(agent_key) })).ok(),
    });
    card
}

pub(crate) async fn ingress_card(State(gateway): State<Arc<Gateway>>) -> Response {
    let card = gateway_card(
        gateway.upstream_card.clone(),
        &gateway.addresses.public_url,
        gateway.addresses.grpc_url.as_deref().map(|url| (url, "")),
        &gateway.agent_key,
    );
    axum::Json(card).into_response()
}

pub(crate) async fn egress_card(
    State(gateway): State<Arc<Gateway>>,
    Path(peer): Path<String>,
) -> Response {
    match egress::card(&gateway, &peer).await {
        Ok(card) => axum::Json(card).into_response(),
        Err(refused) => (
            http::StatusCode::NOT_FOUND,
            axum::Json(json!({"error": refused.to_jsonrpc()})),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gateway_card_lists_its_own_interfaces_and_requires_the_extension() {
        let card = a2a::AgentCard {
            name: "worker".into(),
            supported_interfaces: vec![a2a::AgentInterface {
                url: "http://10.0.0.9:1".into(),
                protocol_binding: "JSONRPC".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let served = gateway_card(card, "http://gw:1", Some(("gw:2", "worker-a")), &[7; 32]);
        let urls: Vec<_> = served
            .supported_interfaces
            .iter()
            .map(|i| {
                (
                    i.url.as_str(),
                    i.protocol_binding.as_str(),
                    i.tenant.as_str(),
                )
            })
            .collect();
        assert_eq!(
            urls,
            [("http://gw:1", "JSONRPC", ""), ("gw:2", "GRPC", "worker-a")]
        );
        let capabilities = served.capabilities.unwrap();
        assert_eq!(
            capabilities.streaming,
            Some(false),
            "the agent does not stream"
        );
        assert_eq!(capabilities.push_notifications, Some(false));
        let extension = &capabilities.extensions[0];
        assert!(extension.required && extension.uri == ext::URI);
        let streaming = a2a::AgentCard {
            capabilities: Some(a2a::AgentCapabilities {
                streaming: Some(true),
                push_notifications: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        };
        let served = gateway_card(streaming, "http://gw:1", None, &[7; 32]);
        let capabilities = served.capabilities.unwrap();
        assert_eq!(capabilities.streaming, Some(true), "as the agent streams");
        assert_eq!(capabilities.push_notifications, Some(false));
    }
}
