//! The token endpoint (`serve --tokens`): a depth-3 chain's holder gets a
//! JWT that verifies with the published JWKS and carries the chain; each
//! refusal is the RFC 6749 error; introspection turns inactive once the
//! root is revoked.

use std::time::{Duration, Instant};

use base64::Engine as _;
use broker_client::Agent;
use broker_client::token::{TokenEndpoint, TokenError};
use delegation_broker::pb;
use serde_json::Value;

use crate::harness::*;

pub(crate) const RESOURCE: &str = "https://api.test";
pub(crate) const SECRET: &str = "introspection secret";

pub(crate) async fn broker() -> Broker {
    Broker::start_with_tokens(tokens_config).await
}

/// The token endpoint's settings in these tests: `RESOURCE`, and the
/// introspector `rs` with `SECRET`.
pub(crate) fn tokens_config(config: &mut delegation_broker::config::Config) {
    config.tokens.resources = vec![RESOURCE.into()];
    config.tokens.introspectors.insert(
        "rs".into(),
        delegation_broker::crypto::sha256(SECRET.as_bytes()),
    );
}

/// Root (opened by `agents[0]`) → `agents[1]` → `agents[2]` → `agents[3]`,
/// each accepted; the ids, root first.
pub(crate) async fn chain_of_three(broker: &mut Broker, agents: &[Agent; 4]) -> Vec<Vec<u8>> {
    let root = broker.open_root(&agents[0], RootSpec::default()).await;
    let mut ids = vec![root.id.clone()];
    for (i, budget) in [(1, 60), (2, 30), (3, 20)] {
        let parent = ids.last().unwrap().clone();
        let id = broker
            .issue(
                &agents[i - 1],
                child(&parent, &root.lineage, &agents[i], budget),
            )
            .await;
        broker.accept(&agents[i], &id, None).await.expect("Accept");
        ids.push(id);
    }
    ids
}

pub(crate) fn id32(id: &[u8]) -> [u8; 32] {
    id.try_into().expect("a 32-byte id")
}

fn key_id(agent: &Agent) -> String {
    delegation_broker::crypto::key_id(&agent.public_key())
}

/// Posts a token exchange with `assertion` as given; the status and body.
pub(crate) async fn exchange(endpoint: &str, assertion: &str, resource: &str) -> (u16, Value) {
    let body = format!(
        "grant_type={}&subject_token={assertion}&subject_token_type={}&resource={}",
        "urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Atoken-exchange",
        "urn%3Aietf%3Aparams%3Aoauth%3Atoken-type%3Ajwt",
        resource.replace(':', "%3A").replace('/', "%2F"),
    );
    let response = reqwest::Client::new()
        .post(endpoint)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .expect("token endpoint answers");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON"))
}

