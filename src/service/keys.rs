//! Keys and sessions: the verifying keys GetBrokerKeys publishes, and
//! OpenSession, which starts a read session for a signing key.

use std::sync::Arc;

use tonic::Request;

use super::BrokerService;
use super::error::ServiceError;
use crate::core::limits::KEYS_MAX_AGE_MS;
use crate::pb;
use crate::store::Store;

/// The verifying keys GetBrokerKeys publishes; shared with whatever
/// refreshes them.
#[derive(Clone, Default)]
pub struct PublishedKeys(Arc<std::sync::RwLock<Published>>);

/// The keys published, and when they were last read from the registry.
type Published = (Vec<pb::BrokerKey>, Option<std::time::Instant>);

impl PublishedKeys {
    pub fn new(keys: Vec<pb::BrokerKey>) -> Self {
        Self(Arc::new(std::sync::RwLock::new((keys, None))))
    }

    pub fn get(&self) -> Vec<pb::BrokerKey> {
        self.read().0.clone()
    }

    /// Whether the list is older than `max_age_ms` (or was never
    /// refreshed); claims the refresh, so one caller at a time reads.
    pub fn stale(&self, max_age_ms: u64) -> bool {
        let now = std::time::Instant::now();
        let max_age = std::time::Duration::from_millis(max_age_ms);
        if self
            .read()
            .1
            .is_some_and(|at| now.duration_since(at) < max_age)
        {
            return false;
        }
        let mut keys = self.write();
        if keys.1.is_some_and(|at| now.duration_since(at) < max_age) {
            return false;
        }
        keys.1 = Some(now);
        true
    }

    pub fn set(&self, keys: Vec<pb::BrokerKey>) {
        let mut published = self.write();
        published.0 = keys;
        published.1 = Some(std::time::Instant::now());
    }

    // Replaced whole: a poisoned lock still holds a complete list.
    pub(super) fn read(&self) -> std::sync::RwLockReadGuard<'_, Published> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn write(&self) -> std::sync::RwLockWriteGuard<'_, Published> {
        self.0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl<S: Store> BrokerService<S> {
    pub(super) async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<pb::OpenSessionResponse, ServiceError> {
        let now_ms = self.clock.now_ms();
        let signed =
            self.signed::<pb::OpenSessionBody>(request.into_inner().signed.as_ref(), now_ms)?;
        signed.require_fresh(now_ms, self.config.limits.timestamp_window_ms)?;
        self.sessions.check_audience(&signed.body.broker_key_id)?;
        Ok(self.sessions.open(signed.agent, now_ms))
    }

    pub(super) async fn get_broker_keys(&self) -> pb::GetBrokerKeysResponse {
        pb::GetBrokerKeysResponse {
            keys: self.keys.refreshed(self.store.as_ref()).await,
        }
    }
}

impl PublishedKeys {
    /// The keys, first read again from the store when older than
    /// `KEYS_MAX_AGE_MS`. A replicated broker reads the shared registry
    /// (one read at a time): a replica registers its key before it
    /// serves, so its signatures verify with the keys of any replica
    /// asked after that.
    pub async fn refreshed<S: Store>(&self, store: &S) -> Vec<pb::BrokerKey> {
        if self.stale(KEYS_MAX_AGE_MS)
            && let Ok(Some(keys)) = store.broker_keys().await
            && !keys.is_empty()
        {
            self.set(keys);
        }
        self.get()
    }
}
