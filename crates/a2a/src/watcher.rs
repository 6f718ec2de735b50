//! The contracts of the followed tasks, watched on one WatchContracts
//! stream for the whole gateway: the broker sends a contract's state when
//! it is added and when its status changes, so an idle followed task
//! costs the broker nothing, and a revocation (the contract's own or an
//! ancestor's) reaches its follower at once. While the stream is down the
//! followers read their contracts as before (`Gateway::broker_status`),
//! and it is opened again with every followed contract.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use broker_domain::Id;
use broker_wire::pb;

use crate::Gateway;

/// Changes queued for the stream before a new one is dropped (the
/// follower of a contract whose add was dropped reads it instead).
pub(crate) const MAX_QUEUED_CHANGES: usize = 4_096;
/// Contracts named in one WatchContracts message, adds and removes
/// together (the broker's bound).
const MAX_IDS_PER_MESSAGE: usize = 1_024;
/// Contracts one stream watches (the broker's bound): the followers of
/// any more read their contracts.
const MAX_WATCHED: usize = 4_096;
/// Longest pause before the stream is opened again after it failed.
const RETRY_CAP: Duration = Duration::from_secs(5);
/// First pause before opening it again.
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// A contract to start or stop watching.
pub(crate) enum Change {
    Add(Id),
    Remove(Id),
}

/// Keeps the gateway's WatchContracts stream open and hands each state it
/// brings to the slot of that contract's task.
pub(crate) async fn run(
    gateway: Arc<Gateway>,
    mut changes: tokio::sync::mpsc::Receiver<Change>,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut pause = RETRY_FIRST;
    loop {
        let why = tokio::select! {
            () = stop.cancelled() => return,
            watched = watch(&gateway, &mut changes) => match watched {
                Ok(()) => return,
                Err(why) => why,
            },
        };
        gateway.watching.store(false, Ordering::Release);
        // What the old stream said may be stale by the time a new one
        // answers: the followers read their contracts meanwhile.
        let slots: Vec<_> = {
            let admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
            admitted.tasks.values().cloned().collect()
        };
        for slot in slots {
            slot.status.send_replace(None);
        }
        tracing::warn!(%why, "the broker's contract stream ended; followers read their contracts until it is back");
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(RETRY_CAP);
    }
}

/// One stream, from its opening (every followed contract added) until it
/// fails (Err) or the changes end (Ok).
async fn watch(
    gateway: &Arc<Gateway>,
    changes: &mut tokio::sync::mpsc::Receiver<Change>,
) -> Result<(), String> {
    let (requests, outgoing) = tokio::sync::mpsc::channel(1);
    // Every task still followed, up to what one stream watches (the
    // followers of the rest read their contracts).
    let slots: Vec<_> = {
        let admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
        admitted
            .tasks
            .values()
            .filter(|slot| !slot.finished.load(Ordering::Acquire))
            .cloned()
            .collect()
    };
    let mut adds: Vec<Vec<u8>> = Vec::new();
    for (at, slot) in slots.iter().enumerate() {
        let watched = at < MAX_WATCHED;
        slot.watched.store(watched, Ordering::Release);
        if watched {
            adds.push(slot.contract_id.to_vec());
        }
    }
    let mut removes = Vec::new();
    // Contracts the stream watches once what was sent is taken.
    let mut watched = 0usize;
    let mut client = gateway.link.reader().await.map_err(|e| e.message)?;
    let mut states = client
        .watch_contracts(tokio_stream::wrappers::ReceiverStream::new(outgoing))
        .await
        .map_err(|status| status.message().to_owned())?
        .into_inner();
    gateway.watching.store(true, Ordering::Release);
    // Changes wait here until the stream takes them, so the states it
    // brings are read meanwhile (a stream blocked on sending would stop
    // the broker's answers, and the broker's answers its reading).
    loop {
        let pending = !(adds.is_empty() && removes.is_empty());
        tokio::select! {
            change = changes.recv() => {
                let Some(change) = change else { return Ok(()) };
                if adds.len() + removes.len() >= MAX_QUEUED_CHANGES {
                    tracing::warn!("the contract watch queue is full: a follower reads its contract instead");
                    continue;
                }
                if let Change::Add(id) = &change
                    && watched + adds.len() >= MAX_WATCHED
                {
                    // Past the stream's bound: that follower reads.
                    unwatched(gateway, id);
                    continue;
                }
                // An add and a remove of one contract cancel out.
                let (to, from) = match change {
                    Change::Add(id) => (&mut adds, (&mut removes, id)),
                    Change::Remove(id) => (&mut removes, (&mut adds, id)),
                };
                let (other, id) = from;
                let id = id.to_vec();
                match other.iter().position(|o| *o == id) {
                    Some(at) => {
                        other.swap_remove(at);
                    }
                    None => to.push(id),
                }
            }
            permit = requests.reserve(), if pending => {
                let permit = permit.map_err(|_| "the stream closed".to_owned())?;
                // Removes first; adds fill the rest of one message.
                let take = |ids: &mut Vec<Vec<u8>>, room: usize| {
                    let at = ids.len().saturating_sub(room);
                    ids.split_off(at)
                };
                let remove_contract_ids = take(&mut removes, MAX_IDS_PER_MESSAGE);
                let add_contract_ids = take(&mut adds, MAX_IDS_PER_MESSAGE - remove_contract_ids.len());
                watched = (watched + add_contract_ids.len()).saturating_sub(remove_contract_ids.len());
                permit.send(pb::WatchContractsRequest {
                    add_contract_ids,
                    remove_contract_ids,
                });
            }
            state = states.message() => match state {
                Ok(Some(response)) => {
                    if let Some(state) = response.contract {
                        deliver(gateway, &state);
                    }
                }
                Ok(None) => return Err("the broker ended the stream".into()),
                Err(status) => return Err(status.message().to_owned()),
            },
        }
    }
}

/// The slot of a contract's task, if it is followed.
fn slot_of(gateway: &Gateway, id: &Id) -> Option<Arc<crate::Slot>> {
    let admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
    admitted
        .contracts
        .get(id)
        .and_then(|task| task.as_ref())
        .and_then(|task| admitted.tasks.get(task))
        .cloned()
}

/// A contract the stream will not watch: its follower reads it.
fn unwatched(gateway: &Gateway, id: &Id) {
    if let Some(slot) = slot_of(gateway, id) {
        slot.watched.store(false, Ordering::Release);
    }
}

/// Gives a contract's state to the slot of its task.
fn deliver(gateway: &Gateway, state: &pb::ContractState) {
    let Ok(id) = Id::try_from(state.contract_id.as_slice()) else {
        return;
    };
    let slot = slot_of(gateway, &id);
    if let Some(slot) = slot {
        slot.status.send_replace(Some(state.status));
    }
}
