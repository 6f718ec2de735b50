//! The A2A egress attaching a broker-minted token (`tokens_url`,
//! `[routes.<peer>] token_header`/`token_resource`): every call to the
//! peer — the task-starting SendMessage, a message in the task, GetTask,
//! CancelTask — carries a JWT that verifies with the broker's published
//! keys and names the fronted agent and the contract it delegated from;
//! a token the broker will not mint stops the message before any
//! contract is issued or the peer is called.

use broker_client::token::TokenEndpoint;
use serde_json::{Value, json};

use crate::a2a_authz::{fake_agent, http_client, post_json, spawn_gateway};
use crate::harness::*;
use crate::tokens::published_key;

/// On the broker's `[tokens] resources`.
const RESOURCE: &str = "https://peer.test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_to_a_peer_carries_a_token_for_the_contract_it_is_made_under() {
    let mut broker = Broker::start_with_tokens(|config| {
        config.tokens.resources = vec![RESOURCE.into()];
    })
    .await;
    let tokens_url = broker.tokens_url.clone().unwrap();
    let [fronted, helper, stranger] = agents();
    let root = broker.open_root(&fronted, RootSpec::default()).await;
    let peer = fake_agent().await;
    let other = fake_agent().await;
    let (_gateway, addrs) = spawn_gateway(
        &broker.addr,
        &fronted,
        &format!(
            "egress_listen = \"127.0.0.1:0\"\ntokens_url = \"{tokens_url}\"\n\
             [[peers]]\nname = \"helper\"\npublic_key = \"{}\"\nurl = \"{}\"\n\
             [[peers]]\nname = \"stranger\"\npublic_key = \"{}\"\nurl = \"{}\"\n\
             [routes.helper]\nbudget = 5\nttl_ms = 60000\n\
             token_header = \"Authorization\"\ntoken_resource = \"{RESOURCE}\"\n\
             [routes.stranger]\nbudget = 5\nttl_ms = 60000\n\
             token_header = \"Authorization\"\ntoken_resource = \"https://elsewhere.test\"\n",
            hex::encode(helper.public_key()),
            peer.url,
            hex::encode(stranger.public_key()),
            other.url,
        ),
        &["a2a egress"],
    );
    let http = http_client();
    let egress = |peer: &str| format!("{}/peers/{peer}", addrs["a2a egress"]);
    let call = |method: &str, params: Value| json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let message =
        |text: &str| json!({"messageId": text, "role": "ROLE_USER", "parts": [{"text": text}]});

    let started = post_json(
        &http,
        egress("helper"),
        &call("SendMessage", json!({"message": message("start")})),
    )
    .await;
    let task_id = started["result"]["task"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a task: {started}"))
        .to_owned();
    let mut next = message("more");
    next["taskId"] = json!(task_id);
    let went_on = post_json(
        &http,
        egress("helper"),
        &call("SendMessage", json!({"message": next})),
    )
    .await;
    assert!(went_on.get("result").is_some(), "{went_on}");
    let got = post_json(
        &http,
        egress("helper"),
        &call("GetTask", json!({"id": task_id})),
    )
    .await;
    assert!(got.get("result").is_some(), "{got}");
    let canceled = post_json(
        &http,
        egress("helper"),
        &call("CancelTask", json!({"id": task_id})),
    )
    .await;
    assert!(canceled.get("result").is_some(), "{canceled}");

    let calls = peer.authorized_calls();
    let methods: Vec<&str> = calls.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(
        methods,
        ["SendMessage", "SendMessage", "GetTask", "CancelTask"]
    );
    for (method, authorization) in &calls {
        let token = authorization
            .as_deref()
            .and_then(|a| a.strip_prefix("Bearer "))
            .unwrap_or_else(|| panic!("{method} carried no bearer token: {authorization:?}"));
        let jws = delegation_broker::jwt::decode(token).expect("a JWS");
        let metadata = TokenEndpoint::new(&tokens_url)
            .unwrap()
            .metadata()
            .await
            .unwrap();
        jws.verify(&published_key(&metadata.jwks_uri, jws.kid().unwrap()).await)
            .expect("verifies with the broker's published key");
        let claims = &jws.claims;
        assert_eq!(claims["aud"], RESOURCE, "{method}");
        assert_eq!(
            claims["sub"],
            delegation_broker::crypto::key_id(&fronted.public_key()).as_str(),
            "{method}: the fronted agent calls"
        );
        assert_eq!(
            claims["tctx"]["contract_id"],
            hex::encode(&root.id).as_str(),
            "{method}: under the contract it delegated the task from"
        );
    }

    // A resource the broker does not mint for: refused naming it, before
    // any contract is issued; the peer is never called.
    let refused = post_json(
        &http,
        egress("stranger"),
        &call("SendMessage", json!({"message": message("start")})),
    )
    .await;
    assert_eq!(
        refused["error"]["data"][0]["reason"], "TOKEN_REFUSED",
        "{refused}"
    );
    let text = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        text.contains("invalid_target") && text.contains("elsewhere.test"),
        "{text}"
    );
    assert!(
        other.calls().is_empty(),
        "the peer was called: {:?}",
        other.calls()
    );
    let ledger = broker.ledger(&root.id).await;
    assert_eq!(
        (ledger.reserved, ledger.spent),
        (0, 0),
        "only the canceled task's contract was ever issued, and it was released"
    );
    broker.stop().await;
}
