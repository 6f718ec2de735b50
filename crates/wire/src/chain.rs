//! Offline verification of a chain of contracts, exactly as types.proto's
//! "Verifying a chain" describes it: one signature (the leaf's), the hash
//! links to the root, and each hop's terms against its parent's. Needs only
//! GetBrokerKeys' keys and GetChain's contracts — what any client in any
//! language has; no store, no transport, no clock.

use std::collections::HashMap;

use ed25519_dalek::VerifyingKey;
use prost::Message;

use crate::crypto::{self, payload_type};
use crate::pb;
pub use broker_domain::limits::MAX_CHAIN_CONTRACTS;
use broker_domain::limits::PPM_ONE;
use broker_domain::{Id, Predicate, Scope};

/// Why a chain does not verify. `index` counts from the root (0).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("the chain is empty")]
    Empty,
    #[error("{0} contracts, at most {MAX_CHAIN_CONTRACTS} in a chain")]
    TooLong(usize),
    #[error("contract {index}: the payload is not a Contract")]
    Undecodable { index: usize },
    #[error("contract {index}: signed by {key_id:?}, which GetBrokerKeys does not publish")]
    UnknownKey { index: usize, key_id: String },
    #[error(
        "contract {index}: dated {at_ms} ms, after its key {key_id:?} retired ({retired_at_ms} ms)"
    )]
    Retired {
        index: usize,
        key_id: String,
        at_ms: i64,
        retired_at_ms: i64,
    },
    #[error("contract {index}: the signature does not verify")]
    BadSignature { index: usize },
    #[error("contract {index}: parent_id is not the id of contract {}", index.wrapping_sub(1))]
    BrokenLink { index: usize },
    #[error("contract {index}: {detail}")]
    Terms { index: usize, detail: String },
    #[error("the last contract's id is {found}, not the one asked for ({expected})")]
    WrongLeaf { expected: String, found: String },
}

/// Published broker keys by id, each checked to be the id of its key,
/// with when it retired (`retired_at_ms`; 0: not retired, or not recorded).
#[derive(Clone, Debug, Default)]
pub struct BrokerKeys(HashMap<String, (VerifyingKey, i64)>);

impl BrokerKeys {
    /// Keeps every published key whose id matches its bytes and whose bytes
    /// are a valid point; drops the rest (a wrong id must not vouch).
    pub fn from_published(keys: &[pb::BrokerKey]) -> Self {
        Self(
            keys.iter()
                .filter_map(|k| {
                    let bytes: [u8; 32] = k.public_key.as_slice().try_into().ok()?;
                    let retired_at_ms = if k.current { 0 } else { k.retired_at_ms.max(0) };
                    (crypto::key_id(&bytes) == k.key_id)
                        .then(|| VerifyingKey::from_bytes(&bytes).ok())
                        .flatten()
                        .map(|key| (k.key_id.clone(), (key, retired_at_ms)))
                })
                .collect(),
        )
    }

    /// The key published as `key_id`; `index` names the item for the error.
    pub fn get(&self, index: usize, key_id: &str) -> Result<&VerifyingKey, ChainError> {
        self.0
            .get(key_id)
            .map(|(key, _)| key)
            .ok_or_else(|| ChainError::UnknownKey {
                index,
                key_id: key_id.chars().take(80).collect(),
            })
    }

    /// Refuses what `key_id` is said to have signed at `at_ms` if the key
    /// had retired by then: a retired key vouches only for what it signed
    /// before (GetBrokerKeys' `retired_at_ms`; 0 is no bound).
    pub fn check_dated(&self, index: usize, key_id: &str, at_ms: i64) -> Result<(), ChainError> {
        match self.0.get(key_id) {
            Some(&(_, retired_at_ms)) if retired_at_ms > 0 && at_ms >= retired_at_ms => {
                Err(ChainError::Retired {
                    index,
                    key_id: key_id.chars().take(80).collect(),
                    at_ms,
                    retired_at_ms,
                })
            }
            _ => Ok(()),
        }
    }
}

/// One verified contract of a chain.
#[derive(Clone, Debug)]
pub struct Hop {
    /// SHA-256 of its payload.
    pub id: Id,
    pub contract: pb::Contract,
    /// What the broker judges its completion on, derived root → leaf.
    pub effective_predicate: String,
}

