//! Acceptance (f) of issue 24: `a2a-gateway`'s Envoy external authorization
//! (`envoy.service.auth.v3.Authorization/Check`), called as Envoy calls it,
//! with a real gRPC client over the envoy-types crate. Only a task-starting
//! A2A message carrying a chain for the fronted agent's open, unused
//! contract is allowed, with the contract's headers; every other request
//! is denied with its reason.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use delegation_broker::a2a::ext::URI;
use delegation_broker::client::Agent;
use delegation_broker::pb;
use envoy_types::ext_authz::v3::pb::{CheckRequest, CheckResponse, HttpResponse};
use envoy_types::pb::envoy::service::auth::v3::AttributeContext;
use envoy_types::pb::envoy::service::auth::v3::attribute_context::{HttpRequest, Request};
use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use prost::Message as _;
use serde_json::json;

use crate::crash::Killed;
use crate::harness::*;

/// Starts `a2a-gateway` fronting `agent` with only its authz listener.
fn spawn_authz(dir: &std::path::Path, broker: &str, agent: &Agent) -> (Killed, String) {
    let key_file = dir.join("agent.key");
    write_key_file(&key_file, &agent.seed());
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "broker = \"{broker}\"\nkey_file = \"{}\"\nauthz_listen = \"127.0.0.1:0\"\n",
            key_file.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .args(["a2a-gateway", "--config"])
        .arg(&config)
        .env("BROKER_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the gateway starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("a2a authz on ")
        .unwrap_or_else(|| panic!("expected the authz address, got {line:?}"))
        .to_owned();
    (Killed(child), format!("http://{addr}"))
}

/// What Envoy sends for a POST of `body` (with_request_body on).
fn check_request(body: &serde_json::Value) -> CheckRequest {
    CheckRequest {
        attributes: Some(AttributeContext {
            request: Some(Request {
                http: Some(HttpRequest {
                    method: "POST".into(),
                    path: "/".into(),
                    host: "worker.internal".into(),
                    body: body.to_string(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

fn send_message(chain: Option<&[u8]>) -> serde_json::Value {
    let mut message = json!({
        "messageId": "m-1",
        "role": "ROLE_USER",
        "parts": [{"text": "summarize the report"}],
    });
    if let Some(chain) = chain {
        let encoded = base64::engine::general_purpose::STANDARD.encode(chain);
        message["metadata"] = json!({ URI: { "chain": encoded } });
        message["extensions"] = json!([URI]);
    }
    json!({"jsonrpc": "2.0", "id": 7, "method": "SendMessage", "params": {"message": message}})
}

async fn chain_bytes(broker: &mut Broker, id: &[u8]) -> Vec<u8> {
    broker
        .client
        .get_chain(pb::GetChainRequest {
            contract_id: id.to_vec(),
        })
        .await
        .unwrap()
        .into_inner()
        .encode_to_vec()
}

fn header(response: &CheckResponse, key: &str) -> Option<String> {
    let headers = match response.http_response.as_ref()? {
        HttpResponse::OkResponse(ok) => &ok.headers,
        HttpResponse::DeniedResponse(denied) => &denied.headers,
        _ => return None,
    };
    headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == key)
        .map(|h| h.value.clone())
}

/// Asserts a denial with `reason`, its JSON-RPC body naming it too.
fn assert_denied(response: &CheckResponse, reason: &str) {
    let status = response.status.as_ref().expect("a status");
    assert_eq!(
        status.code,
        tonic::Code::PermissionDenied as i32,
        "{response:?}"
    );
    assert_eq!(
        header(response, "x-delegation-refusal").as_deref(),
        Some(reason)
    );
    let Some(HttpResponse::DeniedResponse(denied)) = &response.http_response else {
        panic!("a denied response: {response:?}");
    };
    let body: serde_json::Value = serde_json::from_str(&denied.body).unwrap();
    assert_eq!(body["id"], 7);
    assert_eq!(body["error"]["data"][0]["reason"], reason, "{body}");
    assert_eq!(body["error"]["data"][0]["domain"], "delegation.broker.v1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_allows_only_this_agents_open_unused_contract() {
    let mut broker = Broker::start().await;
    let orchestrator = Agent::generate();
    let worker = Agent::generate();
    let stranger = Agent::generate();
    let (root, contract) = broker.root_and_child(&orchestrator, &worker, 10).await;
    let (strangers, _) = broker
        .delegate(&orchestrator, child(&root.id, &root.lineage, &stranger, 5))
        .await
        .unwrap()
        .issued();
    let (revoked, _) = broker
        .delegate(&orchestrator, child(&root.id, &root.lineage, &worker, 5))
        .await
        .unwrap()
        .issued();
    broker.revoke(&orchestrator, &revoked).await.unwrap();
    let mut soon = child(&root.id, &root.lineage, &worker, 5);
    soon.deadline_ms = now_ms() + 1_000;
    let (expiring, _) = broker.delegate(&orchestrator, soon).await.unwrap().issued();

    let dir = tempfile::tempdir().unwrap();
    let (_gateway, addr) = spawn_authz(dir.path(), &broker.addr, &worker);
    let mut authz = AuthorizationClient::connect(addr).await.unwrap();
    let mut check = async |body: serde_json::Value| {
        authz
            .check(check_request(&body))
            .await
            .expect("Check answers")
            .into_inner()
    };

    // No chain at all.
    assert_denied(&check(send_message(None)).await, "INVALID_FIELD");
    // Another agent's contract.
    let theirs = chain_bytes(&mut broker, &strangers).await;
    assert_denied(&check(send_message(Some(&theirs))).await, "NOT_DELEGATE");
    // A tampered chain: one byte of the leaf's signed payload changed.
    let mut tampered = broker
        .client
        .get_chain(pb::GetChainRequest {
            contract_id: contract.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let leaf = tampered
        .chain
        .last_mut()
        .unwrap()
        .contract
        .as_mut()
        .unwrap();
    let at = leaf.payload.len() / 2;
    leaf.payload[at] ^= 0x01;
    assert_denied(
        &check(send_message(Some(&tampered.encode_to_vec()))).await,
        "BAD_SIGNATURE",
    );
    // A revoked contract.
    let revoked_chain = chain_bytes(&mut broker, &revoked).await;
    assert_denied(&check(send_message(Some(&revoked_chain))).await, "ENDED");
    // An expired one (its deadline passes while the test waits).
    let expiring_chain = chain_bytes(&mut broker, &expiring).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_denied(&check(send_message(Some(&expiring_chain))).await, "LATE");
    // Another method without a task.
    let list = json!({"jsonrpc": "2.0", "id": 7, "method": "ListTasks", "params": {}});
    assert_denied(&check(list).await, "INVALID_FIELD");

    // The worker's own open contract: allowed, with its headers.
    let good = chain_bytes(&mut broker, &contract).await;
    let allowed = check(send_message(Some(&good))).await;
    assert_eq!(allowed.status.as_ref().unwrap().code, 0, "{allowed:?}");
    assert_eq!(
        header(&allowed, "x-delegation-contract-id"),
        Some(hex::encode(&contract))
    );
    assert_eq!(header(&allowed, "x-delegation-depth").as_deref(), Some("1"));
    assert_eq!(
        header(&allowed, "x-delegation-residual").as_deref(),
        Some("10")
    );
    let deadline: i64 = header(&allowed, "x-delegation-deadline-ms")
        .unwrap()
        .parse()
        .unwrap();
    assert!(deadline > now_ms());
    // Accepted for the agent at once, so the same chain again is refused,
    // by this gateway and by a restarted one alike.
    assert_eq!(
        broker.state(&contract).await.status,
        pb::ContractStatus::Accepted as i32
    );
    assert_denied(&check(send_message(Some(&good))).await, "ENDED");
    // The agent card is public.
    let card = CheckRequest {
        attributes: Some(AttributeContext {
            request: Some(Request {
                http: Some(HttpRequest {
                    method: "GET".into(),
                    path: "/.well-known/agent-card.json".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    };
    let card = authz.check(card).await.unwrap().into_inner();
    assert_eq!(card.status.unwrap().code, 0);
    broker.stop().await;
}
