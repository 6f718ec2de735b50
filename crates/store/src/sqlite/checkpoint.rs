//! Background WAL checkpoints that keep the WAL bounded without blocking
//! the writer.

use super::*;
use crate::limits::sqlite::MAX_DRAIN_ROUNDS;

/// Default WAL size (`limits.wal_restart_mib`) beyond which the writer
/// finishes a checkpoint (so the WAL
/// restarts from its beginning): bounds the WAL to about this plus one
/// `CHECKPOINT_INTERVAL` of writes. Each finish stalls the writer for a
/// few to 20 ms (the last frames copied and the database file fsynced):
/// at 32 MiB a delegation load of 1,900/s (19 KB of WAL each) finished
/// twice a second and those stalls were the open-loop p99 (BENCHMARKS.md); at 128 MiB once every few seconds.
pub const WAL_RESTART_BYTES: u64 = 128 * 1024 * 1024;

/// Copies committed WAL frames into the database file in the background,
/// without blocking the writer (PASSIVE), so commits never pay for it.
///
/// The WAL only restarts from its beginning when a write transaction
/// starts with every frame copied, which a background checkpoint never
/// achieves against a busy writer. So once the WAL holds `restart_bytes`,
/// this drains it (checkpoints back to back until one had little left to
/// copy) and then asks the writer to copy the rest between two batches
/// (`finish`, see `writer::maintain`): the writer stalls only for the frames
/// of the last round (measured: 9–25 ms stalls twice a second when the
/// writer was asked after a single 250 ms round). Stops when the store is
/// dropped.
pub(super) async fn checkpointer(
    mut conn: SqliteConnection,
    alive: mpsc::WeakSender<(Command, Reply)>,
    finish: Arc<AtomicBool>,
    restart_bytes: u64,
    interval: Duration,
) {
    let page_bytes = match sqlx::query_scalar::<_, i64>("PRAGMA page_size")
        .fetch_one(&mut conn)
        .await
    {
        Ok(bytes) => u64::try_from(bytes).unwrap_or(DEFAULT_PAGE_BYTES),
        Err(e) => {
            tracing::warn!(error = %e, "reading the page size; assuming the default");
            DEFAULT_PAGE_BYTES
        }
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if alive.upgrade().is_none() {
            break;
        }
        let Some(mut done) = checkpoint(&mut conn).await else {
            continue;
        };
        // Frame counts, not the file's size: SQLite rewrites the WAL from
        // its start without shrinking the file.
        if done.wal_frames.saturating_mul(page_bytes) < restart_bytes {
            continue;
        }
        // Asked after the drain, or after MAX_DRAIN_ROUNDS if the writer
        // outpaces every round (a bounded WAL is worth one longer stall);
        // not if a round failed or was busy: the next tick tries again.
        let mut ask = true;
        for _ in 0..MAX_DRAIN_ROUNDS {
            if alive.upgrade().is_none() {
                ask = false;
                break;
            }
            let copied_before = done.copied_frames;
            let Some(next) = checkpoint(&mut conn).await else {
                ask = false;
                break;
            };
            done = next;
            if done.wal_frames.saturating_sub(copied_before) <= DRAINED_FRAMES {
                break;
            }
        }
        if ask {
            finish.store(true, Ordering::Release);
        }
    }
    // A final full checkpoint leaves a compact database behind.
    let _ = sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
        .execute(&mut conn)
        .await;
    let _ = conn.close().await;
}

/// SQLite's default page size; only used if asking for it fails.
pub(super) const DEFAULT_PAGE_BYTES: u64 = 4096;

/// A round that had at most this many frames to copy leaves the writer
/// little to do (about a millisecond of writes at full load).
pub(super) const DRAINED_FRAMES: u64 = 256;

/// What one checkpoint saw, in WAL frames.
pub(super) struct Checkpointed {
    /// Frames in the WAL since it last restarted.
    pub(super) wal_frames: u64,
    /// Of those, frames now copied into the database file.
    pub(super) copied_frames: u64,
}

/// One PASSIVE checkpoint; `None` (logged) if it failed or says nothing.
pub(super) async fn checkpoint(conn: &mut SqliteConnection) -> Option<Checkpointed> {
    // Returns (busy, frames in the WAL, frames copied).
    let began = std::time::Instant::now();
    let r = sqlx::query_as::<_, (i64, i64, i64)>("PRAGMA wal_checkpoint(PASSIVE)")
        .fetch_one(conn)
        .await;
    // A phase of the write path: `bench`'s tail is read against these.
    tracing::trace!(
        took_us = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX),
        "WAL checkpoint ran"
    );
    match r {
        // Busy (another checkpoint ran) or not in WAL mode: no counts.
        Ok((busy, wal_frames, copied_frames))
            if busy != 0 || wal_frames < 0 || copied_frames < 0 =>
        {
            tracing::debug!(busy, wal_frames, copied_frames, "WAL checkpoint skipped");
            None
        }
        Ok((_, wal_frames, copied_frames)) => Some(Checkpointed {
            wal_frames: u64::try_from(wal_frames).unwrap_or(0),
            copied_frames: u64::try_from(copied_frames).unwrap_or(0),
        }),
        Err(e) => {
            static FAILED: broker_wire::throttle::Throttle = broker_wire::throttle::Throttle::new();
            if let Some(held) = FAILED.allow() {
                tracing::warn!(error = %e, held, "WAL checkpoint failed; will retry");
            }
            None
        }
    }
}
