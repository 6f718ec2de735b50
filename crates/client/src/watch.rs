//! One WatchContracts stream for a client that follows many contracts
//! (the gateways): contracts added and removed at any time, each state
//! the broker sends handed to the client's `Follower`, and the stream
//! opened again, with every contract still followed, after it fails.
//! While it is down the follower is told (`live(false)`), so it reads
//! what it needs instead of trusting what the old stream said.

use std::collections::HashSet;
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

pub use broker_domain::Id;

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
    let mut pending = Pending::default();
    for id in follower.followed(MAX_WATCHED_CONTRACTS) {
        if let Some(id) = pending.queue(Change::Add(id)) {
            follower.unwatched(&id);
        }
    }
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
        tokio::select! {
            change = changes.recv() => {
                let Some(change) = change else { return Ok(()) };
                if let Some(id) = pending.queue(change) {
                    follower.unwatched(&id);
                }
            }
            permit = requests.reserve(), if pending.any() => {
                let permit = permit.map_err(|_| "the stream closed".to_owned())?;
                permit.send(pending.message());
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

/// What one stream watches and what waits to be sent to it.
#[derive(Default)]
struct Pending {
    /// Watched once what was sent is taken.
    sent: HashSet<Id>,
    adds: HashSet<Id>,
    removes: HashSet<Id>,
}

impl Pending {
    /// Takes a change. An add and a remove of one contract cancel out; a
    /// remove of a contract never sent is ignored. Returns the contract of
    /// an add refused (past the stream's bound or the queue's): its
    /// follower reads it.
    fn queue(&mut self, change: Change) -> Option<Id> {
        match change {
            Change::Add(id) => {
                if self.removes.remove(&id) || self.sent.contains(&id) || self.adds.contains(&id) {
                    return None;
                }
                let full = self.sent.len() + self.adds.len() >= MAX_WATCHED_CONTRACTS
                    || self.adds.len() + self.removes.len() >= MAX_QUEUED_CHANGES;
                if full {
                    return Some(id);
                }
                self.adds.insert(id);
            }
            Change::Remove(id) => {
                if !self.adds.remove(&id) && self.sent.contains(&id) {
                    self.removes.insert(id);
                }
            }
        }
        None
    }

    fn any(&self) -> bool {
        !(self.adds.is_empty() && self.removes.is_empty())
    }

    /// The next message: removes first, adds filling the rest of the
    /// broker's bound on one message.
    fn message(&mut self) -> pb::WatchContractsRequest {
        let removes: Vec<Id> = self
            .removes
            .iter()
            .take(MAX_WATCH_CONTRACTS_PER_MESSAGE)
            .copied()
            .collect();
        let room = MAX_WATCH_CONTRACTS_PER_MESSAGE - removes.len();
        let adds: Vec<Id> = self.adds.iter().take(room).copied().collect();
        for id in &removes {
            self.removes.remove(id);
            self.sent.remove(id);
        }
        for id in &adds {
            self.adds.remove(id);
            self.sent.insert(*id);
        }
        pb::WatchContractsRequest {
            add_contract_ids: adds.iter().map(|id| id.to_vec()).collect(),
            remove_contract_ids: removes.iter().map(|id| id.to_vec()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_and_removes_cancel_out_and_only_what_was_sent_is_removed() {
        let mut pending = Pending::default();
        assert_eq!(pending.queue(Change::Add([1; 32])), None);
        assert_eq!(pending.queue(Change::Add([2; 32])), None);
        pending.queue(Change::Remove([1; 32]));
        // Never sent: nothing to remove.
        pending.queue(Change::Remove([3; 32]));
        let first = pending.message();
        assert_eq!(first.add_contract_ids, vec![vec![2; 32]]);
        assert!(first.remove_contract_ids.is_empty());
        assert!(!pending.any());
        pending.queue(Change::Remove([2; 32]));
        // Added again before the remove went: it stays watched.
        pending.queue(Change::Add([2; 32]));
        assert!(!pending.any());
        pending.queue(Change::Remove([2; 32]));
        let second = pending.message();
        assert_eq!(second.remove_contract_ids, vec![vec![2; 32]]);
        assert!(pending.sent.is_empty());
    }

    #[test]
    fn adds_past_the_bound_are_refused_and_messages_keep_within_theirs() {
        let mut pending = Pending::default();
        let id = |n: usize| {
            let mut id = [0u8; 32];
            id[..8].copy_from_slice(&(n as u64).to_be_bytes());
            id
        };
        for n in 0..MAX_WATCHED_CONTRACTS {
            assert_eq!(pending.queue(Change::Add(id(n))), None);
        }
        let over = id(MAX_WATCHED_CONTRACTS);
        assert_eq!(pending.queue(Change::Add(over)), Some(over));
        let mut sent = 0;
        while pending.any() {
            let message = pending.message();
            assert!(message.add_contract_ids.len() <= MAX_WATCH_CONTRACTS_PER_MESSAGE);
            sent += message.add_contract_ids.len();
        }
        assert_eq!(sent, MAX_WATCHED_CONTRACTS);
        // One removed makes room for one more.
        pending.queue(Change::Remove(id(0)));
        pending.message();
        assert_eq!(pending.queue(Change::Add(over)), None);
    }
}
