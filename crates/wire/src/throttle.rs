//! Throttled warnings: a repeated failure logs once a second, not once
//! per occurrence.

use std::sync::atomic::{AtomicU64, Ordering};

/// At most one log line per `LOG_THROTTLE_MS` for a repeated warning (a
/// disk full fails every write and every checkpoint: one line a second
/// says so, thousands would bury everything else). A static per message.
pub struct Throttle {
    /// When the last line was let through, in ms since `EPOCH`; 0: never.
    last_ms: AtomicU64,
    /// Lines held back since, reported with the next one let through.
    held: AtomicU64,
}

/// A repeated warning's least interval.
pub const LOG_THROTTLE_MS: u64 = 1_000;

/// The clock throttles read: monotonic, from the first use.
static EPOCH: std::sync::LazyLock<std::time::Instant> =
    std::sync::LazyLock::new(std::time::Instant::now);

impl Throttle {
    pub const fn new() -> Self {
        Self {
            last_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// `Some(lines held back since the last one)` when this line may be
    /// written now; `None` (counted) otherwise.
    pub fn allow(&self) -> Option<u64> {
        // +1: 0 means "never".
        let now_ms = u64::try_from(EPOCH.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        let last_ms = self.last_ms.load(Ordering::Relaxed);
        if last_ms != 0 && now_ms.saturating_sub(last_ms) < LOG_THROTTLE_MS
            || self
                .last_ms
                .compare_exchange(last_ms, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            self.held.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.held.swap(0, Ordering::Relaxed))
    }
}

impl Default for Throttle {
    fn default() -> Self {
        Self::new()
    }
}
