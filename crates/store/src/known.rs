//! The writer's cache of the contracts it decides on: each as the writer
//! knows it (immutable facts, current status and ledger) and the row
//! version it was loaded at, bounded in entries and bytes, swapped out by
//! generations so a large cache is freed off the writer.

use std::collections::HashMap;
use std::sync::Arc;

use super::limits::{MAX_CACHED_CONTRACT_BYTES, MAX_CACHED_CONTRACTS};
use broker_domain::{Id, ParentView};
use broker_wire::pb;

/// A contract as the writer knows it: immutable facts plus current status
/// and ledger (both inside `view`).
#[derive(Clone, Debug)]
pub struct Known {
    /// Issuance sequence number (the row key).
    pub seq: i64,
    pub view: ParentView,
    pub root_id: Id,
    pub root_seq: i64,
    /// The decoded signed contract (what the cache holds it for is
    /// charged by its encoded size).
    pub contract: Arc<pb::Contract>,
    /// The row as a writer of this store last wrote it, when one did (on
    /// PostgreSQL: an optimistic issuance checks it is still so); `None`
    /// for a row only read, and always on SQLite.
    pub version: Option<RowVersion>,
}

/// A contract row's version as a writer of a PostgreSQL store wrote (or
/// locked and read) it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowVersion {
    /// The transaction's id that wrote it: PostgreSQL's `xmin` of the row.
    pub xid: u32,
    /// Every number above this one was taken after that transaction
    /// locked the row: an optimistic issuance numbers its children so.
    pub after: i64,
    /// When it was written (an old one is not trusted: ids wrap).
    pub at_ms: i64,
}

/// The writer's contracts by id, with what they cost in memory: each
/// entry is charged its contract's encoded size plus
/// `KNOWN_ENTRY_OVERHEAD_BYTES` when inserted, so the cache can be bounded
/// in bytes (a deep chain with long texts makes a contract tens of KiB).
///
/// Bounded by generations rather than by clearing: entries go to `young`;
/// once it holds half the bound (in count or bytes), `turn_if_full` makes
/// it `old` and frees the old `old` on a thread of its own. An entry
/// changed again (a parent a batch reserves from) moves back to `young`,
/// so a live chain stays cached. Nothing turns but `turn_if_full`, which
/// backends call before they look a batch's parents up, so whatever a
/// batch found or loaded stays until its plan is done (the map can exceed
/// its bound by one batch). Clearing at the bound froze every request thread
/// (they read this map under the same lock) for 20–180 ms while the
/// writer freed 65,536 decoded contracts, and the map's growth rehashed
/// tens of MiB under the lock (BENCHMARKS.md).
pub struct KnownMap {
    young: Generation,
    old: Generation,
    /// Entries and bytes at which `young` turns old.
    turn_at: (usize, usize),
}

/// One generation of `KnownMap`: its entries and what they were charged.
#[derive(Default)]
struct Generation {
    entries: HashMap<Id, (Known, usize)>,
    bytes: usize,
}

/// A `Known` beside its contract: the view, ids, the hash-map slot.
pub const KNOWN_ENTRY_OVERHEAD_BYTES: usize = 512;

/// Generations up to this many entries are freed by the caller (well
/// under a millisecond), larger ones on a thread of their own (`retire`).
const FREED_INLINE_ENTRIES: usize = 1_024;

impl Default for KnownMap {
    /// Bounded by `MAX_CACHED_CONTRACTS` and `MAX_CACHED_CONTRACT_BYTES`,
    /// both generations together.
    fn default() -> Self {
        KnownMap::bounded(MAX_CACHED_CONTRACTS, MAX_CACHED_CONTRACT_BYTES)
    }
}

impl KnownMap {
    /// The writer's cache: its first generation sized for the bound, so
    /// it does not rehash tens of MiB under the lock as it fills (only
    /// the table's control bytes are written until entries arrive).
    pub fn preallocated() -> Self {
        let mut map = KnownMap::default();
        map.young.entries.reserve(map.turn_at.0);
        map
    }

    /// At most `max_entries` entries and `max_bytes` charged, both
    /// generations together (and one generation being freed), plus what
    /// one batch adds.
    pub fn bounded(max_entries: usize, max_bytes: usize) -> Self {
        KnownMap {
            young: Generation::default(),
            old: Generation::default(),
            turn_at: ((max_entries / 2).max(1), (max_bytes / 2).max(1)),
        }
    }

