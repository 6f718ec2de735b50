//! What mints and introspections answer from memory. A token once
//! verified is known by its SHA-256: its contract, root and expiry, and
//! the answer it gets while it stands. A chain once read is kept for as
//! long as its tree's version (`TreeChanges`) does not move: any event of
//! the tree (a revocation, a completion, a decline, an expiry, a new
//! child, an observation) sends the next call back to the store. So an
//! answer from memory is exact at once for this broker's own writes, and
//! for another replica's within this replica's sequencer poll — memory is
//! not used while those polls fail (`TreeChanges::current`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::core::Id;
use crate::core::token::Hop;
use crate::store::{TreeChanges, TreeVersion};

/// Most tokens remembered (a minted token is under 16 KiB), and most
/// bytes of chains remembered in all (a hop's write scope and identity
/// may take tens of kilobytes); each map is forgotten whole when full (a
/// forgotten entry costs one verification or one read).
pub const MAX_KNOWN_TOKENS: usize = 4_096;
pub const MAX_KNOWN_CHAIN_BYTES: usize = 32 * 1024 * 1024;
/// Most contracts whose root is remembered.
pub const MAX_KNOWN_ROOTS: usize = 65_536;

/// A token this broker signed, verified once.
pub(super) struct KnownToken {
    pub contract: Id,
    pub root: Id,
    pub exp_s: i64,
    /// The answer while it stands: its claims with `active: true`, as JSON.
    pub active: axum::body::Bytes,
}

/// A chain as read, root first, and the version of its tree it holds at.
struct KnownChain {
    version: TreeVersion,
    chain: Arc<Vec<Hop>>,
}

#[derive(Default)]
pub(super) struct Memory {
    tokens: Mutex<HashMap<[u8; 32], Arc<KnownToken>>>,
    chains: Mutex<Chains>,
}

#[derive(Default)]
struct Chains {
    by_contract: HashMap<Id, KnownChain>,
    /// Each contract's root, once read: it never changes.
    roots: HashMap<Id, Id>,
    /// What the remembered chains take, about (`bytes_of`).
    bytes: usize,
}

/// About what a chain takes in memory: each hop and what it points to.
fn bytes_of(chain: &[Hop]) -> usize {
    chain
        .iter()
        .map(|hop| {
            std::mem::size_of::<Hop>()
                + hop.subject.len()
                + hop.host.as_ref().map_or(0, |(_, name)| name.len())
                + hop
                    .write_scope
                    .iter()
                    .map(|p| p.len() + std::mem::size_of::<String>())
                    .sum::<usize>()
        })
        .sum()
}

/// Entries are inserted whole: a poisoned map is still a correct one.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Memory {
    pub fn token(&self, digest: &[u8; 32]) -> Option<Arc<KnownToken>> {
        lock(&self.tokens).get(digest).cloned()
    }

    pub fn remember_token(&self, digest: [u8; 32], token: KnownToken) -> Arc<KnownToken> {
        let token = Arc::new(token);
        let mut tokens = lock(&self.tokens);
        if tokens.len() >= MAX_KNOWN_TOKENS {
            tokens.clear();
        }
        tokens.insert(digest, token.clone());
        token
    }

    /// The chain down to `contract`, while its tree is at the version it
    /// was read at and every writer's events are known (`current`).
    pub fn chain(&self, contract: &Id, trees: &TreeChanges) -> Option<Arc<Vec<Hop>>> {
        if !trees.current() {
            return None;
        }
        let chains = lock(&self.chains);
        let known = chains.by_contract.get(contract)?;
        let root = known.chain.first()?.id;
        (trees.version(&root) == known.version).then(|| known.chain.clone())
    }

    /// `contract`'s root, if a read has shown it.
    pub fn root_of(&self, contract: &Id) -> Option<Id> {
        lock(&self.chains).roots.get(contract).copied()
    }

    /// Remembers `contract`'s root, and its chain when it was read after
    /// its tree settled at `version`.
    pub fn remember(&self, contract: Id, chain: &Arc<Vec<Hop>>, version: Option<TreeVersion>) {
        let Some(root) = chain.first().map(|hop| hop.id) else {
            return;
        };
        let bytes = version.map_or(0, |_| bytes_of(chain));
        let mut chains = lock(&self.chains);
        if chains.bytes.saturating_add(bytes) > MAX_KNOWN_CHAIN_BYTES
            || chains.roots.len() >= MAX_KNOWN_ROOTS
        {
            *chains = Chains::default();
        }
        chains.roots.insert(contract, root);
        if let Some(version) = version {
            chains.bytes += bytes;
            let known = KnownChain {
                version,
                chain: chain.clone(),
            };
            if let Some(old) = chains.by_contract.insert(contract, known) {
                chains.bytes = chains.bytes.saturating_sub(bytes_of(&old.chain));
            }
        }
    }
}
