//! Envoy's external authorization (`envoy.service.auth.v3.Authorization/
//! Check`), so a proxy a platform team already runs (Envoy, Envoy Gateway,
//! Istio, agentgateway, Consul) enforces the ingress rule without this
//! gateway in the data path: a task-starting A2A message reaches the agent
//! only with a chain that verifies offline, names the fronted agent as
//! the leaf's delegate, and whose contract is open and not yet used. The
//! gateway accepts the contract for the agent (so the chain cannot be
//! replayed), and the request goes on with the contract's id, depth,
//! deadline and residual as headers; a denied one gets a JSON-RPC error
//! body. Completing is then the agent's own call.
//!
//! Served by the gateway process (not the broker): it needs the fronted
//! agent's identity and a read session, and it parses A2A bodies, which
//! the broker's core does not learn.

use std::sync::Arc;

use a2a_pb::protojson as a2a;
use envoy_types::ext_authz::v3::pb::{
    Authorization, CheckRequest, CheckResponse, DeniedHttpResponse, HttpResponse, OkHttpResponse,
};
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::{HttpStatus, StatusCode};
use envoy_types::pb::google::rpc;
use prost::Message as _;
use serde_json::{Value, json};

use super::ext::{self, Refused, code};
use super::{Gateway, ingress};
use crate::pb;

/// Headers set on an allowed request.
pub const CONTRACT_ID_HEADER: &str = "x-delegation-contract-id";
pub const DEPTH_HEADER: &str = "x-delegation-depth";
pub const DEADLINE_HEADER: &str = "x-delegation-deadline-ms";
pub const RESIDUAL_HEADER: &str = "x-delegation-residual";
/// The reason of a denial, beside the body.
pub const REFUSAL_HEADER: &str = "x-delegation-refusal";

pub struct Authz {
    pub gateway: Arc<Gateway>,
}

/// What a request is allowed with.
struct Allowed {
    contract_id: [u8; 32],
    depth: u32,
    deadline_ms: i64,
    residual: i64,
}

fn header(key: &str, value: String) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.into(),
            value,
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl Authorization for Authz {
    async fn check(
        &self,
        request: tonic::Request<CheckRequest>,
    ) -> Result<tonic::Response<CheckResponse>, tonic::Status> {
        let http = request
            .into_inner()
            .attributes
            .and_then(|a| a.request)
            .and_then(|r| r.http)
            .unwrap_or_default();
        let (id, decision) = decide(&self.gateway, &http).await;
        let response = match decision {
            Ok(None) => CheckResponse {
                status: Some(rpc::Status::default()),
                http_response: Some(HttpResponse::OkResponse(OkHttpResponse::default())),
                ..Default::default()
            },
            Ok(Some(allowed)) => CheckResponse {
                status: Some(rpc::Status::default()),
                http_response: Some(HttpResponse::OkResponse(OkHttpResponse {
                    headers: vec![
                        header(CONTRACT_ID_HEADER, hex::encode(allowed.contract_id)),
                        header(DEPTH_HEADER, allowed.depth.to_string()),
                        header(DEADLINE_HEADER, allowed.deadline_ms.to_string()),
                        header(RESIDUAL_HEADER, allowed.residual.to_string()),
                    ],
                    // A client must not pose as having passed the check.
                    headers_to_remove: vec![
                        CONTRACT_ID_HEADER.into(),
                        DEPTH_HEADER.into(),
                        DEADLINE_HEADER.into(),
                        RESIDUAL_HEADER.into(),
                    ],
                    ..Default::default()
                })),
                ..Default::default()
            },
            Err(refused) => {
                tracing::info!(reason = %refused.reason, "authz denied");
                self.gateway
                    .metrics
                    .refused(super::metrics::Side::Authz, &refused.reason);
                let body = json!({"jsonrpc": "2.0", "id": id, "error": refused.to_jsonrpc()});
                CheckResponse {
                    status: Some(rpc::Status {
                        code: tonic::Code::PermissionDenied as i32,
                        message: refused.message.clone(),
                        details: Vec::new(),
                    }),
                    http_response: Some(HttpResponse::DeniedResponse(DeniedHttpResponse {
                        // JSON-RPC errors travel in a 200 (A2A's SDKs read
                        // the body); a 403 would hide the reason from them.
                        status: Some(HttpStatus {
                            code: StatusCode::Ok as i32,
                        }),
                        headers: vec![
                            header("content-type", "application/json".into()),
                            header(REFUSAL_HEADER, refused.reason.clone()),
                        ],
                        body: body.to_string(),
                    })),
                    ..Default::default()
                }
            }
        };
        Ok(tonic::Response::new(response))
    }
}

