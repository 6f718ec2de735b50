//! Watch: a stream of a subtree's signed events, capped broker-wide (with
//! a reserve for small tenants), per caller, per connection and per tree,
//! and woken only when its tree changed.

use tonic::Status;

use super::BrokerService;
use super::convert;
use super::error::ServiceError;
use super::limits::{WATCH_BUFFER, WATCH_PAGE, WATCH_PAGE_BYTES};
use crate::core::InputError;
use crate::pb;
use crate::pb::broker_server::Broker;
use crate::store::{Event, Store};

impl<S: Store> BrokerService<S> {
    pub(super) async fn watch_stream(
        &self,
        request: pb::WatchRequest,
        caller: crate::core::AgentKey,
        connection: Option<std::net::SocketAddr>,
    ) -> Result<<Self as Broker>::WatchStream, ServiceError> {
        let contract = convert::id(&request.contract_id, "contract_id")?;
        let cursor = i64::try_from(request.cursor)
            .map_err(|_| InputError::new("cursor", "is not a cursor this broker issued"))?;
        let Some(record) = self.store.contract(contract).await? else {
            return Err(ServiceError::not_found(
                crate::store::Entity::Contract,
                contract,
            ));
        };
        // Every cap before anything is started: broker-wide, per caller and
        // per connection, so one client cannot take every stream; the
        // broker-wide one keeps a reserve for tenants holding few streams,
        // so many keys filling it cannot keep another tenant out.
        let tenant = self.tenant_of(contract).await?;
        let by_caller = self
            .watch_callers
            .take_for(caller, tenant)
            .map_err(ServiceError::Overloaded)?;
        // Unknown peers (none on TCP or TLS) are only capped per caller.
        let by_connection = connection
            .map(|peer| {
                self.watch_connections
                    .take(peer)
                    .map_err(ServiceError::Overloaded)
            })
            .transpose()?;
        let root = record.root_id;
        let by_tree = self
            .watch_trees
            .take(root)
            .map_err(ServiceError::Overloaded)?;
        let (tx, rx) = tokio::sync::mpsc::channel(WATCH_BUFFER);
        let stream = Stream {
            gate: self.gate.clone(),
            share: crate::pool::Share {
                tenant,
                key: caller,
            },
            store: self.store.clone(),
            contract,
            root,
            cursor,
            stopping: self.stopping.clone(),
            tx,
        };
        tokio::spawn(async move {
            let _slots = (by_caller, by_connection, by_tree);
            stream.pump().await;
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    pub(super) async fn watch(
        &self,
        request: tonic::Request<pb::WatchRequest>,
    ) -> Result<<Self as Broker>::WatchStream, ServiceError> {
        let caller = self.caller(&request)?;
        let id = convert::id(&request.get_ref().contract_id, "contract_id")?;
        // Held while the stream is set up (its reads); each page it reads
        // later takes a turn of its own.
        let _turn = self
            .gate
            .admit(&self.config.tenants, &caller, Some(&id))
            .await?;
        self.authorize(&caller, id).await?;
        let connection = request.remote_addr();
        self.watch_stream(request.into_inner(), caller, connection)
            .await
    }
}

/// One Watch stream's state on its task.
struct Stream<S> {
    /// Each page is read in its tenant's turn (`share`), like any read.
    gate: std::sync::Arc<super::gate::Gate>,
    share: crate::pool::Share,
    store: std::sync::Arc<S>,
    contract: crate::core::Id,
    /// Its tree's root: a commit elsewhere does not make it query.
    root: crate::core::Id,
    /// The last event sent.
    cursor: i64,
    stopping: tokio::sync::watch::Receiver<bool>,
    tx: tokio::sync::mpsc::Sender<Result<pb::WatchResponse, Status>>,
}

impl<S: Store> Stream<S> {
    /// Sends the subtree's events after `cursor`, then each new one as its
    /// tree changes, until the client goes away or the server stops.
    async fn pump(mut self) {
        let trees = self.store.tree_changes();
        let mut commits = self.store.commits();
        let mut query = true;
        loop {
            let events = if query {
                // Mark what we have seen before reading, so a commit
                // that lands after the read still wakes us.
                commits.borrow_and_update();
                // Refused (the tenant's queue is full, or its turn did not
                // come): the stream ends OVERLOADED and the client
                // resumes from its last cursor.
                let _turn = match self.gate.admit_share(self.share).await {
                    Ok(turn) => turn,
                    Err(e) => {
                        let _ = self.tx.send(Err(Status::from(e))).await;
                        return;
                    }
                };
                match self
                    .store
                    .events(self.contract, self.cursor, WATCH_PAGE, WATCH_PAGE_BYTES)
                    .await
                {
                    Ok(events) => events,
                    Err(e) => {
                        let _ = self.tx.send(Err(Status::from(ServiceError::from(e)))).await;
                        return;
                    }
                }
            } else {
                Vec::new()
            };
            if events.is_empty() {
                tokio::select! {
                    changed = commits.changed() => if changed.is_err() { return },
                    () = self.tx.closed() => return,
                    _ = self.stopping.wait_for(|stop| *stop) => {
                        // UNAVAILABLE: the client resumes from its last
                        // event's cursor elsewhere or after the restart.
                        // Not waited for: a client that does not read
                        // must not hold the stop.
                        let _ = self.tx.try_send(Err(Status::from(ServiceError::ShuttingDown)));
                        return;
                    }
                }
                // Woken by any commit; query only if this tree got an
                // event after what was sent (see `TreeChanges`). Marked
                // seen first: a tree is touched before its commit is
                // announced, so any announcement after this mark wakes
                // us again, and any before it is visible to the check.
                commits.borrow_and_update();
                query = trees.changed_since(&self.root, self.cursor);
                continue;
            }
            query = true;
            for event in events {
                let (at, event) = match event {
                    Event::Contract { cursor, envelope } => {
                        (cursor, pb::watch_response::Event::Contract(envelope))
                    }
                    Event::Receipt { cursor, envelope } => {
                        (cursor, pb::watch_response::Event::Receipt(envelope))
                    }
                };
                self.cursor = at;
                let response = pb::WatchResponse {
                    cursor: u64::try_from(at).unwrap_or_default(),
                    event: Some(event),
                };
                if self.tx.send(Ok(response)).await.is_err() {
                    return; // The client went away.
                }
            }
        }
    }
}