/// The broker's published key of `kid`, from the JWKS at `jwks_uri`, as
/// a resource server finds it.
pub(crate) async fn published_key(jwks_uri: &str, kid: &str) -> ed25519_dalek::VerifyingKey {
    let jwks: Value = reqwest::get(jwks_uri).await.unwrap().json().await.unwrap();
    let jwk = jwks["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["kid"] == kid)
        .expect("the token's kid is published");
    let x = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(jwk["x"].as_str().unwrap())
        .unwrap();
    delegation_broker::crypto::public_key(&x).unwrap()
}

pub(crate) fn now_s() -> i64 {
    now_ms() / 1000
}

#[tokio::test]
async fn a_minted_token_carries_the_chain_and_verifies_with_the_published_keys() {
    let mut broker = broker().await;
    let agents = [(); 4].map(|()| Agent::generate());
    let ids = chain_of_three(&mut broker, &agents).await;
    let endpoint = TokenEndpoint::new(broker.tokens_url.as_ref().unwrap()).unwrap();
    let minted = endpoint
        .mint(&agents[3], &id32(&ids[3]), RESOURCE)
        .await
        .expect("minted");
    assert!(minted.expires_in > 0 && minted.expires_in <= 300);

    // The resource server's side: the keys from the metadata's jwks_uri.
    let metadata = endpoint.metadata().await.unwrap();
    let token = delegation_broker::jwt::decode(&minted.access_token).expect("a JWS");
    token
        .verify(&published_key(&metadata.jwks_uri, token.kid().unwrap()).await)
        .expect("verifies with the JWKS key");
    let claims = &token.claims;
    assert_eq!(token.header["typ"], "at+jwt");
    assert_eq!(claims["iss"], metadata.issuer.as_str());
    assert_eq!(claims["aud"], RESOURCE);
    assert_eq!(claims["sub"], key_id(&agents[3]).as_str());
    // RFC 8693: the nearest delegator outermost, the root's holder inside.
    assert_eq!(claims["act"]["sub"], key_id(&agents[2]).as_str());
    assert_eq!(claims["act"]["act"]["sub"], key_id(&agents[1]).as_str());
    assert_eq!(
        claims["act"]["act"]["act"]["sub"],
        key_id(&agents[0]).as_str()
    );
    assert!(claims["act"]["act"]["act"].get("act").is_none());
    let served = broker.chain(&ids[3]).await;
    let tctx = &claims["tctx"];
    assert_eq!(tctx["depth"], 3);
    assert_eq!(tctx["contract_id"], hex::encode(&ids[3]).as_str());
    assert_eq!(claims["txn"], hex::encode(&ids[0]).as_str());
    let held = decode_contract(served.chain.last().unwrap().contract.as_ref().unwrap());
    assert_eq!(
        tctx["lineage_hash"],
        hex::encode(&held.intent_lineage_hash).as_str()
    );
    assert_eq!(tctx["residual"], broker.ledger(&ids[3]).await.residual);
    assert_eq!(tctx["deadline_ms"], held.deadline_ms);
    assert!(claims["exp"].as_i64().unwrap() * 1000 <= held.deadline_ms);

    // Introspection: active now; inactive within a second of revoking
    // the root three hops up.
    let rs = ("rs", SECRET);
    let answer = endpoint.introspect(rs, &minted.access_token).await.unwrap();
    assert_eq!(answer["active"], true);
    assert_eq!(answer["tctx"]["depth"], 3);
    broker.revoke(&agents[0], &ids[0]).await.expect("Revoke");
    let revoked = Instant::now();
    loop {
        let answer = endpoint.introspect(rs, &minted.access_token).await.unwrap();
        if answer == serde_json::json!({"active": false}) {
            break;
        }
        assert!(
            revoked.elapsed() < Duration::from_secs(1),
            "still active 1 s after the root was revoked: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // And no new token for it.
    let refused = endpoint.mint(&agents[3], &id32(&ids[3]), RESOURCE).await;
    assert!(
        matches!(&refused, Err(TokenError::Refused { error, description, .. })
            if error == "invalid_grant" && description.contains("REVOKED")),
        "{refused:?}"
    );
}

#[tokio::test]
async fn each_refusal_is_the_rfc_6749_error_naming_what_was_wrong() {
    let mut broker = broker().await;
    let agents = [(); 4].map(|()| Agent::generate());
    let ids = chain_of_three(&mut broker, &agents).await;
    let endpoint = TokenEndpoint::new(broker.tokens_url.as_ref().unwrap()).unwrap();
    let token_endpoint = endpoint.metadata().await.unwrap().token_endpoint;
    let held = id32(&ids[3]);
    let refused = |(status, body): (u16, Value), error: &str, naming: &str| {
        assert_eq!(
            (status, body["error"].as_str()),
            (400, Some(error)),
            "{body}"
        );
        let description = body["error_description"].as_str().unwrap();
        assert!(
            description.contains(naming),
            "{description:?} lacks {naming:?}"
        );
    };

    // Not the holder: its parent's delegate signs for it.
    let stranger = agents[2].token_assertion(&token_endpoint, &held, now_s(), 60);
    refused(
        exchange(&token_endpoint, &stranger, RESOURCE).await,
        "invalid_grant",
        "holds no contract",
    );
    // A resource outside the allow-list.
    let fine = agents[3].token_assertion(&token_endpoint, &held, now_s(), 60);
    refused(
        exchange(&token_endpoint, &fine, "https://elsewhere.test").await,
        "invalid_target",
        "elsewhere.test",
    );
    // Expired.
    let expired = agents[3].token_assertion(&token_endpoint, &held, now_s() - 400, 60);
    refused(
        exchange(&token_endpoint, &expired, RESOURCE).await,
        "invalid_grant",
        "expired",
    );
    // Replayed: the first use mints, the second is refused.
    let once = agents[3].token_assertion(&token_endpoint, &held, now_s(), 60);
    assert_eq!(exchange(&token_endpoint, &once, RESOURCE).await.0, 200);
    refused(
        exchange(&token_endpoint, &once, RESOURCE).await,
        "invalid_grant",
        "used already",
    );
    // Another audience than the token endpoint.
    let elsewhere = agents[3].token_assertion("http://other/token", &held, now_s(), 60);
    refused(
        exchange(&token_endpoint, &elsewhere, RESOURCE).await,
        "invalid_grant",
        "aud",
    );
    // `alg: none`, whatever it claims.
    let unsigned = {
        let b64 = |v: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
        let claims = fine.split('.').nth(1).unwrap().to_owned();
        format!("{}.{claims}.", b64(r#"{"alg":"none"}"#))
    };
    refused(
        exchange(&token_endpoint, &unsigned, RESOURCE).await,
        "invalid_grant",
        "none",
    );
    // A contract that ended: declined by its delegate.
    let late = Agent::generate();
    let lineage = lineage(&mut broker, &ids[3]).await;
    let declined = broker
        .issue(&agents[3], child(&ids[3], &lineage, &late, 5))
        .await;
    broker
        .act(
            &late,
            pb::DeclineBody {
                header: None,
                contract_id: declined.clone(),
                reason: "busy".into(),
            },
        )
        .await
        .expect("Decline");
    let ended = late.token_assertion(&token_endpoint, &id32(&declined), now_s(), 60);
    refused(
        exchange(&token_endpoint, &ended, RESOURCE).await,
        "invalid_grant",
        "DECLINED",
    );
    // Past the deadline of the chain (the broker's clock moves on).
    broker.clock.advance_ms(2 * HOUR_MS);
    let overdue =
        agents[3].token_assertion(&token_endpoint, &held, (now_ms() + 2 * HOUR_MS) / 1000, 60);
    refused(
        exchange(&token_endpoint, &overdue, RESOURCE).await,
        "invalid_grant",
        "deadline",
    );
    // Introspection without the right credentials.
    let wrong = endpoint.introspect(("rs", "guess"), "x.y.z").await;
    assert!(
        matches!(&wrong, Err(TokenError::Refused { status: 401, error, .. }) if error == "invalid_client"),
        "{wrong:?}"
    );
}

async fn lineage(broker: &mut Broker, id: &[u8]) -> Vec<u8> {
    let chain = broker.chain(id).await;
    decode_contract(chain.chain.last().unwrap().contract.as_ref().unwrap()).intent_lineage_hash
}

#[tokio::test]
async fn the_host_mints_for_the_calls_it_executes() {
    let mut broker = broker().await;
    let [orchestrator, delegate, host, stranger] = [(); 4].map(|()| Agent::generate());
    let root = broker.open_root(&orchestrator, RootSpec::default()).await;
    let mut body = root.child(&delegate, 30);
    body.host_public_key = host.public_key().to_vec();
    let id = broker.issue(&orchestrator, body).await;
    broker.accept(&delegate, &id, None).await.expect("Accept");
    let endpoint = TokenEndpoint::new(broker.tokens_url.as_ref().unwrap()).unwrap();
    let minted = endpoint
        .mint(&host, &id32(&id), RESOURCE)
        .await
        .expect("the host mints");
    let token = delegation_broker::jwt::decode(&minted.access_token).unwrap();
    let claims = &token.claims;
    assert_eq!(claims["sub"], key_id(&delegate).as_str());
    assert_eq!(claims["client_id"], key_id(&host).as_str());
    assert_eq!(claims["act"]["sub"], key_id(&host).as_str());
    assert_eq!(claims["act"]["host"], true);
    assert_eq!(claims["act"]["act"]["sub"], key_id(&orchestrator).as_str());
    let refused = endpoint.mint(&stranger, &id32(&id), RESOURCE).await;
    assert!(
        matches!(&refused, Err(TokenError::Refused { error, .. }) if error == "invalid_grant"),
        "{refused:?}"
    );
}

/// Introspection answers from memory once a token is known, yet the call
/// right after an ending in its chain is inactive: an event elsewhere in
/// the tree changes nothing, the leaf's revocation ends the leaf's token
/// and not its parent's, and the chain's deadline ends the rest.
#[tokio::test]
async fn introspection_from_memory_turns_inactive_at_the_next_call_after_an_ending() {
    let mut broker = broker().await;
    let agents = [(); 4].map(|()| Agent::generate());
    let ids = chain_of_three(&mut broker, &agents).await;
    let endpoint = TokenEndpoint::new(broker.tokens_url.as_ref().unwrap()).unwrap();
    let rs = ("rs", SECRET);
    let leaf = endpoint
        .mint(&agents[3], &id32(&ids[3]), RESOURCE)
        .await
        .unwrap();
    let parent = endpoint
        .mint(&agents[2], &id32(&ids[2]), RESOURCE)
        .await
        .unwrap();
    let active = async |token: &str| {
        let answer = endpoint.introspect(rs, token).await.unwrap();
        assert!(answer["active"].is_boolean(), "{answer}");
        answer["active"] == true
    };
    for _ in 0..3 {
        assert!(active(&leaf.access_token).await && active(&parent.access_token).await);
    }
    // A new child of the leaf: the tree moved, nothing ended.
    let lineage = lineage(&mut broker, &ids[3]).await;
    broker
        .issue(&agents[3], child(&ids[3], &lineage, &Agent::generate(), 5))
        .await;
    assert!(active(&leaf.access_token).await && active(&parent.access_token).await);
    // The leaf revoked by its parent's delegate: at the very next call.
    broker.revoke(&agents[2], &ids[3]).await.expect("Revoke");
    assert!(
        !active(&leaf.access_token).await,
        "the revoked leaf's token"
    );
    assert!(active(&parent.access_token).await, "its parent stands");
    assert!(active(&parent.access_token).await, "from memory, still");
    // An ancestor two hops up revoked by the root's holder: the parent's
    // token, known in memory, is inactive at the very next call.
    broker.revoke(&agents[0], &ids[1]).await.expect("Revoke");
    assert!(
        !active(&parent.access_token).await,
        "under a revoked ancestor"
    );
}

/// With replicas, a revocation made through another replica reaches an
/// introspection served from memory within that replica's poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_replicas_revocation_reaches_introspection_from_memory() {
    let mut first = Broker::start_replicated().await;
    let mut second = Broker::start_replica_with_tokens(&first, tokens_config).await;
    let agents = [(); 4].map(|()| Agent::generate());
    let ids = chain_of_three(&mut second, &agents).await;
    let endpoint = TokenEndpoint::new(second.tokens_url.as_ref().unwrap()).unwrap();
    let rs = ("rs", SECRET);
    let minted = endpoint
        .mint(&agents[3], &id32(&ids[3]), RESOURCE)
        .await
        .unwrap();
    for _ in 0..3 {
        let answer = endpoint.introspect(rs, &minted.access_token).await.unwrap();
        assert_eq!(answer["active"], true);
    }
    first.revoke(&agents[0], &ids[0]).await.expect("Revoke");
    let revoked = Instant::now();
    loop {
        let answer = endpoint.introspect(rs, &minted.access_token).await.unwrap();
        if answer["active"] == false {
            break;
        }
        assert!(
            revoked.elapsed() < Duration::from_secs(1),
            "still active 1 s after another replica revoked the root"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    second.stop().await;
    first.stop().await;
}
