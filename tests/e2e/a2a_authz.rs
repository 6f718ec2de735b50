//! `a2a-gateway`'s Envoy external authorization
//! (`envoy.service.auth.v3.Authorization/Check`), called as Envoy calls it,
//! with a real gRPC client over the envoy-types crate. Only a task-starting
//! A2A message carrying a chain for the fronted agent's open, unused
//! contract is allowed, with the contract's headers; every other request
//! is denied with its reason.

use std::process::{Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use broker_a2a::ext::URI;
use broker_client::Agent;
use delegation_broker::pb;
use envoy_types::ext_authz::v3::pb::{CheckRequest, CheckResponse, HttpResponse};
use envoy_types::pb::envoy::service::auth::v3::AttributeContext;
use envoy_types::pb::envoy::service::auth::v3::attribute_context::{HttpRequest, Request};
use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use prost::Message as _;
use serde_json::{Value, json};

use crate::crash::Killed;
use crate::harness::*;

/// Starts `a2a-gateway` fronting `agent` with only its authz listener.
fn spawn_authz(broker: &str, agent: &Agent) -> (Gateway, String) {
    let listen = "authz_listen = \"127.0.0.1:0\"\n";
    let (gateway, addrs) = spawn_gateway(broker, agent, listen, &["a2a authz"]);
    (gateway, format!("http://{}", addrs["a2a authz"]))
}

/// Asks `authz` what Envoy asks for a POST of `body`.
async fn ask(
    authz: &mut AuthorizationClient<tonic::transport::Channel>,
    body: &serde_json::Value,
) -> CheckResponse {
    authz
        .check(check_request(body))
        .await
        .expect("Check answers")
        .into_inner()
}

/// What Envoy sends for a POST of `body` (with_request_body on).
pub(crate) fn check_request(body: &serde_json::Value) -> CheckRequest {
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

pub(crate) fn send_message(chain: Option<&[u8]>) -> serde_json::Value {
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

pub(crate) async fn chain_bytes(broker: &mut Broker, id: &[u8]) -> Vec<u8> {
    broker.chain(id).await.encode_to_vec()
}

pub(crate) fn header(response: &CheckResponse, key: &str) -> Option<String> {
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
pub(crate) fn assert_denied(response: &CheckResponse, reason: &str) {
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
    let [orchestrator, worker, stranger] = agents();
    let (root, contract) = broker.root_and_child(&orchestrator, &worker, 10).await;
    let strangers = broker.issue(&orchestrator, root.child(&stranger, 5)).await;
    let revoked = broker.issue(&orchestrator, root.child(&worker, 5)).await;
    broker.revoke(&orchestrator, &revoked).await.unwrap();
    let mut soon = root.child(&worker, 5);
    soon.deadline_ms = now_ms() + 1_000;
    let expiring = broker.issue(&orchestrator, soon).await;

    let (_gateway, addr) = spawn_authz(&broker.addr, &worker);
    let mut authz = AuthorizationClient::connect(addr).await.unwrap();
    let mut check = async |body: serde_json::Value| ask(&mut authz, &body).await;

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

/// A stand-in for an A2A agent over JSON-RPC: keeps every task it is sent
/// (WORKING until canceled) with its messages as history, as the SDK's
/// agents do.
pub(crate) struct FakeAgent {
    pub url: String,
    server: tokio::task::JoinHandle<()>,
    state: std::sync::Arc<FakeState>,
}

/// What the fake agent holds: its tasks, and the methods it was called
/// with, in order, each with its `Authorization` header.
#[derive(Default)]
pub(crate) struct FakeState {
    tasks: std::sync::Mutex<std::collections::HashMap<String, Value>>,
    calls: std::sync::Mutex<Vec<(String, Option<String>)>>,
    /// New tasks finish at once: answered WORKING, read COMPLETED with an
    /// artifact (a quick agent answering before it has finished).
    quick: std::sync::atomic::AtomicBool,
}

impl FakeAgent {
    /// The JSON-RPC methods the agent was called with so far.
    pub fn calls(&self) -> Vec<String> {
        let calls = self.state.calls.lock().unwrap();
        calls.iter().map(|(method, _)| method.clone()).collect()
    }

    /// The methods, each with the `Authorization` header it came with.
    pub fn authorized_calls(&self) -> Vec<(String, Option<String>)> {
        self.state.calls.lock().unwrap().clone()
    }

    /// Whether new tasks finish at once (`FakeState::quick`).
    pub fn finish_at_once(&self, quick: bool) {
        self.state
            .quick
            .store(quick, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many messages task `id` holds (None: no such task).
    pub fn history_len(&self, id: &str) -> Option<usize> {
        let tasks = self.state.tasks.lock().unwrap();
        tasks
            .get(id)
            .map(|t| t["history"].as_array().map_or(0, Vec::len))
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub(crate) async fn fake_agent() -> FakeAgent {
    fake_agent_on(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap())
}

/// The stand-in agent serving on `listener`.
pub(crate) fn fake_agent_on(listener: tokio::net::TcpListener) -> FakeAgent {
    let url = format!("http://{}", listener.local_addr().unwrap());
    let card = json!({
        "name": "fake",
        "description": "a stand-in agent",
        "version": "1",
        "supportedInterfaces": [{"url": format!("{url}/"), "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}],
        "capabilities": {},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
    });
    let state = std::sync::Arc::new(FakeState::default());
    let router = axum::Router::new()
        .route(
            "/.well-known/agent-card.json",
            axum::routing::get(move || async move { axum::Json(card) }),
        )
        .route("/", axum::routing::post(fake_rpc))
        .with_state(state.clone());
    let server = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    FakeAgent { url, server, state }
}

async fn fake_rpc(
    axum::extract::State(state): axum::extract::State<std::sync::Arc<FakeState>>,
    headers: axum::http::HeaderMap,
    axum::Json(request): axum::Json<Value>,
) -> axum::Json<Value> {
    let params = &request["params"];
    let authorization = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    state.calls.lock().unwrap().push((
        request["method"].as_str().unwrap_or_default().to_owned(),
        authorization,
    ));
    let mut tasks = state.tasks.lock().unwrap();
    let task_id = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let result = match request["method"].as_str().unwrap_or_default() {
        "SendMessage" => {
            let message = params["message"].clone();
            let id = task_id(&message["taskId"]);
            if id.is_empty() {
                let n = tasks.len() + 1;
                let id = format!("task-{n}");
                let context = message["contextId"]
                    .as_str()
                    .filter(|c| !c.is_empty())
                    .map_or_else(|| format!("ctx-{n}"), str::to_owned);
                let task = json!({"id": id, "contextId": context,
                    "status": {"state": "TASK_STATE_WORKING"}, "history": [message]});
                let mut kept = task.clone();
                if state.quick.load(std::sync::atomic::Ordering::Relaxed) {
                    kept["status"] = json!({"state": "TASK_STATE_COMPLETED"});
                    kept["artifacts"] =
                        json!([{"artifactId": "a", "parts": [{"data": {"answer": 42}}]}]);
                }
                tasks.insert(id, kept);
                Some(json!({"task": task}))
            } else {
                tasks.get_mut(&id).map(|task| {
                    task["history"].as_array_mut().unwrap().push(message);
                    json!({"task": task.clone()})
                })
            }
        }
        "GetTask" => tasks.get(&task_id(&params["id"])).cloned(),
        "CancelTask" => tasks.get_mut(&task_id(&params["id"])).map(|task| {
            task["status"] = json!({"state": "TASK_STATE_CANCELED"});
            task.clone()
        }),
        "ListTasks" => Some(json!({"tasks": []})),
        _ => None,
    };
    axum::Json(match result {
        Some(result) => json!({"jsonrpc": "2.0", "id": request["id"], "result": result}),
        None => json!({"jsonrpc": "2.0", "id": request["id"],
            "error": {"code": -32001, "message": "the fake agent has no such task or method"}}),
    })
}

/// Starts `a2a-gateway` for `agent` with `config` (beside broker and
/// key_file) and returns the addresses it printed, by what precedes them.
pub(crate) fn spawn_gateway(
    broker: &str,
    agent: &Agent,
    config: &str,
    expect: &[&str],
) -> (Gateway, std::collections::HashMap<String, String>) {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("agent.key");
    write_key_file(&key_file, &agent.seed());
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        format!(
            "broker = \"{broker}\"\nkey_file = \"{}\"\n{config}",
            key_file.display()
        ),
    )
    .unwrap();
    let (process, seen) = Killed::announcing_all(
        Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args(["a2a-gateway", "--config"])
            .arg(&path)
            .env("BROKER_LOG", "warn")
            .stderr(Stdio::inherit()),
        expect,
    );
    (
        Gateway {
            _process: process,
            _dir: dir,
        },
        seen,
    )
}

/// A running gateway and the directory of its key and configuration.
pub(crate) struct Gateway {
    _process: Killed,
    _dir: tempfile::TempDir,
}

/// Envoy's request for `verb path` with `body` as it came.
pub(crate) fn raw_check(verb: &str, path: &str, body: &str) -> CheckRequest {
    CheckRequest {
        attributes: Some(AttributeContext {
            request: Some(Request {
                http: Some(HttpRequest {
                    method: verb.into(),
                    path: path.into(),
                    host: "worker.internal".into(),
                    body: body.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

/// Asserts a denial with `reason`, whatever the body's id.
pub(crate) fn assert_refused(response: &CheckResponse, reason: &str) {
    assert_eq!(
        response.status.as_ref().map(|s| s.code),
        Some(tonic::Code::PermissionDenied as i32),
        "{response:?}"
    );
    assert_eq!(
        header(response, "x-delegation-refusal").as_deref(),
        Some(reason),
        "{response:?}"
    );
}

pub(crate) fn assert_allowed(response: &CheckResponse) {
    assert_eq!(
        response.status.as_ref().map(|s| s.code),
        Some(0),
        "{response:?}"
    );
}

/// A SendMessage in task `task_id` carrying `chain`.
pub(crate) fn continuation(task_id: &str, chain: &[u8]) -> serde_json::Value {
    let mut body = send_message(Some(chain));
    body["params"]["message"]["taskId"] = json!(task_id);
    body
}

/// What the proxy does once a check allowed a request: the agent gets it.
pub(crate) async fn forward(agent: &FakeAgent, body: &serde_json::Value) -> serde_json::Value {
    post_json(&http_client(), format!("{}/", agent.url), body).await
}

pub(crate) fn http_client() -> reqwest::Client {
    // reqwest is built without a default TLS provider (the binary installs one).
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

pub(crate) async fn post_json(
    http: &reqwest::Client,
    url: String,
    body: &serde_json::Value,
) -> serde_json::Value {
    let answer = http
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    serde_json::from_slice(&answer).unwrap()
}

/// A message in a task continues only under the contract that task was
/// started under (read from the agent), while it is ACCEPTED: not under
/// another open or accepted contract naming the agent, whose id never
/// reaches the headers; an OPEN contract is not let through unconsumed;
/// a revoked task's messages stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_passes_only_under_its_tasks_own_accepted_contract() {
    let mut broker = Broker::start().await;
    let [orchestrator, worker] = agents();
    let (root, first) = broker.root_and_child(&orchestrator, &worker, 10).await;
    let issue =
        async |broker: &mut Broker| broker.issue(&orchestrator, root.child(&worker, 5)).await;
    let second = issue(&mut broker).await;
    let unused = issue(&mut broker).await;
    let agent = fake_agent().await;
    let (_gateway, addrs) = spawn_gateway(
        &broker.addr,
        &worker,
        &format!(
            "upstream = \"{}\"\nauthz_listen = \"127.0.0.1:0\"\n",
            agent.url
        ),
        &["a2a authz"],
    );
    let mut authz = AuthorizationClient::connect(format!("http://{}", addrs["a2a authz"]))
        .await
        .unwrap();
    let mut check = async |body: serde_json::Value| ask(&mut authz, &body).await;
    let first_chain = chain_bytes(&mut broker, &first).await;
    let second_chain = chain_bytes(&mut broker, &second).await;
    let unused_chain = chain_bytes(&mut broker, &unused).await;

    // Two tasks, each started under its own contract (the proxy forwards
    // what was allowed).
    let mut started = Vec::new();
    for chain in [&first_chain, &second_chain] {
        let body = send_message(Some(chain));
        assert_allowed(&check(body.clone()).await);
        let answer = forward(&agent, &body).await;
        started.push(answer["result"]["task"]["id"].as_str().unwrap().to_owned());
    }
    let (task, other_task) = (&started[0], &started[1]);

    // Its own contract continues it, named in the headers.
    let own = check(continuation(task, &first_chain)).await;
    assert_allowed(&own);
    assert_eq!(
        header(&own, "x-delegation-contract-id"),
        Some(hex::encode(&first))
    );
    // Another accepted contract of this agent does not.
    let crossed = check(continuation(task, &second_chain)).await;
    assert_denied(&crossed, "NOT_HOLDER");
    assert_eq!(header(&crossed, "x-delegation-contract-id"), None);
    assert_denied(
        &check(continuation(other_task, &first_chain)).await,
        "NOT_HOLDER",
    );
    // Nor an open one, which stays open (not used up by a continuation).
    assert_denied(
        &check(continuation(task, &unused_chain)).await,
        "NOT_HOLDER",
    );
    assert_eq!(
        broker.state(&unused).await.status,
        pb::ContractStatus::Open as i32
    );
    // A task the agent does not have.
    assert_denied(
        &check(continuation("no-such-task", &first_chain)).await,
        "NOT_FOUND",
    );
    // Revoked: the task's messages stop, under any chain.
    broker.revoke(&orchestrator, &first).await.unwrap();
    assert_denied(&check(continuation(task, &first_chain)).await, "ENDED");
    assert_denied(
        &check(continuation(task, &second_chain)).await,
        "NOT_HOLDER",
    );
    // The other task goes on under its own.
    assert_allowed(&check(continuation(other_task, &second_chain)).await);
    broker.stop().await;
}

/// Without `upstream` the gateway cannot read a task's contract: a
/// continuation is refused, whatever chain it carries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_upstream_a_continuation_is_refused() {
    let mut broker = Broker::start().await;
    let [orchestrator, worker] = agents();
    let (_root, contract) = broker.root_and_child(&orchestrator, &worker, 10).await;
    let (_gateway, addr) = spawn_authz(&broker.addr, &worker);
    let mut authz = AuthorizationClient::connect(addr).await.unwrap();
    let chain = chain_bytes(&mut broker, &contract).await;
    assert_allowed(&ask(&mut authz, &send_message(Some(&chain))).await);
    let continued = ask(&mut authz, &continuation("task-1", &chain)).await;
    assert_denied(&continued, "INVALID_FIELD");
    broker.stop().await;
}

/// Only POST on the JSON-RPC path (and GET of the card) passes: the body's
/// `method` does not decide for another verb or path. A body with a
/// duplicate key, at any level, is refused: the agent might read the other
/// one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_json_rpc_posts_without_duplicate_keys_pass() {
    let broker = Broker::start().await;
    let worker = Agent::generate();
    let (_gateway, addrs) = spawn_gateway(
        &broker.addr,
        &worker,
        "authz_listen = \"127.0.0.1:0\"\nauthz_jsonrpc_paths = [\"/\", \"/a2a\"]\n",
        &["a2a authz"],
    );
    let mut authz = AuthorizationClient::connect(format!("http://{}", addrs["a2a authz"]))
        .await
        .unwrap();
    let mut check = async |verb: &str, path: &str, body: &str| {
        authz
            .check(raw_check(verb, path, body))
            .await
            .expect("Check answers")
            .into_inner()
    };
    let get_task = r#"{"jsonrpc": "2.0", "id": 7, "method": "GetTask", "params": {"id": "t"}}"#;
    assert_allowed(&check("POST", "/", get_task).await);
    assert_allowed(&check("POST", "/a2a", get_task).await);
    assert_allowed(&check("GET", "/.well-known/agent-card.json", "").await);
    assert_allowed(&check("GET", "/a2a/.well-known/agent-card.json", "").await);
    for (verb, path) in [
        ("DELETE", "/"),
        ("PUT", "/"),
        ("PATCH", "/a2a"),
        ("GET", "/"),
        ("GET", "/tasks/t"),
        // A2A's REST binding and its gRPC binding are not checked here.
        ("POST", "/tasks/t:cancel"),
        ("POST", "/message:send"),
        ("POST", "/a2a.v1.A2AService/CancelTask"),
        ("POST", "/?x=1"),
        ("POST", "/a2a/"),
        ("GET", "/x/.well-known/agent-card.json"),
    ] {
        let denied = check(verb, path, get_task).await;
        assert_refused(&denied, "INVALID_FIELD");
        let Some(HttpResponse::DeniedResponse(body)) = &denied.http_response else {
            panic!("denied: {denied:?}");
        };
        assert!(body.body.contains("only POST on /, /a2a"), "{}", body.body);
    }
    // Duplicate keys: the method, a nested field, an array's object.
    for body in [
        r#"{"jsonrpc": "2.0", "id": 7, "method": "GetTask", "method": "CancelTask", "params": {"id": "t"}}"#,
        r#"{"jsonrpc": "2.0", "id": 7, "method": "GetTask", "params": {"id": "t", "id": "u"}}"#,
        r#"{"jsonrpc": "2.0", "id": 7, "method": "SendMessage", "params": {"message": {"parts": [{"text": "a", "text": "b"}]}}}"#,
    ] {
        assert_refused(&check("POST", "/", body).await, "UNDECODABLE_MESSAGE");
    }
    broker.stop().await;
}

/// The SendMessage body of a task-starting message in `context_id`.
pub(crate) fn message_in_context(context_id: &str, chain: &[u8]) -> serde_json::Value {
    let mut body = send_message(Some(chain));
    body["params"]["message"]["contextId"] = json!(context_id);
    body["params"]["configuration"] = json!({"returnImmediately": true});
    body
}

/// A second caller starting a task in the first caller's context (context
/// ids are the callers' to choose) does not become the parent of the
/// agent's next outbound delegation in it: with two live contracts the
/// context names none (the agent must name its contract), and once the
/// intruder's contract ends the first caller's is the parent again. The
/// intruder's message arrives over each of the ingress's bindings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_context_never_makes_another_callers_contract_the_parent() {
    for binding in ["jsonrpc", "grpc"] {
        shared_context(binding).await;
    }
}

async fn shared_context(binding: &str) {
    let mut broker = Broker::start().await;
    let [victim, intruder, worker, helper] = agents();
    let (_, victims) = broker.root_and_child(&victim, &worker, 10).await;
    let (_, intruders) = broker.root_and_child(&intruder, &worker, 10).await;
    let agent = fake_agent().await;
    let peer = fake_agent().await;
    let (_gateway, addrs) = spawn_gateway(
        &broker.addr,
        &worker,
        &format!(
            "upstream = \"{}\"\nlisten = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\
             egress_listen = \"127.0.0.1:0\"\n\
             [[peers]]\nname = \"helper\"\npublic_key = \"{}\"\nurl = \"{}\"\n\
             [routes.helper]\nbudget = 1\nttl_ms = 60000\n",
            agent.url,
            hex::encode(helper.public_key()),
            peer.url
        ),
        &["a2a ingress", "a2a ingress grpc", "a2a egress"],
    );
    let http = http_client();
    let post = async |url: String, body: &serde_json::Value| post_json(&http, url, body).await;
    let ingress = format!("{}/", addrs["a2a ingress"]);
    let victims_chain = chain_bytes(&mut broker, &victims).await;
    let started = post(
        ingress.clone(),
        &message_in_context("shared", &victims_chain),
    )
    .await;
    assert!(started["result"]["task"]["id"].is_string(), "{started}");
    // The intruder starts a task in the same context.
    let intruders_chain = chain_bytes(&mut broker, &intruders).await;
    let intrusion = message_in_context("shared", &intruders_chain);
    if binding == "grpc" {
        let request: a2a_pb::protojson::SendMessageRequest =
            serde_json::from_value(intrusion["params"].clone()).unwrap();
        let request =
            a2a_pb::proto::SendMessageRequest::decode(request.encode_to_vec().as_slice()).unwrap();
        let mut client = a2a_pb::proto::a2a_service_client::A2aServiceClient::connect(format!(
            "http://{}",
            addrs["a2a ingress grpc"]
        ))
        .await
        .unwrap();
        client
            .send_message(request)
            .await
            .expect("admitted over gRPC");
    } else {
        let answer = post(ingress.clone(), &intrusion).await;
        assert!(answer["result"]["task"]["id"].is_string(), "{answer}");
    }
    for id in [&victims, &intruders] {
        assert_eq!(
            broker.state(id).await.status,
            pb::ContractStatus::Accepted as i32
        );
    }

    // The worker calls out in that context, naming no contract.
    let egress = format!("{}/peers/helper", addrs["a2a egress"]);
    let outbound = json!({"jsonrpc": "2.0", "id": 9, "method": "SendMessage", "params": {"message": {
        "messageId": "out-1", "role": "ROLE_USER", "contextId": "shared",
        "parts": [{"text": "check the numbers"}]}}});
    let refused = post(egress.clone(), &outbound).await;
    assert_eq!(
        refused["error"]["data"][0]["reason"], "NOT_FOUND",
        "{binding}: {refused}"
    );
    for id in [&victims, &intruders] {
        assert_eq!(broker.ledger(id).await.residual, 10, "{binding}");
    }
    // The intruder's contract ends: the context names the victim's again.
    broker.revoke(&intruder, &intruders).await.unwrap();
    let delegated = post(egress, &outbound).await;
    assert!(
        delegated["result"]["task"]["id"].is_string(),
        "{binding}: {delegated}"
    );
    assert_eq!(broker.ledger(&victims).await.residual, 9, "{binding}");
    broker.stop().await;
}

/// A gateway started before its agent waits for it (`upstream_wait_ms`)
/// and serves once the agent answers its card, instead of exiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_waits_for_an_agent_that_starts_after_it() {
    let broker = Broker::start().await;
    let worker = Agent::generate();
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let address = free.local_addr().expect("its address");
    drop(free);
    let config = format!(
        "upstream = \"http://{address}\"\nlisten = \"127.0.0.1:0\"\nupstream_wait_ms = 30000\n"
    );
    let addr = broker.addr.clone();
    let gateway = tokio::task::spawn_blocking(move || {
        spawn_gateway(&addr, &worker, &config, &["a2a ingress"])
    });
    // The gateway is up and asking; the agent comes a second later.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .expect("the agent's port");
    let _agent = fake_agent_on(listener);
    let (_gateway, seen) = gateway.await.expect("the gateway starts");
    assert!(seen.contains_key("a2a ingress"), "{seen:?}");
}
