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
//! Only POST on `authz_jsonrpc_paths` and GET of the card pass, and a
//! body with duplicate keys is refused: the agent must read the request
//! the check decided on. A message in a task already started passes only
//! under the contract the task was started under, read from the agent.
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
use serde_json::{Value, json};

use crate::client::CARD_PATH;
use crate::ext::{self, MAX_ECHOED_NAME_BYTES, Refused, code, echoed};
use crate::gateway::Upstream;
use crate::jsonrpc::{Envelope, envelope};
use crate::{Gateway, broker, broker_error, ingress};
use broker_client::names::{cut, status_name};
use broker_domain::Id;
use broker_wire::pb;

/// Headers set on an allowed request.
pub const CONTRACT_ID_HEADER: &str = "x-delegation-contract-id";
pub const DEPTH_HEADER: &str = "x-delegation-depth";
pub const DEADLINE_HEADER: &str = "x-delegation-deadline-ms";
pub const RESIDUAL_HEADER: &str = "x-delegation-residual";
/// The reason of a denial, beside the body.
pub const REFUSAL_HEADER: &str = "x-delegation-refusal";
/// Longest HTTP method quoted back in a refusal: the gateway's own bound;
/// real methods are short words.
const MAX_ECHOED_VERB_BYTES: usize = 16;
/// Longest path quoted back in a refusal: the gateway's own bound, more
/// than other echoed input (`ext::echoed`) because the operator fixing the
/// proxy's routes needs the path the proxy sent.
const MAX_ECHOED_PATH_BYTES: usize = 256;

pub struct Authz {
    pub gateway: Arc<Gateway>,
}

