//! WatchContracts: one stream of the states of many contracts the client
//! names, each sent when added and again when its status changes. A
//! change is seen through `TreeChanges`: the tree versions of the
//! watched contracts are compared at most every `WATCH_SCAN_MS` after a
//! commit, and only the contracts of trees that changed since their last
//! read (their add's included) are read again, so idle contracts cost no
//! read at all.

use std::collections::HashMap;

use tonic::{Status, Streaming};

use super::BrokerService;
use super::convert;
use super::error::ServiceError;
use super::limits::{
    MAX_WATCH_CONTRACTS_PER_MESSAGE, MAX_WATCHED_CONTRACTS, WATCH_READS_AT_ONCE, WATCH_SCAN_MS,
    WATCH_STALE_RESCAN_MS,
};
use crate::core::access::Standing;
use crate::core::{AgentKey, Id};
use crate::pb;
use crate::store::{Store, TreeChanges, TreeVersion};

/// What the client is told of one contract: its status when last read,
/// and its tree's version then (`None`: read while an event of the tree
/// may have been committing, so read it again at the next scan).
struct Watched {
    root: Id,
    status: i32,
    version: Option<TreeVersion>,
}

/// Why a stream ends early: a status for the client, or `None` when the
/// client went away.
type Ended = Option<Status>;

/// A service error as the status that ends the stream.
fn ended(error: impl Into<ServiceError>) -> Ended {
    Some(Status::from(error.into()))
}

pub(super) type ContractsStream = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<pb::WatchContractsResponse, Status>> + Send>,
>;

impl<S: Store> BrokerService<S> {
    pub(super) async fn watch_contracts(
        &self,
        request: tonic::Request<Streaming<pb::WatchContractsRequest>>,
    ) -> Result<ContractsStream, ServiceError> {
        let caller = self.caller(&request)?;
        let _turn = self.admit_caller(&caller).await?;
        let tenant = self.config.tenants.of(&caller);
        let by_caller = self
            .watch_callers
            .take_for(caller, tenant)
            .map_err(ServiceError::Overloaded)?;
        let by_connection = request
            .remote_addr()
            .map(|peer| {
                self.watch_connections
                    .take(peer)
                    .map_err(ServiceError::Overloaded)
            })
            .transpose()?;
        let (tx, rx) = tokio::sync::mpsc::channel(super::limits::WATCH_BUFFER);
        // The status that ends the stream, sent after what is buffered: a
        // channel of its own, so ending never waits for the client.
        let (end_tx, end_rx) = tokio::sync::mpsc::channel(1);
        let requests = request.into_inner();
        let (store, config, gate) = (self.store.clone(), self.config.clone(), self.gate.clone());
        let stopping = self.stopping.clone();
        tokio::spawn(async move {
            let _slots = (by_caller, by_connection);
            let mut pump = Pump {
                store,
                config,
                gate,
                stopping,
                caller,
                requests,
                watched: HashMap::new(),
                stale_read_at: None,
                tx,
            };
            if let Err(Some(status)) = pump.run().await {
                let _ = end_tx.try_send(Err(status));
            }
        });
        use tokio_stream::StreamExt;
        use tokio_stream::wrappers::ReceiverStream;
        Ok(Box::pin(
            ReceiverStream::new(rx).chain(ReceiverStream::new(end_rx)),
        ))
    }
}

/// One WatchContracts stream on its task.
struct Pump<S> {
    store: std::sync::Arc<S>,
    config: std::sync::Arc<crate::config::Config>,
    /// Each scan's reads take a turn of the caller's tenant, like any read.
    gate: std::sync::Arc<super::gate::Gate>,
    stopping: tokio::sync::watch::Receiver<bool>,
    caller: AgentKey,
    requests: Streaming<pb::WatchContractsRequest>,
    watched: HashMap<Id, Watched>,
    /// When every contract was last read because versions were not
    /// current (replicas whose sequencer fell behind).
    stale_read_at: Option<std::time::Instant>,
    tx: tokio::sync::mpsc::Sender<Result<pb::WatchContractsResponse, Status>>,
}

/// What one read found: the contract, the status the client was told
/// (`None`: never told), its tree's version as of the read (`None`: an
/// event of the tree may have come meanwhile), and the record (or the
/// error).
type Read = (
    Id,
    Option<i32>,
    Option<TreeVersion>,
    Result<Option<crate::store::ContractRecord>, crate::store::StoreError>,
);

