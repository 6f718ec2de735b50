//! The parents' chains the egress keeps (`Gateway::chain_below`): a chain
//! never changes, so each parent's is read once, within a bound on count
//! and bytes.

use std::collections::HashMap;
use std::sync::Arc;

use broker_domain::Id;
use broker_wire::pb;

/// Parents whose chains are kept.
const MAX_KEPT_CHAINS: usize = 256;
/// Bytes of chains kept: a signed contract is usually a few hundred bytes,
/// but its texts, scope and schema may make it tens of KiB, and a chain
/// holds up to the broker's depth ceiling of them.
const MAX_KEPT_CHAIN_BYTES: usize = 16 * 1024 * 1024;
/// A chain larger than this is used once and not kept.
const MAX_KEPT_CHAIN_BYTES_EACH: usize = MAX_KEPT_CHAIN_BYTES / 16;

/// Parents' chains (their signed contracts) and their encoded bytes.
#[derive(Default)]
pub(crate) struct KeptChains {
    by_parent: HashMap<Id, (Arc<Vec<pb::ContractState>>, usize)>,
    bytes: usize,
}

impl KeptChains {
    pub(crate) fn get(&self, parent: &Id) -> Option<Arc<Vec<pb::ContractState>>> {
        self.by_parent.get(parent).map(|(chain, _)| chain.clone())
    }

    /// Keeps `parent`'s chain unless it is larger than
    /// `MAX_KEPT_CHAIN_BYTES_EACH`; past either bound everything kept is
    /// forgotten first (which ones go matters little: a dropped one is
    /// read again).
    pub(crate) fn keep(&mut self, parent: Id, chain: Arc<Vec<pb::ContractState>>) {
        let bytes: usize = chain.iter().map(prost::Message::encoded_len).sum();
        if bytes > MAX_KEPT_CHAIN_BYTES_EACH {
            return;
        }
        // Two first reads of one parent at once: the second replaces the first.
        if let Some((_, old)) = self.by_parent.remove(&parent) {
            self.bytes -= old;
        }
        if self.by_parent.len() >= MAX_KEPT_CHAINS || self.bytes + bytes > MAX_KEPT_CHAIN_BYTES {
            *self = Self::default();
        }
        self.by_parent.insert(parent, (chain, bytes));
        self.bytes += bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain of one hop whose signed contract has `payload` bytes.
    fn chain(payload: usize) -> Arc<Vec<pb::ContractState>> {
        Arc::new(vec![pb::ContractState {
            contract_id: vec![1; 32],
            contract: Some(pb::Sealed {
                payload: vec![0; payload],
                ..Default::default()
            }),
            ..Default::default()
        }])
    }

    fn id(n: usize) -> Id {
        let mut id = [0u8; 32];
        id[..8].copy_from_slice(&(n as u64).to_le_bytes());
        id
    }

    #[test]
    fn chains_are_kept_within_their_count_and_bytes() {
        let mut kept = KeptChains::default();
        for n in 0..MAX_KEPT_CHAINS {
            kept.keep(id(n), chain(100));
        }
        assert!(kept.get(&id(0)).is_some());
        // One more than the count: everything before is forgotten.
        kept.keep(id(MAX_KEPT_CHAINS), chain(100));
        assert!(kept.get(&id(0)).is_none());
        assert!(kept.get(&id(MAX_KEPT_CHAINS)).is_some());

        // A chain over the bound for one is never kept.
        let mut kept = KeptChains::default();
        kept.keep(id(1), chain(MAX_KEPT_CHAIN_BYTES_EACH + 1));
        assert!(kept.get(&id(1)).is_none());

        // Past the bytes in all, everything before is forgotten.
        let each = MAX_KEPT_CHAIN_BYTES_EACH - 64;
        let fit = MAX_KEPT_CHAIN_BYTES / MAX_KEPT_CHAIN_BYTES_EACH;
        for n in 0..fit {
            kept.keep(id(n), chain(each));
        }
        assert!(kept.get(&id(0)).is_some());
        assert!(kept.bytes <= MAX_KEPT_CHAIN_BYTES);
        kept.keep(id(fit), chain(each));
        assert!(kept.get(&id(0)).is_none());
        assert!(kept.bytes <= MAX_KEPT_CHAIN_BYTES);
    }

    #[test]
    fn a_chain_kept_again_is_counted_once() {
        let mut kept = KeptChains::default();
        kept.keep(id(1), chain(100));
        let once = kept.bytes;
        kept.keep(id(1), chain(100));
        assert_eq!(kept.bytes, once);
        assert_eq!(kept.by_parent.len(), 1);
    }
}
