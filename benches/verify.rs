//! Verifying a whole chain as a third party would, from bytes to a decision:
//! this broker's chain (the signed contracts GetChain returns, checked with
//! `chain::verify_chain`: the leaf's signature, the hash links, every hop's
//! terms) against a biscuit-auth token whose blocks carry the same
//! information per hop — a delegate key, an attenuation (the trust factor),
//! a budget, a deadline — built in the same run (bytes → `Biscuit::from`,
//! which checks every block's signature → authorize). Prints both chains'
//! bytes. Run with `cargo bench --bench verify`; numbers in BENCHMARKS.md.

use std::hint::black_box;

use biscuit_auth::macros::{biscuit, block};
use biscuit_auth::{AuthorizerBuilder, Biscuit, KeyPair};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use delegation_broker::chain::{self, BrokerKeys};
use delegation_broker::core::{ChildAsk, ChildTerms, Liability, Policy, Predicate, Scope};
use delegation_broker::crypto;
use delegation_broker::pb;
use delegation_broker::stamp::{HopTrust, NewChild, NewRoot, RequestMeta, Stamper};
use prost::Message;

const DEPTHS: [usize; 3] = [1, 8, 64];
const ROOT_BUDGET: i64 = 1_000_000;
const DEADLINE_MS: i64 = 1_900_000_000_000;
const FACTOR_PPM: u32 = 990_000;

fn request(n: usize) -> RequestMeta {
    RequestMeta {
        agent: [n as u8; 32],
        nonce: (n as u64).to_be_bytes().to_vec(),
        digest: crypto::sha256(&n.to_be_bytes()),
        timestamp_ms: 1_000,
    }
}

fn delegate_key(hop: usize) -> [u8; 32] {
    crypto::sha256(format!("delegate {hop}").as_bytes())
}

/// The broker's chain of `depth` hops, encoded as GetChain carries it (the
/// signed contracts), and the published key.
fn broker_chain(depth: usize) -> (Vec<u8>, Vec<pb::BrokerKey>) {
    let key = crypto::generate_signing_key();
    let stamper = Stamper::new(key.clone());
    let root = NewRoot {
        request: request(0),
        intent: "ship the release".into(),
        task: "ship".into(),
        budget: ROOT_BUDGET,
        deadline_ms: DEADLINE_MS,
        policy: Policy {
            max_depth: 64,
            min_cumulative_trust_ppm: 0,
            max_children: 64,
            retry_headroom: true,
            require_host: false,
        },
        predicate: Predicate::default(),
        write_scope: Scope::parse(&["src".to_owned()], "write_scope").expect("scope"),
        labels: Default::default(),
        trace: None,
    };
    let lineage = crypto::sha256(root.intent.as_bytes());
    let mut parent = stamper.root(&root, 1_000);
    let mut contracts = vec![parent.stamped.envelope.clone()];
    let mut cumulative = 1_000_000u32;
    for hop in 1..=depth {
        cumulative = (u64::from(cumulative) * u64::from(FACTOR_PPM) / 1_000_000) as u32;
        let child = NewChild {
            request: request(hop),
            parent_id: parent.stamped.id,
            ask: ChildAsk {
                requester: delegate_key(hop - 1),
                intent_lineage_hash: lineage,
                budget: ROOT_BUDGET - hop as i64,
                deadline_ms: None,
                liability: Liability::Principal,
                predicate: Predicate::default(),
                escalation_channel: String::new(),
                min_retry_cost: 0,
                min_retry_latency_ms: 0,
                write_scope: Scope::parse(&["src".to_owned()], "write_scope").expect("scope"),
                factor_ppm: FACTOR_PPM,
                factor_note: String::new(),
            },
            task: format!("step {hop}"),
            delegate_key: delegate_key(hop),
            trust: HopTrust {
                source: pb::TrustSource::Attestation,
                attestation_digest: Some([3; 32]),
                risk_class: String::new(),
            },
            host: None,
            result_schema_json: String::new(),
            trace: None,
        };
        let terms = ChildTerms {
            depth: hop as u32,
            deadline_ms: DEADLINE_MS,
            effective_predicate: Predicate::default(),
            cumulative_trust_ppm: cumulative,
        };
        parent = stamper.child(&lineage, &child, &terms, 1_000);
        contracts.push(parent.stamped.envelope.clone());
    }
    let response = pb::GetChainResponse {
        chain: contracts
            .into_iter()
            .map(|contract| pb::ContractState {
                contract: Some(contract),
                ..Default::default()
            })
            .collect(),
    };
    let public = key.verifying_key().to_bytes();
    let keys = vec![pb::BrokerKey {
        key_id: crypto::key_id(&public),
        public_key: public.to_vec(),
        current: true,
    }];
    (response.encode_to_vec(), keys)
}

