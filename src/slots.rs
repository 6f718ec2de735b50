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
    /// (slots taken in all, slots taken per key).
    taken: Mutex<(usize, HashMap<K, usize>)>,
}

/// A taken slot, given back when dropped.
pub struct Slot<K: Hash + Eq + Clone> {
    slots: Arc<Slots<K>>,
    key: K,
}

impl<K: Hash + Eq + Clone> Slots<K> {
    pub fn new(
        max_total: usize,
        total_limit: &'static str,
        max_per_key: usize,
        per_key_limit: &'static str,
    ) -> Arc<Self> {
        Arc::new(Self {
            max_total,
            max_per_key,
            total_limit,
            per_key_limit,
            taken: Mutex::default(),
        })
    }

    /// Takes a slot for `key`, or names the cap that is reached.
    pub fn take(self: &Arc<Self>, key: K) -> Result<Slot<K>, &'static str> {
        let mut taken = self.lock();
        if taken.0 >= self.max_total {
            return Err(self.total_limit);
        }
        let mine = taken.1.entry(key.clone()).or_insert(0);
        if *mine >= self.max_per_key {
            return Err(self.per_key_limit);
        }
        *mine += 1;
        taken.0 += 1;
        Ok(Slot {
            slots: self.clone(),
            key,
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
}
