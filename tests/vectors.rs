//! The shared signing test vectors (`testdata/signing-vectors.json`, written
//! by `scripts/signing-vectors.py` with the Python client), checked with the
//! broker's own functions: PAE, key ids, signing, strict verification, ids,
//! request digests, chain and receipt verification. The same file is checked
//! by the Python client (`clients/python/tests/test_vectors.py`) and the
//! TypeScript client (`clients/typescript/test/vectors.test.ts`).

use std::collections::HashMap;

use broker_client::Agent;
use delegation_broker::chain::{self, BrokerKeys};
use delegation_broker::crypto::{self, payload_type};
use delegation_broker::pb;
use ed25519_dalek::SigningKey;
use prost::Message;
use serde_json::Value;

/// One positive case, its hex decoded.
struct Case {
    name: String,
    form: String,
    message: String,
    payload_type: String,
    seed: [u8; 32],
    public_key: [u8; 32],
    key_id: String,
    body: Vec<u8>,
    pae: Vec<u8>,
    signature: Vec<u8>,
    signed: Vec<u8>,
    id: Option<Vec<u8>>,
    request_digest: Option<Vec<u8>>,
}

/// One negative case: must not verify.
struct Negative {
    name: String,
    base: String,
    form: String,
    payload_type: String,
    public_key: [u8; 32],
    body: Vec<u8>,
    signature: Vec<u8>,
}

struct Vectors {
    keys: Vec<pb::BrokerKey>,
    cases: Vec<Case>,
    chain: Vec<String>,
    negative: Vec<Negative>,
}

impl Vectors {
    fn case(&self, name: &str) -> &Case {
        self.cases
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no case {name}"))
    }

    fn broker_keys(&self) -> BrokerKeys {
        BrokerKeys::from_published(&self.keys)
    }
}

fn load() -> Vectors {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/signing-vectors.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text).expect("signing-vectors.json is JSON");
    let keys = array(&json, "broker_keys")
        .iter()
        .map(|k| pb::BrokerKey {
            key_id: string(k, "key_id"),
            public_key: bytes(k, "public_key"),
            current: k["current"].as_bool().expect("current is a bool"),
            retired_at_ms: 0,
        })
        .collect();
    let cases = array(&json, "cases")
        .iter()
        .map(|c| Case {
            name: string(c, "name"),
            form: string(c, "form"),
            message: string(c, "message"),
            payload_type: string(c, "payload_type"),
            seed: key32(c, "seed"),
            public_key: key32(c, "public_key"),
            key_id: string(c, "key_id"),
            body: bytes(c, "body"),
            pae: bytes(c, "pae"),
            signature: bytes(c, "signature"),
            signed: bytes(c, "signed"),
            id: optional_bytes(c, "id"),
            request_digest: optional_bytes(c, "request_digest"),
        })
        .collect();
    let chain = array(&json, "chain")
        .iter()
        .map(|name| name.as_str().expect("chain names are strings").to_owned())
        .collect();
    let negative = array(&json, "negative")
        .iter()
        .map(|n| Negative {
            name: string(n, "name"),
            base: string(n, "base"),
            form: string(n, "form"),
            payload_type: string(n, "payload_type"),
            public_key: key32(n, "public_key"),
            body: bytes(n, "body"),
            signature: bytes(n, "signature"),
        })
        .collect();
    Vectors {
        keys,
        cases,
        chain,
        negative,
    }
}

fn array<'a>(json: &'a Value, field: &str) -> &'a Vec<Value> {
    json[field]
        .as_array()
        .unwrap_or_else(|| panic!("{field} is an array"))
}

fn string(json: &Value, field: &str) -> String {
    json[field]
        .as_str()
        .unwrap_or_else(|| panic!("{field} is a string"))
        .to_owned()
}

fn bytes(json: &Value, field: &str) -> Vec<u8> {
    hex::decode(string(json, field)).unwrap_or_else(|e| panic!("{field} is hex: {e}"))
}

fn optional_bytes(json: &Value, field: &str) -> Option<Vec<u8>> {
    (!json[field].is_null()).then(|| bytes(json, field))
}

fn key32(json: &Value, field: &str) -> [u8; 32] {
    bytes(json, field)
        .try_into()
        .unwrap_or_else(|_| panic!("{field} is 32 bytes"))
}

