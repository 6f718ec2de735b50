//! Workload identities in: an issuer made here (its own ES256 key, a
//! SPIFFE bundle file; and an OIDC issuer with an EdDSA key) mints
//! JWT-SVIDs; an orchestrator allowed only by a SPIFFE ID pattern opens a
//! root once its key is bound; the delegate's identity is in the signed
//! chain; every bad token is refused with the check that failed.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use broker_client::Agent;
use delegation_broker::chain::{BrokerKeys, verify_chain};
use delegation_broker::config::{IssuerConfig, KeySource};
use delegation_broker::core::identity::{IdentityPattern, IssuerKind, IssuerPolicy};
use delegation_broker::pb;
use ring::rand::SystemRandom;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair as _};
use serde_json::{Value, json};

use crate::harness::*;

const TRUST_DOMAIN: &str = "prod.test";
const AUDIENCE: &str = "delegation-broker";
const OIDC_ISSUER: &str = "https://oidc.test";

/// A SPIFFE issuer's ES256 key, as SPIRE's JWT signer would hold it.
struct Spire {
    key: EcdsaKeyPair,
    rng: SystemRandom,
}

impl Spire {
    fn new() -> Self {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
            .unwrap();
        Self { key, rng }
    }

    /// The SPIFFE bundle: a JWKS whose keys are for JWT-SVIDs.
    fn bundle(&self) -> Value {
        let point = self.key.public_key().as_ref();
        json!({
            "keys": [{
                "kty": "EC", "crv": "P-256", "use": "jwt-svid", "kid": "spire-1",
                "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
                "y": URL_SAFE_NO_PAD.encode(&point[33..65]),
            }],
            "spiffe_sequence": 1,
        })
    }

    fn sign(&self, header: &Value, claims: &Value) -> String {
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let signature = self.key.sign(&self.rng, input.as_bytes()).unwrap();
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature.as_ref()))
    }

    /// A JWT-SVID for `path` in the trust domain, valid for five minutes.
    fn svid(&self, path: &str) -> String {
        self.sign(&svid_header(), &svid_claims(path))
    }
}

fn svid_header() -> Value {
    json!({"alg": "ES256", "kid": "spire-1", "typ": "JWT"})
}

fn svid_claims(path: &str) -> Value {
    let now_s = now_ms() / 1000;
    json!({
        "sub": format!("spiffe://{TRUST_DOMAIN}{path}"),
        "aud": [AUDIENCE],
        "exp": now_s + 300,
        "iat": now_s,
    })
}

/// A broker trusting the SPIFFE issuer (its bundle in `dir`) and an OIDC
/// issuer (an EdDSA JWKS), whose orchestrators are named only by pattern.
async fn broker(spire: &Spire, oidc: &Agent, dir: &std::path::Path) -> Broker {
    Broker::start_with(trusting(spire, oidc, dir, "spire")).await
}

/// A configuration trusting the SPIFFE issuer (named `spire_name`) and
/// the OIDC one, with orchestrators named only by pattern.
fn trusting(
    spire: &Spire,
    oidc: &Agent,
    dir: &std::path::Path,
    spire_name: &str,
) -> impl FnOnce(&mut delegation_broker::config::Config) {
    let bundle = dir.join("bundle.json");
    std::fs::write(&bundle, spire.bundle().to_string()).unwrap();
    let jwks = dir.join("oidc.json");
    let oidc_jwk = delegation_broker::jwt::jwk(&oidc.public_key());
    std::fs::write(&jwks, json!({"keys": [oidc_jwk]}).to_string()).unwrap();
    let spire_name = spire_name.to_owned();
    move |config| {
        config.identity.issuers = vec![
            IssuerConfig {
                policy: IssuerPolicy {
                    name: spire_name,
                    kind: IssuerKind::Spiffe {
                        trust_domain: TRUST_DOMAIN.into(),
                    },
                    issuer: None,
                    audiences: vec![AUDIENCE.into()],
                },
                keys: KeySource::File(bundle),
                refresh_s: 300,
            },
            IssuerConfig {
                policy: IssuerPolicy {
                    name: "oidc".into(),
                    kind: IssuerKind::Oidc,
                    issuer: Some(OIDC_ISSUER.into()),
                    audiences: vec![AUDIENCE.into()],
                },
                keys: KeySource::File(jwks),
                refresh_s: 300,
            },
        ];
        let pattern = IdentityPattern::parse("spiffe://prod.test/orchestrators/*").unwrap();
        config.orchestrators.by_identity = vec![(pattern, 1_000)];
    }
}

