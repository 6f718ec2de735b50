//! The request keys (agent, nonce) the writer committed recently, as
//! time-bucketed Bloom filters. A batch none of whose keys may be here is
//! planned without reading the request log first, which saves the writer
//! a round trip to SQLite per batch.
//!
//! The set is only a hint, in both directions. A false "maybe" (a Bloom
//! collision) only sends a batch the careful way. A false "no" cannot
//! happen for a fresh retry: the set remembers every key committed since
//! `covered_since_ms`, and a request whose timestamp could belong to an
//! older original is always sent the careful way (see `may_contain`).
//! Should that reasoning ever fail, the request log's primary key still
//! refuses the duplicate and the writer redoes the batch carefully (see
//! `sqlite::apply_batch`), so nothing is answered twice either way. This
//! closes the cheap amplification of replaying an old captured request
//! to make the writer redo whole batches.

use std::collections::VecDeque;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

/// Most buckets kept: bounds memory to `MAX_BUCKETS * BUCKET_BITS / 8`
/// bytes (6 MiB).
pub const MAX_BUCKETS: usize = 24;
/// Bits per bucket: at 4,000 requests/s and the default 5-minute window a
/// bucket holds about 100,000 keys, a 0.02% false-"maybe" rate.
const BUCKET_BITS: usize = 1 << 21;
/// Bit probes per key.
const PROBES: u64 = 7;
/// Shortest bucket span.
const MIN_BUCKET_MS: i64 = 10_000;

/// One span of time's keys.
struct Bucket {
    /// Broker time of the bucket's first insert: every key in it was
    /// committed at or after this.
    started_ms: i64,
    bits: Vec<u64>,
}

/// Recently committed request keys.
pub struct RecentRequests {
    /// Random per process, so nobody can aim for collisions (which would
    /// only cost them the careful path anyway).
    hasher: RandomState,
    /// Oldest first.
    buckets: VecDeque<Bucket>,
    /// How long one bucket collects keys.
    bucket_ms: i64,
    /// The broker's timestamp window: how far a fresh request's timestamp
    /// may be from the time its original was committed.
    window_ms: i64,
    /// Every key committed at or after this is in `buckets`.
    covered_since_ms: i64,
}

impl RecentRequests {
    /// A set that can vouch for requests up to `window_ms` off the
    /// broker's clock, starting empty at `now_ms` (so it vouches for
    /// nothing older: after a restart the writer reads the log until the
    /// set has filled).
    pub fn new(window_ms: i64, now_ms: i64) -> Self {
        assert!(window_ms >= 0, "a timestamp window is not negative");
        // Twice the window (a fresh retry's original is at most that old),
        // over all buckets but the one filling.
        let keep_ms = window_ms.saturating_mul(2);
        let spans = MAX_BUCKETS as i64 - 1;
        let bucket_ms = keep_ms
            .saturating_add(spans - 1)
            .checked_div(spans)
            .unwrap_or(MIN_BUCKET_MS)
            .max(MIN_BUCKET_MS);
        Self {
            hasher: RandomState::new(),
            buckets: VecDeque::new(),
            bucket_ms,
            window_ms,
            covered_since_ms: now_ms,
        }
    }

    fn probes(&self, agent: &[u8; 32], nonce: &[u8]) -> impl Iterator<Item = usize> {
        let first = self.hasher.hash_one((agent, nonce));
        let step = self.hasher.hash_one((nonce, agent)) | 1;
        (0..PROBES)
            .map(move |i| (first.wrapping_add(i.wrapping_mul(step)) % BUCKET_BITS as u64) as usize)
    }

    /// False only if no request with this key and header timestamp
    /// `timestamp_ms` can have been committed before: then the batch may
    /// skip reading the request log. True for keys that may be here and
    /// for timestamps old enough that their original could predate what
    /// the set covers.
    pub fn may_contain(&self, agent: &[u8; 32], nonce: &[u8], timestamp_ms: i64) -> bool {
        // The original of a fresh request was committed no earlier than
        // its timestamp minus the window.
        if timestamp_ms.saturating_sub(self.window_ms) < self.covered_since_ms {
            return true;
        }
        let probes: Vec<usize> = self.probes(agent, nonce).collect();
        self.buckets.iter().any(|bucket| {
            probes
                .iter()
                .all(|&bit| bucket.bits[bit / 64] & (1 << (bit % 64)) != 0)
        })
    }

