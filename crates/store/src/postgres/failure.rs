//! How a writer's transaction failed, and what follows: redone
//! (contention), answered as unavailable (the database away), or an
//! error; and the backoff between attempts.

use super::*;
use crate::limits::postgres::{RETRY_BASE_MS, RETRY_CAP_MS};

/// Whether redoing the whole transaction may succeed: a serialization
/// failure or deadlock (40001, 40P01), or a request key another replica
/// committed meanwhile (23505 on the request log: the redo replays it).
pub(super) fn retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("40001" | "40P01" | "23505"))
        }
        _ => false,
    }
}

/// Whether an optimistic issuance was aborted by `issuance_guard`: a
/// cached parent had changed (BR001) or a tree is draining (BR002).
pub(super) fn lost_optimism(e: &sqlx::Error) -> Option<&'static str> {
    match e {
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("BR001") => Some("stale"),
            Some("BR002") => Some("draining"),
            _ => None,
        },
        _ => None,
    }
}

/// Whether the database could not be reached (or went away mid-way):
/// nothing, or an unknown outcome that the request log settles on retry.
pub(super) fn unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => true,
        // admin_shutdown, crash_shutdown, cannot_connect_now, and the
        // connection-exception class.
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            matches!(c.as_ref(), "57P01" | "57P02" | "57P03") || c.starts_with("08")
        }),
        _ => false,
    }
}

/// The answer to callers of a transaction that failed for good.
pub(super) fn failed(e: &sqlx::Error, attempts: u32) -> StoreError {
    if retryable(e) {
        StoreError::Unavailable {
            reason: pb::ErrorReason::Contention,
            detail: format!(
                "{attempts} attempts lost to concurrent writers (the last: {e}); nothing was recorded: retry with the same nonce"
            ),
        }
    } else if unreachable(e) {
        StoreError::Unavailable {
            reason: pb::ErrorReason::Unavailable,
            detail: "the database cannot be reached; retry with the same nonce (a request that was recorded after all gets its answer)".into(),
        }
    } else {
        backend_ref(e)
    }
}

/// Sleeps before attempt `attempt` (1-based redo count), exponentially
/// longer with full jitter so replicas that collided do not collide again.
pub(super) async fn backoff(attempt: u32) {
    let cap = RETRY_BASE_MS
        .saturating_mul(1u64 << attempt.min(16))
        .min(RETRY_CAP_MS);
    let mut bytes = [0u8; 8];
    let jitter = match getrandom::fill(&mut bytes) {
        Ok(()) => u64::from_le_bytes(bytes) % cap.max(1),
        Err(_) => cap / 2,
    };
    tokio::time::sleep(Duration::from_millis(jitter.max(1))).await;
}