/// Verifies a chain, root first (as GetChain returns it), and returns every
/// contract's terms. One signature is checked, the leaf's: it covers the
/// whole chain through the hash links (see types.proto); its key must not
/// have retired before the leaf was issued. `leaf_id`, when given, must be
/// the last contract's id. The one chain check of the binary: the CLI's
/// `verify` and the A2A gateway both call it.
pub fn verify_chain(
    chain: &[pb::Sealed],
    keys: &BrokerKeys,
    leaf_id: Option<&Id>,
) -> Result<Vec<Hop>, ChainError> {
    let hops = decode(chain)?;
    let last = hops.len() - 1;
    if let Some(expected) = leaf_id
        && hops[last].id != *expected
    {
        return Err(ChainError::WrongLeaf {
            expected: hex::encode(expected),
            found: hex::encode(hops[last].id),
        });
    }
    let leaf = &hops[last].contract;
    let key = keys.get(last, &leaf.broker_key_id)?;
    crypto::verify_sealed(&chain[last], payload_type::CONTRACT, key)
        .map_err(|_| ChainError::BadSignature { index: last })?;
    keys.check_dated(last, &leaf.broker_key_id, leaf.issued_at_ms)?;
    check_terms(hops)
}

/// Checks every contract's own signature too, as one ed25519 batch (for an
/// auditor keeping each contract on its own; `verify_chain` does not need
/// them). On a failed batch each is checked strictly to name the culprit.
pub fn verify_every_signature(chain: &[pb::Sealed], keys: &BrokerKeys) -> Result<(), ChainError> {
    verify_sealed_batch(chain, payload_type::CONTRACT, keys, |payload| {
        pb::Contract::decode(payload).ok().map(|c| c.broker_key_id)
    })?;
    for (index, sealed) in chain.iter().enumerate() {
        let contract = pb::Contract::decode(sealed.payload.as_slice())
            .map_err(|_| ChainError::Undecodable { index })?;
        keys.check_dated(index, &contract.broker_key_id, contract.issued_at_ms)?;
    }
    Ok(())
}

/// Batch-verifies sealed payloads of one type, each under the key its
/// payload names (`key_id_of`). Errors name the first bad one by index.
pub fn verify_sealed_batch(
    items: &[pb::Sealed],
    type_: &str,
    keys: &BrokerKeys,
    key_id_of: impl Fn(&[u8]) -> Option<String>,
) -> Result<(), ChainError> {
    let mut messages = Vec::with_capacity(items.len());
    let mut signatures = Vec::with_capacity(items.len());
    let mut verifying = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let key_id = key_id_of(&item.payload).ok_or(ChainError::Undecodable { index })?;
        verifying.push(*keys.get(index, &key_id)?);
        signatures.push(
            ed25519_dalek::Signature::from_slice(&item.signature)
                .map_err(|_| ChainError::BadSignature { index })?,
        );
        messages.push(crypto::pae(type_, &item.payload));
    }
    let refs: Vec<&[u8]> = messages.iter().map(Vec::as_slice).collect();
    // A batch checks the verification equation only; strict verification
    // also refuses small-order keys and small-order or non-canonically
    // encoded R. Those are checked here first, so the batch accepts exactly
    // what `verify_strict` one by one would.
    if verifying.iter().all(|key| !key.is_weak())
        && items.iter().all(|item| strict_r(&item.signature))
        && ed25519_dalek::verify_batch(&refs, &signatures, &verifying).is_ok()
    {
        return Ok(());
    }
    for (index, (item, key)) in items.iter().zip(&verifying).enumerate() {
        crypto::verify_sealed(item, type_, key).map_err(|_| ChainError::BadSignature { index })?;
    }
    Ok(())
}

/// R (the signature's first 32 bytes) is a canonical encoding of a point
/// that is not of small order.
fn strict_r(signature: &[u8]) -> bool {
    let Some(bytes) = signature
        .get(..32)
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
    else {
        return false;
    };
    let compressed = curve25519_dalek::edwards::CompressedEdwardsY(bytes);
    compressed
        .decompress()
        .is_some_and(|r| !r.is_small_order() && r.compress() == compressed)
}

fn decode(chain: &[pb::Sealed]) -> Result<Vec<Hop>, ChainError> {
    if chain.is_empty() {
        return Err(ChainError::Empty);
    }
    if chain.len() > MAX_CHAIN_CONTRACTS {
        return Err(ChainError::TooLong(chain.len()));
    }
    chain
        .iter()
        .enumerate()
        .map(|(index, sealed)| {
            Ok(Hop {
                id: crypto::sha256(&sealed.payload),
                contract: pb::Contract::decode(sealed.payload.as_slice())
                    .map_err(|_| ChainError::Undecodable { index })?,
                effective_predicate: String::new(),
            })
        })
        .collect()
}

