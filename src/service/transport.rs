//! Errors tonic raises before a request reaches the service — an oversized
//! message, bytes that do not decode as the request message — are rewritten
//! here into the broker's error contract (RESOURCE_EXHAUSTED naming the
//! limit, INVALID_ARGUMENT naming the message), with an ErrorInfo like
//! every other error. tonic reports them as OUT_OF_RANGE and INTERNAL.

use std::collections::HashMap;

use tonic::body::Body;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use super::error::ERROR_DOMAIN;

/// What tonic's codec says for an oversized message.
const TOO_LARGE_PREFIX: &str = "Error, decoded message length too large";
/// What prost says for bytes that do not decode.
const UNDECODABLE_PREFIX: &str = "failed to decode Protobuf message";

/// Maps a response whose status came from tonic's decoder.
pub fn rewrite_decoder_errors(response: http::Response<Body>) -> http::Response<Body> {
    let Some(status) = Status::from_header_map(response.headers()) else {
        return response;
    };
    let (code, reason, limit) = match status.code() {
        Code::OutOfRange if status.message().starts_with(TOO_LARGE_PREFIX) => (
            Code::ResourceExhausted,
            "MESSAGE_TOO_LARGE",
            crate::config::keys::max_request_bytes,
        ),
        Code::Internal if status.message().starts_with(UNDECODABLE_PREFIX) => {
            (Code::InvalidArgument, "UNDECODABLE_MESSAGE", "request")
        }
        _ => return response,
    };
    let metadata = HashMap::from([(
        if code == Code::InvalidArgument {
            "field"
        } else {
            "limit"
        }
        .to_owned(),
        limit.to_owned(),
    )]);
    let message = format!("{limit}: {}", status.message());
    Status::with_error_details(
        code,
        message,
        ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata),
    )
    .into_http()
}

broker_runtime::state_layer! {
    /// Refuses every new call but health's with UNAVAILABLE (`ShuttingDown`)
    /// once a stop was asked, while calls already running finish: a client
    /// then retries elsewhere at once instead of waiting out the drain.
    pub struct StoppingLayer(tokio::sync::watch::Receiver<bool>) => Stopping { stopping }
}

/// Health answers NOT_SERVING through the drain: probes read it, not an
/// error.
const HEALTH_PATH_PREFIX: &str = "/grpc.health.v1.Health/";

impl<S, B> tower::Service<http::Request<B>> for Stopping<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if *self.stopping.borrow() && !request.uri().path().starts_with(HEALTH_PATH_PREFIX) {
            let refused = Status::from(super::error::ServiceError::ShuttingDown).into_http();
            return Box::pin(std::future::ready(Ok(refused)));
        }
        Box::pin(self.inner.call(request))
    }
}