/// The broker's payload type constant for a message's full name.
fn broker_type(message: &str) -> &'static str {
    match message {
        "delegation.broker.v1.Contract" => payload_type::CONTRACT,
        "delegation.broker.v1.Receipt" => payload_type::RECEIPT,
        "delegation.broker.v1.Session" => payload_type::SESSION,
        "delegation.broker.v1.OpenRootBody" => payload_type::OPEN_ROOT,
        "delegation.broker.v1.DelegateBody" => payload_type::DELEGATE,
        "delegation.broker.v1.OpenSessionBody" => payload_type::OPEN_SESSION,
        "delegation.broker.v1.AcceptBody" => payload_type::ACCEPT,
        "delegation.broker.v1.DeclineBody" => payload_type::DECLINE,
        "delegation.broker.v1.CompleteBody" => payload_type::COMPLETE,
        "delegation.broker.v1.AdjudicateBody" => payload_type::ADJUDICATE,
        "delegation.broker.v1.EscalateBody" => payload_type::ESCALATE,
        "delegation.broker.v1.RevokeBody" => payload_type::REVOKE,
        "delegation.broker.v1.RecordReceiptsBody" => payload_type::RECORD_RECEIPTS,
        "delegation.broker.v1.Attestation" => payload_type::ATTESTATION,
        other => panic!("a vector of an unexpected message {other}"),
    }
}

/// The body decoded as its message and encoded again by prost; for a
/// request, also the agent key its header names.
fn reencode(message: &str, body: &[u8]) -> (Vec<u8>, Option<Vec<u8>>) {
    fn header(h: Option<pb::RequestHeader>) -> Option<Vec<u8>> {
        Some(h.expect("a request body has a header").agent_public_key)
    }
    match message {
        "delegation.broker.v1.Contract" => {
            (pb::Contract::decode(body).unwrap().encode_to_vec(), None)
        }
        "delegation.broker.v1.Receipt" => {
            (pb::Receipt::decode(body).unwrap().encode_to_vec(), None)
        }
        "delegation.broker.v1.Session" => {
            (pb::Session::decode(body).unwrap().encode_to_vec(), None)
        }
        "delegation.broker.v1.OpenRootBody" => {
            let m = pb::OpenRootBody::decode(body).unwrap();
            (m.encode_to_vec(), header(m.header))
        }
        "delegation.broker.v1.DelegateBody" => {
            let m = pb::DelegateBody::decode(body).unwrap();
            (m.encode_to_vec(), header(m.header))
        }
        "delegation.broker.v1.OpenSessionBody" => {
            let m = pb::OpenSessionBody::decode(body).unwrap();
            (m.encode_to_vec(), header(m.header))
        }
        other => panic!("add {other} to reencode"),
    }
}

fn sealed_key_id(message: &str, payload: &[u8]) -> Option<String> {
    match message {
        "delegation.broker.v1.Contract" => {
            pb::Contract::decode(payload).ok().map(|m| m.broker_key_id)
        }
        "delegation.broker.v1.Receipt" => {
            pb::Receipt::decode(payload).ok().map(|m| m.broker_key_id)
        }
        "delegation.broker.v1.Session" => {
            pb::Session::decode(payload).ok().map(|m| m.broker_key_id)
        }
        _ => None,
    }
}

fn message_of(type_: &str) -> &str {
    type_
        .strip_prefix("application/vnd.")
        .and_then(|t| t.strip_suffix("+protobuf"))
        .unwrap_or_else(|| panic!("{type_} is not application/vnd.<message>+protobuf"))
}

fn sealed_of(case: &Case) -> pb::Sealed {
    pb::Sealed {
        payload: case.body.clone(),
        signature: case.signature.clone(),
    }
}

#[test]
fn the_vectors_cover_every_signed_form() {
    let v = load();
    for message in [
        "delegation.broker.v1.Contract",
        "delegation.broker.v1.Receipt",
        "delegation.broker.v1.Session",
    ] {
        assert!(
            v.cases
                .iter()
                .any(|c| c.form == "sealed" && c.message == message),
            "no sealed {message}"
        );
    }
    assert!(v.cases.iter().any(|c| c.form == "envelope"));
    assert!(!v.negative.is_empty());
    // Every published key's id is the id of its bytes.
    for key in &v.keys {
        let bytes: [u8; 32] = key.public_key.as_slice().try_into().unwrap();
        assert_eq!(crypto::key_id(&bytes), key.key_id);
    }
}

