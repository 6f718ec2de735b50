//! Offline verification of whole chains from GetBrokerKeys and GetChain
//! alone, following types.proto's "Verifying a chain" step by step with
//! nothing but ed25519, SHA-256 and the generated message types — no broker
//! code, as a client in another language would — then every tampering it
//! must reject. The library's own `chain::verify_chain` (used by
//! `delegation-broker verify`) is held to the same verdicts.

use broker_client::Agent;
use delegation_broker::chain;
use delegation_broker::pb;
use ed25519_dalek::{Signature, VerifyingKey};
use prost::Message;
use sha2::{Digest, Sha256};

use crate::harness::{Broker, RootSpec, liable_child};

const CONTRACT_TYPE: &str = "application/vnd.delegation.broker.v1.Contract+protobuf";

/// DSSE v1 pre-authentication encoding, written from the specification.
fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "DSSEv1 {} {} {} ",
        payload_type.len(),
        payload_type,
        payload.len()
    )
    .into_bytes();
    out.extend_from_slice(payload);
    out
}

fn key_id(public_key: &[u8]) -> String {
    format!("ed25519:{}", hex::encode(&Sha256::digest(public_key)[..16]))
}

/// A verified contract: its id, its terms and its derived effective
/// predicate.
struct Hop {
    id: Vec<u8>,
    contract: pb::Contract,
    effective_predicate: String,
}

/// The procedure of types.proto, step by step.
fn verify(chain: &[pb::Sealed], keys: &[pb::BrokerKey]) -> Result<Vec<Hop>, String> {
    // 1. Keys whose id is the id of their bytes.
    let keys: Vec<(&str, VerifyingKey)> = keys
        .iter()
        .filter(|k| k.key_id == key_id(&k.public_key))
        .filter_map(|k| {
            let bytes: [u8; 32] = k.public_key.as_slice().try_into().ok()?;
            Some((k.key_id.as_str(), VerifyingKey::from_bytes(&bytes).ok()?))
        })
        .collect();
    let hops: Vec<Hop> = chain
        .iter()
        .map(|s| {
            Ok(Hop {
                id: Sha256::digest(&s.payload).to_vec(),
                contract: pb::Contract::decode(s.payload.as_slice())
                    .map_err(|e| format!("undecodable: {e}"))?,
                effective_predicate: String::new(),
            })
        })
        .collect::<Result<_, String>>()?;
    let leaf = hops.last().ok_or("empty chain")?;
    // 2. The leaf's signature, under the key its payload names.
    let (_, key) = keys
        .iter()
        .find(|(id, _)| *id == leaf.contract.broker_key_id)
        .ok_or("the leaf's key is not published")?;
    let signature = Signature::from_slice(&chain[chain.len() - 1].signature)
        .map_err(|_| "malformed signature")?;
    key.verify_strict(
        &pae(CONTRACT_TYPE, &chain[chain.len() - 1].payload),
        &signature,
    )
    .map_err(|_| "the leaf's signature does not verify")?;
    // 3–5. Links, the root's terms, each hop against its parent.
    let mut out: Vec<Hop> = Vec::with_capacity(hops.len());
    for hop in hops {
        let c = &hop.contract;
        let part = |p: &str| format!("({p}\n)");
        let effective = match out.last() {
            None => {
                if !c.parent_id.is_empty() || c.depth != 0 {
                    return Err("the chain does not start at a root".into());
                }
                if c.intent_lineage_hash != Sha256::digest(c.intent.as_bytes()).to_vec() {
                    return Err("root lineage is not SHA-256(intent)".into());
                }
                if c.trust_source != pb::TrustSource::Root as i32
                    || (c.factor_ppm, c.cumulative_trust_ppm) != (1_000_000, 1_000_000)
                    || c.policy.is_none()
                {
                    return Err("root terms".into());
                }
                if c.predicate.is_empty() {
                    String::new()
                } else {
                    part(&c.predicate)
                }
            }
            Some(parent) => {
                let (p, root) = (&parent.contract, &out[0].contract);
                let policy = root.policy.expect("checked at the root");
                if c.parent_id != parent.id {
                    return Err(format!("depth {}: broken link", c.depth));
                }
                if c.depth != p.depth + 1 || c.depth > policy.max_depth {
                    return Err("depth".into());
                }
                if !c.intent.is_empty() || c.policy.is_some() || !c.labels.is_empty() {
                    return Err("a child carries the root's terms".into());
                }
                if c.intent_lineage_hash != root.intent_lineage_hash {
                    return Err("lineage".into());
                }
                let cumulative =
                    u64::from(p.cumulative_trust_ppm) * u64::from(c.factor_ppm) / 1_000_000;
                if c.factor_ppm > 1_000_000
                    || u64::from(c.cumulative_trust_ppm) != cumulative
                    || c.cumulative_trust_ppm < policy.min_cumulative_trust_ppm
                {
                    return Err("trust".into());
                }
                if c.budget > p.budget || c.deadline_ms > p.deadline_ms {
                    return Err("budget or deadline not narrowed".into());
                }
                let inside = |path: &String| {
                    p.write_scope.iter().any(|q| {
                        path == q
                            || (q == "/" && path.starts_with('/'))
                            || path
                                .strip_prefix(q.as_str())
                                .is_some_and(|r| r.starts_with('/'))
                    })
                };
                if !c.write_scope.iter().all(inside) {
                    return Err("scope widened".into());
                }
                let delegate = pb::Liability::Delegate as i32;
                if c.liability == delegate && p.liability != delegate {
                    return Err("liability".into());
                }
                let inherited = if c.liability == delegate {
                    parent.effective_predicate.clone()
                } else {
                    String::new()
                };
                match (inherited.is_empty(), c.predicate.is_empty()) {
                    (_, true) => inherited,
                    (true, false) => part(&c.predicate),
                    (false, false) => format!("{inherited} && {}", part(&c.predicate)),
                }
            }
        };
        out.push(Hop {
            effective_predicate: effective,
            ..hop
        });
    }
    Ok(out)
}

