//! The broker's keys: loaded or created at start, published, and
//! re-read by replicas so each sees the others' keys.

use super::*;

/// How often a replica re-reads the registered keys: a replica that
/// started (or rotated) since is published within this.
pub(super) const KEYS_REFRESH: Duration = Duration::from_millis(500);

/// A replica's heartbeat: a quarter of the TTL, so three beats can be
/// lost (a slow database, a pause) before its key is retired; within
/// these bounds.
pub(super) fn heartbeat_interval(ttl_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ttl_ms / 4).unwrap_or(0)).clamp(KEYS_REFRESH, MAX_HEARTBEAT)
}

/// Longest between two heartbeats, whatever the TTL.
pub(super) const MAX_HEARTBEAT: Duration = Duration::from_secs(60);

/// Keeps `keys` equal to the shared registry while the store lives, and
/// beats this replica's heartbeat (a single broker's keys never change
/// while it runs: returns at once).
pub(super) async fn refresh_keys<S: Served>(
    store: std::sync::Weak<S>,
    keys: crate::service::PublishedKeys,
    current: [u8; 32],
    ttl_ms: i64,
) {
    let mut tick = tokio::time::interval(KEYS_REFRESH);
    let every = heartbeat_interval(ttl_ms);
    let mut next_beat = tokio::time::Instant::now() + every;
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else { return };
        if tokio::time::Instant::now() >= next_beat {
            next_beat = tokio::time::Instant::now() + every;
            store.heartbeat(current, ttl_ms).await;
        }
        match store.broker_keys().await {
            Ok(Some(registered)) if !registered.is_empty() => keys.set(registered),
            Ok(Some(_)) => {}
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "refreshing the published keys; keeping the last")
            }
        }
    }
}

/// The broker's signing keys (created on first start).
pub(super) async fn load_keys(
    config: &Config,
    key_file: Option<std::path::PathBuf>,
) -> Result<keystore::Loaded, ServerError> {
    let data_dir = config.data_dir.clone();
    Ok(
        tokio::task::spawn_blocking(move || keystore::load(&data_dir, key_file.as_deref()))
            .await
            .map_err(|e| ServerError::KeyLoading(e.to_string()))??,
    )
}

/// Makes the data directory when missing and locks it (`DataDirLock`).
pub(super) async fn lock_data_dir(
    dir: std::path::PathBuf,
) -> Result<keystore::DataDirLock, ServerError> {
    tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServerError::DataDir(format!("{}: {e}", dir.display())))?;
        Ok(keystore::DataDirLock::acquire(&dir)?)
    })
    .await
    .map_err(|e| ServerError::KeyLoading(e.to_string()))?
}

/// Writes a fresh signing key, once the store opened (see `Loaded`).
pub(super) async fn save_keys(loaded: keystore::Loaded) -> Result<(), ServerError> {
    Ok(tokio::task::spawn_blocking(move || loaded.save())
        .await
        .map_err(|e| ServerError::KeyLoading(e.to_string()))??)
}

/// The keys a single broker publishes: its current key, then the retired.
pub(super) fn published(keyring: &keystore::Keyring) -> Vec<pb::BrokerKey> {
    let current = keyring.current.verifying_key().to_bytes();
    let mut keys = vec![pb::BrokerKey {
        key_id: crypto::key_id(&current),
        public_key: current.to_vec(),
        current: true,
        retired_at_ms: 0,
    }];
    keys.extend(keyring.retired.iter().map(|k| pb::BrokerKey {
        key_id: crypto::key_id(&k.to_bytes()),
        public_key: k.to_bytes().to_vec(),
        current: false,
        retired_at_ms: 0,
    }));
    keys
}