#[test]
fn every_case_signs_and_verifies_with_the_brokers_functions() {
    let v = load();
    let keys = v.broker_keys();
    for c in &v.cases {
        let name = &c.name;
        let type_ = broker_type(&c.message);
        assert_eq!(c.payload_type, type_, "{name}: payload type");
        assert_eq!(message_of(&c.payload_type), c.message, "{name}");
        // Keys: the seed's public key, and its id.
        let signing = SigningKey::from_bytes(&c.seed);
        assert_eq!(
            signing.verifying_key().to_bytes(),
            c.public_key,
            "{name}: public key"
        );
        assert_eq!(
            Agent::from_seed(c.seed).public_key(),
            c.public_key,
            "{name}"
        );
        assert_eq!(crypto::key_id(&c.public_key), c.key_id, "{name}: key id");
        // PAE, and the signature over it.
        assert_eq!(crypto::pae(type_, &c.body), c.pae, "{name}: PAE");
        let vk = crypto::public_key(&c.public_key).expect("a valid public key");
        // ed25519 is deterministic: signing again from the seed gives the same bytes.
        let sealed = crypto::seal(&signing, type_, c.body.clone());
        assert_eq!(sealed.signature, c.signature, "{name}: re-signed");
        crypto::verify_sealed(&sealed_of(c), type_, &vk).unwrap_or_else(|e| panic!("{name}: {e}"));
        // The body is canonical protobuf: prost re-encodes it byte for byte.
        let (again, signer) = reencode(&c.message, &c.body);
        assert_eq!(again, c.body, "{name}: re-encoded body");
        match c.form.as_str() {
            "envelope" => {
                assert!(c.id.is_none(), "{name}: requests have no id");
                let digest = c.request_digest.as_deref().expect("a request digest");
                assert_eq!(
                    digest,
                    &crypto::sha256(&c.pae)[..],
                    "{name}: request digest"
                );
                assert_eq!(
                    signer.as_deref(),
                    Some(&c.public_key[..]),
                    "{name}: the header's agent signs"
                );
                let envelope = pb::Envelope::decode(c.signed.as_slice()).unwrap();
                assert_eq!(
                    envelope,
                    crypto::sign_envelope(&signing, type_, c.body.clone()),
                    "{name}"
                );
                assert_eq!(
                    envelope.encode_to_vec(),
                    c.signed,
                    "{name}: the serialized envelope"
                );
                crypto::verify_envelope(&envelope, type_, &vk)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                // The Rust agent signs the decoded body to the same envelope.
                let agent = Agent::from_seed(c.seed);
                let resigned = match c.message.as_str() {
                    "delegation.broker.v1.OpenRootBody" => {
                        agent.sign(type_, &pb::OpenRootBody::decode(c.body.as_slice()).unwrap())
                    }
                    "delegation.broker.v1.DelegateBody" => {
                        agent.sign(type_, &pb::DelegateBody::decode(c.body.as_slice()).unwrap())
                    }
                    "delegation.broker.v1.OpenSessionBody" => agent.sign(
                        type_,
                        &pb::OpenSessionBody::decode(c.body.as_slice()).unwrap(),
                    ),
                    other => panic!("add {other} here"),
                };
                assert_eq!(
                    resigned.encode_to_vec(),
                    c.signed,
                    "{name}: the Rust agent's envelope"
                );
            }
            "sealed" => {
                assert!(c.request_digest.is_none(), "{name}");
                assert_eq!(
                    c.id.as_deref(),
                    Some(&crypto::sha256(&c.body)[..]),
                    "{name}: id"
                );
                let decoded = pb::Sealed::decode(c.signed.as_slice()).unwrap();
                assert_eq!(decoded, sealed, "{name}: the serialized Sealed");
                assert_eq!(sealed.encode_to_vec(), c.signed, "{name}");
                let key_id = sealed_key_id(&c.message, &c.body).expect("a broker-signed message");
                assert_eq!(key_id, c.key_id, "{name}: broker_key_id");
                chain::verify_sealed_batch(&[sealed], type_, &keys, |p| {
                    sealed_key_id(&c.message, p)
                })
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            }
            other => panic!("{name}: unknown form {other}"),
        }
    }
}