/// What the test asked for at each hop.
struct Asked {
    delegate: Vec<u8>,
    budget: i64,
    predicate: String,
}

const FACTOR: f64 = 0.99;

/// Opens a root and delegates a liable chain `depth` hops deep, each hop
/// attested at `FACTOR`, with a predicate at every other hop. Returns the
/// chain as GetChain answers it and what was asked at each hop.
async fn chain_of(broker: &mut Broker, depth: usize) -> (Vec<pb::ContractState>, Vec<Asked>) {
    let agents: Vec<Agent> = (0..=depth).map(|_| Agent::generate()).collect();
    let root = broker
        .open_root(
            &agents[0],
            RootSpec {
                budget: 1_000_000,
                max_depth: 64,
                predicate: "result.schema_valid".into(),
                ..RootSpec::default()
            },
        )
        .await;
    let mut asked = vec![Asked {
        delegate: agents[0].public_key().to_vec(),
        budget: 1_000_000,
        predicate: "result.schema_valid".into(),
    }];
    let mut parent = root.id.clone();
    for hop in 1..=depth {
        let predicate = if hop % 2 == 1 {
            format!("result.within_scope || {hop} > 100")
        } else {
            String::new()
        };
        let budget = 1_000_000 - 1_000 * hop as i64;
        let mut body = liable_child(&parent, &root.lineage, &agents[hop], budget, &predicate);
        body.delegate_attestation = Some(broker.attest(&agents[hop], FACTOR));
        parent = broker.issue(&agents[hop - 1], body).await;
        asked.push(Asked {
            delegate: agents[hop].public_key().to_vec(),
            budget,
            predicate,
        });
    }
    let chain = broker
        .client
        .get_chain(pb::GetChainRequest {
            contract_id: parent,
        })
        .await
        .unwrap()
        .into_inner()
        .chain;
    (chain, asked)
}

fn sealed(chain: &[pb::ContractState]) -> Vec<pb::Sealed> {
    chain.iter().map(|s| s.contract.clone().unwrap()).collect()
}

/// Both verifiers (this file's and the library's) agree on a verdict.
fn verdict(chain: &[pb::Sealed], keys: &[pb::BrokerKey]) -> bool {
    let ours = verify(chain, keys);
    let library = chain::verify_chain(chain, &chain::BrokerKeys::from_published(keys), None);
    assert_eq!(
        ours.is_ok(),
        library.is_ok(),
        "the documented procedure and the library disagree: {:?} / {:?}",
        ours.as_ref().err(),
        library.as_ref().err()
    );
    ours.is_ok()
}