type HttpRequest = envoy_types::pb::envoy::service::auth::v3::attribute_context::HttpRequest;

/// Allowed (with the contract, for a task-starting message), or refused;
/// beside it the JSON-RPC id to answer with.
async fn decide(
    gateway: &Gateway,
    http: &HttpRequest,
) -> (Value, Result<Option<Allowed>, Refused>) {
    if http.method.eq_ignore_ascii_case("GET") {
        // The agent card is public.
        let path = http.path.split('?').next().unwrap_or_default();
        return if path.ends_with(super::client::CARD_PATH) {
            (Value::Null, Ok(None))
        } else {
            (
                Value::Null,
                Err(Refused::new(
                    code::UNSUPPORTED_OPERATION,
                    "INVALID_FIELD",
                    format!(
                        "GET {}: only the agent card is served",
                        crate::mcp::link::cut(path, 256)
                    ),
                )),
            )
        };
    }
    let body: &[u8] = if http.raw_body.is_empty() {
        http.body.as_bytes()
    } else {
        &http.raw_body
    };
    if body.is_empty() {
        return (
            Value::Null,
            Err(Refused::new(
                code::INVALID_REQUEST,
                "INVALID_FIELD",
                "the proxy passed no request body: configure ext_authz with with_request_body (the chain rides in the A2A message)",
            )),
        );
    }
    let mut request: Value = match serde_json::from_slice(body) {
        Ok(value) => value,
        Err(e) => {
            return (
                Value::Null,
                Err(Refused::new(
                    code::PARSE_ERROR,
                    "UNDECODABLE_MESSAGE",
                    format!("not JSON: {e}"),
                )),
            );
        }
    };
    let id = request
        .get_mut("id")
        .map(Value::take)
        .unwrap_or(Value::Null);
    let method = request
        .get("method")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let decision = match method.as_str() {
        "SendMessage" | "SendStreamingMessage" => {
            let params = request
                .get_mut("params")
                .map(Value::take)
                .unwrap_or(Value::Null);
            admit(gateway, params).await.map(Some)
        }
        // Task ids are the agent's unguessable ids, given to the caller.
        "GetTask" => Ok(None),
        other => Err(Refused::new(
            code::UNSUPPORTED_OPERATION,
            "INVALID_FIELD",
            format!(
                "{}: not allowed through this proxy; tasks start with SendMessage under a contract",
                crate::mcp::link::cut(other, 64)
            ),
        )),
    };
    (id, decision)
}

async fn admit(gateway: &Gateway, params: Value) -> Result<Allowed, Refused> {
    let mut request: a2a::SendMessageRequest = serde_json::from_value(params).map_err(|e| {
        Refused::new(
            code::INVALID_PARAMS,
            "INVALID_FIELD",
            format!("SendMessage: params are not its A2A v1 request ({e})"),
        )
    })?;
    let message = request.message.as_mut().ok_or_else(|| {
        Refused::new(code::INVALID_PARAMS, "INVALID_FIELD", "message is required")
            .with("field", "message")
    })?;
    ingress::check_size(message)?;
    // Behind a proxy every message carries its chain: the proxy does not
    // see the agent's answers, so it cannot map task ids to contracts.
    let extension = ext::take(message)?;
    let chain = ext::chain_of(extension.as_ref())?;
    let (contract_id, _) = ingress::admit_chain(gateway, &chain).await?;
    let starts = message.task_id.is_empty();
    let binding = starts
        .then(|| ingress::bind(gateway, contract_id))
        .transpose()?;
    let state = gateway.contract(&contract_id).await?;
    let open = match pb::ContractStatus::try_from(state.status) {
        Ok(pb::ContractStatus::Open) => true,
        Ok(pb::ContractStatus::Accepted) => !starts,
        _ => false,
    };
    if !open {
        return Err(ingress::ended(
            &contract_id,
            format!("it is {}", ingress::status_name(state.status)),
        ));
    }
    let contract = state
        .contract
        .as_ref()
        .and_then(|s| pb::Contract::decode(s.payload.as_slice()).ok())
        .unwrap_or_default();
    if binding.is_some() {
        // Accepted at the broker before the request goes on: a replay of
        // the same chain is refused (ACCEPTED) even by a restarted
        // gateway or another replica of it. Fails closed. The binding
        // only covers concurrent checks until then, so it is not kept
        // (nothing in memory grows with the contracts allowed).
        super::broker::accept(gateway, None, &contract_id)
            .await
            .map_err(super::broker_error)?;
        gateway.metrics.admitted.inc();
    }
    drop(binding);
    Ok(Allowed {
        contract_id,
        depth: contract.depth,
        deadline_ms: contract.deadline_ms,
        residual: state.ledger.map_or(0, |l| l.residual),
    })
}
