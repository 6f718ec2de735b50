//! The request keys (agent, nonce) the writer committed recently, as two
//! generations of Bloom filters. A batch none of whose keys may be here is
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

use super::limits::{MAX_FILTER_BITS, MIN_FILTER_BITS, MIN_SPAN_MS};
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

/// The request rate the filters are sized for: up to it (and with the
/// default 5-minute window) about one key in a thousand draws a false
/// "maybe"; beyond it the rate grows and more batches read the log.
pub const DESIGN_REQUESTS_PER_S: usize = 5_000;
/// Filter bits per key at the design rate (with `PROBES` probes: a
/// 0.05% false "maybe" per filter).
const BITS_PER_KEY: usize = 16;
/// Bit probes per key (≈ BITS_PER_KEY × ln 2).
const PROBES: usize = 11;

/// One generation's keys.
struct Filter {
    /// Broker time from which this generation collects keys.
    since_ms: i64,
    bits: Vec<u64>,
}

impl Filter {
    fn new(since_ms: i64, bits: usize) -> Self {
        Self {
            since_ms,
            bits: vec![0; bits / 64],
        }
    }
}

/// Recently committed request keys: the current generation and the one
/// before it, each spanning twice the timestamp window.
pub struct RecentRequests {
    /// Random per process, so nobody can aim for collisions (which would
    /// only cost them the careful path anyway).
    hasher: RandomState,
    current: Filter,
    previous: Option<Filter>,
    /// How long a generation collects keys.
    span_ms: i64,
    /// Bits per filter (a power of two).
    filter_bits: usize,
    /// The broker's timestamp window: how far a fresh request's timestamp
    /// may be from the time its original was committed.
    window_ms: i64,
    /// Every key committed at or after this is held.
    covered_since_ms: i64,
}

impl RecentRequests {
    /// A set that can vouch for requests up to `window_ms` off the
    /// broker's clock, holding every key committed from `since_ms` on
    /// (the caller loads those; the set vouches for nothing older).
    pub fn new(window_ms: i64, since_ms: i64) -> Self {
        assert!(window_ms >= 0, "a timestamp window is not negative");
        // A fresh retry's original is at most two windows old; a
        // generation that long means the one before always covers it.
        let span_ms = window_ms.saturating_mul(2).max(MIN_SPAN_MS);
        let span_s = usize::try_from(span_ms / 1_000)
            .unwrap_or(usize::MAX)
            .max(1);
        let filter_bits = DESIGN_REQUESTS_PER_S
            .saturating_mul(span_s)
            .saturating_mul(BITS_PER_KEY)
            .clamp(MIN_FILTER_BITS, MAX_FILTER_BITS)
            .next_power_of_two()
            .min(MAX_FILTER_BITS);
        Self {
            hasher: RandomState::new(),
            current: Filter::new(since_ms, filter_bits),
            previous: None,
            span_ms,
            filter_bits,
            window_ms,
            covered_since_ms: since_ms,
        }
    }

    /// The key's bit positions (double hashing), without allocating: this
    /// runs twice per request on the writer.
    fn probes(&self, agent: &[u8; 32], nonce: &[u8]) -> [usize; PROBES] {
        let first = self.hasher.hash_one((agent, nonce));
        let step = self.hasher.hash_one((nonce, agent)) | 1;
        let mask = self.filter_bits as u64 - 1;
        std::array::from_fn(|i| (first.wrapping_add((i as u64).wrapping_mul(step)) & mask) as usize)
    }

    /// False only if no request with this key and header timestamp
    /// `timestamp_ms` can have been committed before: then the batch may
    /// skip reading the request log. True for keys that may be here and
    /// for timestamps old enough that their original could predate what
    /// the set holds.
    pub fn may_contain(&self, agent: &[u8; 32], nonce: &[u8], timestamp_ms: i64) -> bool {
        // The original of a fresh request was committed no earlier than
        // its timestamp minus the window.
        if timestamp_ms.saturating_sub(self.window_ms) < self.covered_since_ms {
            return true;
        }
        let probes = self.probes(agent, nonce);
        let held = |filter: &Filter| {
            probes
                .iter()
                .all(|&bit| filter.bits[bit / 64] & (1 << (bit % 64)) != 0)
        };
        held(&self.current) || self.previous.as_ref().is_some_and(held)
    }

    /// Records a key committed at broker time `now_ms`.
    pub fn insert(&mut self, agent: &[u8; 32], nonce: &[u8], now_ms: i64) {
        if now_ms >= self.current.since_ms.saturating_add(self.span_ms) {
            let next = Filter::new(now_ms, self.filter_bits);
            let done = std::mem::replace(&mut self.current, next);
            // What the dropped generation held was committed before
            // `done` started (with a clock that only moves forward; if it
            // ever jumps back, the request log's key still catches a
            // retry the set let through).
            self.covered_since_ms = self.covered_since_ms.max(done.since_ms);
            self.previous = Some(done);
        }
        for bit in self.probes(agent, nonce) {
            self.current.bits[bit / 64] |= 1 << (bit % 64);
        }
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
    fn generations_rotate_and_the_coverage_moves_with_them() {
        let start = 0;
        let mut recent = RecentRequests::new(WINDOW_MS, start);
        let agent = [3u8; 32];
        let span = recent.span_ms;
        assert!(span >= 2 * WINDOW_MS);
        recent.insert(&agent, b"first", start);
        recent.insert(&agent, b"second", start + span);
        // One rotation: "first" is in the previous generation, still held.
        assert_eq!(recent.covered_since_ms(), start);
        let now = start + span;
        assert!(recent.may_contain(&agent, b"first", now + WINDOW_MS));
        recent.insert(&agent, b"third", start + 2 * span);
        // Two: the generation holding "first" is gone, and the set no
        // longer vouches for anything its original could predate.
        assert_eq!(recent.covered_since_ms(), start + span);
        let now = start + 2 * span;
        assert!(!recent.may_contain(&agent, b"first", now));
        assert!(recent.may_contain(&agent, b"second", now));
        assert!(recent.may_contain(&agent, b"anything", span + WINDOW_MS - 1));
    }

    #[test]
    fn false_maybes_are_rare_at_the_design_rate() {
        // A short window keeps the test quick; the sizing rule is the same.
        const SHORT_WINDOW_MS: i64 = 30_000;
        let mut recent = RecentRequests::new(SHORT_WINDOW_MS, 0);
        let agent = [5u8; 32];
        // A full generation at the design rate in the previous filter, and
        // half of one in the current.
        let generation = DESIGN_REQUESTS_PER_S * 2 * (SHORT_WINDOW_MS as usize / 1_000);
        for i in 0..generation as u64 {
            recent.insert(&agent, &i.to_be_bytes(), 1);
        }
        for i in 0..(generation / 2) as u64 {
            recent.insert(&agent, &(u64::MAX - i).to_be_bytes(), recent.span_ms + 1);
        }
        let now = recent.span_ms + 1;
        let asked = 20_000u64;
        let false_maybes = (0..asked)
            .map(|i| (1u64 << 40) + i)
            .filter(|i| recent.may_contain(&agent, &i.to_be_bytes(), now))
            .count();
        // Expected about 0.06% per query (two filters): 12 in 20,000;
        // allow four times that.
        assert!(false_maybes < 50, "{false_maybes} false maybes in {asked}");
    }
}