async fn bind(
    broker: &mut Broker,
    agent: &Agent,
    token: &str,
) -> Result<pb::BindIdentityResponse, tonic::Status> {
    Ok(broker
        .client
        .bind_identity(agent.bind_identity(token))
        .await?
        .into_inner())
}

#[tokio::test]
async fn an_orchestrator_named_by_spiffe_id_opens_a_root_once_bound_and_the_chain_names_workloads()
{
    let dir = tempfile::tempdir().unwrap();
    let (spire, oidc) = (Spire::new(), Agent::generate());
    let mut broker = broker(&spire, &oidc, dir.path()).await;
    let [orchestrator, worker] = agents();

    // Unbound, its key is nobody's orchestrator.
    let refused = broker
        .send_open_root(orchestrator.open_root(RootSpec::default().body()))
        .await
        .expect_err("an unbound key");
    assert_status(
        &refused,
        tonic::Code::PermissionDenied,
        "NOT_AN_ORCHESTRATOR",
    );

    let bound = bind(
        &mut broker,
        &orchestrator,
        &spire.svid("/orchestrators/planner"),
    )
    .await
    .expect("bound");
    assert_eq!(bound.identity, "spiffe://prod.test/orchestrators/planner");
    assert_eq!(bound.issuer, "spire");
    assert!(bound.expires_at_ms > now_ms() && bound.expires_at_ms <= now_ms() + 300_000);
    // Over the pattern's allowance: the identity's limit holds.
    let over = broker
        .send_open_root(orchestrator.open_root(RootSpec::with(|s| s.budget = 1_001).body()))
        .await
        .expect_err("over the allowance");
    assert_status(
        &over,
        tonic::Code::PermissionDenied,
        "ROOT_BUDGET_OVER_ALLOWANCE",
    );
    let root = broker.open_root(&orchestrator, RootSpec::default()).await;
    assert_eq!(root.contract.delegate_identity, bound.identity);

    // The worker binds through the OIDC issuer; its contract names it.
    let now_s = now_ms() / 1000;
    let oidc_token = delegation_broker::jwt::sign(
        &ed25519_dalek::SigningKey::from_bytes(&oidc.seed()),
        "JWT",
        None,
        json!({"iss": OIDC_ISSUER, "sub": "system:serviceaccount:agents:worker",
               "aud": AUDIENCE, "exp": now_s + 600})
        .as_object()
        .unwrap(),
    );
    let worker_bound = bind(&mut broker, &worker, &oidc_token)
        .await
        .expect("bound");
    assert_eq!(
        worker_bound.identity,
        "https://oidc.test#system:serviceaccount:agents:worker"
    );
    let child = broker.issue(&orchestrator, root.child(&worker, 40)).await;
    let chain = broker.chain(&child).await;
    let sealed: Vec<pb::Sealed> = chain
        .chain
        .iter()
        .map(|s| s.contract.clone().unwrap())
        .collect();
    let keys = BrokerKeys::from_published(&broker.keys().await);
    let hops = verify_chain(&sealed, &keys, None).expect("the chain verifies offline");
    let named: Vec<&str> = hops
        .iter()
        .map(|h| h.contract.delegate_identity.as_str())
        .collect();
    assert_eq!(
        named,
        [
            "spiffe://prod.test/orchestrators/planner",
            "https://oidc.test#system:serviceaccount:agents:worker"
        ]
    );

    // Audits name them too: a contract's audit its delegate's workload,
    // and runs group by the workload that opened them.
    assert_eq!(
        audit(&mut broker, &child).await.delegate_identity,
        worker_bound.identity
    );
    let groups = broker
        .client
        .aggregate_audits(pb::AggregateAuditsRequest {
            selector: Default::default(),
            group_by: vec!["@identity".into()],
        })
        .await
        .unwrap()
        .into_inner()
        .groups;
    let by_opener: Vec<(&str, u64)> = groups
        .iter()
        .map(|g| (g.key["@identity"].as_str(), g.runs))
        .collect();
    assert_eq!(by_opener, [(bound.identity.as_str(), 1)]);
}

