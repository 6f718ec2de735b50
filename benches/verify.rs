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
use delegation_broker::chain::fixture::{self, DEADLINE_MS, ROOT_BUDGET, delegate_key};
use delegation_broker::chain::{self, BrokerKeys};
use delegation_broker::core::Liability;
use delegation_broker::crypto;
use delegation_broker::pb;
use prost::Message;

const DEPTHS: [usize; 3] = [1, 8, 64];
const FACTOR_PPM: u32 = 990_000;

/// The broker's chain of `depth` hops, encoded as GetChain carries it (the
/// signed contracts), and the published key.
fn broker_chain(depth: usize) -> (Vec<u8>, BrokerKeys) {
    let (contracts, keys) =
        fixture::stamped_chain(&crypto::generate_signing_key(), depth, "", |n| {
            fixture::Hop {
                budget: ROOT_BUDGET - n as i64,
                liability: Liability::Principal,
                predicate: String::new(),
                factor_ppm: FACTOR_PPM,
            }
        });
    let response = pb::GetChainResponse {
        chain: contracts
            .into_iter()
            .map(|contract| pb::ContractState {
                contract: Some(contract),
                ..Default::default()
            })
            .collect(),
    };
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
        let (ours, keys) = broker_chain(depth);
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
