//! What introspection answers from memory. A token once verified is known
//! by its SHA-256: its contract, root and expiry, and the answer it gets
//! while it stands. A chain once read is known to stand, until its
//! earliest deadline, for as long as its tree's version (`TreeChanges`)
//! does not move: any event of the tree (a revocation, a completion, a
//! decline, an expiry, a new child) sends the next introspection back to
//! the store. So an answer from memory is exact at once for this broker's
//! own writes, and for another replica's within its sequencer's poll.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::core::Id;
use crate::store::TreeVersion;

/// Most tokens and chains remembered; each map is forgotten whole when
/// full (a forgotten one costs one verification or one read).
pub const MAX_KNOWN_TOKENS: usize = 16_384;
pub const MAX_KNOWN_CHAINS: usize = 16_384;

/// A token this broker signed, verified once.
pub(super) struct KnownToken {
    pub contract: Id,
    pub root: Id,
    pub exp_s: i64,
    /// The answer while it stands: its claims with `active: true`, as JSON.
    pub active: axum::body::Bytes,
}

#[derive(Clone, Copy)]
struct KnownChain {
    version: TreeVersion,
    stands: bool,
    /// The earliest deadline of the chain's contracts.
    deadline_ms: i64,
}

#[derive(Default)]
pub(super) struct Memory {
    tokens: Mutex<HashMap<[u8; 32], Arc<KnownToken>>>,
    chains: Mutex<HashMap<Id, KnownChain>>,
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

    /// Whether the chain down to `contract` stands at `now_ms`, when it
    /// was read at its tree's current `version`.
    pub fn stands(&self, contract: &Id, version: TreeVersion, now_ms: i64) -> Option<bool> {
        let known = *lock(&self.chains).get(contract)?;
        (known.version == version).then_some(known.stands && now_ms < known.deadline_ms)
    }

    /// Remembers a chain read after its tree settled at `version`.
    pub fn remember_chain(
        &self,
        contract: Id,
        version: TreeVersion,
        stands: bool,
        deadline_ms: i64,
    ) {
        let mut chains = lock(&self.chains);
        if chains.len() >= MAX_KNOWN_CHAINS {
            chains.clear();
        }
        chains.insert(
            contract,
            KnownChain {
                version,
                stands,
                deadline_ms,
            },
        );
    }
}
