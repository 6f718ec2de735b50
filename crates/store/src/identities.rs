//! Keys bound to workload identities (BindIdentity). A single broker on
//! SQLite keeps them here, in memory: a binding lives no longer than the
//! token that proved it (minutes to hours), and an agent binds again
//! after a restart. Replicas on PostgreSQL share a table instead
//! (`postgres::identities`).

use std::collections::HashMap;
use std::sync::Mutex;

use broker_domain::AgentKey;

use crate::limits::{MAX_IDENTITY_BINDINGS, MAX_KEYS_PER_IDENTITY};
use crate::{IdentityBinding, StoreError};

#[derive(Default)]
pub struct Bindings(Mutex<Bound>);

#[derive(Default)]
struct Bound {
    by_key: HashMap<AgentKey, IdentityBinding>,
    /// The keys bound to each identity, at most `MAX_KEYS_PER_IDENTITY`.
    by_identity: HashMap<String, Vec<AgentKey>>,
}

impl Bound {
    fn unbind(&mut self, key: &AgentKey) {
        let Some(old) = self.by_key.remove(key) else {
            return;
        };
        if let Some(keys) = self.by_identity.get_mut(&old.identity) {
            keys.retain(|k| k != key);
            if keys.is_empty() {
                self.by_identity.remove(&old.identity);
            }
        }
    }
}

impl Bindings {
    /// Binds, replacing the key's earlier binding. One identity holds at
    /// most `MAX_KEYS_PER_IDENTITY` keys (binding another unbinds the one
    /// that expires first), so one workload's token cannot fill the map;
    /// full, expired bindings are dropped first, and still full the bind
    /// is refused (`Busy`), never a live binding of another dropped.
    pub fn bind(&self, binding: IdentityBinding, now_ms: i64) -> Result<(), StoreError> {
        let mut bound = self.lock();
        bound.unbind(&binding.key);
        if bound.by_key.len() >= MAX_IDENTITY_BINDINGS {
            let expired: Vec<AgentKey> = bound
                .by_key
                .values()
                .filter(|b| b.expires_at_ms <= now_ms)
                .map(|b| b.key)
                .collect();
            for key in &expired {
                bound.unbind(key);
            }
            if bound.by_key.len() >= MAX_IDENTITY_BINDINGS {
                return Err(StoreError::Busy);
            }
        }
        let keys = bound
            .by_identity
            .entry(binding.identity.clone())
            .or_default()
            .clone();
        if keys.len() >= MAX_KEYS_PER_IDENTITY {
            let first_to_expire = keys
                .iter()
                .min_by_key(|k| bound.by_key.get(*k).map_or(i64::MIN, |b| b.expires_at_ms));
            if let Some(key) = first_to_expire.copied() {
                bound.unbind(&key);
            }
        }
        bound
            .by_identity
            .entry(binding.identity.clone())
            .or_default()
            .push(binding.key);
        bound.by_key.insert(binding.key, binding);
        Ok(())
    }

    pub fn of(&self, key: &AgentKey, now_ms: i64) -> Option<IdentityBinding> {
        self.lock()
            .by_key
            .get(key)
            .filter(|b| b.expires_at_ms > now_ms)
            .cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Bound> {
        // Changed whole under the lock: a poisoned map is still a good one.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(key: u8, identity: &str, expires_at_ms: i64) -> IdentityBinding {
        IdentityBinding {
            key: [key; 32],
            identity: identity.into(),
            issuer: "spire".into(),
            expires_at_ms,
        }
    }

    #[test]
    fn one_identity_holds_a_bounded_number_of_keys() {
        let bindings = Bindings::default();
        for n in 0..MAX_KEYS_PER_IDENTITY {
            let expires = 1_000 + n as i64;
            bindings
                .bind(binding(n as u8, "spiffe://t/a", expires), 0)
                .unwrap();
        }
        bindings
            .bind(binding(250, "spiffe://t/a", 5_000), 0)
            .unwrap();
        // The one that expired first made room; the others stay.
        assert_eq!(bindings.of(&[0; 32], 0), None);
        assert!(bindings.of(&[1; 32], 0).is_some());
        assert!(bindings.of(&[250; 32], 0).is_some());
        // Rebinding a key moves it to its new identity.
        bindings.bind(binding(1, "spiffe://t/b", 5_000), 0).unwrap();
        assert_eq!(bindings.of(&[1; 32], 0).unwrap().identity, "spiffe://t/b");
    }
}
