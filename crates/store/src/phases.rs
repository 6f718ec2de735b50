//! Where a store command's time goes, per command, for the load generator
//! (`bench` prints them): how long it waited for its answer in all, how
//! long for the writer to start its batch, how long that batch took, and
//! how long its answer then waited for the WAL's fsync (and each fsync's
//! own duration). Process-wide like `sqlite::WAL_SYNCS`:
//! counters that only grow, read as the difference of two snapshots, so
//! recording is one atomic add and nothing is ever reset under a reader.

use std::sync::atomic::{AtomicU64, Ordering};

/// Times below this many microseconds have a bucket each.
const EXACT_US: u64 = 16;

/// Buckets per doubling of the time above `EXACT_US`: each bucket's bound
/// is at most 1/8 above the times it holds.
const BUCKETS_PER_OCTAVE: u64 = 8;

/// Doublings above `EXACT_US` covered: up to 2^31 µs (half an hour);
/// longer times count in the last bucket.
const OCTAVES: u64 = 27;

const BUCKETS: usize = (EXACT_US + BUCKETS_PER_OCTAVE * OCTAVES) as usize;

/// A histogram of microseconds with log-spaced buckets.
pub struct Phase {
    buckets: [AtomicU64; BUCKETS],
}

/// Every command's wait, from being queued to its answer (`store::submit`).
pub static SUBMITTED: Phase = Phase::new();
/// For each command, from being queued to its batch starting (SQLite's
/// writer): the wait behind earlier batches and whatever else the writer
/// did meanwhile (checkpoints, pruning).
pub static QUEUED: Phase = Phase::new();
/// For each command, the duration of the batch that wrote it (SQLite's
/// writer: plan, script, commit).
pub static BATCH: Phase = Phase::new();
/// For each command, from its batch's commit to its answer being sent
/// (SQLite's syncer: the WAL fsync it waited for, and the queue before).
pub static SYNC_WAIT: Phase = Phase::new();
/// Each WAL fsync's own duration (SQLite's syncer), once per fsync, not
/// per command: the disk's share of `SYNC_WAIT`, against `disk-probe`'s.
pub static FSYNC: Phase = Phase::new();

impl Phase {
    #[allow(clippy::declare_interior_mutable_const)] // only an initializer
    const fn new() -> Self {
        const ZERO: AtomicU64 = AtomicU64::new(0);
        Self {
            buckets: [ZERO; BUCKETS],
        }
    }

    /// Counts `times` commands that each took `took_us`.
    pub fn record(&self, took_us: u64, times: u64) {
        self.buckets[bucket_of(took_us)].fetch_add(times, Ordering::Relaxed);
    }

    /// Records the time since `began` for one command.
    pub fn since(&self, began: std::time::Instant) {
        self.record(micros(began.elapsed()), 1);
    }

    pub fn snapshot(&self) -> PhaseSnapshot {
        PhaseSnapshot {
            counts: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
        }
    }
}

/// A duration in whole microseconds, saturating.
pub fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Below `EXACT_US` the time itself; then `BUCKETS_PER_OCTAVE` buckets
/// per power of two, picked by the three bits below the leading one.
fn bucket_of(us: u64) -> usize {
    if us < EXACT_US {
        return us as usize;
    }
    let octave = u64::from(63 - us.leading_zeros()); // floor(log2 us) ≥ 4
    let fraction = (us >> (octave - 3)) & (BUCKETS_PER_OCTAVE - 1);
    let index = EXACT_US + (octave - 4) * BUCKETS_PER_OCTAVE + fraction;
    usize::try_from(index).map_or(BUCKETS - 1, |i| i.min(BUCKETS - 1))
}

/// The largest time a bucket holds (its upper bound).
fn bound_of(index: usize) -> u64 {
    let index = index as u64;
    if index < EXACT_US {
        return index;
    }
    let octave = 4 + (index - EXACT_US) / BUCKETS_PER_OCTAVE;
    let fraction = (index - EXACT_US) % BUCKETS_PER_OCTAVE;
    // The bucket holds [2^o + f·2^(o−3), 2^o + (f+1)·2^(o−3)).
    (1u64 << octave) + (fraction + 1) * (1u64 << (octave - 3)) - 1
}

/// Bucket counts at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PhaseSnapshot {
    counts: Vec<u64>,
}

impl PhaseSnapshot {
    /// What was recorded between `earlier` and this snapshot.
    pub fn minus(&self, earlier: &PhaseSnapshot) -> PhaseSnapshot {
        PhaseSnapshot {
            counts: self
                .counts
                .iter()
                .enumerate()
                .map(|(i, c)| c.saturating_sub(earlier.counts.get(i).copied().unwrap_or(0)))
                .collect(),
        }
    }

    /// This snapshot's counts and `other`'s together (two windows of
    /// recording, e.g. each call of one kind).
    pub fn plus(&self, other: &PhaseSnapshot) -> PhaseSnapshot {
        let len = self.counts.len().max(other.counts.len());
        PhaseSnapshot {
            counts: (0..len)
                .map(|i| {
                    let a = self.counts.get(i).copied().unwrap_or(0);
                    a.saturating_add(other.counts.get(i).copied().unwrap_or(0))
                })
                .collect(),
        }
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The bound of the bucket holding quantile `q` (0..=1): at most about
    /// 9% above the true value; `None` if nothing was recorded.
    pub fn quantile_us(&self, q: f64) -> Option<u64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(bound_of(i));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_time_lands_in_a_bucket_whose_bound_holds_it_within_a_ninth() {
        let mut last = 0;
        for us in (0..5_000u64).chain((5_000..1 << 30).step_by(9_973)) {
            let i = bucket_of(us);
            assert!(i >= last, "buckets grow with the time ({us} µs)");
            last = i;
            let bound = bound_of(i);
            assert!(bound >= us, "{us} µs in bucket {i} bounded by {bound}");
            if i < BUCKETS - 1 {
                assert!(bound as f64 <= us as f64 * 1.125, "{us} µs bound {bound}");
            }
            if i > 0 {
                assert!(bound_of(i - 1) < us, "{us} µs belongs in a lower bucket");
            }
        }
    }

    #[test]
    fn quantiles_come_from_the_difference_of_two_snapshots() {
        let phase = Phase::new();
        phase.record(1_000_000, 50);
        let before = phase.snapshot();
        phase.record(100, 98);
        phase.record(10_000, 2);
        let window = phase.snapshot().minus(&before);
        assert_eq!(window.count(), 100);
        let p50 = window.quantile_us(0.5).unwrap();
        assert!((100..=112).contains(&p50), "{p50}");
        let p99 = window.quantile_us(0.99).unwrap();
        assert!((10_000..=11_250).contains(&p99), "{p99}");
        assert_eq!(Phase::new().snapshot().quantile_us(0.5), None);
    }
}
