//! Which trees changed since a point (`TreeChanges`): Watch streams skip
//! unchanged trees, and readers remember what they read of a tree until
//! it changes.

use broker_domain::Id;

use crate::limits;

/// The last event (contract or receipt) sequence number the writer gave
/// each tree it touched recently, by root id: lets a Watch stream that was
/// woken by a commit skip its query when its tree did not change (800 idle
/// watchers each re-ran a recursive subtree query at every commit), and
/// lets what was read of a tree be remembered until it changes
/// (`settled_version`). For Watch, a hint only: an unknown tree counts as
/// changed, so forgetting (the map is cleared past `MAX_TRACKED_TREES`)
/// costs a query, never an event. For versions, an unknown tree keeps its
/// version until it is touched or the map is cleared (a clearing is a new
/// generation, so no version of before it comes back).
#[derive(Clone, Default)]
pub struct TreeChanges(std::sync::Arc<std::sync::Mutex<Trees>>);

#[derive(Default)]
struct Trees {
    /// With replicas: when the sequencer last read every other replica's
    /// events (`polled`); `None` before its first complete poll.
    polled_at: Option<std::time::Instant>,
    /// Other writers exist, seen only through those polls.
    polled_by_sequencer: bool,
    last: std::collections::HashMap<Id, i64>,
    /// Bumped at each clearing: a version names the map it was read from.
    generation: u64,
    /// The highest seq touched before the last clearing: what a tree the
    /// map no longer names may have had.
    cleared_through: i64,
    highest: i64,
    /// Every touch up to this seq has committed (`committed`).
    committed_through: i64,
}

/// What had committed at one moment (`TreeChanges::committed_mark`): a
/// read begun after it shows every event up to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommittedMark {
    generation: u64,
    through: i64,
}

/// A tree's state as `TreeChanges` knows it: equal versions, no event in
/// between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeVersion {
    generation: u64,
    last: Option<i64>,
}

impl TreeChanges {
    /// For a store other replicas write to as well: its trees are
    /// `current` only while the sequencer's polls keep up.
    pub fn polled_by_sequencer() -> Self {
        let changes = Self::default();
        changes.lock().polled_by_sequencer = true;
        changes
    }

    /// The sequencer has just read every event placed so far.
    pub fn polled(&self) {
        self.lock().polled_at = Some(std::time::Instant::now());
    }

    /// Whether every event committed until a moment ago is known here:
    /// always with one writer; with replicas, while the sequencer's last
    /// complete poll is at most `MAX_POLL_AGE` old.
    pub fn current(&self) -> bool {
        let trees = self.lock();
        !trees.polled_by_sequencer
            || trees
                .polled_at
                .is_some_and(|at| at.elapsed() <= limits::postgres::MAX_POLL_AGE)
    }

    /// Records that `root`'s tree got event `seq`, before its transaction
    /// commits (SQLite) or after (PostgreSQL); streams are woken only once
    /// it is durable.
    pub fn touch(&self, root: Id, seq: i64) {
        let mut trees = self.lock();
        if trees.last.len() >= limits::MAX_TRACKED_TREES && !trees.last.contains_key(&root) {
            trees.cleared_through = trees.highest;
            trees.generation += 1;
            trees.last.clear();
        }
        let last = trees.last.entry(root).or_insert(seq);
        *last = (*last).max(seq);
        trees.highest = trees.highest.max(seq);
    }

    /// Every touch so far has committed (the writer calls it after each
    /// commit; touches made after commit are followed by it at once).
    pub fn committed(&self) {
        let mut trees = self.lock();
        trees.committed_through = trees.highest;
    }

    /// Whether `root`'s tree may have an event after `cursor`.
    pub fn changed_since(&self, root: &Id, cursor: i64) -> bool {
        self.lock().last.get(root).is_none_or(|last| *last > cursor)
    }

    /// `root`'s version now.
    pub fn version(&self, root: &Id) -> TreeVersion {
        let trees = self.lock();
        TreeVersion {
            generation: trees.generation,
            last: trees.last.get(root).copied(),
        }
    }

