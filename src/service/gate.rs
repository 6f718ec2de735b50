//! Admission: a request that reads or writes the store first takes a
//! place at work (`limits.max_requests_at_work`), handed out by tenant in
//! turn, then by key (`pool::FairQueue`). Queues past it (the readers'
//! pool, the writer's) are first come first served, so without this a
//! tenant with a thousand calls in flight makes every other tenant's call
//! wait behind all of them. The tenant is found before any read
//! (`Tenants::admitting`): from the signer's declared tenant, or from a
//! memo of the contracts this broker issued or read.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use super::error::ServiceError;
use super::limits::ADMISSION_MEMO;
use crate::core::tenant::{Known, Tenants};
use crate::core::{AgentKey, Id};
use crate::pool::{FairQueue, PoolError, Share, Turn};

pub(crate) struct Gate {
    places: FairQueue,
    wait: Duration,
    memo: Mutex<Memo>,
}

/// Two generations: a hit in the older one moves to the newer.
#[derive(Default)]
struct Memo {
    newer: HashMap<Id, Known>,
    older: HashMap<Id, Known>,
}

impl Memo {
    fn get(&mut self, id: &Id) -> Option<Known> {
        if let Some(known) = self.newer.get(id) {
            return Some(*known);
        }
        let known = self.older.remove(id)?;
        self.insert(*id, known);
        Some(known)
    }

    fn insert(&mut self, id: Id, known: Known) {
        if self.newer.len() >= ADMISSION_MEMO {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(id, known);
    }
}

impl Gate {
    pub(crate) fn new(places: usize, wait_ms: u64) -> Self {
        Self {
            places: FairQueue::new(places),
            wait: Duration::from_millis(wait_ms),
            memo: Mutex::default(),
        }
    }

    /// What the memo knows of `id`.
    pub(crate) fn known(&self, id: &Id) -> Option<Known> {
        self.lock().get(id)
    }

    /// Remembers `id`'s tenant and parties (it was issued or read).
    pub(crate) fn remember(&self, id: Id, known: Known) {
        self.lock().insert(id, known);
    }

    /// A place at work for `signer`'s request naming `named` (if any),
    /// in its tenant's turn; refused OVERLOADED when the tenant already
    /// has `MAX_WAITING_PER_TENANT` requests waiting, or the turn did not
    /// come within `limits.admission_wait_ms`.
    pub(crate) async fn admit(
        &self,
        tenants: &Tenants,
        signer: &AgentKey,
        named: Option<&Id>,
    ) -> Result<Turn, ServiceError> {
        let known = named.and_then(|id| self.known(id));
        let share = Share {
            tenant: tenants.admitting(signer, known.as_ref()),
            key: *signer,
        };
        self.admit_share(share).await
    }

    /// A place at work for a share already known (a Watch stream's page,
    /// its caller authorized and its tree's tenant read).
    pub(crate) async fn admit_share(&self, share: Share) -> Result<Turn, ServiceError> {
        self.places
            .acquire(share, self.wait)
            .await
            .map_err(|e| match e {
                PoolError::Full | PoolError::TimedOut(_) => {
                    ServiceError::Overloaded(crate::config::keys::max_requests_at_work)
                }
                PoolError::Panicked | PoolError::Stopped => {
                    ServiceError::Internal(format!("admission: {e}"))
                }
            })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memo> {
        // Each change is one insert or move: a poisoned lock still holds
        // a usable memo.
        self.memo
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
