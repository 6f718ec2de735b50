//! Per-caller limits: a broker-wide cap on some kind of work (Watch
//! streams, audit calls, judgments) and a cap per key (a caller, a
//! connection, a contract), so one client can never take all of it.
//! Taking a slot never waits: past a cap the caller is told which limit
//! (its config key or constant) it reached.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// Slots of one kind of work.
pub struct Slots<K: Hash + Eq + Clone> {
    max_total: usize,
    max_per_key: usize,
    /// The config keys named when a cap is reached.
    total_limit: &'static str,
    per_key_limit: &'static str,
    /// Slots past `max_total` kept for tenants holding few (`Reserve`).
    reserve: Reserve,
    /// (slots taken in all, slots taken per key).
    taken: Mutex<(usize, HashMap<K, usize>)>,
    /// Slots taken per tenant (only with a reserve).
    tenants: Mutex<HashMap<[u8; 32], usize>>,
}

/// A share of slots past the total that only a tenant holding fewer than
/// `small_share` slots may take: however many tenants fill the total, a
/// tenant that holds almost nothing still gets in (until as many more
/// tenants fill the reserve too).
#[derive(Clone, Copy, Debug, Default)]
pub struct Reserve {
    pub slots: usize,
    pub small_share: usize,
}

/// A taken slot, given back when dropped.
pub struct Slot<K: Hash + Eq + Clone> {
    slots: Arc<Slots<K>>,
    key: K,
    tenant: Option<[u8; 32]>,
}

impl<K: Hash + Eq + Clone> Slots<K> {
    pub fn new(
        max_total: usize,
        total_limit: &'static str,
        max_per_key: usize,
        per_key_limit: &'static str,
    ) -> Arc<Self> {
        Self::with_reserve(
            max_total,
            total_limit,
            max_per_key,
            per_key_limit,
            Reserve::default(),
        )
    }

    /// `new`, with `reserve` slots past the total for small tenants
    /// (`take_for`).
    pub fn with_reserve(
        max_total: usize,
        total_limit: &'static str,
        max_per_key: usize,
        per_key_limit: &'static str,
        reserve: Reserve,
    ) -> Arc<Self> {
        Arc::new(Self {
            max_total,
            max_per_key,
            total_limit,
            per_key_limit,
            reserve,
            taken: Mutex::default(),
            tenants: Mutex::default(),
        })
    }

    /// Takes a slot for `key`, or names the cap that is reached.
    pub fn take(self: &Arc<Self>, key: K) -> Result<Slot<K>, &'static str> {
        self.take_in(key, None)
    }

    /// Takes a slot for `key` of `tenant`: past the total, from the
    /// reserve while the tenant holds fewer than its small share.
    pub fn take_for(self: &Arc<Self>, key: K, tenant: [u8; 32]) -> Result<Slot<K>, &'static str> {
        self.take_in(key, Some(tenant))
    }

    fn take_in(
        self: &Arc<Self>,
        key: K,
        tenant: Option<[u8; 32]>,
    ) -> Result<Slot<K>, &'static str> {
        // Lock order: tenants, then taken (also on drop).
        let mut tenants = self
            .tenants
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut taken = self.lock();
        let held = tenant.map_or(usize::MAX, |t| tenants.get(&t).copied().unwrap_or(0));
        let cap = if held < self.reserve.small_share {
            self.max_total.saturating_add(self.reserve.slots)
        } else {
            self.max_total
        };
        if taken.0 >= cap {
            return Err(self.total_limit);
        }
        let mine = taken.1.entry(key.clone()).or_insert(0);
        if *mine >= self.max_per_key {
            return Err(self.per_key_limit);
        }
        *mine += 1;
        taken.0 += 1;
        if let Some(t) = tenant {
            *tenants.entry(t).or_insert(0) += 1;
        }
        Ok(Slot {
            slots: self.clone(),
            key,
            tenant,
        })
    }

    /// Slots taken in all (for tests).
    pub fn taken(&self) -> usize {
        self.lock().0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, HashMap<K, usize>)> {
        // Counts are updated in single steps: a poisoned lock still holds
        // consistent ones.
        self.taken
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl<K: Hash + Eq + Clone> Drop for Slot<K> {
    fn drop(&mut self) {
        let mut tenants = self
            .slots
            .tenants
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(t) = self.tenant
            && let Some(held) = tenants.get_mut(&t)
        {
            *held = held.saturating_sub(1);
            if *held == 0 {
                tenants.remove(&t);
            }
        }
        let mut taken = self.slots.lock();
        taken.0 = taken.0.saturating_sub(1);
        if let Some(mine) = taken.1.get_mut(&self.key) {
            *mine = mine.saturating_sub(1);
            if *mine == 0 {
                // Entries go with their last slot: the map holds only
                // callers with work running, never every caller ever seen.
                taken.1.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_hold_per_key_and_in_all_and_slots_come_back() {
        let slots = Slots::new(3, "total", 2, "per key");
        let a1 = slots.take('a').unwrap();
        let _a2 = slots.take('a').unwrap();
        assert!(matches!(slots.take('a'), Err("per key")));
        let _b1 = slots.take('b').unwrap();
        assert!(matches!(slots.take('c'), Err("total")));
        drop(a1);
        assert_eq!(slots.taken(), 2);
        let _c1 = slots.take('c').unwrap();
        assert!(matches!(slots.take('a'), Err("total")));
    }

    #[test]
    fn a_key_is_forgotten_with_its_last_slot() {
        let slots = Slots::new(10, "total", 1, "per key");
        for _ in 0..100 {
            drop(slots.take(7u32).unwrap());
        }
        assert_eq!(slots.taken(), 0);
        assert!(slots.lock().1.is_empty());
    }

    /// 32 tenants fill the total; one that holds nothing still gets in,
    /// from the reserve, up to its small share; a full reserve is full.
    #[test]
    fn a_small_tenant_gets_in_past_a_full_total() {
        let reserve = Reserve {
            slots: 4,
            small_share: 2,
        };
        let slots = Slots::with_reserve(64, "total", 64, "per key", reserve);
        let mut held = Vec::new();
        for t in 0..32u8 {
            for _ in 0..2 {
                held.push(slots.take_for(t, [t; 32]).unwrap());
            }
        }
        assert!(matches!(slots.take_for(0, [0; 32]), Err("total")));
        let victim = [99; 32];
        let a = slots.take_for(99, victim).unwrap();
        let _b = slots.take_for(99, victim).unwrap();
        assert!(
            matches!(slots.take_for(99, victim), Err("total")),
            "past its small share"
        );
        drop(a);
        let _c = slots.take_for(99, victim).unwrap();
        for t in 100..102u8 {
            slots
                .take_for(t, [t; 32])
                .map(|s| held.push(s))
                .unwrap_or_else(|_| panic!("{t}"));
        }
        assert!(
            matches!(slots.take_for(103, [103; 32]), Err("total")),
            "the reserve is full"
        );
        drop(held);
        assert_eq!(slots.taken(), 2);
        assert_eq!(slots.tenants.lock().unwrap().len(), 1);
    }
}
