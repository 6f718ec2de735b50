//! The contracts of the followed tasks, watched on one WatchContracts
//! stream for the whole gateway (`broker_client::watch`): the broker sends
//! a contract's state when it is added and when its status changes, so an
//! idle followed task costs the broker nothing, and a revocation (the
//! contract's own or an ancestor's) reaches its follower at once. While
//! the stream is down the followers read their contracts as before
//! (`Gateway::broker_status`), and it is opened again with every followed
//! contract.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use broker_client::watch::{self, Id};
use broker_wire::pb;

use crate::Gateway;

/// Keeps the gateway's WatchContracts stream open until `stop`.
pub(crate) async fn run(
    gateway: Arc<Gateway>,
    changes: watch::Receiver,
    stop: tokio_util::sync::CancellationToken,
) {
    let link = gateway.link.clone();
    let follower = Arc::new(Followers(gateway));
    watch::run(link, follower, changes, stop.cancelled_owned()).await;
}

/// The followed tasks' slots, as the stream's follower.
struct Followers(Arc<Gateway>);

impl Followers {
    /// The slot of a contract's task, if it is followed.
    fn slot_of(&self, id: &Id) -> Option<Arc<crate::Slot>> {
        let admitted = self.0.admitted.lock().unwrap_or_else(|e| e.into_inner());
        admitted
            .contracts
            .get(id)
            .and_then(|task| task.as_ref())
            .and_then(|task| admitted.tasks.get(task))
            .cloned()
    }
}

impl watch::Follower for Followers {
    /// Every task still followed, up to what one stream watches (the
    /// followers of the rest read their contracts).
    fn followed(&self, max: usize) -> Vec<Id> {
        let admitted = self.0.admitted.lock().unwrap_or_else(|e| e.into_inner());
        let mut ids = Vec::new();
        for slot in admitted
            .tasks
            .values()
            .filter(|slot| !slot.finished.load(Ordering::Acquire))
        {
            let watched = ids.len() < max;
            slot.watched.store(watched, Ordering::Release);
            if watched {
                ids.push(slot.contract_id);
            }
        }
        ids
    }

    fn state(&self, state: &pb::ContractState) {
        let Ok(id) = Id::try_from(state.contract_id.as_slice()) else {
            return;
        };
        if let Some(slot) = self.slot_of(&id) {
            slot.status.send_replace(Some(state.status));
        }
    }

    fn live(&self, live: bool) {
        self.0.watching.store(live, Ordering::Release);
        if live {
            return;
        }
        // What the old stream said may be stale by the time a new one
        // answers: the followers read their contracts meanwhile.
        let slots: Vec<_> = {
            let admitted = self.0.admitted.lock().unwrap_or_else(|e| e.into_inner());
            admitted.tasks.values().cloned().collect()
        };
        for slot in slots {
            slot.status.send_replace(None);
        }
    }

    fn unwatched(&self, id: &Id) {
        if let Some(slot) = self.slot_of(id) {
            slot.watched.store(false, Ordering::Release);
        }
    }
}