    /// Records a key committed at broker time `now_ms`.
    pub fn insert(&mut self, agent: &[u8; 32], nonce: &[u8], now_ms: i64) {
        let due = self
            .buckets
            .back()
            .is_none_or(|newest| now_ms >= newest.started_ms.saturating_add(self.bucket_ms));
        if due {
            self.buckets.push_back(Bucket {
                started_ms: now_ms,
                bits: vec![0; BUCKET_BITS / 64],
            });
            while self.buckets.len() > MAX_BUCKETS {
                self.buckets.pop_front();
                if let Some(oldest) = self.buckets.front() {
                    self.covered_since_ms = self.covered_since_ms.max(oldest.started_ms);
                }
            }
        }
        let probes: Vec<usize> = self.probes(agent, nonce).collect();
        let Some(newest) = self.buckets.back_mut() else {
            unreachable!("a bucket was just ensured");
        };
        for bit in probes {
            newest.bits[bit / 64] |= 1 << (bit % 64);
        }
        debug_assert!(self.buckets.len() <= MAX_BUCKETS);
    }

    /// Broker time since which every committed key is held.
    pub fn covered_since_ms(&self) -> i64 {
        self.covered_since_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW_MS: i64 = 300_000;

    #[test]
    fn remembers_committed_keys_by_agent_and_nonce() {
        let start = 1_000_000;
        let mut recent = RecentRequests::new(WINDOW_MS, start);
        let agent = [7u8; 32];
        let fresh = start + WINDOW_MS; // fresh, and its original could not predate `start`
        assert!(!recent.may_contain(&agent, b"n1", fresh));
        recent.insert(&agent, b"n1", start + 5);
        assert!(recent.may_contain(&agent, b"n1", fresh));
        assert!(
            !recent.may_contain(&[8u8; 32], b"n1", fresh),
            "keyed by agent too"
        );
        assert!(!recent.may_contain(&agent, b"n2", fresh));
    }

    #[test]
    fn timestamps_the_set_cannot_vouch_for_take_the_careful_way() {
        let start = 1_000_000;
        let recent = RecentRequests::new(WINDOW_MS, start);
        // Its original could have been committed before the set started
        // (say, before a restart).
        assert!(recent.may_contain(&[1u8; 32], b"never seen", start + WINDOW_MS - 1));
        assert!(!recent.may_contain(&[1u8; 32], b"never seen", start + WINDOW_MS));
    }

    #[test]
    fn old_buckets_go_and_the_coverage_moves_with_them() {
        let start = 0;
        let mut recent = RecentRequests::new(WINDOW_MS, start);
        let agent = [3u8; 32];
        recent.insert(&agent, b"first", start);
        let bucket_ms = recent.bucket_ms;
        assert!(bucket_ms * (MAX_BUCKETS as i64 - 1) >= 2 * WINDOW_MS);
        // One key per bucket span until the first bucket is dropped.
        for i in 1..=MAX_BUCKETS as i64 {
            recent.insert(&agent, &i.to_be_bytes(), start + i * bucket_ms);
        }
        assert_eq!(recent.buckets.len(), MAX_BUCKETS);
        assert_eq!(recent.covered_since_ms(), start + bucket_ms);
        let now = start + MAX_BUCKETS as i64 * bucket_ms;
        // A fresh request now may still be a retry of something in the
        // kept buckets, and is vouched for only from the coverage on.
        assert!(recent.may_contain(&agent, &1i64.to_be_bytes(), now));
        assert!(
            !recent.may_contain(&agent, b"first", now),
            "dropped with its bucket"
        );
        assert!(recent.may_contain(&agent, b"anything", bucket_ms + WINDOW_MS - 1));
    }

    #[test]
    fn false_maybes_are_rare_at_a_full_bucket() {
        let mut recent = RecentRequests::new(WINDOW_MS, 0);
        let agent = [5u8; 32];
        for i in 0..100_000u32 {
            recent.insert(&agent, &i.to_be_bytes(), 1);
        }
        let now = WINDOW_MS;
        let false_maybes = (100_000..110_000u32)
            .filter(|i| recent.may_contain(&agent, &i.to_be_bytes(), now))
            .count();
        // Expected about 0.02%: 2 in 10,000; allow ten times that.
        assert!(false_maybes < 20, "{false_maybes} false maybes in 10,000");
    }
}