    /// The versions of several trees, under one lock: a stream's scan
    /// looks at thousands.
    pub fn versions<'a>(&self, roots: impl IntoIterator<Item = &'a Id>) -> Vec<TreeVersion> {
        let trees = self.lock();
        roots
            .into_iter()
            .map(|root| TreeVersion {
                generation: trees.generation,
                last: trees.last.get(root).copied(),
            })
            .collect()
    }

    /// `root`'s version when every event it may name has committed, so a
    /// read begun after this call shows the tree as of this version or
    /// later: while `version` still returns it, what that read showed
    /// still holds. `None` while an event of the tree may be committing.
    pub fn settled_version(&self, root: &Id) -> Option<TreeVersion> {
        let trees = self.lock();
        let last = trees.last.get(root).copied();
        (last.unwrap_or(trees.cleared_through) <= trees.committed_through).then_some(TreeVersion {
            generation: trees.generation,
            last,
        })
    }

    /// Every event committed now, for a read about to begin whose tree is
    /// not known yet (`settled_since`).
    pub fn committed_mark(&self) -> CommittedMark {
        let trees = self.lock();
        CommittedMark {
            generation: trees.generation,
            through: trees.committed_through,
        }
    }

    /// `settled_version` for a read begun after `mark`, asked once the
    /// read has named its tree: `Some` when no event of `root` came after
    /// the mark (so the read showed the tree as of this version or later),
    /// else `None` (read it again at the next look).
    pub fn settled_since(&self, root: &Id, mark: CommittedMark) -> Option<TreeVersion> {
        let trees = self.lock();
        let last = trees.last.get(root).copied();
        (trees.generation == mark.generation
            && last.unwrap_or(trees.cleared_through) <= mark.through)
            .then_some(TreeVersion {
                generation: trees.generation,
                last,
            })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Trees> {
        // Single-step updates: a poisoned map is still a correct hint.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_settles_once_its_touches_commit_and_moves_with_each_touch() {
        let trees = TreeChanges::default();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let quiet = trees.settled_version(&a).expect("nothing is committing");
        trees.touch(a, 5);
        assert_eq!(
            trees.settled_version(&a),
            None,
            "seq 5 may still be committing"
        );
        assert_ne!(trees.version(&a), quiet);
        trees.committed();
        let settled = trees.settled_version(&a).expect("committed");
        assert_eq!(settled, trees.version(&a));
        // Another tree's event leaves this one's version alone, and while
        // it commits this tree is still settled.
        trees.touch(b, 6);
        assert_eq!(trees.settled_version(&a), Some(settled));
        assert_eq!(trees.settled_version(&b), None);
        trees.touch(a, 7);
        assert_ne!(trees.version(&a), settled);
    }

    #[test]
    fn a_read_begun_after_a_mark_is_settled_only_if_its_tree_got_nothing_since() {
        let trees = TreeChanges::default();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        trees.touch(a, 1);
        trees.committed();
        let mark = trees.committed_mark();
        // Another tree's event after the mark leaves `a` settled.
        trees.touch(b, 2);
        assert_eq!(trees.settled_since(&a, mark), Some(trees.version(&a)));
        assert_eq!(trees.settled_since(&b, mark), None, "seq 2 came after");
        trees.committed();
        assert_eq!(
            trees.settled_since(&b, mark),
            None,
            "committed after the mark: the read may not show it"
        );
        // A touch of `a` after the mark, committed or not, unsettles it.
        trees.touch(a, 3);
        assert_eq!(trees.settled_since(&a, mark), None);
        trees.committed();
        assert_eq!(trees.settled_since(&a, mark), None);
        let later = trees.committed_mark();
        assert_eq!(trees.settled_since(&a, later), trees.settled_version(&a));
        // A tree never touched is settled as of the last clearing.
        assert!(trees.settled_since(&[9u8; 32], later).is_some());
    }

    #[test]
    fn a_mark_taken_before_a_clearing_settles_nothing() {
        let trees = TreeChanges::default();
        let a = [1u8; 32];
        trees.touch(a, 1);
        trees.committed();
        let mark = trees.committed_mark();
        // A clearing whose forgotten trees all lie within the mark: only
        // the generation tells that `a`'s version is not the one read.
        for n in 0..limits::MAX_TRACKED_TREES {
            let mut root = [0u8; 32];
            root[..8].copy_from_slice(&(n as u64 + 10).to_le_bytes());
            trees.touch(root, 1);
        }
        trees.committed();
        assert_eq!(trees.settled_since(&a, mark), None);
        assert!(trees.settled_since(&a, trees.committed_mark()).is_some());
    }

    #[test]
    fn a_tree_forgotten_by_a_clearing_is_not_settled_before_the_clearing_commits() {
        let trees = TreeChanges::default();
        let a = [1u8; 32];
        trees.touch(a, 1);
        trees.committed();
        let before = trees.settled_version(&a).unwrap();
        // Filling the map clears it: `a`'s last touch (uncommitted, seq
        // 2) is forgotten with it.
        trees.touch(a, 2);
        for n in 0..limits::MAX_TRACKED_TREES {
            let mut root = [0u8; 32];
            root[..8].copy_from_slice(&(n as u64 + 10).to_le_bytes());
            trees.touch(root, 3);
        }
        assert_ne!(trees.version(&a), before, "a clearing is a new version");
        assert_eq!(trees.settled_version(&a), None, "seq 2 may be committing");
        trees.committed();
        assert!(trees.settled_version(&a).is_some());
    }
}
