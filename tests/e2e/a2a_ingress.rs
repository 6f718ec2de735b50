//! The A2A gateway's ingress over both of its bindings (JSON-RPC at
//! `listen`, gRPC at `grpc_listen`), with its authorization beside it:
//! each tenant's share of `max_tasks`, continuations under their task's
//! own contract, what passes over gRPC, and the chain check's retired
//! keys, which tasks the gateway watches, and one follower a task after a
//! restart. Real processes on 127.0.0.1:0; the agent is a stand-in.

use std::collections::HashMap;

use a2a_pb::proto;
use a2a_pb::proto::a2a_service_client::A2aServiceClient;
use broker_client::Agent;
use delegation_broker::pb;
use envoy_types::ext_authz::v3::pb::CheckRequest;
use envoy_types::pb::envoy::service::auth::v3::AttributeContext;
use envoy_types::pb::envoy::service::auth::v3::attribute_context::{HttpRequest, Request};
use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use prost::Message as _;
use serde_json::{Value, json};
use tonic_types::StatusExt as _;

use crate::a2a_authz::{
    assert_denied, assert_refused, chain_bytes, fake_agent, forward, send_message, spawn_gateway,
};
use crate::harness::*;

/// The ingress's bindings, as the tests name them.
const BINDINGS: [&str; 2] = ["jsonrpc", "grpc"];

/// A gateway config serving the ingress over both bindings and the authz,
/// in front of the agent at `upstream`. A short call timeout: no test
/// here waits for a task to settle.
fn both_bindings(upstream: &str) -> String {
    format!(
        "upstream = \"{upstream}\"\nlisten = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\
         authz_listen = \"127.0.0.1:0\"\ncall_timeout_ms = 10000\n"
    )
}

const PRINTED: [&str; 3] = ["a2a ingress", "a2a ingress grpc", "a2a authz"];

/// An ingress refusal, whichever binding carried it.
#[derive(Debug)]
struct Refusal {
    reason: String,
    message: String,
    metadata: HashMap<String, String>,
}

/// SendMessage params starting a task under `chain`, answered at once.
fn start(chain: &[u8]) -> Value {
    let mut params = send_message(Some(chain))["params"].take();
    params["configuration"] = json!({"returnImmediately": true});
    params
}

/// SendMessage params continuing task `task_id`, carrying `chain`.
fn continuing(task_id: &str, chain: &[u8]) -> Value {
    let mut params = start(chain);
    params["message"]["taskId"] = json!(task_id);
    params
}

/// One SendMessage to the ingress over `binding`: its result as JSON-RPC
/// shows it (`{"task": …}`), or its refusal.
async fn send(
    binding: &str,
    addrs: &HashMap<String, String>,
    params: Value,
) -> Result<Value, Refusal> {
    if binding == "grpc" {
        let request: a2a_pb::protojson::SendMessageRequest =
            serde_json::from_value(params).expect("an A2A request");
        let request = proto::SendMessageRequest::decode(request.encode_to_vec().as_slice())
            .expect("the same message in the gRPC types");
        let mut client = A2aServiceClient::connect(format!("http://{}", addrs["a2a ingress grpc"]))
            .await
            .expect("the gRPC ingress");
        return match client.send_message(request).await {
            Ok(answer) => {
                let answer = a2a_pb::protojson::SendMessageResponse::decode(
                    answer.into_inner().encode_to_vec().as_slice(),
                )
                .expect("the same answer in the JSON types");
                Ok(serde_json::to_value(&answer).expect("JSON"))
            }
            Err(status) => Err(refusal_of(&status)),
        };
    }
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": params});
    let answer = crate::a2a_authz::post_json(
        &crate::a2a_authz::http_client(),
        format!("{}/", addrs["a2a ingress"]),
        &body,
    )
    .await;
    if let Some(result) = answer.get("result") {
        return Ok(result.clone());
    }
    let error = &answer["error"];
    let info = &error["data"][0];
    Err(Refusal {
        reason: info["reason"].as_str().unwrap_or_default().to_owned(),
        message: error["message"].as_str().unwrap_or_default().to_owned(),
        metadata: serde_json::from_value(info["metadata"].clone()).unwrap_or_default(),
    })
}