#[tokio::test]
async fn whole_chains_of_depth_1_8_and_64_verify_offline_with_every_term() {
    let mut broker = Broker::start().await;
    for depth in [1usize, 8, 64] {
        let (chain, asked) = chain_of(&mut broker, depth).await;
        // Everything below uses only the wire: keys and the chain.
        let keys = broker.keys().await;
        let contracts = sealed(&chain);
        assert_eq!(contracts.len(), depth + 1);
        let hops = verify(&contracts, &keys).expect("the chain verifies");
        assert!(verdict(&contracts, &keys));
        let library = chain::verify_chain(
            &contracts,
            &chain::BrokerKeys::from_published(&keys),
            Some(&chain[depth].contract_id.clone().try_into().unwrap()),
        )
        .unwrap();
        let mut cumulative: u64 = 1_000_000;
        for (i, (hop, state)) in hops.iter().zip(&chain).enumerate() {
            let c = &hop.contract;
            assert_eq!(hop.id, state.contract_id, "id = SHA-256(payload)");
            assert_eq!(c.depth as usize, i);
            assert_eq!(c.delegate_public_key, asked[i].delegate, "holder");
            assert_eq!(c.budget, asked[i].budget, "budget");
            assert_eq!(c.predicate, asked[i].predicate, "predicate");
            if i > 0 {
                assert_eq!(c.factor_ppm, 990_000);
                assert_eq!(c.trust_source, pb::TrustSource::Attestation as i32);
                assert_eq!(c.attestation_digest.len(), 32);
                cumulative = cumulative * 990_000 / 1_000_000;
            }
            assert_eq!(u64::from(c.cumulative_trust_ppm), cumulative);
            // The broker's copy of the effective predicate is the derived one.
            assert_eq!(hop.effective_predicate, state.effective_predicate);
            assert_eq!(library[i].effective_predicate, hop.effective_predicate);
        }
        // Every ancestor's predicate is in the leaf's effective predicate.
        let leaf = &hops[depth].effective_predicate;
        for a in asked.iter().filter(|a| !a.predicate.is_empty()) {
            assert!(leaf.contains(&format!("({}\n)", a.predicate)));
        }
        // Linear: no contract grows with its depth (only the ids differ).
        // (Odd hops carry a predicate, even ones none: compare like with like.)
        let sizes: Vec<usize> = contracts
            .iter()
            .skip(1)
            .step_by(2)
            .map(|s| s.encoded_len())
            .collect();
        assert!(
            sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 16,
            "{sizes:?}"
        );
        // Every contract's own signature verifies too (one batch).
        chain::verify_every_signature(&contracts, &chain::BrokerKeys::from_published(&keys))
            .unwrap();
    }
    broker.stop().await;
}

#[tokio::test]
async fn every_tampering_of_a_chain_is_rejected() {
    let mut broker = Broker::start().await;
    let (chain, _) = chain_of(&mut broker, 8).await;
    let (other, _) = chain_of(&mut broker, 8).await;
    let keys = broker.keys().await;
    let genuine = sealed(&chain);
    assert!(verdict(&genuine, &keys));

    // A changed budget of any contract, ancestors and leaf.
    for i in 0..genuine.len() {
        let mut tampered = genuine.clone();
        let mut c = pb::Contract::decode(tampered[i].payload.as_slice()).unwrap();
        c.budget += 1;
        tampered[i].payload = c.encode_to_vec();
        assert!(!verdict(&tampered, &keys), "budget of contract {i}");
    }
    // A flipped signature bit.
    let mut tampered = genuine.clone();
    tampered[8].signature[10] ^= 0x04;
    assert!(!verdict(&tampered, &keys), "flipped signature");
    // A flipped ancestor signature does not change any term the chain
    // proves, but checking every signature catches it.
    let mut tampered = genuine.clone();
    tampered[3].signature[10] ^= 0x04;
    assert_eq!(
        chain::verify_every_signature(&tampered, &chain::BrokerKeys::from_published(&keys)),
        Err(chain::ChainError::BadSignature { index: 3 })
    );
    // Two contracts swapped.
    for (a, b) in [(0, 1), (3, 4), (7, 8)] {
        let mut tampered = genuine.clone();
        tampered.swap(a, b);
        assert!(!verdict(&tampered, &keys), "swapped {a} and {b}");
    }
    // A wrong key: another key, published under its own id or under the
    // broker's id.
    let stranger = Agent::generate();
    let other_key = pb::BrokerKey {
        key_id: key_id(&stranger.public_key()),
        public_key: stranger.public_key().to_vec(),
        current: true,
        retired_at_ms: 0,
    };
    assert!(
        !verdict(&genuine, std::slice::from_ref(&other_key)),
        "other key"
    );
    let impostor = pb::BrokerKey {
        key_id: keys[0].key_id.clone(),
        ..other_key
    };
    assert!(!verdict(&genuine, &[impostor]), "a key under another's id");
    // A cut chain: no root, or a missing middle.
    assert!(!verdict(&genuine[1..], &keys), "no root");
    let mut cut = genuine.clone();
    cut.remove(4);
    assert!(!verdict(&cut, &keys), "missing middle");
    // A contract of another tree spliced in, at the same depth.
    for i in [0, 4, 8] {
        let mut spliced = genuine.clone();
        spliced[i] = other[i].contract.clone().unwrap();
        assert!(!verdict(&spliced, &keys), "spliced at {i}");
    }
    // The other tree's chain is itself genuine.
    assert!(verdict(&sealed(&other), &keys));
    broker.stop().await;
}
