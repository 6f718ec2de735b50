//! Logs: the process's tracing subscriber (human-readable, or one JSON
//! object per line with `BROKER_LOG_FORMAT=json`), and the span every gRPC
//! call runs in — named by its method, carrying the W3C trace id the
//! caller sent in `traceparent` (a fresh one when it sent none), and the
//! broker's facts about the call (contract, parent, root, depth, the
//! acting key's id, the outcome, refused codes) as the handlers learn
//! them. Every log line written during a call carries its trace id.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tracing::Instrument;
use tracing_subscriber::EnvFilter;

/// Environment variable choosing the log format: `text` (the default) or
/// `json`.
pub const LOG_FORMAT_ENV: &str = "BROKER_LOG_FORMAT";
/// Environment variable filtering logs (`tracing` directives).
pub const LOG_FILTER_ENV: &str = "BROKER_LOG";

/// Longest `traceparent` header read (the W3C form is 55 bytes; later
/// versions may append fields).
const MAX_TRACEPARENT_BYTES: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("{LOG_FORMAT_ENV} must be \"text\" or \"json\", not {0:?}")]
    LogFormat(String),
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl LogFormat {
    /// From `BROKER_LOG_FORMAT` (unset or empty: text).
    pub fn from_env() -> Result<Self, TelemetryError> {
        match std::env::var(LOG_FORMAT_ENV).unwrap_or_default().as_str() {
            "" | "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(TelemetryError::LogFormat(other.chars().take(64).collect())),
        }
    }
}

/// Installs the process's subscriber: logs to stderr, filtered by
/// `BROKER_LOG` (default `info`), in `format`.
pub fn init_logs(format: LogFormat) {
    let filter = EnvFilter::try_from_env(LOG_FILTER_ENV).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        Format::Text => builder.init(),
        Format::Json => builder
            .json()
            // The call's span (trace id, method, contract…) in every line.
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
}

use LogFormat as Format;

/// The trace id of a W3C `traceparent` value
/// (`version-traceid-parentid-flags`), as 32 lowercase hex digits; `None`
/// for anything malformed or the all-zero id the specification forbids.
pub fn trace_id_of(traceparent: &str) -> Option<String> {
    if traceparent.len() > MAX_TRACEPARENT_BYTES {
        return None;
    }
    let mut parts = traceparent.trim().split('-');
    let (version, trace_id, parent_id, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    // Version ff is invalid; version 00 has exactly four fields.
    if !hex(version, 2) || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if !hex(trace_id, 32) || !hex(parent_id, 16) || !hex(flags, 2) {
        return None;
    }
    if trace_id.bytes().all(|b| b == b'0') || parent_id.bytes().all(|b| b == b'0') {
        return None;
    }
    Some(trace_id.to_owned())
}

/// A fresh random trace id (for a call that brought none).
fn fresh_trace_id() -> String {
    let mut id = [0u8; 16];
    // The OS CSPRNG; a failure leaves a fixed id, still a valid one.
    if getrandom::fill(&mut id).is_err() {
        id = [1; 16];
    }
    hex::encode(id)
}

/// The tower layer that runs every call in its span.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallSpanLayer;

impl<S> tower::Layer<S> for CallSpanLayer {
    type Service = CallSpan<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CallSpan { inner }
    }
}

#[derive(Clone, Debug)]
pub struct CallSpan<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for CallSpan<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let [_, service, method] = crate::metrics::method_labels(request.uri().path());
        let trace_id = request
            .headers()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(trace_id_of)
            .unwrap_or_else(fresh_trace_id);
        let span = tracing::info_span!(
            "call",
            trace_id = %trace_id,
            rpc.service = service,
            rpc.method = method,
            broker.contract_id = tracing::field::Empty,
            broker.parent_id = tracing::field::Empty,
            broker.root_id = tracing::field::Empty,
            broker.depth = tracing::field::Empty,
            broker.agent_key_id = tracing::field::Empty,
            broker.outcome = tracing::field::Empty,
            broker.refused_codes = tracing::field::Empty,
        );
        let started = Instant::now();
        let response = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        Box::pin(
            async move {
                let response = response.await;
                if let Ok(response) = &response {
                    tracing::debug!(
                        grpc_status = response
                            .headers()
                            .get("grpc-status")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("in trailers"),
                        elapsed_us = started.elapsed().as_micros() as u64,
                        "call answered"
                    );
                }
                response
            }
            .instrument(span),
        )
    }
}

/// Records a broker fact on the current call's span (`field` is one of the
/// `broker.*` fields declared in `CallSpan`).
pub fn record(field: &'static str, value: impl std::fmt::Display) {
    tracing::Span::current().record(field, tracing::field::display(value));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_parsed_as_the_w3c_specification_says() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        assert_eq!(
            trace_id_of(&format!("00-{id}-00f067aa0ba902b7-01")).as_deref(),
            Some(id)
        );
        // A later version may carry more fields.
        assert_eq!(
            trace_id_of(&format!("01-{id}-00f067aa0ba902b7-01-extra")).as_deref(),
            Some(id)
        );
        for bad in [
            "",
            "00",
            &format!("00-{id}-00f067aa0ba902b7-01-extra"),
            &format!("ff-{id}-00f067aa0ba902b7-01"),
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            &format!("00-{id}-0000000000000000-01"),
            &format!("00-{}-00f067aa0ba902b7-01", id.to_uppercase()),
            &format!("00-{id}-00f067aa0ba902b7"),
            &format!("00-{id}x-00f067aa0ba902b7-01"),
            &"0".repeat(MAX_TRACEPARENT_BYTES + 1),
        ] {
            assert_eq!(trace_id_of(bad), None, "{bad:?}");
        }
        assert_eq!(fresh_trace_id().len(), 32);
        assert_ne!(fresh_trace_id(), fresh_trace_id());
    }
}