fn refusal_of(status: &tonic::Status) -> Refusal {
    let info = status
        .get_details_error_info()
        .unwrap_or_else(|| panic!("an ErrorInfo: {status:?}"));
    Refusal {
        reason: info.reason,
        message: status.message().to_owned(),
        metadata: info.metadata.into_iter().collect(),
    }
}

fn task_id(result: &Value) -> String {
    result["task"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a task: {result}"))
        .to_owned()
}

/// Small, so a few keys fill them.
const MAX_TASKS: usize = 4;
const TASKS_PER_TENANT: usize = 2;

/// Free keys, each opening one root whose child names the agent, are all
/// the broker's one `open` tenant: they fill that tenant's share of the
/// gateway's `max_tasks`, not `max_tasks`, and a declared tenant's task
/// (and a listed orchestrator's) is admitted while `open` is at its share.
/// The broker names each tree's tenant in ContractState.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_keys_cannot_take_a_declared_tenants_share_of_max_tasks() {
    let [acme, listed] = agents();
    let mut broker = Broker::start_with(|c| {
        c.tenants
            .declare("acme", &[acme.public_key()])
            .expect("a tenant");
        c.tenants.orchestrator(listed.public_key());
    })
    .await;
    let worker = Agent::generate();
    let mut free = Vec::new();
    for _ in 0..MAX_TASKS {
        let (_, id) = broker.root_and_child(&Agent::generate(), &worker, 10).await;
        free.push(id);
    }
    let (_, acmes) = broker.root_and_child(&acme, &worker, 10).await;
    let (_, listeds) = broker.root_and_child(&listed, &worker, 10).await;
    assert_eq!(broker.state(&free[0]).await.tenant, "open");
    assert_eq!(broker.state(&free[1]).await.tenant, "open");
    assert_eq!(broker.state(&acmes).await.tenant, "acme");
    assert_eq!(
        broker.state(&listeds).await.tenant,
        format!("orchestrator-{}", hex::encode(&listed.public_key()[..8]))
    );

    let agent = fake_agent().await;
    let (_gateway, addrs) = spawn_gateway(
        &broker.addr,
        &worker,
        &format!(
            "{}max_tasks = {MAX_TASKS}\nmax_tasks_per_tenant = {TASKS_PER_TENANT}\n",
            both_bindings(&agent.url)
        ),
        &PRINTED,
    );
    for (i, id) in free.iter().enumerate() {
        let binding = BINDINGS[i % 2];
        let chain = chain_bytes(&mut broker, id).await;
        let answer = send(binding, &addrs, start(&chain)).await;
        if i < TASKS_PER_TENANT {
            task_id(&answer.expect("within the open tenant's share"));
            continue;
        }
        let refused = answer.expect_err("past the open tenant's share");
        assert_eq!(refused.reason, "OVERLOADED", "{binding}: {refused:?}");
        assert_eq!(refused.metadata["tenant"], "open", "{refused:?}");
        assert_eq!(refused.metadata["limit"], "max_tasks_per_tenant");
        assert!(refused.message.contains("\"open\""), "{}", refused.message);
        // Refused before anything moved: the contract is still open.
        assert_eq!(
            broker.state(id).await.status,
            pb::ContractStatus::Open as i32
        );
    }
    for (binding, id) in [("jsonrpc", &acmes), ("grpc", &listeds)] {
        let chain = chain_bytes(&mut broker, id).await;
        let started = send(binding, &addrs, start(&chain))
            .await
            .expect("another tenant's task is admitted while open is at its share");
        task_id(&started);
    }
    broker.stop().await;
}

/// At the ingress a message in a task goes on under that task's own
/// contract only, over either binding: whatever chain it carries, the
/// message reaches that task alone, another contract's chain is neither
/// bound nor used up (an open one still starts its own task after), a
/// task the agent has that no contract started here is NOT_FOUND, and
/// once the task's contract is revoked its messages are ENDED whatever
/// chain they carry, while the other task goes on. (The ingress follows
/// its tasks itself, so a continuation needs no chain: that one must be
/// the task's is the authorization's rule, for a proxy that does not see
/// the answers; see `a_continuation_passes_only_under_its_tasks_own_
/// accepted_contract`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingress_continuation_runs_only_under_its_tasks_own_contract() {
    for binding in BINDINGS {
        ingress_continuation(binding).await;
    }
}