    /// Marks a known contract as ending or not (`ParentView::ending`):
    /// decided per batch by the backend, which knows the drains.
    pub fn set_ending(&mut self, id: &Id, ending: bool) {
        if let Some(known) = self.get_mut(id) {
            known.view.ending = ending;
        }
    }

    pub fn get(&self, id: &Id) -> Option<&Known> {
        self.young
            .entries
            .get(id)
            .or_else(|| self.old.entries.get(id))
            .map(|(known, _)| known)
    }

    /// For status and ledger changes; the contract itself is immutable.
    /// A changed entry is in use: it moves back to the young generation.
    pub fn get_mut(&mut self, id: &Id) -> Option<&mut Known> {
        if let Some((known, cost)) = self.old.remove(id) {
            self.young.insert(*id, known, cost);
        }
        self.young.entries.get_mut(id).map(|(known, _)| known)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&Id, &Known)> {
        self.young
            .entries
            .iter()
            .chain(self.old.entries.iter())
            .map(|(id, (known, _))| (id, known))
    }

    pub fn contains_key(&self, id: &Id) -> bool {
        self.young.entries.contains_key(id) || self.old.entries.contains_key(id)
    }

    pub fn insert(&mut self, id: Id, known: Known) {
        use prost::Message;
        let cost = known.contract.encoded_len() + KNOWN_ENTRY_OVERHEAD_BYTES;
        self.old.remove(&id);
        self.young.insert(id, known, cost);
    }

    pub fn remove(&mut self, id: &Id) -> Option<Known> {
        let young = self.young.remove(id);
        let old = self.old.remove(id);
        young.or(old).map(|(known, _)| known)
    }

    pub fn len(&self) -> usize {
        self.young.entries.len() + self.old.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the entries were charged in all.
    pub fn bytes(&self) -> usize {
        self.young.bytes + self.old.bytes
    }

    /// Forgets everything; the entries are freed off the caller's thread.
    /// The young generation keeps its table's size (no rehash as it
    /// fills again).
    pub fn clear(&mut self) {
        let young = Generation {
            entries: HashMap::with_capacity(self.young.entries.capacity()),
            bytes: 0,
        };
        retire(std::mem::replace(&mut self.young, young));
        retire(std::mem::take(&mut self.old));
    }

    /// Turns the young generation old if it holds half the bound, and
    /// frees the old one (off this thread). Call it only between batches.
    pub fn turn_if_full(&mut self) {
        let (max_entries, max_bytes) = self.turn_at;
        if self.young.entries.len() < max_entries && self.young.bytes < max_bytes {
            return;
        }
        // Sized as the generation it follows: no rehash while it fills.
        let capacity = self.young.entries.len().min(max_entries);
        let young = Generation {
            entries: HashMap::with_capacity(capacity),
            bytes: 0,
        };
        let old = std::mem::replace(&mut self.young, young);
        retire(std::mem::replace(&mut self.old, old));
    }
}

impl Generation {
    fn insert(&mut self, id: Id, known: Known, cost: usize) {
        if let Some((_, old_cost)) = self.entries.insert(id, (known, cost)) {
            self.bytes -= old_cost;
        }
        self.bytes += cost;
    }

    fn remove(&mut self, id: &Id) -> Option<(Known, usize)> {
        let (known, cost) = self.entries.remove(id)?;
        self.bytes -= cost;
        Some((known, cost))
    }
}

/// Frees a generation on a thread of its own: the caller holds the
/// cache's lock, and freeing tens of thousands of decoded contracts takes
/// tens of milliseconds. At most one generation turns per
/// `MAX_CACHED_CONTRACTS / 2` insertions; a small one (a cache cleared
/// after a failed batch, say) is freed here, not by a thread per batch.
/// Where no thread can be started, it is freed here too.
fn retire(generation: Generation) {
    if generation.entries.len() <= FREED_INLINE_ENTRIES {
        return;
    }
    let free = move || drop(generation);
    // On failure `spawn` drops the closure, and the generation with it.
    let _ = std::thread::Builder::new()
        .name("cache-free".into())
        .spawn(free);
}
