//! One WatchContracts stream for a client that follows many contracts
//! (the gateways): contracts added and removed at any time, each state
//! the broker sends handed to the client's `Follower`, and the stream
//! opened again, with every contract still followed, after it fails.
//! While it is down the follower is told (`live(false)`), so it reads
//! what it needs instead of trusting what the old stream said.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use broker_domain::limits::{MAX_WATCH_CONTRACTS_PER_MESSAGE, MAX_WATCHED_CONTRACTS};
use broker_wire::pb;

use crate::Link;

/// Changes queued for the stream before a new one is refused (its
/// follower reads that contract instead).
pub const MAX_QUEUED_CHANGES: usize = 4_096;
/// Longest pause before the stream is opened again after it failed.
const RETRY_CAP: Duration = Duration::from_secs(5);
/// First pause before opening it again.
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// A contract's 32-byte id.
pub type Id = [u8; 32];

/// What follows the watched contracts; called from the stream's task.
pub trait Follower: Send + Sync + 'static {
    /// The contracts a new stream watches, at most `max` (the follower
    /// reads the others itself); each one's state comes back at once.
    fn followed(&self, max: usize) -> Vec<Id>;
    /// A watched contract's state: when it was added, and after each
    /// change of its status (an ancestor's revocation included).
    fn state(&self, state: &pb::ContractState);
    /// The stream opened (true) or was lost (false); while it is lost,
    /// what it said may be stale.
    fn live(&self, live: bool);
    /// A contract the stream will not watch (past its bound): its
    /// follower reads it.
    fn unwatched(&self, id: &Id);
}

/// A contract to start or stop watching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    Add(Id),
    Remove(Id),
}

/// The sending side: where the client says what to watch.
#[derive(Clone)]
pub struct Changes(tokio::sync::mpsc::Sender<Change>);

/// The stream task's side of `Changes`.
pub struct Receiver(tokio::sync::mpsc::Receiver<Change>);

/// A queue of changes for one stream (`run`).
pub fn changes() -> (Changes, Receiver) {
    let (sender, receiver) = tokio::sync::mpsc::channel(MAX_QUEUED_CHANGES);
    (Changes(sender), Receiver(receiver))
}

impl Changes {
    /// Queues a change; false when the queue is full or the stream's task
    /// has stopped (then the follower reads that contract itself).
    pub fn send(&self, change: Change) -> bool {
        self.0.try_send(change).is_ok()
    }
}

/// Keeps one WatchContracts stream open for `follower` until `stop`
/// resolves or every `Changes` is dropped.
pub async fn run(
    link: Link,
    follower: Arc<dyn Follower>,
    mut changes: Receiver,
    stop: impl Future<Output = ()>,
) {
    tokio::pin!(stop);
    let mut pause = RETRY_FIRST;
    loop {
        let why = tokio::select! {
            () = &mut stop => return,
            watched = watch(&link, follower.as_ref(), &mut changes.0) => match watched {
                Ok(()) => return,
                Err(why) => why,
            },
        };
        follower.live(false);
        tracing::warn!(%why, "the broker's contract stream ended; contracts are read until it is back");
        tokio::select! {
            () = &mut stop => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(RETRY_CAP);
    }
}

/// One stream, from its opening (every followed contract added) until it
/// fails (Err) or the changes end (Ok).
async fn watch(
    link: &Link,
    follower: &dyn Follower,
    changes: &mut tokio::sync::mpsc::Receiver<Change>,
) -> Result<(), String> {
    let (requests, outgoing) = tokio::sync::mpsc::channel(1);
    let mut adds: Vec<Vec<u8>> = follower
        .followed(MAX_WATCHED_CONTRACTS)
        .into_iter()
        .take(MAX_WATCHED_CONTRACTS)
        .map(|id| id.to_vec())
        .collect();
    let mut removes = Vec::new();
    // Contracts the stream watches once what was sent is taken.
    let mut watched = 0usize;
    let mut client = link.reader().await.map_err(|e| e.message)?;
    let mut states = client
        .watch_contracts(tokio_stream::wrappers::ReceiverStream::new(outgoing))
        .await
        .map_err(|status| status.message().to_owned())?
        .into_inner();
    follower.live(true);
    // Changes wait here until the stream takes them, so the states it
    // brings are read meanwhile (a stream blocked on sending would stop
    // the broker's answers, and the broker's answers its reading).
    loop {
        let pending = !(adds.is_empty() && removes.is_empty());
        tokio::select! {
            change = changes.recv() => {
                let Some(change) = change else { return Ok(()) };
                if adds.len() + removes.len() >= MAX_QUEUED_CHANGES {
                    tracing::warn!("the contract watch queue is full: a contract is read instead");
                    if let Change::Add(id) = &change {
                        follower.unwatched(id);
                    }
                    continue;
                }
                if let Change::Add(id) = &change
                    && watched + adds.len() >= MAX_WATCHED_CONTRACTS
                {
                    follower.unwatched(id);
                    continue;
                }
                queue(&mut adds, &mut removes, change);
            }
            permit = requests.reserve(), if pending => {
                let permit = permit.map_err(|_| "the stream closed".to_owned())?;
                // Removes first; adds fill the rest of one message.
                let take = |ids: &mut Vec<Vec<u8>>, room: usize| {
                    let at = ids.len().saturating_sub(room);
                    ids.split_off(at)
                };
                let remove_contract_ids = take(&mut removes, MAX_WATCH_CONTRACTS_PER_MESSAGE);
                let room = MAX_WATCH_CONTRACTS_PER_MESSAGE - remove_contract_ids.len();
                let add_contract_ids = take(&mut adds, room);
                watched = (watched + add_contract_ids.len()).saturating_sub(remove_contract_ids.len());
                permit.send(pb::WatchContractsRequest {
                    add_contract_ids,
                    remove_contract_ids,
                });
            }
            state = states.message() => match state {
                Ok(Some(response)) => {
                    if let Some(state) = response.contract {
                        follower.state(&state);
                    }
                }
                Ok(None) => return Err("the broker ended the stream".into()),
                Err(status) => return Err(status.message().to_owned()),
            },
        }
    }
}

/// Adds `change` to what waits for the stream: an add and a remove of one
/// contract cancel out.
fn queue(adds: &mut Vec<Vec<u8>>, removes: &mut Vec<Vec<u8>>, change: Change) {
    let (to, other, id) = match change {
        Change::Add(id) => (adds, removes, id),
        Change::Remove(id) => (removes, adds, id),
    };
    let id = id.to_vec();
    match other.iter().position(|o| *o == id) {
        Some(at) => {
            other.swap_remove(at);
        }
        None => to.push(id),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_add_and_a_remove_of_one_contract_cancel_out() {
        let (mut adds, mut removes) = (Vec::new(), Vec::new());
        queue(&mut adds, &mut removes, Change::Add([1; 32]));
        queue(&mut adds, &mut removes, Change::Add([2; 32]));
        queue(&mut adds, &mut removes, Change::Remove([1; 32]));
        queue(&mut adds, &mut removes, Change::Remove([3; 32]));
        assert_eq!(adds, vec![vec![2; 32]]);
        assert_eq!(removes, vec![vec![3; 32]]);
    }
}