async fn ingress_continuation(binding: &str) {
    let mut broker = Broker::start().await;
    let [orchestrator, worker] = agents();
    let (root, first) = broker.root_and_child(&orchestrator, &worker, 10).await;
    let mut issue = async || broker.issue(&orchestrator, root.child(&worker, 2)).await;
    let second = issue().await;
    let unused = issue().await;
    let agent = fake_agent().await;
    let (_gateway, addrs) =
        spawn_gateway(&broker.addr, &worker, &both_bindings(&agent.url), &PRINTED);
    let first_chain = chain_bytes(&mut broker, &first).await;
    let second_chain = chain_bytes(&mut broker, &second).await;
    let unused_chain = chain_bytes(&mut broker, &unused).await;
    let task = task_id(&send(binding, &addrs, start(&first_chain)).await.unwrap());
    let other = task_id(&send(binding, &addrs, start(&second_chain)).await.unwrap());
    for id in [&first, &second] {
        assert_eq!(
            broker.state(id).await.status,
            pb::ContractStatus::Accepted as i32,
            "{binding}"
        );
    }
    let history = |id: &str| agent.history_len(id).unwrap_or(0);

    // Another contract's chain in the task's message: the message goes to
    // this task, nothing else moves.
    let (mine, theirs) = (history(&task), history(&other));
    for chain in [&second_chain, &unused_chain] {
        let continued = send(binding, &addrs, continuing(&task, chain))
            .await
            .unwrap_or_else(|e| panic!("{binding}: {e:?}"));
        assert_eq!(task_id(&continued), task);
    }
    assert_eq!(history(&task), mine + 2, "{binding}");
    assert_eq!(history(&other), theirs, "{binding}");
    assert_eq!(
        broker.state(&unused).await.status,
        pb::ContractStatus::Open as i32,
        "{binding}: an open contract is not used up by a continuation"
    );

    // A task of the agent's that no contract started here.
    let direct = forward(
        &agent,
        &json!({"jsonrpc": "2.0", "id": 3, "method": "SendMessage", "params": {"message": {
            "messageId": "d-1", "role": "ROLE_USER", "parts": [{"text": "hello"}]}}}),
    )
    .await;
    let direct = task_id(&direct["result"]);
    let before = history(&direct);
    let refused = send(binding, &addrs, continuing(&direct, &first_chain))
        .await
        .expect_err("a task no contract started");
    assert_eq!(refused.reason, "NOT_FOUND", "{binding}: {refused:?}");
    assert_eq!(history(&direct), before, "{binding}: nothing forwarded");

    // Revoked: the task's messages stop, under any chain.
    broker.revoke(&orchestrator, &first).await.unwrap();
    let mine = history(&task);
    for chain in [&first_chain, &second_chain] {
        let refused = send(binding, &addrs, continuing(&task, chain))
            .await
            .expect_err("the task's contract was revoked");
        assert_eq!(refused.reason, "ENDED", "{binding}: {refused:?}");
    }
    assert_eq!(history(&task), mine, "{binding}: nothing forwarded");
    // The other task goes on under its own; the unused contract starts
    // its own task.
    send(binding, &addrs, continuing(&other, &second_chain))
        .await
        .unwrap_or_else(|e| panic!("{binding}: {e:?}"));
    task_id(&send(binding, &addrs, start(&unused_chain)).await.unwrap());
    broker.stop().await;
}

/// A SendMessageRequest whose `message` field (2) is on the wire twice.
#[derive(Clone, PartialEq, prost::Message)]
struct TwiceMessage {
    #[prost(message, repeated, tag = "2")]
    message: Vec<proto::Message>,
    #[prost(message, optional, tag = "3")]
    configuration: Option<proto::SendMessageConfiguration>,
}

