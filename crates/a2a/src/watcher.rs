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
/// Contracts named in one WatchContracts message (the broker's bound).
const MAX_IDS_PER_MESSAGE: usize = 1_024;
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
pub(crate) async fn run(gateway: Arc<Gateway>, mut changes: tokio::sync::mpsc::Receiver<Change>) {
    let mut pause = RETRY_FIRST;
    loop {
        match watch(&gateway, &mut changes).await {
            Ok(()) => return, // The gateway is stopping: no more changes.
            Err(why) => {
                gateway.watching.store(false, Ordering::Release);
                tracing::warn!(%why, "the broker's contract stream ended; followers read their contracts until it is back");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RETRY_CAP);
    }
}

/// One stream, from its opening (every followed contract added) until it
/// fails (Err) or the changes end (Ok).
async fn watch(
    gateway: &Arc<Gateway>,
    changes: &mut tokio::sync::mpsc::Receiver<Change>,
) -> Result<(), String> {
    let (requests, outgoing) = tokio::sync::mpsc::channel(MAX_QUEUED_CHANGES / MAX_IDS_PER_MESSAGE);
    let followed: Vec<Id> = {
        let admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
        admitted
            .tasks
            .values()
            .map(|slot| slot.contract_id)
            .collect()
    };
    for chunk in followed.chunks(MAX_IDS_PER_MESSAGE) {
        let add = pb::WatchContractsRequest {
            add_contract_ids: chunk.iter().map(|id| id.to_vec()).collect(),
            remove_contract_ids: Vec::new(),
        };
        if requests.try_send(add).is_err() {
            return Err("too many contracts to add at once".into());
        }
    }
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
    let (mut adds, mut removes) = (Vec::new(), Vec::new());
    loop {
        let pending = !(adds.is_empty() && removes.is_empty());
        tokio::select! {
            change = changes.recv() => {
                let Some(change) = change else { return Ok(()) };
                if adds.len() + removes.len() >= MAX_QUEUED_CHANGES {
                    tracing::warn!("the contract watch queue is full: a follower reads its contract instead");
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
                let take = |ids: &mut Vec<Vec<u8>>| {
                    let at = ids.len().saturating_sub(MAX_IDS_PER_MESSAGE);
                    ids.split_off(at)
                };
                permit.send(pb::WatchContractsRequest {
                    add_contract_ids: take(&mut adds),
                    remove_contract_ids: take(&mut removes),
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

/// Gives a contract's state to the slot of its task.
fn deliver(gateway: &Gateway, state: &pb::ContractState) {
    let Ok(id) = Id::try_from(state.contract_id.as_slice()) else {
        return;
    };
    let slot = {
        let admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
        admitted
            .contracts
            .get(&id)
            .and_then(|task| task.as_ref())
            .and_then(|task| admitted.tasks.get(task))
            .cloned()
    };
    if let Some(slot) = slot {
        slot.status.send_replace(Some(state.status));
    }
}