/// Steps 3–5 of the procedure: links, the root's terms, each hop's terms.
fn check_terms(mut hops: Vec<Hop>) -> Result<Vec<Hop>, ChainError> {
    let terms = |index: usize, detail: String| ChainError::Terms { index, detail };
    let root = &hops[0].contract;
    if !root.parent_id.is_empty() || root.depth != 0 {
        return Err(terms(
            0,
            "the first contract is not a root (it names a parent or has depth > 0): the chain is cut".into(),
        ));
    }
    if root.intent_lineage_hash != crypto::sha256(root.intent.as_bytes()) {
        return Err(terms(
            0,
            "intent_lineage_hash is not SHA-256(intent)".into(),
        ));
    }
    if root.trust_source != pb::TrustSource::Root as i32
        || root.factor_ppm != PPM_ONE
        || root.cumulative_trust_ppm != PPM_ONE
    {
        return Err(terms(0, "a root's trust is ROOT, 1_000_000 ppm".into()));
    }
    let policy = root
        .policy
        .ok_or_else(|| terms(0, "the root carries no policy".into()))?;
    hops[0].effective_predicate = conjoin(0, "", &root.predicate)?;
    for index in 1..hops.len() {
        let (before, rest) = hops.split_at_mut(index);
        let (parent, hop) = (&before[index - 1], &mut rest[0]);
        let (p, c) = (&parent.contract, &hop.contract);
        if c.parent_id != parent.id {
            return Err(ChainError::BrokenLink { index });
        }
        let fail = |detail: &str| Err(terms(index, detail.to_owned()));
        if c.depth != p.depth + 1 {
            return fail("depth is not its parent's + 1");
        }
        if c.depth > policy.max_depth {
            return fail("depth exceeds the root policy's max_depth");
        }
        if !c.intent.is_empty() || c.policy.is_some() || !c.labels.is_empty() {
            return fail("a child carries intent, policy or labels (the root's apply)");
        }
        if c.intent_lineage_hash != p.intent_lineage_hash {
            return fail("intent_lineage_hash differs from the root's");
        }
        let expected = u64::from(p.cumulative_trust_ppm) * u64::from(c.factor_ppm.min(PPM_ONE))
            / u64::from(PPM_ONE);
        if c.factor_ppm > PPM_ONE || u64::from(c.cumulative_trust_ppm) != expected {
            return fail("cumulative_trust_ppm is not floor(parent × factor_ppm / 1_000_000)");
        }
        if c.cumulative_trust_ppm < policy.min_cumulative_trust_ppm {
            return fail("cumulative trust is below the root policy's minimum");
        }
        if c.budget > p.budget || c.budget < 0 {
            return fail("budget exceeds the parent's");
        }
        if c.deadline_ms > p.deadline_ms {
            return fail("deadline is later than the parent's");
        }
        let parent_scope = Scope::from_trusted(p.write_scope.clone());
        if !Scope::from_trusted(c.write_scope.clone())
            .widening_over(&parent_scope)
            .is_empty()
        {
            return fail("write_scope reaches outside the parent's");
        }
        let delegate = pb::Liability::Delegate as i32;
        if c.liability == delegate && p.liability != delegate {
            return fail("a DELEGATE contract under a liability-retaining parent");
        }
        let inherited = if c.liability == delegate {
            parent.effective_predicate.as_str()
        } else {
            ""
        };
        hop.effective_predicate = conjoin(index, inherited, &c.predicate)?;
    }
    Ok(hops)
}

fn conjoin(index: usize, inherited: &str, own: &str) -> Result<String, ChainError> {
    Predicate::conjoin(
        &Predicate::from_trusted(inherited.to_owned()),
        &Predicate::from_trusted(own.to_owned()),
    )
    .map(|p| p.as_str().to_owned())
    .ok_or_else(|| ChainError::Terms {
        index,
        detail: "the effective predicate exceeds its limit".into(),
    })
}

/// Chains stamped by the broker's own `Stamper`, for the unit tests, the
/// `chain` fuzz target and `benches/verify.rs`: what GetChain would
/// return for a tree, without a store.
#[doc(hidden)]
pub mod fixture {
    use super::BrokerKeys;
    use crate::command::{HopTrust, NewChild, NewRoot, RequestMeta};
    use crate::crypto;
    use crate::pb;
    use crate::stamp::Stamper;
    use broker_domain::limits::PPM_ONE;
    use broker_domain::{ChildAsk, ChildTerms, Liability, Policy, Predicate, Scope};

    /// What one hop asks for.
    pub struct Hop {
        pub budget: i64,
        pub liability: Liability,
        pub predicate: String,
        pub factor_ppm: u32,
    }