/// What the gRPC binding lets through, beside JSON-RPC's POST-only and
/// duplicate-key rules:
/// - at the ingress's gRPC listener only A2AService's SendMessage,
///   GetTask and CancelTask reach the agent: its other methods are
///   UNIMPLEMENTED with the reason, and a method of no service here, or
///   of another service, is UNIMPLEMENTED by the server; the agent is
///   called for none of them;
/// - a duplicate field is not refused: protobuf gives it one reading (the
///   last value of a field wins, messages merge) and the gateway forwards
///   its own encoding of that reading, so the agent reads the request
///   the gateway decided on — shown with `message` twice, naming two
///   tasks: the last one's task gets the message, the other nothing;
/// - the authorization decides only on JSON-RPC bodies: a request on the
///   gRPC binding's route is refused INVALID_FIELD even with an open
///   contract's chain in it, and that contract is not used up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_grpc_only_the_served_a2a_methods_reach_the_agent() {
    let mut broker = Broker::start().await;
    let [orchestrator, worker] = agents();
    let (root, first) = broker.root_and_child(&orchestrator, &worker, 10).await;
    let second = broker.issue(&orchestrator, root.child(&worker, 2)).await;
    let unused = broker.issue(&orchestrator, root.child(&worker, 2)).await;
    let agent = fake_agent().await;
    let (_gateway, addrs) =
        spawn_gateway(&broker.addr, &worker, &both_bindings(&agent.url), &PRINTED);
    let channel = channel(&format!("http://{}", addrs["a2a ingress grpc"])).await;
    let mut client = A2aServiceClient::new(channel.clone());
    let unserved = [
        client
            .list_tasks(proto::ListTasksRequest::default())
            .await
            .map(drop),
        client
            .get_extended_agent_card(proto::GetExtendedAgentCardRequest::default())
            .await
            .map(drop),
        client
            .create_task_push_notification_config(proto::TaskPushNotificationConfig::default())
            .await
            .map(drop),
        // Streaming is not served either.
        client
            .send_streaming_message(proto::SendMessageRequest::default())
            .await
            .map(drop),
        client
            .subscribe_to_task(proto::SubscribeToTaskRequest::default())
            .await
            .map(drop),
    ];
    for answer in unserved {
        let status = answer.expect_err("not served");
        assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
        assert_eq!(refusal_of(&status).reason, "INVALID_FIELD");
    }
    for path in [
        "/lf.a2a.v1.A2AService/NoSuchMethod",
        "/a2a.v1.A2AService/SendMessage",
        "/grpc.health.v1.Health/Check",
        "/delegation.broker.v1.Broker/GetContract",
    ] {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.unwrap();
        let status = grpc
            .unary(
                tonic::Request::new(proto::GetTaskRequest::default()),
                http::uri::PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::<proto::GetTaskRequest, proto::Task>::default(),
            )
            .await
            .expect_err("not served");
        assert_eq!(
            status.code(),
            tonic::Code::Unimplemented,
            "{path}: {status:?}"
        );
    }
    assert!(agent.calls().is_empty(), "{:?}", agent.calls());

    // Two tasks under their contracts, then one request naming both.
    let first_chain = chain_bytes(&mut broker, &first).await;
    let second_chain = chain_bytes(&mut broker, &second).await;
    let one = task_id(&send("grpc", &addrs, start(&first_chain)).await.unwrap());
    let two = task_id(&send("grpc", &addrs, start(&second_chain)).await.unwrap());
    let (ones, twos) = (
        agent.history_len(&one).unwrap(),
        agent.history_len(&two).unwrap(),
    );
    let message = |task: &str| proto::Message {
        message_id: format!("dup-{task}"),
        task_id: task.to_owned(),
        role: proto::Role::User as i32,
        parts: vec![proto::Part {
            content: Some(proto::part::Content::Text("which task?".into())),
            ..Default::default()
        }],
        ..Default::default()
    };
    let twice = TwiceMessage {
        message: vec![message(&one), message(&two)],
        configuration: Some(proto::SendMessageConfiguration {
            return_immediately: true,
            ..Default::default()
        }),
    };
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let answer = grpc
        .unary(
            tonic::Request::new(twice),
            http::uri::PathAndQuery::from_static("/lf.a2a.v1.A2AService/SendMessage"),
            tonic_prost::ProstCodec::<TwiceMessage, proto::SendMessageResponse>::default(),
        )
        .await
        .expect("one reading: the last task named")
        .into_inner();
    let Some(proto::send_message_response::Payload::Task(task)) = answer.payload else {
        panic!("a task: {answer:?}");
    };
    assert_eq!(task.id, two);
    assert_eq!(agent.history_len(&two), Some(twos + 1));
    assert_eq!(
        agent.history_len(&one),
        Some(ones),
        "the first reading reached no task"
    );

    // The authorization and the gRPC route.
    let unused_chain = chain_bytes(&mut broker, &unused).await;
    let request: a2a_pb::protojson::SendMessageRequest =
        serde_json::from_value(start(&unused_chain)).unwrap();
    let mut frame = vec![0u8];
    let encoded = request.encode_to_vec();
    frame.extend_from_slice(&u32::try_from(encoded.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&encoded);
    let mut authz = AuthorizationClient::connect(format!("http://{}", addrs["a2a authz"]))
        .await
        .unwrap();
    let check = CheckRequest {
        attributes: Some(AttributeContext {
            request: Some(Request {
                http: Some(HttpRequest {
                    method: "POST".into(),
                    path: "/lf.a2a.v1.A2AService/SendMessage".into(),
                    host: "worker.internal".into(),
                    headers: [("content-type".to_owned(), "application/grpc".to_owned())]
                        .into_iter()
                        .collect(),
                    raw_body: frame,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    };
    let denied = authz.check(check).await.unwrap().into_inner();
    assert_refused(&denied, "INVALID_FIELD");
    assert_eq!(
        broker.state(&unused).await.status,
        pb::ContractStatus::Open as i32
    );
    broker.stop().await;
}

/// A broker key retired by its operator (`keys retire`, a replicated
/// broker's registry: only it records when a key retired) vouches only for
/// what it signed before: a chain whose leaf that key signed afterwards —
/// here forged with the retired key's seed, otherwise a valid chain — is
/// refused BAD_SIGNATURE by the gateway over JSON-RPC, over gRPC and at
/// its authorization, with the very words `delegation-broker verify` says
/// when given the key's retirement time, while a chain it signed before
/// its retirement is admitted over both bindings and verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_signed_after_its_key_retired_is_refused_like_verify_refuses_it() {
    use delegation_broker::chain::{BrokerKeys, ChainError, verify_chain};
    use delegation_broker::crypto;
    let database = delegation_broker::store::postgres::testing::TestDatabase::migrated().await;
    let binary = env!("CARGO_BIN_EXE_delegation-broker");
    let dir = tempfile::tempdir().unwrap();
    let old_key = Agent::generate();
    let key_file = dir.path().join("old.key");
    write_key_file(&key_file, &old_key.seed());
    let key_path = key_file.display().to_string();
    let (replica, addr) = crate::operations::spawn_serve(
        &dir.path().join("a"),
        &[
            "--database-url",
            &database.url,
            "--signing-key-file",
            &key_path,
        ],
    );
    let [orchestrator, worker] = agents();
    let mut client = connect(&addr).await;
    let spec = RootSpec::default();
    let root = client
        .open_root(orchestrator.open_root(spec.body()))
        .await
        .unwrap()
        .into_inner()
        .issued
        .unwrap();
    let lineage = decode_contract(root.contract.as_ref().unwrap()).intent_lineage_hash;
    let mut reader = connect_as(&addr, &orchestrator).await;
    let mut chains = Vec::new();
    for _ in 0..3 {
        let answer = client
            .delegate(orchestrator.delegate(child(&root.contract_id, &lineage, &worker, 2)))
            .await
            .unwrap()
            .into_inner();
        let (id, _) = Outcome::from(answer.outcome.unwrap()).issued();
        let chain = reader
            .get_chain(pb::GetChainRequest { contract_id: id })
            .await
            .unwrap()
            .into_inner();
        chains.push(chain);
    }
    drop(reader);
    drop(client);
    drop(replica);
    let old_id = crypto::key_id(&old_key.public_key());
    let retired = std::process::Command::new(binary)
        .args(["keys", "retire", &old_id, "--database-url", &database.url])
        .output()
        .unwrap();
    assert!(retired.status.success(), "{retired:?}");
    // Another replica, with a key of its own, publishes the retirement.
    let (_replica, addr) =
        crate::operations::spawn_serve(&dir.path().join("b"), &["--database-url", &database.url]);
    let published = published_keys(&addr).await;
    let old = published
        .iter()
        .find(|k| k.key_id == old_id)
        .expect("the retired key is still published");
    let retired_at_ms = old.retired_at_ms;
    assert!(!old.current && retired_at_ms > 0, "{old:?}");
    let current = published.iter().find(|k| k.current).expect("a current key");

    // The leaf of one chain again, dated at the retirement and signed
    // with the retired key.
    let mut forged = chains.pop().unwrap();
    let leaf_state = forged.chain.last_mut().unwrap();
    let mut leaf = decode_contract(leaf_state.contract.as_ref().unwrap());
    leaf.issued_at_ms = retired_at_ms;
    let signing = ed25519_dalek::SigningKey::from_bytes(&old_key.seed());
    let sealed = crypto::seal(
        &signing,
        crypto::payload_type::CONTRACT,
        leaf.encode_to_vec(),
    );
    leaf_state.contract_id = crypto::sha256(&sealed.payload).to_vec();
    leaf_state.contract = Some(sealed);
    let sealed_of = |chain: &pb::GetChainResponse| -> Vec<pb::Sealed> {
        chain
            .chain
            .iter()
            .map(|s| s.contract.clone().unwrap())
            .collect()
    };
    // Nothing but the key's retirement refuses it.
    let unretired: Vec<pb::BrokerKey> = published
        .iter()
        .map(|k| pb::BrokerKey {
            current: true,
            retired_at_ms: 0,
            ..k.clone()
        })
        .collect();
    verify_chain(
        &sealed_of(&forged),
        &BrokerKeys::from_published(&unretired),
        None,
    )
    .expect("a valid chain but for its key's retirement");
    let expected = verify_chain(
        &sealed_of(&forged),
        &BrokerKeys::from_published(&published),
        None,
    )
    .expect_err("signed after its key retired");
    assert!(
        matches!(expected, ChainError::Retired { index: 1, .. }),
        "{expected}"
    );
    let expected = expected.to_string();

    let agent = fake_agent().await;
    let (_gateway, addrs) = spawn_gateway(&addr, &worker, &both_bindings(&agent.url), &PRINTED);
    let forged_bytes = forged.encode_to_vec();
    for binding in BINDINGS {
        let refused = send(binding, &addrs, start(&forged_bytes))
            .await
            .expect_err("signed after its key retired");
        assert_eq!(refused.reason, "BAD_SIGNATURE", "{binding}: {refused:?}");
        assert!(
            refused.message.contains(&expected),
            "{binding}: {} does not say {expected}",
            refused.message
        );
    }
    let mut authz = AuthorizationClient::connect(format!("http://{}", addrs["a2a authz"]))
        .await
        .unwrap();
    let denied = authz
        .check(crate::a2a_authz::check_request(&send_message(Some(
            &forged_bytes,
        ))))
        .await
        .unwrap()
        .into_inner();
    assert_denied(&denied, "BAD_SIGNATURE");
    assert!(agent.calls().is_empty(), "{:?}", agent.calls());
    // Signed before the retirement: admitted over both bindings.
    for (binding, chain) in BINDINGS.into_iter().zip(&chains) {
        task_id(
            &send(binding, &addrs, start(&chain.encode_to_vec()))
                .await
                .unwrap_or_else(|e| panic!("{binding}: {e:?}")),
        );
    }

    // `verify`, given the keys with the old one's retirement time.
    let verify = |chain: &pb::GetChainResponse, old_key_arg: String| {
        let file = dir.path().join("chain.bin");
        std::fs::write(&file, chain.encode_to_vec()).unwrap();
        let out = std::process::Command::new(binary)
            .args(["verify", "--public-key", &old_key_arg, "--public-key"])
            .arg(hex::encode(&current.public_key))
            .arg("--chain")
            .arg(&file)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let dated = format!("{}:{retired_at_ms}", hex::encode(old_key.public_key()));
    let (ok, said) = verify(&forged, dated.clone());
    assert!(
        !ok && said.contains(&expected),
        "verify said {said:?}, not {expected}"
    );
    let (ok, said) = verify(&chains[0], dated);
    assert!(ok, "{said}");
    // Without the retirement time it cannot tell.
    let (ok, _) = verify(&forged, hex::encode(old_key.public_key()));
    assert!(ok, "an undated key vouches for what it signs");
}

/// A gateway metric's value (one without labels).
async fn gateway_metric(metrics_url: &str, name: &str) -> u64 {
    let text = crate::a2a_authz::http_client()
        .get(metrics_url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}")) as u64
}

/// The gateway's count of contracts it asked its WatchContracts stream to
/// add.
async fn contracts_watched(metrics_url: &str) -> u64 {
    gateway_metric(metrics_url, "a2a_gateway_contracts_watched_total").await
}

/// A task the ingress's first read finds settled (the agent answered
/// before it had finished) moves its contract to COMPLETED and is never
/// added to the gateway's WatchContracts stream: it costs the broker no
/// watch read. A task still working is added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_settled_at_its_first_read_is_never_watched() {
    let mut broker = Broker::start().await;
    let worker = Agent::generate();
    let agent = fake_agent().await;
    let (_gateway, addrs) = spawn_gateway(
        &broker.addr,
        &worker,
        &format!(
            "upstream = \"{}\"\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n",
            agent.url
        ),
        &["a2a ingress", "a2a metrics"],
    );
    let metrics = addrs["a2a metrics"].clone();
    agent.finish_at_once(true);
    let (_, quick) = broker.root_and_child(&Agent::generate(), &worker, 10).await;
    let chain = chain_bytes(&mut broker, &quick).await;
    task_id(
        &send("jsonrpc", &addrs, start(&chain))
            .await
            .expect("admitted"),
    );
    // Its follower done: the contract moved and nothing more to do.
    let began = std::time::Instant::now();
    while broker.state(&quick).await.status != pb::ContractStatus::Completed as i32
        || gateway_metric(&metrics, "a2a_gateway_tasks_followed").await != 0
    {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(30),
            "the quick task's follower never finished"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(contracts_watched(&metrics).await, 0);

    agent.finish_at_once(false);
    let (_, working) = broker.root_and_child(&Agent::generate(), &worker, 10).await;
    let chain = chain_bytes(&mut broker, &working).await;
    task_id(
        &send("jsonrpc", &addrs, start(&chain))
            .await
            .expect("admitted"),
    );
    let began = std::time::Instant::now();
    while contracts_watched(&metrics).await != 1 {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(30),
            "the working task's contract was never watched"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    broker.stop().await;
}

/// Callers reading one task at once after the gateway restarted rebuild
/// its slot between them and start one follower for it: a second would
/// remove the contract from the gateway's watch when it ended, while the
/// first still relied on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_after_a_restart_start_one_follower() {
    /// Readers at once: enough that rebuilds overlap.
    const READERS: usize = 8;
    let mut broker = Broker::start().await;
    let worker = Agent::generate();
    let agent = fake_agent().await;
    let config = format!(
        "upstream = \"{}\"\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n",
        agent.url
    );
    let expect = ["a2a ingress", "a2a metrics"];
    let (first, addrs) = spawn_gateway(&broker.addr, &worker, &config, &expect);
    let (_, contract) = broker.root_and_child(&Agent::generate(), &worker, 10).await;
    let chain = chain_bytes(&mut broker, &contract).await;
    let task = task_id(
        &send("jsonrpc", &addrs, start(&chain))
            .await
            .expect("admitted"),
    );
    // The agent lists no tasks, so the new gateway learns of this one only
    // when it is read.
    drop(first);
    let (_gateway, addrs) = spawn_gateway(&broker.addr, &worker, &config, &expect);
    let read = json!({"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": task}});
    let mut reads = tokio::task::JoinSet::new();
    for _ in 0..READERS {
        let (url, read) = (format!("{}/", addrs["a2a ingress"]), read.clone());
        reads.spawn(async move {
            crate::a2a_authz::post_json(&crate::a2a_authz::http_client(), url, &read).await
        });
    }
    while let Some(answer) = reads.join_next().await {
        let answer = answer.unwrap();
        assert_eq!(answer["result"]["id"], json!(task), "{answer}");
    }
    // A follower counts itself once it runs: wait for the first, then
    // give a second one the time to show.
    let followed = || gateway_metric(&addrs["a2a metrics"], "a2a_gateway_tasks_followed");
    let began = std::time::Instant::now();
    while followed().await == 0 {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(30),
            "the task was never followed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(followed().await, 1);
    broker.stop().await;
}
