//! Keys bound to workload identities (BindIdentity). A single broker on
//! SQLite keeps them here, in memory: a binding lives no longer than the
//! token that proved it (minutes to hours), and an agent binds again
//! after a restart. Replicas on PostgreSQL share a table instead
//! (`postgres::identities`).

use std::collections::HashMap;
use std::sync::Mutex;

use broker_domain::AgentKey;

use crate::limits::MAX_IDENTITY_BINDINGS;
use crate::{IdentityBinding, StoreError};

#[derive(Default)]
pub struct Bindings(Mutex<HashMap<AgentKey, IdentityBinding>>);

impl Bindings {
    /// Binds, replacing the key's earlier binding. Full, expired bindings
    /// are dropped first; still full, the bind is refused (`Busy`), never
    /// a live binding dropped.
    pub fn bind(&self, binding: IdentityBinding, now_ms: i64) -> Result<(), StoreError> {
        let mut bound = self.lock();
        if bound.len() >= MAX_IDENTITY_BINDINGS && !bound.contains_key(&binding.key) {
            bound.retain(|_, b| b.expires_at_ms > now_ms);
            if bound.len() >= MAX_IDENTITY_BINDINGS {
                return Err(StoreError::Busy);
            }
        }
        bound.insert(binding.key, binding);
        Ok(())
    }

    pub fn of(&self, key: &AgentKey, now_ms: i64) -> Option<IdentityBinding> {
        self.lock()
            .get(key)
            .filter(|b| b.expires_at_ms > now_ms)
            .cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<AgentKey, IdentityBinding>> {
        // Entries are inserted whole: a poisoned map is still a good one.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
