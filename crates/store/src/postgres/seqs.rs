//! The numbers a writer's transactions take from the `seqs` sequence:
//! reserved after the rows they depend on are locked (`Reserved`), and
//! the ones an optimistic issuance takes, reserved by the statement
//! before it (`Prefetched`).

use super::*;
use crate::limits::postgres::MAX_PREFETCHED_AGE;

/// Numbers `nextval('seqs')` reserved for one transaction, in increasing
/// order, taken after the rows they depend on are locked (so the children
/// of one parent are numbered in commit order, a child after its parent).
#[derive(Default)]
pub(crate) struct Reserved {
    /// Not yet taken, in increasing order.
    pub(super) left: std::collections::VecDeque<i64>,
    /// Every number handed out: the events this transaction writes.
    pub(super) taken: Vec<i64>,
}

/// The statement of `Reserved::reserve`: `$1` numbers.
pub(super) const RESERVE: &str = "SELECT nextval('seqs') FROM generate_series(1, $1)";

/// The drains of a batch's trees and its numbers, in one round trip after
/// the parents' statement: `$1` the parents' root seqs, `$2` how many
/// numbers. Drain rows have a root; number rows a NULL one. Not folded
/// into the parents' statement: in READ COMMITTED a statement's snapshot
/// is taken before its lock waits, so a drain committed while that
/// statement waited for a parent's lock would be missed; this statement's
/// snapshot is taken after every parent is locked. The numbers are taken
/// after the locks too (see `Reserved`).
pub(super) const DRAINS_AND_NUMBERS: &str = "SELECT root_seq, target_seq AS seq FROM draining WHERE root_seq = ANY($1) \
     UNION ALL SELECT NULL, nextval('seqs') FROM generate_series(1, $2)";

impl Reserved {
    /// Reads the drains of `roots` (root seq, draining contract's seq) and
    /// reserves `count` numbers (`DRAINS_AND_NUMBERS`).
    pub(super) async fn drains_and_reserve(
        &mut self,
        conn: &mut PgConnection,
        roots: &[i64],
        count: usize,
    ) -> Result<Vec<(i64, i64)>, sqlx::Error> {
        let rows: Vec<(Option<i64>, i64)> = sqlx::query_as(DRAINS_AND_NUMBERS)
            .bind(roots)
            .bind(i64::try_from(count).unwrap_or(i64::MAX))
            .fetch_all(&mut *conn)
            .await?;
        let mut drains = Vec::new();
        let mut seqs = Vec::with_capacity(count);
        for (root, seq) in rows {
            match root {
                Some(root) => drains.push((root, seq)),
                None => seqs.push(seq),
            }
        }
        seqs.sort_unstable();
        self.left.extend(seqs);
        Ok(drains)
    }

    pub(super) async fn reserve(
        &mut self,
        conn: &mut PgConnection,
        count: usize,
    ) -> Result<(), sqlx::Error> {
        if count == 0 {
            return Ok(());
        }
        let mut seqs: Vec<i64> = sqlx::query_scalar(RESERVE)
            .bind(i64::try_from(count).unwrap_or(i64::MAX))
            .fetch_all(&mut *conn)
            .await?;
        seqs.sort_unstable();
        self.left.extend(seqs);
        Ok(())
    }
}

impl batch::SeqSource for Reserved {
    fn take(&mut self) -> i64 {
        // Callers reserve exactly what they take (one number per issuance
        // command, one per receipt of a decision). Should that ever fail,
        // a number no row has is handed out: the insert of a second one
        // fails the transaction, nothing is written twice.
        let seq = self.left.pop_front().unwrap_or_else(|| {
            tracing::error!("a transaction took more numbers than it reserved");
            i64::MIN + i64::try_from(self.taken.len()).unwrap_or(0)
        });
        self.taken.push(seq);
        seq
    }
}

/// Numbers issuance statements reserved (after their locks) for the
/// optimistic issuances that follow, shared by a replica's writers and
/// handed out in increasing order: each above every number an answered
/// issuance of this replica used, so a root opened after another's answer
/// is numbered after it (roots are listed by number). Unused for
/// `MAX_PREFETCHED_AGE` they are dropped: a replica that was idle takes
/// fresh numbers, not ones older than what other replicas gave since.
#[derive(Default)]
pub(super) struct Prefetched {
    left: std::collections::VecDeque<i64>,
    /// The highest number handed out, or used by a committed issuance.
    last: i64,
    /// When `left` was reserved.
    at: Option<std::time::Instant>,
}

impl Prefetched {
    /// After an issuance committed having used numbers up to `used_max`:
    /// `numbers` (in order, reserved by its statement) replace those left
    /// unless a later statement's already did.
    pub(super) fn refill(&mut self, numbers: &[i64], used_max: i64) {
        self.last = self.last.max(used_max);
        let newer = match (numbers.first(), self.left.back()) {
            (Some(first), Some(back)) => first > back,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if newer {
            self.left = numbers.iter().copied().collect();
            self.at = Some(std::time::Instant::now());
        }
        let last = self.last;
        self.left.retain(|n| *n > last);
    }

    /// `count` numbers, each above `above` (and above every number handed
    /// out before), or `None` when too few are left or they are too old.
    pub(super) fn take(&mut self, count: usize, above: i64) -> Option<Vec<i64>> {
        if self.at.is_none_or(|at| at.elapsed() >= MAX_PREFETCHED_AGE) {
            self.left.clear();
            return None;
        }
        while self.left.front().is_some_and(|n| *n <= above) {
            self.left.pop_front();
        }
        if self.left.len() < count {
            return None;
        }
        let taken: Vec<i64> = self.left.drain(..count).collect();
        if let Some(last) = taken.last() {
            self.last = self.last.max(*last);
        }
        Some(taken)
    }
}
