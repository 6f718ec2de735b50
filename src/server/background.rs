//! What runs beside the requests: health following the store, the
//! sweep of expired contracts, span export counters.

use super::*;

/// Health tells the truth: NOT_SERVING while the store cannot serve (a
/// failed fsync stops SQLite for good; storage failing or PostgreSQL away
/// until a probe write succeeds), SERVING again when it can, and
/// `Stopping` from the moment a stop is asked.
pub(super) fn follow_health(
    mut serving: tokio::sync::watch::Receiver<bool>,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) -> tokio::sync::watch::Receiver<crate::service::health::Serving> {
    use crate::service::health::Serving;
    let (state, health) = tokio::sync::watch::channel(Serving::Serving);
    tokio::spawn(async move {
        let mut store_open = true;
        loop {
            let now = if *stopping.borrow_and_update() {
                Serving::Stopping
            } else if store_open && *serving.borrow_and_update() {
                Serving::Serving
            } else {
                Serving::NotServing
            };
            let was = state.send_replace(now);
            if now == Serving::NotServing && was != Serving::NotServing {
                tracing::error!("the store cannot serve: health is NOT_SERVING");
            } else if now == Serving::Serving && was == Serving::NotServing {
                tracing::info!("the store serves again: health is SERVING");
            }
            if now == Serving::Stopping {
                return;
            }
            tokio::select! {
                changed = serving.changed(), if store_open => {
                    // The store stopped for good.
                    store_open = changed.is_ok();
                }
                changed = stopping.changed() => if changed.is_err() {
                    // The server is gone without a stop: nothing to tell.
                    return;
                },
            }
        }
    });
    health
}

/// Overdue contracts expired per sweep; the rest wait for the next tick.
pub(super) const EXPIRED_PER_SWEEP: u32 = 256;
/// Most contracts the sweeper remembers as failing to expire.
pub(super) const MAX_SKIPPED_EXPIRIES: usize = 1_024;

/// Expires overdue contracts in the background so their reservations
/// return even if nobody touches them (they also expire on access). Stops
/// when the store is gone.
pub(super) async fn expiry_sweeper<S: Store>(
    store: std::sync::Weak<S>,
    clock: Arc<dyn Clock>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Contracts whose expiry failed (a bug, logged): skipped so they cannot
    // starve the ones listed after them. Bounded; forgotten when full.
    let mut failed: std::collections::HashSet<crate::core::Id> = std::collections::HashSet::new();
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else { return };
        let limit =
            EXPIRED_PER_SWEEP.saturating_add(u32::try_from(failed.len()).unwrap_or(u32::MAX));
        let overdue = match store.overdue(clock.now_ms(), limit).await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(error = %e, "expiry sweep could not list overdue contracts");
                continue;
            }
        };
        let due: Vec<_> = overdue
            .into_iter()
            .filter(|id| !failed.contains(id))
            .collect();
        for contract_id in due {
            let command = LifecycleCommand {
                request: None,
                contract_id,
                action: Action::Expire,
            };
            match store.transition(command).await {
                Ok(_) => {}
                // Another path (a cascade, an access, another replica's
                // sweeper) ended it first.
                Err(crate::store::StoreError::FailedPrecondition { .. }) => {}
                // Its descendants are being ended in steps (a drain): it is
                // expired by a later sweep; the others go on now.
                Err(crate::store::StoreError::Unavailable {
                    reason: crate::pb::ErrorReason::DescendantsEnding,
                    ..
                }) => {}
                // Passing (a full queue, a database away or contended):
                // the next sweep tries again.
                Err(
                    e @ (crate::store::StoreError::Busy
                    | crate::store::StoreError::Unavailable { .. }
                    | crate::store::StoreError::Backend(_)),
                ) => {
                    tracing::warn!(error = %e, contract = %hex::encode(contract_id), "expiry deferred to the next sweep");
                    break;
                }
                Err(e) => {
                    tracing::error!(error = %e, contract = %hex::encode(contract_id), "expiry failed; skipping it");
                    if failed.len() >= MAX_SKIPPED_EXPIRIES {
                        failed.clear();
                    }
                    failed.insert(contract_id);
                }
            }
        }
    }
}

/// The span exporter's counts (process-wide; zero without `--otlp-endpoint`):
/// ended but neither exported nor failed means queued, or dropped by the
/// full queue.
pub(super) fn trace_export_metrics(metrics: &crate::metrics::Metrics) {
    metrics.sampled_counter(
        "broker_trace_spans_ended_total",
        "Call spans ended and handed to the OTLP export queue.",
        || crate::telemetry::span_counts().ended,
    );
    metrics.sampled_counter(
        "broker_trace_spans_exported_total",
        "Call spans the OTLP collector accepted.",
        || crate::telemetry::span_counts().exported,
    );
    metrics.sampled_counter(
        "broker_trace_spans_failed_total",
        "Call spans in batches whose OTLP export failed (collector away, timeout).",
        || crate::telemetry::span_counts().failed,
    );
}