/// What a request is allowed with.
struct Allowed {
    contract_id: Id,
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
                    .refused(crate::metrics::Side::Authz, &refused.reason);
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

/// Whether `path` (query and all) is the agent card's, at the root or
/// under a JSON-RPC path.
fn is_card(gateway: &Gateway, path: &str) -> bool {
    path == CARD_PATH
        || gateway
            .config
            .authz_jsonrpc_paths
            .iter()
            .any(|p| path.strip_prefix(p.trim_end_matches('/')) == Some(CARD_PATH))
}

/// Allowed (with the contract, for a SendMessage), or refused; beside it
/// the JSON-RPC id to answer with. Only what the agent would read as the
/// request decided on passes: a POST of a JSON-RPC body without duplicate
/// keys to one of `authz_jsonrpc_paths`, or a GET of the card.
async fn decide(
    gateway: &Gateway,
    http: &HttpRequest,
) -> (Value, Result<Option<Allowed>, Refused>) {
    let verb = http.method.as_str();
    if verb == "GET" && is_card(gateway, http.path.as_str()) {
        // The agent card is public.
        return (Value::Null, Ok(None));
    }
    let Envelope { id, method, params } = match request(gateway, http) {
        Ok(request) => request,
        Err((id, refused)) => return (id, Err(refused)),
    };
    let decision = match method.as_str() {
        "SendMessage" | "SendStreamingMessage" => admit(gateway, params.unwrap_or(Value::Null))
            .await
            .map(Some),
        // Task ids are the agent's unguessable ids, given to the caller.
        "GetTask" => Ok(None),
        other => Err(Refused::new(
            code::UNSUPPORTED_OPERATION,
            "INVALID_FIELD",
            format!(
                "{}: not allowed through this proxy; tasks start with SendMessage under a contract",
                cut(other, MAX_ECHOED_NAME_BYTES)
            ),
        )),
    };
    (id, decision)
}

/// The JSON-RPC request a POST to one of `authz_jsonrpc_paths` carries,
/// read strictly within `max_message_bytes`; anything else is refused.
fn request(gateway: &Gateway, http: &HttpRequest) -> Result<Envelope, (Value, Refused)> {
    let paths = &gateway.config.authz_jsonrpc_paths;
    let verb = http.method.as_str();
    let path = http.path.as_str();
    if verb != "POST" || !paths.iter().any(|p| p == path) {
        return Err((
            Value::Null,
            Refused::new(
                code::UNSUPPORTED_OPERATION,
                "INVALID_FIELD",
                format!(
                    "{} {}: only POST on {} (A2A JSON-RPC) and GET {CARD_PATH} pass this proxy",
                    cut(verb, MAX_ECHOED_VERB_BYTES),
                    cut(path, MAX_ECHOED_PATH_BYTES),
                    paths.join(", ")
                ),
            )
            .with("field", "path"),
        ));
    }
    let body: &[u8] = if http.raw_body.is_empty() {
        http.body.as_bytes()
    } else {
        &http.raw_body
    };
    if body.is_empty() {
        return Err((
            Value::Null,
            Refused::new(
                code::INVALID_REQUEST,
                "INVALID_FIELD",
                "the proxy passed no request body: configure ext_authz with with_request_body (the chain rides in the A2A message)",
            ),
        ));
    }
    let max_bytes = gateway.config.max_message_bytes;
    if body.len() > max_bytes {
        return Err((
            Value::Null,
            Refused::new(
                code::INVALID_REQUEST,
                "MESSAGE_TOO_LARGE",
                format!(
                    "the body is {} bytes, at most {max_bytes} (max_message_bytes)",
                    body.len()
                ),
            ),
        ));
    }
    envelope(body, max_bytes)
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
    // see the agent's answers.
    let extension = ext::take(message)?;
    let chain = ext::chain_of(extension.as_ref())?;
    let (contract_id, _) = ingress::admit_chain(gateway, &chain).await?;
    if !message.task_id.is_empty() {
        let task_id = message.task_id.clone();
        return continuation(gateway, &task_id, contract_id).await;
    }
    let state = gateway.contract(&contract_id).await?;
    let binding = ingress::bind(gateway, contract_id, &ingress::tenant_of(&state))?;
    if state.status != pb::ContractStatus::Open as i32 {
        return Err(ingress::ended(
            &contract_id,
            format!("it is {}", status_name(state.status)),
        ));
    }
    // Accepted at the broker before the request goes on: a replay of the
    // same chain is refused (ACCEPTED) even by a restarted gateway or
    // another replica of it. Fails closed. The binding only covers
    // concurrent checks until then, so it is not kept (nothing in memory
    // grows with the contracts allowed).
    broker::accept(gateway, None, &contract_id)
        .await
        .map_err(broker_error)?;
    gateway.metrics.admitted.inc();
    drop(binding);
    Ok(allowed(contract_id, &state))
}

/// A message in a task already started: allowed only under the contract
/// the task was started under (the agent's record says which), while that
/// contract is ACCEPTED. Another contract's chain, even an open or
/// accepted one naming this agent, does not continue it.
async fn continuation(
    gateway: &Gateway,
    task_id: &str,
    contract_id: Id,
) -> Result<Allowed, Refused> {
    let field = "message.taskId";
    let shown = echoed(task_id);
    if matches!(gateway.upstream, Upstream::None) {
        return Err(Refused::new(
            code::UNSUPPORTED_OPERATION,
            "INVALID_FIELD",
            format!(
                "task {shown:?}: a message in a task already started passes this proxy only when the gateway reads the task's contract from the agent (set upstream in the gateway's config)"
            ),
        )
        .with("field", field));
    }
    let not_found = || {
        Refused::new(
            code::TASK_NOT_FOUND,
            "NOT_FOUND",
            format!("task {shown:?}: the agent has no task started under a contract by that id"),
        )
        .with("field", field)
    };
    let task = gateway.upstream_task(task_id).await.ok_or_else(not_found)?;
    let bound: Id = ext::started_under(&task)
        .and_then(|id| id.try_into().ok())
        .ok_or_else(not_found)?;
    if bound != contract_id {
        return Err(Refused::new(
            code::INVALID_PARAMS,
            "NOT_HOLDER",
            format!(
                "task {shown:?} was started under contract {}, not {}: a message in a task carries the chain of the task's own contract",
                hex::encode(bound),
                hex::encode(contract_id)
            ),
        )
        .with("contractId", hex::encode(contract_id)));
    }
    let state = gateway.contract(&bound).await?;
    match pb::ContractStatus::try_from(state.status) {
        Ok(pb::ContractStatus::Accepted) => Ok(allowed(bound, &state)),
        Ok(pb::ContractStatus::Open) => Err(Refused::new(
            code::INVALID_PARAMS,
            "WRONG_STATE",
            format!(
                "contract {} is open, not accepted: its task was not started through this proxy",
                hex::encode(bound)
            ),
        )
        .with("contractId", hex::encode(bound))),
        _ => Err(ingress::ended(
            &bound,
            format!("it is {}", status_name(state.status)),
        )),
    }
}

fn allowed(contract_id: Id, state: &pb::ContractState) -> Allowed {
    let contract = broker_client::terms(state.contract.as_ref()).unwrap_or_default();
    Allowed {
        contract_id,
        depth: contract.depth,
        deadline_ms: contract.deadline_ms,
        residual: state.ledger.as_ref().map_or(0, |l| l.residual),
    }
}
