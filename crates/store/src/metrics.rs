//! What the store reports from its own threads (group commits, fsyncs,
//! retakes, optimistic issuances): the handles only; the server's
//! registry registers and serves them.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts};

/// Buckets of `broker_group_commit_commands`: 1 to the writer's largest
/// batch.
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Buckets of `broker_wal_fsync_seconds`: 50 µs to 2.5 s (this disk's
/// fsync is ~0.1 ms, its stalls 40–730 ms).
const FSYNC_BUCKETS_S: [f64; 12] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 2.5,
];

/// What the SQLite store reports from its own threads. Cheap to clone:
/// the handles are atomics.
#[derive(Clone, Debug)]
pub struct StoreMetrics {
    /// Commands per group commit (one write transaction).
    pub batch_commands: Histogram,
    /// Time of each fsync of the write-ahead log.
    pub wal_fsync_seconds: Histogram,
    /// Fsyncs of at least `SLOW_WAL_SYNC_US` (the disk stalled).
    pub wal_fsync_stalls: IntCounter,
    /// Takes of the writer's SQLite connection abandoned and asked again
    /// (`store::sqlite::raw::take_handle`).
    pub sqlite_handle_retakes: IntCounter,
    /// PostgreSQL issuance transactions written from the writer's cached
    /// parents, by outcome: `written`, or redone with the parents locked
    /// because one had changed (`stale`) or a tree was draining
    /// (`draining`).
    pub optimistic_issuances: IntCounterVec,
}

impl StoreMetrics {
    /// The store's metrics, not yet registered (`Metrics::new` does).
    pub fn new() -> Self {
        Self {
            batch_commands: histogram(
                "broker_group_commit_commands",
                "Commands per group commit (one write transaction of the store's writer).",
                &BATCH_BUCKETS,
            ),
            wal_fsync_seconds: histogram(
                "broker_wal_fsync_seconds",
                "Time of each fsync of the SQLite write-ahead log (every durable answer waits for one).",
                &FSYNC_BUCKETS_S,
            ),
            wal_fsync_stalls: counter(
                "broker_wal_fsync_stalls_total",
                "Fsyncs of the write-ahead log that took 5 ms or more.",
            ),
            sqlite_handle_retakes: counter(
                "broker_sqlite_handle_retakes_total",
                "Times the SQLite writer asked again for its connection, not handed over in 50 ms (each a stall of every write).",
            ),
            optimistic_issuances: counter_vec(
                "broker_optimistic_issuances_total",
                "PostgreSQL issuance transactions planned from the writer's cached parents: written, or redone with the parents locked (stale: a parent had changed; draining: a tree was draining).",
                &["outcome"],
            ),
        }
    }
}

// Metric constructors: the names and help texts are constants, checked
// by the tests that scrape them, so a failure here is a programming error.
fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("valid metric")
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("valid metric")
}

impl Default for StoreMetrics {
    fn default() -> Self {
        Self::new()
    }
}