/// Bytes → verified chain → the leaf's terms (what an authorizer decides
/// on).
fn verify_broker(bytes: &[u8], keys: &BrokerKeys) -> i64 {
    let response = pb::GetChainResponse::decode(bytes).expect("decodes");
    let sealed: Vec<pb::Sealed> = response
        .chain
        .into_iter()
        .map(|s| s.contract.expect("contract"))
        .collect();
    let hops = chain::verify_chain(&sealed, keys, None).expect("verifies");
    hops.last().expect("a leaf").contract.budget
}

/// A biscuit with the same per-hop information: the authority block holds
/// the root's delegate, budget, deadline and trust; each attenuation block
/// names the next delegate and its trust factor and checks the budget and
/// deadline.
fn biscuit_chain(depth: usize) -> (Vec<u8>, KeyPair) {
    let root = KeyPair::new();
    let mut token = biscuit!(
        r#"delegate({key}); trust(1000000); check if budget($b), $b <= {budget}; check if now($t), $t <= {deadline};"#,
        key = delegate_key(0).to_vec(),
        budget = ROOT_BUDGET,
        deadline = DEADLINE_MS,
    )
    .build(&root)
    .expect("authority block");
    for hop in 1..=depth {
        token = token
            .append(block!(
                r#"delegate({key}); trust({factor}); check if budget($b), $b <= {budget}; check if now($t), $t <= {deadline};"#,
                key = delegate_key(hop).to_vec(),
                factor = i64::from(FACTOR_PPM),
                budget = ROOT_BUDGET - hop as i64,
                deadline = DEADLINE_MS,
            ))
            .expect("attenuation block");
    }
    (token.to_vec().expect("serializes"), root)
}

/// Bytes → every block's signature → authorization of a request within
/// every block's budget and deadline.
fn verify_biscuit(bytes: &[u8], root: &KeyPair) -> bool {
    let token = Biscuit::from(bytes, root.public()).expect("verifies");
    let mut authorizer = AuthorizerBuilder::new()
        .fact(biscuit_auth::builder::fact(
            "budget",
            &[biscuit_auth::builder::int(ROOT_BUDGET - 64)],
        ))
        .expect("fact")
        .fact(biscuit_auth::builder::fact(
            "now",
            &[biscuit_auth::builder::int(1_000)],
        ))
        .expect("fact")
        .policy("allow if true")
        .expect("policy")
        .build(&token)
        .expect("authorizer");
    authorizer.authorize().is_ok()
}

fn chains(c: &mut Criterion) {
    let mut group = c.benchmark_group("verify a whole chain");
    for depth in DEPTHS {
        let (ours, published) = broker_chain(depth);
        let keys = BrokerKeys::from_published(&published);
        let (theirs, root) = biscuit_chain(depth);
        assert_eq!(verify_broker(&ours, &keys), ROOT_BUDGET - depth as i64);
        assert!(verify_biscuit(&theirs, &root));
        let sealed_bytes: usize = pb::GetChainResponse::decode(ours.as_slice())
            .expect("decodes")
            .chain
            .iter()
            .map(|s| s.contract.as_ref().expect("contract").encoded_len())
            .sum();
        println!(
            "depth {depth}: broker chain {} bytes (signed contracts {sealed_bytes}), biscuit {} bytes",
            ours.len(),
            theirs.len()
        );
        group.bench_with_input(BenchmarkId::new("broker", depth), &ours, |b, ours| {
            b.iter(|| verify_broker(black_box(ours), &keys))
        });
        group.bench_with_input(BenchmarkId::new("biscuit", depth), &theirs, |b, theirs| {
            b.iter(|| verify_biscuit(black_box(theirs), &root))
        });
    }
    group.finish();
}

criterion_group!(verify, chains);
criterion_main!(verify);
