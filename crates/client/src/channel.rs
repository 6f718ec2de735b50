//! The channel to the broker, opened one way by every client in the
//! binary (the CLI, both gateways, the tools): the address checked and
//! named when it is wrong, the connection bounded in time.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::BrokerError;

/// `addr` as an endpoint with its connection bounded by `connect_timeout`.
pub fn endpoint(addr: &str, connect_timeout: Duration) -> Result<Endpoint, BrokerError> {
    let endpoint = Endpoint::from_shared(addr.to_owned()).map_err(|_| {
        BrokerError::input(
            "addr",
            format!("{addr:?} is not a URI such as http://127.0.0.1:50051"),
        )
    })?;
    Ok(endpoint.connect_timeout(connect_timeout))
}

/// A channel connected now: an unreachable broker is an error naming it.
pub async fn connect(addr: &str, connect_timeout: Duration) -> Result<Channel, BrokerError> {
    endpoint(addr, connect_timeout)?
        .connect()
        .await
        .map_err(|e| BrokerError::new("UNAVAILABLE", format!("cannot connect to {addr}: {e}")))
}

/// A channel connected on first use (a gateway may start before the
/// broker), each call bounded by `call_timeout`.
pub fn lazy(
    addr: &str,
    connect_timeout: Duration,
    call_timeout: Duration,
) -> Result<Channel, BrokerError> {
    Ok(endpoint(addr, connect_timeout)?
        .timeout(call_timeout)
        .connect_lazy())
}

/// Whether the broker at `addr` is serving (gRPC health, the whole
/// server): `Ok(false)` when it answers NOT_SERVING (starting, draining,
/// its store unreachable); an error when it does not answer.
pub async fn serving(addr: &str, timeout: Duration) -> Result<bool, BrokerError> {
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
    let channel = connect(addr, timeout).await?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let check = health.check(HealthCheckRequest {
        service: String::new(),
    });
    let answer = tokio::time::timeout(timeout, check).await.map_err(|_| {
        BrokerError::new("DEADLINE_EXCEEDED", format!("{addr}: no health answer"))
    })??;
    Ok(answer.into_inner().status == ServingStatus::Serving as i32)
}