#[tokio::test]
async fn every_bad_workload_token_is_refused_naming_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let (spire, oidc) = (Spire::new(), Agent::generate());
    let mut broker = broker(&spire, &oidc, dir.path()).await;
    let agent = Agent::generate();
    let with = |change: &dyn Fn(&mut Value)| {
        let mut claims = svid_claims("/orchestrators/a");
        change(&mut claims);
        spire.sign(&svid_header(), &claims)
    };
    let now_s = now_ms() / 1000;
    let unsigned = |header: Value| {
        format!(
            "{}.{}.",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(svid_claims("/orchestrators/a").to_string())
        )
    };
    // HS256 keyed with the issuer's public key, the classic confusion.
    let hs256 = {
        use ring::hmac;
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(json!({"alg": "HS256", "kid": "spire-1"}).to_string()),
            URL_SAFE_NO_PAD.encode(svid_claims("/orchestrators/a").to_string())
        );
        let key = hmac::Key::new(hmac::HMAC_SHA256, spire.key.public_key().as_ref());
        let tag = hmac::sign(&key, input.as_bytes());
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(tag.as_ref()))
    };
    // Signed by the other issuer's key, claiming this trust domain.
    let foreign_key = delegation_broker::jwt::sign(
        &ed25519_dalek::SigningKey::from_bytes(&oidc.seed()),
        "JWT",
        None,
        svid_claims("/orchestrators/a").as_object().unwrap(),
    );
    let other_key = Agent::generate();
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "expired",
            with(&|c| c["exp"] = json!(now_s - 120)),
            "IDENTITY_EXPIRED",
        ),
        (
            "wrong audience",
            with(&|c| c["aud"] = json!(["someone-else"])),
            "IDENTITY_AUDIENCE",
        ),
        (
            "alg none",
            unsigned(json!({"alg": "none"})),
            "IDENTITY_ALGORITHM",
        ),
        ("HS256 with the public key", hs256, "IDENTITY_ALGORITHM"),
        (
            "another trust domain",
            with(&|c| c["sub"] = json!("spiffe://staging.test/orchestrators/a")),
            "IDENTITY_TRUST_DOMAIN",
        ),
        ("a key of another issuer", foreign_key, "IDENTITY_SIGNATURE"),
        (
            "bound to another key",
            with(
                &|c| c["cnf"] = json!({"jkt": delegation_broker::core::identity::jwk_thumbprint(&other_key.public_key())}),
            ),
            "IDENTITY_KEY_BINDING",
        ),
        ("not a JWT", "not.a.jwt".into(), "IDENTITY_FORMAT"),
    ];
    for (case, token, check) in cases {
        let refused = bind(&mut broker, &agent, &token).await.expect_err(case);
        assert_status(&refused, tonic::Code::Unauthenticated, "IDENTITY_REFUSED");
        let info = tonic_types::StatusExt::get_details_error_info(&refused).unwrap();
        assert_eq!(
            info.metadata.get("check").map(String::as_str),
            Some(check),
            "{case}: {refused:?}"
        );
    }
    // Nothing was bound: the agent is still nobody's orchestrator, until
    // a good token (bound to its own key) binds it.
    let refused = broker
        .send_open_root(agent.open_root(RootSpec::default().body()))
        .await
        .expect_err("unbound");
    assert_status(
        &refused,
        tonic::Code::PermissionDenied,
        "NOT_AN_ORCHESTRATOR",
    );
    let own = with(&|c| {
        c["cnf"] =
            json!({"jkt": delegation_broker::core::identity::jwk_thumbprint(&agent.public_key())})
    });
    bind(&mut broker, &agent, &own).await.expect("its own key");
    broker.open_root(&agent, RootSpec::default()).await;
}