impl<S: Store> Pump<S> {
    /// Serves the stream until the client goes away (Ok) or it must end
    /// with a status.
    async fn run(&mut self) -> Result<(), Ended> {
        let trees = self.store.tree_changes();
        let mut commits = self.store.commits();
        let mut stopping = self.stopping.clone();
        // A scan put off (its turn refused, or versions not current and
        // every contract read a moment ago): when to try again.
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            let retry = async {
                match retry_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                request = self.requests.message() => match request {
                    Ok(Some(request)) => self.change(request).await?,
                    Ok(None) => return Ok(()),
                    // A message too large or undecodable, or the client gone.
                    Err(status) => return Err(Some(status)),
                },
                changed = commits.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    // Commits in a burst are looked at together.
                    tokio::time::sleep(std::time::Duration::from_millis(WATCH_SCAN_MS)).await;
                    commits.borrow_and_update();
                    retry_at = self.scan(&trees).await?;
                }
                () = retry => {
                    retry_at = self.scan(&trees).await?;
                }
                _ = async { stopping.wait_for(|stop| *stop).await.is_ok() } => {
                    return Err(ended(ServiceError::ShuttingDown));
                }
                () = self.tx.closed() => return Ok(()),
            }
        }
    }

    /// Adds and removes contracts; each newly added one is answered with
    /// its state (one already watched is left as it is).
    async fn change(&mut self, request: pb::WatchContractsRequest) -> Result<(), Ended> {
        let named = request.add_contract_ids.len() + request.remove_contract_ids.len();
        if named > MAX_WATCH_CONTRACTS_PER_MESSAGE {
            return Err(ended(crate::core::InputError::new(
                "add_contract_ids",
                format!(
                    "names more than {MAX_WATCH_CONTRACTS_PER_MESSAGE} contracts in one message (adds and removes together)"
                ),
            )));
        }
        for id in &request.remove_contract_ids {
            if let Ok(id) = convert::id(id, "remove_contract_ids") {
                self.watched.remove(&id);
            }
        }
        let mut added = Vec::with_capacity(request.add_contract_ids.len());
        for id in &request.add_contract_ids {
            let id = convert::id(id, "add_contract_ids").map_err(ended)?;
            if !self.watched.contains_key(&id) && !added.contains(&id) {
                added.push(id);
            }
        }
        if self.watched.len() + added.len() > MAX_WATCHED_CONTRACTS {
            return Err(ended(ServiceError::Overloaded("max_watched_contracts")));
        }
        // Checked and read in the caller's turn, a few at a time; sent
        // after the turn is given back (a client slow to read holds no
        // place at work).
        let reader = self.config.readers.contains(&self.caller);
        for chunk in added.chunks(WATCH_READS_AT_ONCE) {
            let turn = self
                .gate
                .admit(&self.config.tenants, &self.caller, None)
                .await
                .map_err(ended)?;
            let mut reads = tokio::task::JoinSet::new();
            for (at, &id) in chunk.iter().enumerate() {
                let (store, caller) = (self.store.clone(), self.caller);
                reads.spawn(async move {
                    // Its tree is known only once read: what had committed
                    // before the read tells whether the read is its
                    // tree's current state (else the next scan reads it).
                    let trees = store.tree_changes();
                    let mark = trees.committed_mark();
                    let record = store.contract(id).await;
                    let version = match &record {
                        Ok(Some(r)) => trees.settled_since(&r.root_id, mark),
                        _ => None,
                    };
                    // A contract's own delegate or host needs no other read.
                    let named = matches!(&record, Ok(Some(r)) if super::access::names(r, &caller));
                    let party = if reader || named {
                        Ok(Some(true))
                    } else {
                        store.is_party(id, caller).await
                    };
                    (at, id, party, record, version)
                });
            }
            let mut read = reads.join_all().await;
            drop(turn);
            read.sort_by_key(|(at, ..)| *at);
            for (_, id, party, record, version) in read {
                if !crate::core::access::may_read(Standing::of_party(party.map_err(ended)?)) {
                    return Err(ended(ServiceError::not_found(
                        crate::store::Entity::Contract,
                        id,
                    )));
                }
                self.apply((id, None, version, record), true).await?;
            }
        }
        Ok(())
    }

    /// Reads the contracts of every tree that changed since their last
    /// read, and sends those whose status changed. When the scan must be
    /// put off, when to try again.
    async fn scan(&mut self, trees: &TreeChanges) -> Result<Option<tokio::time::Instant>, Ended> {
        // With replicas, a tree's version is known only while the
        // sequencer keeps up: else every contract is read again, at most
        // once every WATCH_STALE_RESCAN_MS.
        let current = trees.current();
        let stale_every = std::time::Duration::from_millis(WATCH_STALE_RESCAN_MS);
        if !current {
            if let Some(at) = self.stale_read_at.filter(|at| at.elapsed() < stale_every) {
                return Ok(Some((at + stale_every).into()));
            }
            self.stale_read_at = Some(std::time::Instant::now());
        }
        let now = if current {
            trees.versions(self.watched.values().map(|w| &w.root))
        } else {
            Vec::new()
        };
        // `now` is in the map's order: nothing changed it meanwhile.
        let due: Vec<(Id, Id, i32)> = self
            .watched
            .iter()
            .enumerate()
            .filter(|(at, (_, w))| !current || w.version.is_none_or(|v| now.get(*at) != Some(&v)))
            .map(|(_, (id, w))| (*id, w.root, w.status))
            .collect();
        if due.is_empty() {
            return Ok(None);
        }
        // The reads take the caller's turn; refused, the scan is put off
        // (the stream goes on).
        let Ok(turn) = self
            .gate
            .admit(&self.config.tenants, &self.caller, None)
            .await
        else {
            return Ok(Some(
                tokio::time::Instant::now() + std::time::Duration::from_millis(WATCH_SCAN_MS),
            ));
        };
        // A subtree revoked at once changes many contracts: read a few at
        // a time in parallel, all before sending any.
        let mut found: Vec<Read> = Vec::with_capacity(due.len());
        for chunk in due.chunks(WATCH_READS_AT_ONCE) {
            let mut reads = tokio::task::JoinSet::new();
            for &(id, root, status) in chunk {
                let (store, trees) = (self.store.clone(), trees.clone());
                reads.spawn(async move {
                    let version = trees.settled_version(&root);
                    (id, Some(status), version, store.contract(id).await)
                });
            }
            found.extend(reads.join_all().await);
        }
        drop(turn);
        for read in found {
            self.apply(read, false).await?;
        }
        Ok(None)
    }

    /// Records what a read found (at its tree's version as of the read:
    /// `None` when an event of the tree may have come meanwhile, so the
    /// next scan reads it again) and sends the state when `always` or its
    /// status is not the one the client was told.
    async fn apply(
        &mut self,
        (id, known, version, record): Read,
        always: bool,
    ) -> Result<(), Ended> {
        let record = match record {
            Ok(Some(record)) => record,
            Ok(None) => {
                return Err(ended(ServiceError::not_found(
                    crate::store::Entity::Contract,
                    id,
                )));
            }
            Err(e) => return Err(ended(e)),
        };
        let root = record.root_id;
        let state = convert::contract_state(record);
        let changed = known.is_none_or(|status| status != state.status);
        self.watched.insert(
            id,
            Watched {
                root,
                status: state.status,
                version,
            },
        );
        if always || changed {
            self.send(pb::WatchContractsResponse {
                contract: Some(state),
            })
            .await?;
        }
        Ok(())
    }

    /// Sends one state, waiting for the client to read at most
    /// `limits.watch_send_timeout_ms`, and not past a shutdown.
    async fn send(&mut self, response: pb::WatchContractsResponse) -> Result<(), Ended> {
        let mut stopping = self.stopping.clone();
        let timeout = std::time::Duration::from_millis(self.config.limits.watch_send_timeout_ms);
        tokio::select! {
            sent = tokio::time::timeout(timeout, self.tx.send(Ok(response))) => match sent {
                Ok(Ok(())) => Ok(()),
                // The client went away.
                Ok(Err(_)) => Err(None),
                Err(_) => Err(ended(ServiceError::Overloaded(
                    crate::config::keys::watch_send_timeout_ms,
                ))),
            },
            _ = async { stopping.wait_for(|stop| *stop).await.is_ok() } => {
                Err(ended(ServiceError::ShuttingDown))
            }
        }
    }
}