#[test]
fn the_chain_verifies_and_every_binding_holds() {
    let v = load();
    let keys = v.broker_keys();
    let sealed: Vec<pb::Sealed> = v.chain.iter().map(|name| sealed_of(v.case(name))).collect();
    let ids: Vec<[u8; 32]> = v
        .chain
        .iter()
        .map(|name| v.case(name).id.clone().unwrap().try_into().unwrap())
        .collect();
    let hops = chain::verify_chain(&sealed, &keys, ids.last()).expect("the chain verifies");
    chain::verify_every_signature(&sealed, &keys).expect("every signature verifies");
    assert_eq!(hops.iter().map(|h| h.id).collect::<Vec<_>>(), ids);
    let (root, child) = (&hops[0].contract, &hops[1].contract);
    assert_eq!(
        root.intent_lineage_hash,
        crypto::sha256(root.intent.as_bytes())
    );
    assert_eq!(child.intent_lineage_hash, root.intent_lineage_hash);
    assert_eq!(
        Some(&root.request_digest),
        v.case("open-root").request_digest.as_ref()
    );
    assert_eq!(
        Some(&child.request_digest),
        v.case("delegate").request_digest.as_ref()
    );
    assert_eq!(
        hops[1].effective_predicate,
        format!("({}\n) && ({}\n)", root.predicate, child.predicate)
    );
    let delegate = pb::DelegateBody::decode(v.case("delegate").body.as_slice()).unwrap();
    assert_eq!(delegate.parent_id, ids[0]);

    let refused = v.case("receipt-refused");
    let receipt_key = crypto::public_key(&refused.public_key).unwrap();
    crypto::verify_sealed(&sealed_of(refused), payload_type::RECEIPT, &receipt_key).unwrap();
    let receipt = pb::Receipt::decode(refused.body.as_slice()).unwrap();
    assert_eq!(receipt.kind, pb::ReceiptKind::Refused as i32);
    assert_eq!(receipt.contract_id, ids[0]);
    assert_eq!(receipt.root_id, ids[0]);
    assert_eq!(
        Some(&receipt.request_digest),
        v.case("delegate-refused").request_digest.as_ref()
    );
    assert_eq!(receipt.primary, pb::InvariantCode::NoRetryHeadroom as i32);

    let session = pb::Session::decode(v.case("session").body.as_slice()).unwrap();
    assert_eq!(session.agent_public_key, v.case("open-session").public_key);
    let opened = pb::OpenSessionBody::decode(v.case("open-session").body.as_slice()).unwrap();
    assert_eq!(opened.broker_key_id, session.broker_key_id);
}

#[test]
fn every_negative_case_fails() {
    let v = load();
    let keys = v.broker_keys();
    let mut seen = HashMap::new();
    for n in &v.negative {
        let name = &n.name;
        let base = v.case(&n.base);
        *seen.entry(n.form.as_str()).or_insert(0) += 1;
        let vk = crypto::public_key(&n.public_key).expect("a valid public key");
        let sealed = pb::Sealed {
            payload: n.body.clone(),
            signature: n.signature.clone(),
        };
        // The broker's type constant, when the type is one it signs or checks.
        let type_ = broker_type(message_of(&n.payload_type));
        assert_eq!(type_, n.payload_type, "{name}");
        assert!(
            crypto::verify_sealed(&sealed, type_, &vk).is_err(),
            "{name}: verified"
        );
        match n.form.as_str() {
            "envelope" => {
                let envelope = pb::Envelope {
                    payload_type: n.payload_type.clone(),
                    payload: n.body.clone(),
                    signatures: vec![pb::Signature {
                        keyid: base.key_id.clone(),
                        sig: n.signature.clone(),
                    }],
                };
                assert!(
                    crypto::verify_envelope(&envelope, type_, &vk).is_err(),
                    "{name}: verified"
                );
            }
            "sealed" => {
                let message = message_of(&n.payload_type);
                assert!(
                    chain::verify_sealed_batch(&[sealed], type_, &keys, |p| {
                        sealed_key_id(message, p)
                    })
                    .is_err(),
                    "{name}: verified in a batch"
                );
            }
            other => panic!("{name}: unknown form {other}"),
        }
    }
    assert!(seen.contains_key("sealed") && seen.contains_key("envelope"));
}

#[test]
fn a_flipped_bit_anywhere_in_the_chain_fails() {
    let v = load();
    let keys = v.broker_keys();
    let sealed: Vec<pb::Sealed> = v.chain.iter().map(|name| sealed_of(v.case(name))).collect();
    let flipped = v
        .negative
        .iter()
        .find(|n| n.base == v.chain[0] && n.body != v.case(&n.base).body)
        .expect("a negative case flipping the root's body");
    let root = pb::Sealed {
        payload: flipped.body.clone(),
        signature: flipped.signature.clone(),
    };
    assert!(chain::verify_chain(&[root], &keys, None).is_err());
    for (index, contract) in sealed.iter().enumerate() {
        for byte in (0..contract.payload.len()).step_by(7) {
            let mut tampered = sealed.clone();
            tampered[index].payload[byte] ^= 0x80;
            assert!(
                chain::verify_chain(&tampered, &keys, None).is_err(),
                "contract {index}, byte {byte}"
            );
        }
    }
}
