//! The stores a broker serves from: what the server reads beside the
//! `Store` trait (health, the gauges of `/metrics`), per backend.

use super::*;

/// The store a broker serves from, with what the server reads beside the
/// `Store` trait: health, and the gauges of `/metrics`.
pub trait Served: Store + Clone {
    /// True while the store can serve; false after it stopped (SQLite,
    /// for good: a failed fsync) or while its database is unreachable
    /// (PostgreSQL, until it is back).
    fn serving(&self) -> tokio::sync::watch::Receiver<bool>;
    /// Contracts open or accepted now.
    fn open_contracts(&self) -> impl Future<Output = Result<i64, crate::store::StoreError>> + Send;
    /// Commands waiting for the store's writers.
    fn queue_depth(&self) -> usize;
    /// Registers the store's own gauges (PostgreSQL's pools); a weak
    /// reference: metrics never keep the store alive.
    fn pool_metrics(_store: std::sync::Weak<Self>, _metrics: &crate::metrics::Metrics) {}
    /// Says this replica, signing with `key`, is alive, and retires the
    /// keys of replicas silent for `ttl_ms` (PostgreSQL); nothing for a
    /// single broker.
    fn heartbeat(&self, key: [u8; 32], ttl_ms: i64) -> impl Future<Output = ()> + Send;
    /// Resolves once the store's writer has answered everything queued
    /// and made it durable, after the last handle is dropped (holds none).
    fn finished(&self) -> impl Future<Output = ()> + Send + 'static;
}

impl Served for SqliteStore {
    fn serving(&self) -> tokio::sync::watch::Receiver<bool> {
        let (serving, status) = tokio::sync::watch::channel(true);
        let lost = self.durability_lost();
        let mut writable = self.writable();
        tokio::spawn(async move {
            tokio::pin!(lost);
            loop {
                let now = *writable.borrow_and_update();
                serving.send_if_modified(|was| std::mem::replace(was, now) != now);
                tokio::select! {
                    () = &mut lost => break,
                    changed = writable.changed() => if changed.is_err() { break },
                }
            }
            let _ = serving.send(false);
            // Held until every receiver is gone: the status stays false.
            serving.closed().await;
        });
        status
    }

    async fn open_contracts(&self) -> Result<i64, crate::store::StoreError> {
        SqliteStore::open_contracts(self).await
    }

    fn queue_depth(&self) -> usize {
        SqliteStore::queue_depth(self)
    }

    async fn heartbeat(&self, _key: [u8; 32], _ttl_ms: i64) {}

    fn finished(&self) -> impl Future<Output = ()> + Send + 'static {
        // The syncer stops after the writer, which stops once its queue
        // is empty and every handle gone.
        self.durability_lost()
    }
}

impl Served for PostgresStore {
    fn serving(&self) -> tokio::sync::watch::Receiver<bool> {
        self.reachable()
    }

    async fn open_contracts(&self) -> Result<i64, crate::store::StoreError> {
        PostgresStore::open_contracts(self).await
    }

    fn queue_depth(&self) -> usize {
        PostgresStore::queue_depth(self)
    }

    fn pool_metrics(store: std::sync::Weak<Self>, metrics: &crate::metrics::Metrics) {
        pool_metrics(store, metrics);
    }

    async fn heartbeat(&self, key: [u8; 32], ttl_ms: i64) {
        use crate::store::postgres::migrate::Heartbeat;
        match PostgresStore::heartbeat(self, &key, ttl_ms).await {
            Ok((own, retired)) => {
                for key_id in retired {
                    tracing::warn!(%key_id, ttl_ms, "a replica's key was not seen for limits.replica_key_ttl_ms: retired (its contracts still verify; no new sessions)");
                }
                match own {
                    Heartbeat::Current => {}
                    Heartbeat::RetiredByOperator => tracing::error!(
                        key_id = %crypto::key_id(&key),
                        "this replica's signing key was retired by an operator: other replicas refuse its sessions; restart it with a new key (rotate-key or --signing-key-file)"
                    ),
                    Heartbeat::Missing => {
                        tracing::warn!(key_id = %crypto::key_id(&key), "this replica's key is missing from the registry: registering it again");
                        if let Err(e) = self.register_keys(&key, &[]).await {
                            tracing::warn!(error = %e, "registering this replica's key again");
                        }
                    }
                }
            }
            // The database away: health says so; the next beat retries.
            Err(e) => tracing::debug!(error = %e, "heartbeat of this replica's key"),
        }
    }

    fn finished(&self) -> impl Future<Output = ()> + Send + 'static {
        // Every answer waited for its own commit: nothing to finish.
        std::future::ready(())
    }
}