    /// The root's budget and deadline (every hop's deadline).
    pub const ROOT_BUDGET: i64 = 1_000_000;
    pub const DEADLINE_MS: i64 = 1_900_000_000_000;

    fn request(n: usize) -> RequestMeta {
        RequestMeta {
            agent: [n as u8; 32],
            nonce: (n as u64).to_be_bytes().to_vec(),
            digest: crypto::sha256(&n.to_be_bytes()),
            timestamp_ms: 1_000,
        }
    }

    /// The delegate key of hop `n` (the root's holder is hop 0).
    pub fn delegate_key(n: usize) -> [u8; 32] {
        crypto::sha256(format!("delegate {n}").as_bytes())
    }

    /// A root with `root_predicate` and `depth` children, hop `n` asking
    /// `hop(n)`, all under scope "src", signed with `key`; and the keys a
    /// verifier would take from GetBrokerKeys.
    pub fn stamped_chain(
        key: &ed25519_dalek::SigningKey,
        depth: usize,
        root_predicate: &str,
        hop: impl Fn(usize) -> Hop,
    ) -> (Vec<pb::Sealed>, BrokerKeys) {
        let stamper = Stamper::new(key.clone());
        let scope = Scope::parse(&["src".to_owned()], "write_scope").expect("a valid scope");
        let root = NewRoot {
            identity: None,
            request: request(0),
            intent: "ship the release".into(),
            task: "ship".into(),
            budget: ROOT_BUDGET,
            deadline_ms: DEADLINE_MS,
            policy: Policy {
                max_depth: broker_domain::limits::MAX_DEPTH_CEILING,
                min_cumulative_trust_ppm: 0,
                max_children: 64,
                retry_headroom: true,
                require_host: false,
            },
            predicate: Predicate::from_trusted(root_predicate.to_owned()),
            write_scope: scope.clone(),
            labels: Default::default(),
            trace: None,
        };
        let lineage = crypto::sha256(root.intent.as_bytes());
        let mut parent = stamper.root(&root, 1_000);
        let mut chain = vec![parent.stamped.envelope.clone()];
        let mut cumulative = u64::from(PPM_ONE);
        for n in 1..=depth {
            let asked = hop(n);
            cumulative = cumulative * u64::from(asked.factor_ppm) / u64::from(PPM_ONE);
            let child = NewChild {
                identity: None,
                request: request(n),
                parent_id: parent.stamped.id,
                ask: ChildAsk {
                    requester: delegate_key(n - 1),
                    intent_lineage_hash: lineage,
                    budget: asked.budget,
                    deadline_ms: None,
                    liability: asked.liability,
                    predicate: Predicate::from_trusted(asked.predicate),
                    escalation_channel: "up".into(),
                    min_retry_cost: 0,
                    min_retry_latency_ms: 0,
                    write_scope: scope.clone(),
                    factor_ppm: asked.factor_ppm,
                    factor_note: String::new(),
                },
                task: format!("step {n}"),
                delegate_key: delegate_key(n),
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
                depth: n as u32,
                deadline_ms: DEADLINE_MS,
                // Not signed: only the store keeps it.
                effective_predicate: Predicate::default(),
                cumulative_trust_ppm: u32::try_from(cumulative).unwrap_or(PPM_ONE),
            };
            parent = stamper.child(&lineage, &child, &terms, 1_000);
            chain.push(parent.stamped.envelope.clone());
        }
        let public = key.verifying_key().to_bytes();
        let keys = BrokerKeys::from_published(&[pb::BrokerKey {
            key_id: crypto::key_id(&public),
            public_key: public.to_vec(),
            current: true,
            retired_at_ms: 0,
        }]);
        (chain, keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A root and `depth` DELEGATE hops at factor 0.9, each with its own
    /// predicate.
    fn stamped(depth: usize) -> (Vec<pb::Sealed>, BrokerKeys) {
        fixture::stamped_chain(
            &crypto::generate_signing_key(),
            depth,
            "result.schema_valid",
            |n| fixture::Hop {
                budget: 100 - n as i64,
                liability: broker_domain::Liability::Delegate,
                predicate: format!("result.n > {n}"),
                factor_ppm: 900_000,
            },
        )
    }

    #[test]
    fn a_stamped_chain_verifies_with_derived_effective_predicates() {
        let (chain, keys) = stamped(3);
        let leaf = crypto::sha256(&chain[3].payload);
        let hops = verify_chain(&chain, &keys, Some(&leaf)).expect("verifies");
        assert_eq!(hops[3].contract.cumulative_trust_ppm, 729_000);
        assert_eq!(
            hops[3].effective_predicate,
            "(result.schema_valid\n) && (result.n > 1\n) && (result.n > 2\n) && (result.n > 3\n)"
        );
        verify_every_signature(&chain, &keys).expect("every signature");
        // Any prefix is a chain too.
        assert!(verify_chain(&chain[..2], &keys, None).is_ok());
    }

    #[test]
    fn malformed_chains_are_refused_by_name() {
        let (chain, keys) = stamped(2);
        assert_eq!(
            verify_chain(&[], &keys, None).err(),
            Some(ChainError::Empty)
        );
        let long = vec![chain[0].clone(); MAX_CHAIN_CONTRACTS + 1];
        assert_eq!(
            verify_chain(&long, &keys, None).err(),
            Some(ChainError::TooLong(MAX_CHAIN_CONTRACTS + 1))
        );
        assert!(matches!(
            verify_chain(&chain, &keys, Some(&[0; 32])),
            Err(ChainError::WrongLeaf { .. })
        ));
        assert!(matches!(
            verify_chain(&chain, &BrokerKeys::default(), None),
            Err(ChainError::UnknownKey { index: 2, .. })
        ));
        let mut swapped = chain.clone();
        swapped.swap(1, 2);
        assert!(verify_chain(&swapped, &keys, None).is_err());
        let mut junk = chain.clone();
        junk[1].payload = vec![0xff; 8];
        assert_eq!(
            verify_chain(&junk, &keys, None).err(),
            Some(ChainError::Undecodable { index: 1 })
        );
        // A published key whose id is not its own vouches for nothing.
        let other = crypto::generate_signing_key().verifying_key().to_bytes();
        let lying = BrokerKeys::from_published(&[pb::BrokerKey {
            key_id: pb::Contract::decode(chain[2].payload.as_slice())
                .expect("contract")
                .broker_key_id,
            public_key: other.to_vec(),
            current: true,
            retired_at_ms: 0,
        }]);
        assert!(matches!(
            verify_chain(&chain, &lying, None),
            Err(ChainError::UnknownKey { .. })
        ));
    }

    #[test]
    fn a_retired_key_vouches_only_for_what_it_signed_before() {
        let key = crypto::generate_signing_key();
        let (chain, _) = fixture::stamped_chain(&key, 2, "true", |_| fixture::Hop {
            budget: 10,
            liability: broker_domain::Liability::Delegate,
            predicate: String::new(),
            factor_ppm: 900_000,
        });
        let issued_at_ms = pb::Contract::decode(chain[2].payload.as_slice())
            .expect("contract")
            .issued_at_ms;
        let public = key.verifying_key().to_bytes();
        let published = |current: bool, retired_at_ms: i64| {
            BrokerKeys::from_published(&[pb::BrokerKey {
                key_id: crypto::key_id(&public),
                public_key: public.to_vec(),
                current,
                retired_at_ms,
            }])
        };
        // Retired after the leaf was issued, or when not recorded: verifies.
        assert!(verify_chain(&chain, &published(false, issued_at_ms + 1), None).is_ok());
        assert!(verify_chain(&chain, &published(false, 0), None).is_ok());
        // Retired by then: refused, by both checks.
        let retired = published(false, issued_at_ms);
        assert!(matches!(
            verify_chain(&chain, &retired, None),
            Err(ChainError::Retired { index: 2, .. })
        ));
        assert!(matches!(
            verify_every_signature(&chain, &retired),
            Err(ChainError::Retired { index: 0, .. })
        ));
        // A current key is never retired, whatever the field says.
        assert!(verify_chain(&chain, &published(true, issued_at_ms), None).is_ok());
    }

    #[test]
    fn batch_verification_names_the_bad_signature() {
        let (mut chain, keys) = stamped(4);
        chain[2].signature[5] ^= 1;
        assert_eq!(
            verify_every_signature(&chain, &keys),
            Err(ChainError::BadSignature { index: 2 })
        );
        // The leaf's signature (and the links) still prove every term.
        assert!(verify_chain(&chain, &keys, None).is_ok());
    }

    #[test]
    fn small_order_and_non_canonical_r_are_refused_before_a_batch() {
        // The identity point (y = 1): small order.
        let mut identity = [0u8; 64];
        identity[0] = 1;
        assert!(!strict_r(&identity));
        // y = p + 1 encodes the identity again, non-canonically.
        let mut non_canonical = [0xffu8; 64];
        non_canonical[0] = 0xee;
        non_canonical[31] = 0x7f;
        assert!(!strict_r(&non_canonical));
        assert!(!strict_r(&[0u8; 10]));
        // A real signature's R passes.
        let (chain, _) = stamped(1);
        assert!(strict_r(&chain[1].signature));
    }
}
