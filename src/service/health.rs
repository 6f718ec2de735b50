//! gRPC health (`grpc.health.v1.Health`), the broker's own rather than
//! tonic-health's: its answer is what the server decides (`Serving`: the
//! store can make writes durable, and no stop was asked), and its Watch
//! streams end at shutdown, right after they have sent NOT_SERVING — a
//! client's health Watch (gRPC client-side health checking keeps one per
//! connection) must never hold the process open.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{Semaphore, watch};
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use super::error::ServiceError;
use crate::pb;

/// What health says, as the server decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serving {
    /// The store can make writes durable.
    Serving,
    /// The store cannot serve now (storage failing, database away); it
    /// may come back.
    NotServing,
    /// A stop was asked: NOT_SERVING for good, and Watch streams end.
    Stopping,
}

impl Serving {
    fn wire(self) -> ServingStatus {
        match self {
            Self::Serving => ServingStatus::Serving,
            Self::NotServing | Self::Stopping => ServingStatus::NotServing,
        }
    }
}

use super::limits::{HEALTH_WATCH_BUFFER, MAX_HEALTH_WATCHES};

/// The services health answers for: the whole server, and the Broker.
const SERVICES: [&str; 2] = ["", pb::broker_server::SERVICE_NAME];

/// The `Health` service over the server's decision.
pub struct HealthService {
    state: watch::Receiver<Serving>,
    watches: Arc<Semaphore>,
}

/// The health service, following `state`.
pub fn health_server(state: watch::Receiver<Serving>) -> HealthServer<HealthService> {
    HealthServer::new(HealthService {
        state,
        watches: Arc::new(Semaphore::new(MAX_HEALTH_WATCHES)),
    })
}

fn known(service: &str) -> Result<(), Status> {
    if SERVICES.contains(&service) {
        Ok(())
    } else {
        Err(
            ServiceError::UnknownHealthService(crate::core::error::bounded(
                service.to_owned(),
                128,
            ))
            .into(),
        )
    }
}

fn response(serving: Serving) -> HealthCheckResponse {
    HealthCheckResponse {
        status: serving.wire() as i32,
    }
}

type WatchStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        known(&request.get_ref().service)?;
        Ok(Response::new(response(*self.state.borrow())))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        known(&request.get_ref().service)?;
        let permit = self
            .watches
            .clone()
            .try_acquire_owned()
            .map_err(|_| ServiceError::Overloaded("MAX_HEALTH_WATCHES"))?;
        let (tx, rx) = tokio::sync::mpsc::channel(HEALTH_WATCH_BUFFER);
        let mut state = self.state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            loop {
                let now = *state.borrow_and_update();
                if tx.send(Ok(response(now))).await.is_err() || now == Serving::Stopping {
                    // Gone, or told NOT_SERVING for the last time: the
                    // stream ends (status OK), the connection can close.
                    return;
                }
                tokio::select! {
                    changed = state.changed() => if changed.is_err() { return },
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    fn request(service: &str) -> Request<HealthCheckRequest> {
        Request::new(HealthCheckRequest {
            service: service.to_owned(),
        })
    }

    #[tokio::test]
    async fn watch_follows_the_state_and_ends_after_stopping() {
        let (state, rx) = watch::channel(Serving::Serving);
        let service = HealthService {
            state: rx,
            watches: Arc::new(Semaphore::new(1)),
        };
        let mut stream = service
            .watch(request(pb::broker_server::SERVICE_NAME))
            .await
            .unwrap()
            .into_inner();
        let status = |r: Option<Result<HealthCheckResponse, Status>>| r.unwrap().unwrap().status;
        assert_eq!(status(stream.next().await), ServingStatus::Serving as i32);
        // One stream at a time here: the second is refused.
        let second = service.watch(request("")).await.err().unwrap();
        assert_eq!(second.code(), tonic::Code::ResourceExhausted);
        state.send(Serving::NotServing).unwrap();
        assert_eq!(
            status(stream.next().await),
            ServingStatus::NotServing as i32
        );
        state.send(Serving::Serving).unwrap();
        assert_eq!(status(stream.next().await), ServingStatus::Serving as i32);
        state.send(Serving::Stopping).unwrap();
        assert_eq!(
            status(stream.next().await),
            ServingStatus::NotServing as i32
        );
        assert!(stream.next().await.is_none(), "the stream ends at shutdown");
        let check = service.check(request("")).await.unwrap().into_inner();
        assert_eq!(check.status, ServingStatus::NotServing as i32);
        let unknown = service.check(request("nope")).await.err().unwrap();
        assert_eq!(unknown.code(), tonic::Code::NotFound);
    }
}
