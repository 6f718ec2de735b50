//! The request keys (agent, nonce) the writer committed most recently, as
//! fingerprints. A batch none of whose keys is here is planned without
//! reading the request log first: that saves the writer a round trip to
//! SQLite per batch. The set is only a hint. A key that is missing (evicted,
//! or committed before a restart) still cannot be answered twice: its
//! request-log row makes the batch's insert fail, and the writer redoes
//! the batch the careful way (see `sqlite::apply_batch`).

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

use crate::core::limits::MAX_NONCE_BYTES;

/// Fingerprints kept: about a minute of traffic at 4,000 requests/s, in
/// about 8 MiB. Retries of older requests take the slower path, which is
/// still exact.
pub const MAX_RECENT_REQUESTS: usize = 1 << 18;

/// Recently committed request keys, oldest evicted first.
pub struct RecentRequests {
    /// Random per process, so nobody can aim for collisions (which would
    /// only cost them the slower path anyway).
    hasher: RandomState,
    /// Fingerprint → how many entries of `order` hold it.
    counts: HashMap<u64, u32>,
    /// Fingerprints in insertion order, for eviction.
    order: VecDeque<u64>,
    /// Most entries held.
    capacity: usize,
}

impl RecentRequests {
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0, "a recent-request set needs room");
        Self {
            hasher: RandomState::new(),
            counts: HashMap::new(),
            order: VecDeque::new(),
            capacity,
        }
    }

    fn fingerprint(&self, agent: &[u8; 32], nonce: &[u8]) -> u64 {
        debug_assert!(nonce.len() <= MAX_NONCE_BYTES);
        self.hasher.hash_one((agent, nonce))
    }

    /// False only if the key was not committed recently (or was evicted);
    /// true may also be a fingerprint collision.
    pub fn may_contain(&self, agent: &[u8; 32], nonce: &[u8]) -> bool {
        self.counts.contains_key(&self.fingerprint(agent, nonce))
    }

    /// Records a committed key, evicting the oldest beyond capacity.
    pub fn insert(&mut self, agent: &[u8; 32], nonce: &[u8]) {
        let fingerprint = self.fingerprint(agent, nonce);
        *self.counts.entry(fingerprint).or_insert(0) += 1;
        self.order.push_back(fingerprint);
        while self.order.len() > self.capacity {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(count) = self.counts.get_mut(&oldest) {
                *count -= 1;
                if *count == 0 {
                    self.counts.remove(&oldest);
                }
            }
        }
        debug_assert!(self.order.len() <= self.capacity);
        debug_assert!(self.counts.len() <= self.order.len());
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_committed_keys_and_evicts_the_oldest() {
        let mut recent = RecentRequests::new(3);
        let agent = [7u8; 32];
        assert!(!recent.may_contain(&agent, b"n1"));
        for nonce in [b"n1", b"n2", b"n3"] {
            recent.insert(&agent, nonce);
        }
        assert!(recent.may_contain(&agent, b"n1"));
        assert!(!recent.may_contain(&[8u8; 32], b"n1"), "keyed by agent too");
        recent.insert(&agent, b"n4");
        assert_eq!(recent.len(), 3);
        assert!(!recent.may_contain(&agent, b"n1"), "oldest evicted");
        assert!(recent.may_contain(&agent, b"n4"));
    }

    #[test]
    fn a_key_inserted_twice_survives_the_eviction_of_its_first_entry() {
        let mut recent = RecentRequests::new(2);
        let agent = [1u8; 32];
        recent.insert(&agent, b"a");
        recent.insert(&agent, b"a");
        recent.insert(&agent, b"b");
        // The first "a" is gone, the second is still held.
        assert!(recent.may_contain(&agent, b"a"));
        recent.insert(&agent, b"c");
        assert!(!recent.may_contain(&agent, b"a"));
        assert!(recent.may_contain(&agent, b"b") && recent.may_contain(&agent, b"c"));
    }
}