#[tokio::test]
async fn without_issuers_binding_is_not_configured() {
    let mut broker = Broker::start().await;
    let agent = Agent::generate();
    let refused = bind(&mut broker, &agent, "a.b.c")
        .await
        .expect_err("no issuers");
    assert_status(
        &refused,
        tonic::Code::FailedPrecondition,
        "IDENTITY_NOT_CONFIGURED",
    );
}

#[tokio::test]
async fn bind_identity_from_a_shell() {
    let dir = tempfile::tempdir().unwrap();
    let (spire, oidc) = (Spire::new(), Agent::generate());
    let broker = broker(&spire, &oidc, dir.path()).await;
    let agent = Agent::generate();
    let key_file = dir.path().join("agent.key");
    write_key_file(&key_file, &agent.seed());
    let token_file = dir.path().join("svid.jwt");
    std::fs::write(&token_file, spire.svid("/orchestrators/shell") + "\n").unwrap();
    // Asynchronously: the broker serves on this test's runtime.
    let run = |token_file: &std::path::Path| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args([
                "bind-identity",
                "--addr",
                &broker.addr,
                "--json",
                "--key-file",
            ])
            .arg(&key_file)
            .arg("--token-file")
            .arg(token_file)
            .env_remove("BROKER_KEY_FILE")
            .output()
    };
    let bound = run(&token_file).await.expect("runs");
    assert!(
        bound.status.success(),
        "{}",
        String::from_utf8_lossy(&bound.stderr)
    );
    let answer: Value = serde_json::from_slice(&bound.stdout).expect("JSON");
    assert_eq!(answer["identity"], "spiffe://prod.test/orchestrators/shell");
    assert_eq!(answer["issuer"], "spire");
    // A token of another trust domain: the check is named.
    let claims =
        json!({"sub": "spiffe://other.test/x", "aud": [AUDIENCE], "exp": now_ms() / 1000 + 60});
    std::fs::write(&token_file, spire.sign(&svid_header(), &claims)).unwrap();
    let refused = run(&token_file).await.expect("runs");
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("IDENTITY_REFUSED") && stderr.contains("other.test"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_binding_counts_only_while_its_issuer_is_trusted() {
    // Replicas share bindings through their database; one whose
    // configuration no longer names the issuer (here: the same keys under
    // another name, as after removing it and adding another) ignores them.
    let dir = tempfile::tempdir().unwrap();
    let (spire, oidc) = (Spire::new(), Agent::generate());
    let mut first =
        Broker::start_replicated_with(trusting(&spire, &oidc, dir.path(), "spire")).await;
    let mut second =
        Broker::start_replica_with(&first, trusting(&spire, &oidc, dir.path(), "renamed")).await;
    let orchestrator = Agent::generate();
    bind(&mut first, &orchestrator, &spire.svid("/orchestrators/a"))
        .await
        .expect("bound at the first replica");
    first.open_root(&orchestrator, RootSpec::default()).await;
    let refused = second
        .send_open_root(orchestrator.open_root(RootSpec::default().body()))
        .await
        .expect_err("the binding's issuer is not trusted here");
    assert_status(
        &refused,
        tonic::Code::PermissionDenied,
        "NOT_AN_ORCHESTRATOR",
    );
    // Bound again through an issuer it trusts, it is admitted there too.
    bind(&mut second, &orchestrator, &spire.svid("/orchestrators/a"))
        .await
        .expect("bound at the second replica");
    second.open_root(&orchestrator, RootSpec::default()).await;
}
