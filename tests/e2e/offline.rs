//! Offline verification: a contract and each of its hop proofs checked from
//! GetBrokerKeys output with nothing but ed25519, SHA-256 and the generated
//! message types — no broker code, as a client in another language would.

use delegation_broker::client::Agent;
use delegation_broker::pb;
use ed25519_dalek::{Signature, VerifyingKey};
use prost::Message;
use sha2::{Digest, Sha256};

use crate::harness::{Broker, RootSpec, liable_child};

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

/// Verifies `envelope` under the published key named `key_id` (from the
/// signed payload) and returns the payload decoded as `T`.
fn verify<T: Message + Default>(
    envelope: &pb::Envelope,
    expected_type: &str,
    keys: &[pb::BrokerKey],
    key_id_of: impl Fn(&T) -> &str,
) -> T {
    assert_eq!(envelope.payload_type, expected_type);
    let message = T::decode(envelope.payload.as_slice()).unwrap();
    let key = keys
        .iter()
        .find(|k| k.key_id == key_id_of(&message))
        .expect("signed key id is published");
    assert_eq!(
        key.key_id,
        key_id(&key.public_key),
        "published key id matches its key"
    );
    let vk = VerifyingKey::from_bytes(key.public_key.as_slice().try_into().unwrap()).unwrap();
    let ok = envelope.signatures.iter().any(|s| {
        Signature::from_slice(&s.sig).is_ok_and(|sig| {
            vk.verify_strict(&pae(&envelope.payload_type, &envelope.payload), &sig)
                .is_ok()
        })
    });
    assert!(ok, "signature verifies");
    message
}

#[tokio::test]
async fn a_contract_and_every_hop_proof_verify_offline() {
    let mut broker = Broker::start().await;
    let agents: Vec<Agent> = (0..4).map(|_| Agent::generate()).collect();
    let root = broker
        .open_root(
            &agents[0],
            RootSpec {
                min_trust: 100_000,
                ..RootSpec::default()
            },
        )
        .await;
    let mut parent = root.id.clone();
    let factors = [0.9, 0.75, 0.5];
    for hop in 1..=3 {
        let mut body = if hop == 1 {
            liable_child(
                &parent,
                &root.lineage,
                &agents[hop],
                50,
                "result.schema_valid",
            )
        } else {
            liable_child(&parent, &root.lineage, &agents[hop], 50 >> hop, "")
        };
        body.delegate_attestation = Some(broker.attest(&agents[hop], factors[hop - 1]));
        parent = broker
            .delegate(&agents[hop - 1], body)
            .await
            .unwrap()
            .issued()
            .0;
    }

    // Everything below uses only the wire: keys and the chain.
    let keys = broker.keys().await;
    let chain = broker
        .client
        .get_chain(pb::GetChainRequest {
            contract_id: parent.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .chain;
    assert_eq!(chain.len(), 4);
    let mut previous_id: Vec<u8> = Vec::new();
    for (depth, state) in chain.iter().enumerate() {
        let envelope = state.contract.as_ref().unwrap();
        let contract: pb::Contract = verify(
            envelope,
            "application/vnd.delegation.broker.v1.Contract+protobuf",
            &keys,
            |c: &pb::Contract| &c.broker_key_id,
        );
        assert_eq!(
            Sha256::digest(&envelope.payload).to_vec(),
            state.contract_id,
            "id = SHA-256(payload)"
        );
        assert_eq!(contract.parent_id, previous_id, "hash chain to the root");
        assert_eq!(contract.depth as usize, depth);
        assert_eq!(
            contract.intent_lineage_hash,
            Sha256::digest(contract.intent.as_bytes()).to_vec()
        );
        assert_eq!(contract.hop_proofs.len(), depth + 1);
        let mut cumulative: u64 = 1_000_000;
        for (i, proof_envelope) in contract.hop_proofs.iter().enumerate() {
            let proof: pb::HopProof = verify(
                proof_envelope,
                "application/vnd.delegation.broker.v1.HopProof+protobuf",
                &keys,
                |p: &pb::HopProof| &p.broker_key_id,
            );
            assert_eq!(proof.depth as usize, i);
            assert_eq!(proof.intent_lineage_hash, contract.intent_lineage_hash);
            if i > 0 {
                assert_eq!(proof.factor_ppm, (factors[i - 1] * 1e6) as u32);
                assert_eq!(proof.trust_source, pb::TrustSource::Attestation as i32);
                cumulative = cumulative * u64::from(proof.factor_ppm) / 1_000_000;
            }
            assert_eq!(
                u64::from(proof.cumulative_trust_ppm),
                cumulative,
                "floor(product) in ppm"
            );
        }
        let own = pb::HopProof::decode(contract.hop_proofs[depth].payload.as_slice()).unwrap();
        assert_eq!(own.agent_public_key, contract.delegate_public_key);
        assert_eq!(own.parent_id, contract.parent_id);
        previous_id = state.contract_id.clone();
    }
    let last =
        pb::Contract::decode(chain[3].contract.as_ref().unwrap().payload.as_slice()).unwrap();
    assert_eq!(last.effective_predicate, "(result.schema_valid\n)");
    // 0.9 × 0.75 × 0.5 = 0.3375 → 337500 ppm.
    let own = pb::HopProof::decode(last.hop_proofs[3].payload.as_slice()).unwrap();
    assert_eq!(own.cumulative_trust_ppm, 337_500);

    // A tampered contract fails.
    let mut tampered = chain[3].contract.clone().unwrap();
    let mut contract = pb::Contract::decode(tampered.payload.as_slice()).unwrap();
    contract.budget += 1;
    tampered.payload = contract.encode_to_vec();
    let vk = VerifyingKey::from_bytes(keys[0].public_key.as_slice().try_into().unwrap()).unwrap();
    let sig = Signature::from_slice(&tampered.signatures[0].sig).unwrap();
    assert!(
        vk.verify_strict(&pae(&tampered.payload_type, &tampered.payload), &sig)
            .is_err()
    );

    broker.stop().await;
}
