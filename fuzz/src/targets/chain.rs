//! Offline chain verification (`chain::verify_chain`, what
//! `delegation-broker verify --chain` runs on files from anywhere).
//!
//! Asserts:
//! - arbitrary bytes, decoded as a GetChainResponse, never panic the
//!   verifier, and a chain that verifies satisfies what verification
//!   promises (checked again here, independently: hash links, root first,
//!   depths, non-increasing budgets and deadlines, the cumulative-trust
//!   product);
//! - a genuine chain stamped by the broker's own `Stamper` verifies, and
//!   every mutation of it fails for a verifier that names the leaf it asked
//!   for — a changed byte in any contract's payload,
//!   a changed byte in the leaf's signature, contracts dropped, swapped or
//!   duplicated — unless the mutation left the verified bytes as they were
//!   (an ancestor's own signature is not part of what the leaf's proves;
//!   `verify_every_signature` catches a change there).

use std::sync::OnceLock;

use arbitrary::{Arbitrary, Unstructured};
use delegation_broker::chain::{self, BrokerKeys, fixture};
use delegation_broker::core::Liability;
use delegation_broker::crypto;
use delegation_broker::pb;
use prost::Message;

const DEPTH: usize = 6;

/// One genuine chain and its key, stamped once by the broker's `Stamper`.
fn genuine() -> &'static (Vec<pb::Sealed>, BrokerKeys) {
    static CHAIN: OnceLock<(Vec<pb::Sealed>, BrokerKeys)> = OnceLock::new();
    CHAIN.get_or_init(|| {
        fixture::stamped_chain(
            &ed25519_dalek::SigningKey::from_bytes(&[7; 32]),
            DEPTH,
            "result.schema_valid",
            |n| fixture::Hop {
                budget: 1_000 - 10 * n as i64,
                liability: Liability::Delegate,
                predicate: format!("result.n > {n}"),
                factor_ppm: 900_000,
            },
        )
    })
}

#[derive(Debug, Arbitrary)]
pub enum Mutation {
    PayloadByte { contract: u8, at: u16, xor: u8 },
    LeafSignatureByte { at: u8, xor: u8 },
    AncestorSignatureByte { contract: u8, at: u8, xor: u8 },
    Drop { contract: u8 },
    Swap { a: u8, b: u8 },
    Duplicate { contract: u8 },
}

#[derive(Debug)]
pub enum Input {
    Bytes(Vec<u8>),
    Mutations(Vec<Mutation>),
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(if u.ratio(1, 3)? {
            Input::Bytes(u.arbitrary()?)
        } else {
            let n = u.int_in_range(1..=3)?;
            Input::Mutations((0..n).map(|_| u.arbitrary()).collect::<Result<_, _>>()?)
        })
    }
}

/// What a verified chain must satisfy, checked without the library.
fn promised(chain: &[pb::Sealed], hops: &[chain::Hop]) {
    assert_eq!(chain.len(), hops.len());
    for (i, (sealed, hop)) in chain.iter().zip(hops).enumerate() {
        assert_eq!(hop.id, crypto::sha256(&sealed.payload));
        assert_eq!(hop.contract.depth as usize, i);
        if i == 0 {
            assert!(hop.contract.parent_id.is_empty());
            assert_eq!(hop.contract.cumulative_trust_ppm, 1_000_000);
        } else {
            let p = &hops[i - 1].contract;
            assert_eq!(hop.contract.parent_id, hops[i - 1].id.to_vec());
            assert!(hop.contract.budget <= p.budget);
            assert!(hop.contract.deadline_ms <= p.deadline_ms);
            assert_eq!(
                u64::from(hop.contract.cumulative_trust_ppm),
                u64::from(p.cumulative_trust_ppm) * u64::from(hop.contract.factor_ppm) / 1_000_000
            );
        }
    }
}

/// One input (the fuzz target's entry).
pub fn fuzz(input: Input) {
    let (genuine, keys) = genuine();
    match input {
        Input::Bytes(bytes) => {
            let Ok(response) = pb::GetChainResponse::decode(bytes.as_slice()) else {
                return;
            };
            let chain: Vec<pb::Sealed> = response
                .chain
                .into_iter()
                .filter_map(|s| s.contract)
                .collect();
            if let Ok(hops) = chain::verify_chain(&chain, keys, None) {
                promised(&chain, &hops);
            }
        }
        Input::Mutations(mutations) => {
            let hops =
                chain::verify_chain(genuine, keys, None).expect("the genuine chain verifies");
            promised(genuine, &hops);
            let mut chain = genuine.clone();
            for m in &mutations {
                let n = chain.len().max(1);
                match *m {
                    Mutation::PayloadByte { contract, at, xor } => {
                        if let Some(c) = chain.get_mut(contract as usize % n) {
                            let len = c.payload.len().max(1);
                            if let Some(b) = c.payload.get_mut(at as usize % len) {
                                *b ^= xor;
                            }
                        }
                    }
                    Mutation::LeafSignatureByte { at, xor } => {
                        if let Some(c) = chain.last_mut() {
                            let len = c.signature.len().max(1);
                            if let Some(b) = c.signature.get_mut(at as usize % len) {
                                *b ^= xor;
                            }
                        }
                    }
                    Mutation::AncestorSignatureByte { contract, at, xor } => {
                        let last = chain.len().saturating_sub(1).max(1);
                        if let Some(c) = chain.get_mut(contract as usize % last)
                            && let Some(b) = c.signature.get_mut(at as usize % 64)
                        {
                            *b ^= xor;
                        }
                    }
                    Mutation::Drop { contract } => {
                        if chain.len() > 1 {
                            chain.remove(contract as usize % n);
                        }
                    }
                    Mutation::Swap { a, b } => chain.swap(a as usize % n, b as usize % n),
                    Mutation::Duplicate { contract } => {
                        let c = chain[contract as usize % n].clone();
                        chain.insert(contract as usize % n, c);
                    }
                }
            }
            // The leaf's signature and every payload are what verification
            // rests on; an ancestor's signature is not.
            let unchanged = chain.len() == genuine.len()
                && chain
                    .iter()
                    .zip(genuine)
                    .all(|(a, b)| a.payload == b.payload)
                && chain.last().map(|c| &c.signature) == genuine.last().map(|c| &c.signature);
            // A prefix is a genuine chain for its own leaf: the verifier
            // names the leaf it asked for.
            let leaf = crypto::sha256(&genuine[genuine.len() - 1].payload);
            match chain::verify_chain(&chain, keys, Some(&leaf)) {
                Ok(hops) => {
                    assert!(unchanged, "a mutated chain verified: {mutations:?}");
                    promised(&chain, &hops);
                }
                Err(_) => assert!(!unchanged, "an unchanged chain failed: {mutations:?}"),
            }
        }
    }
}
