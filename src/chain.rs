//! Offline verification of a chain of contracts, exactly as types.proto's
//! "Verifying a chain" describes it: one signature (the leaf's), the hash
//! links to the root, and each hop's terms against its parent's. Needs only
//! GetBrokerKeys' keys and GetChain's contracts — what any client in any
//! language has; no store, no transport, no clock.

use std::collections::HashMap;

use ed25519_dalek::VerifyingKey;
use prost::Message;

use crate::core::limits::PPM_ONE;
use crate::core::{Id, Predicate, Scope};
use crate::crypto::{self, payload_type};
use crate::pb;

/// Longest chain verified: the deepest policy the broker allows is 64, so
/// a longer "chain" is not one (bounds the work a hostile file can cause).
pub const MAX_CHAIN_CONTRACTS: usize = crate::core::limits::MAX_DEPTH_CEILING as usize + 1;

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
    #[error("contract {index}: the signature does not verify")]
    BadSignature { index: usize },
    #[error("contract {index}: parent_id is not the id of contract {}", index.wrapping_sub(1))]
    BrokenLink { index: usize },
    #[error("contract {index}: {detail}")]
    Terms { index: usize, detail: String },
    #[error("the last contract's id is {found}, not the one asked for ({expected})")]
    WrongLeaf { expected: String, found: String },
}

/// Published broker keys by id, each checked to be the id of its key.
#[derive(Clone, Debug, Default)]
pub struct BrokerKeys(HashMap<String, VerifyingKey>);

impl BrokerKeys {
    /// Keeps every published key whose id matches its bytes and whose bytes
    /// are a valid point; drops the rest (a wrong id must not vouch).
    pub fn from_published(keys: &[pb::BrokerKey]) -> Self {
        Self(
            keys.iter()
                .filter_map(|k| {
                    let bytes: [u8; 32] = k.public_key.as_slice().try_into().ok()?;
                    (crypto::key_id(&bytes) == k.key_id)
                        .then(|| VerifyingKey::from_bytes(&bytes).ok())
                        .flatten()
                        .map(|key| (k.key_id.clone(), key))
                })
                .collect(),
        )
    }

    fn get(&self, index: usize, key_id: &str) -> Result<&VerifyingKey, ChainError> {
        self.0.get(key_id).ok_or_else(|| ChainError::UnknownKey {
            index,
            key_id: key_id.chars().take(80).collect(),
        })
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
/// whole chain through the hash links (see types.proto). `leaf_id`, when
/// given, must be the last contract's id.
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
    let key = keys.get(last, &hops[last].contract.broker_key_id)?;
    crypto::verify_sealed(&chain[last], payload_type::CONTRACT, key)
        .map_err(|_| ChainError::BadSignature { index: last })?;
    check_terms(hops)
}

/// Checks every contract's own signature too, as one ed25519 batch (for an
/// auditor keeping each contract on its own; `verify_chain` does not need
/// them). On a failed batch each is checked strictly to name the culprit.
pub fn verify_every_signature(chain: &[pb::Sealed], keys: &BrokerKeys) -> Result<(), ChainError> {
    verify_sealed_batch(chain, payload_type::CONTRACT, keys, |payload| {
        pb::Contract::decode(payload).ok().map(|c| c.broker_key_id)
    })
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
    // Batch verification does not reject what strict verification rejects
    // for small-order keys, so it is trusted only when no key is one.
    if verifying.iter().all(|key| !key.is_weak())
        && ed25519_dalek::verify_batch(&refs, &signatures, &verifying).is_ok()
    {
        return Ok(());
    }
    for (index, (item, key)) in items.iter().zip(&verifying).enumerate() {
        crypto::verify_sealed(item, type_, key).map_err(|_| ChainError::BadSignature { index })?;
    }
    Ok(())
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
