//! Logs and traces: the process's tracing subscriber (human-readable, or
//! one JSON object per line with `BROKER_LOG_FORMAT=json`), spans exported
//! over OTLP when an endpoint is configured (`--otlp-endpoint`,
//! `OTEL_EXPORTER_OTLP_ENDPOINT`), and the span every gRPC call runs in:
//! named by its method, continuing the W3C trace context the caller sent
//! (`traceparent`, `tracestate`, `baggage`) or starting a trace, and
//! carrying the broker's facts about the call (contract, parent, root,
//! depth, the acting key's id, the outcome, refused codes) as the handlers
//! learn them. Every log line written during a call carries its trace id.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tracing::Instrument;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;

/// Environment variable choosing the log format: `text` (the default) or
/// `json`.
pub const LOG_FORMAT_ENV: &str = "BROKER_LOG_FORMAT";
/// Environment variable filtering logs (`tracing` directives).
pub const LOG_FILTER_ENV: &str = "BROKER_LOG";

/// Longest trace-context header read (`traceparent` is 55 bytes; W3C caps
/// `tracestate` at 512 and `baggage` at 8,192).
const MAX_TRACE_HEADER_BYTES: usize = 8_192;
/// Longest an export of one batch of spans may take.
const OTLP_EXPORT_TIMEOUT_MS: u64 = 5_000;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("{LOG_FORMAT_ENV} must be \"text\" or \"json\", not {0:?}")]
    LogFormat(String),
    #[error("the OTLP exporter: {0}")]
    Exporter(String),
    #[error("the log subscriber: {0}")]
    Subscriber(String),
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

/// The running telemetry: exports what is buffered and stops the span
/// exporter on `shutdown`.
pub struct Telemetry {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Telemetry {
    /// Exports what is buffered and stops the exporter (off the async
    /// threads: it waits for the export).
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
    }

    /// Exports what is buffered now. Blocks the calling thread until the
    /// export is done: call it off the async threads.
    pub fn flush(&self) {
        if let Some(provider) = &self.provider {
            let _ = provider.force_flush();
        }
    }
}

/// Installs the process's subscriber: logs to stderr, filtered by
/// `BROKER_LOG` (default `info`), in `format`; and, with `otlp_endpoint`
/// (e.g. `http://127.0.0.1:4317`), the call spans exported over OTLP/gRPC
/// in batches. Must run inside a tokio runtime when exporting (the
/// exporter's channel lives on it).
pub fn init(format: LogFormat, otlp_endpoint: Option<&str>) -> Result<Telemetry, TelemetryError> {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::WithExportConfig as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;

    let filter = EnvFilter::try_from_env(LOG_FILTER_ENV).unwrap_or_else(|_| EnvFilter::new("info"));
    CALL_SPANS_AT_INFO.store(
        format == LogFormat::Json || otlp_endpoint.is_some(),
        std::sync::atomic::Ordering::Relaxed,
    );
    let (provider, traces) = match otlp_endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(std::time::Duration::from_millis(OTLP_EXPORT_TIMEOUT_MS))
                .build()
                .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
            let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(
                    opentelemetry_sdk::Resource::builder()
                        .with_service_name("delegation-broker")
                        .build(),
                )
                .build();
            let layer = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("delegation-broker"))
                // The call spans only (they are this module's), not every
                // library's. A static filter: each callsite's interest is
                // decided once, where a predicate would make every event of
                // every library (h2, hyper, sqlx…) be asked at run time.
                .with_filter(
                    tracing_subscriber::filter::Targets::new()
                        .with_target(module_path!(), tracing::Level::INFO),
                );
            (Some(provider), Some(layer))
        }
        None => (None, None),
    };
    let text = (format == LogFormat::Text).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter.clone())
    });
    let json = (format == LogFormat::Json).then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            // The call's span (trace id, method, contract…) in every line.
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_filter(filter)
    });
    tracing_subscriber::registry()
        .with(traces)
        .with(text)
        .with(json)
        .try_init()
        .map_err(|e| TelemetryError::Subscriber(e.to_string()))?;
    Ok(Telemetry { provider })
}

/// Reads W3C trace context from gRPC request headers.
struct Headers<'a>(&'a http::HeaderMap);

impl opentelemetry::propagation::Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .get(key)
            .and_then(|v| v.to_str().ok())
            .filter(|v| v.len() <= MAX_TRACE_HEADER_BYTES)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// The trace context (and baggage) a call's headers carry.
fn extract(headers: &http::HeaderMap) -> opentelemetry::Context {
    use opentelemetry::propagation::TextMapPropagator as _;
    let trace = opentelemetry_sdk::propagation::TraceContextPropagator::new();
    let baggage = opentelemetry_sdk::propagation::BaggagePropagator::new();
    let cx = trace.extract(&Headers(headers));
    baggage.extract_with_context(&cx, &Headers(headers))
}

/// Makes `parent` the span's parent and returns the call's trace id: the
/// exported span's (which continues the caller's trace); without an
/// exporter, the caller's, or a fresh one.
fn continue_trace(span: &tracing::Span, parent: opentelemetry::Context) -> String {
    use opentelemetry::trace::{TraceContextExt as _, TraceId};
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let sent = parent.span().span_context().trace_id();
    // Fails (harmlessly) when no exporter is installed.
    let _ = span.set_parent(parent);
    let exported = span.context().span().span_context().trace_id();
    if exported != TraceId::INVALID {
        exported.to_string()
    } else if sent != TraceId::INVALID {
        sent.to_string()
    } else {
        fresh_trace_id()
    }
}

/// A span's W3C identity as stored with what it issued: trace id (16
/// bytes), span id (8), trace flags (1).
pub type TraceContext = [u8; 25];

/// The current call's exported span, when traces are exported (`None`
/// otherwise: nothing to link to).
pub fn current_trace_context() -> Option<TraceContext> {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let span = span.span_context();
    if !span.is_valid() {
        return None;
    }
    let mut out = [0u8; 25];
    out[..16].copy_from_slice(&span.trace_id().to_bytes());
    out[16..24].copy_from_slice(&span.span_id().to_bytes());
    out[24] = span.trace_flags().to_u8();
    Some(out)
}

/// Links the current call's span to the span stored in `stored` (the call
/// that issued the contract it acts on).
pub fn link_to(stored: &TraceContext) {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let mut trace_id = [0u8; 16];
    trace_id.copy_from_slice(&stored[..16]);
    let mut span_id = [0u8; 8];
    span_id.copy_from_slice(&stored[16..24]);
    let linked = SpanContext::new(
        TraceId::from_bytes(trace_id),
        SpanId::from_bytes(span_id),
        TraceFlags::new(stored[24]),
        true,
        TraceState::default(),
    );
    if linked.is_valid() {
        tracing::Span::current().add_link(linked);
    }
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

/// Whether call spans are made at INFO — something consumes them: JSON
/// logs or a trace exporter — or at DEBUG: with text logs at the default
/// level they would cost a loaded broker several percent of its CPU for
/// nobody (`BROKER_LOG=delegation_broker=debug` shows them).
static CALL_SPANS_AT_INFO: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// A call's span at `$level` (a constant: each level is its own callsite),
/// with every field a handler may record declared empty.
macro_rules! call_span {
    ($level:expr, $name:expr, $service:expr, $method:expr) => {
        tracing::span!(
            $level,
            "call",
            otel.name = $name,
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            rpc.system = "grpc",
            rpc.service = $service,
            rpc.method = $method,
            rpc.grpc.status_code = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            broker.contract_id = tracing::field::Empty,
            broker.parent_id = tracing::field::Empty,
            broker.root_id = tracing::field::Empty,
            broker.depth = tracing::field::Empty,
            broker.agent_key_id = tracing::field::Empty,
            broker.outcome = tracing::field::Empty,
            broker.refused_codes = tracing::field::Empty,
        )
    };
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
        let path = request.uri().path();
        let [_, service, method] = crate::metrics::method_labels(path);
        let name = crate::metrics::method_name(path);
        let span = if CALL_SPANS_AT_INFO.load(std::sync::atomic::Ordering::Relaxed) {
            call_span!(tracing::Level::INFO, name, service, method)
        } else {
            call_span!(tracing::Level::DEBUG, name, service, method)
        };
        if !span.is_disabled() {
            let trace_id = continue_trace(&span, extract(request.headers()));
            span.record("trace_id", tracing::field::display(trace_id));
        }
        let started = Instant::now();
        let response = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        Box::pin(
            async move {
                let response = response.await;
                if let Ok(response) = &response {
                    // Errors come trailers-only, their code in the headers;
                    // an OK call's code follows in the trailers.
                    let code = response
                        .headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("0");
                    let span = tracing::Span::current();
                    span.record("rpc.grpc.status_code", code);
                    if code != "0" {
                        span.record("otel.status_code", "ERROR");
                    }
                    tracing::debug!(
                        grpc_status = code,
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
/// `broker.*` fields declared in `CallSpan`). `value` is formatted only if
/// a layer takes the span: pass the lazy adapters below, not strings.
pub fn record(field: &'static str, value: impl std::fmt::Display) {
    tracing::Span::current().record(field, tracing::field::display(value));
}

/// Bytes as lowercase hex, formatted only when recorded.
pub struct Hex<'a>(pub &'a [u8]);

impl std::fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// A public key's id (`crypto::key_id`), hashed only when recorded.
pub struct KeyId<'a>(pub &'a [u8; 32]);

impl std::fmt::Display for KeyId<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::crypto::key_id(self.0))
    }
}

/// `broker.outcome`: what happened, and whether it was the stored answer
/// to a retry.
pub struct Outcome<'a>(pub &'a str, pub bool);

impl std::fmt::Display for Outcome<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)?;
        if self.1 {
            f.write_str(" (replayed)")?;
        }
        Ok(())
    }
}

/// Whether the current call's span is taken by any layer (facts that are
/// costly to gather are skipped otherwise).
pub fn recording() -> bool {
    !tracing::Span::current().is_disabled()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> http::HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_static(k),
                    http::HeaderValue::from_str(v).expect("header value"),
                )
            })
            .collect()
    }

    #[test]
    fn trace_headers_past_the_limit_are_not_read() {
        use opentelemetry::propagation::Extractor as _;
        let long = "k=".to_owned() + &"v".repeat(MAX_TRACE_HEADER_BYTES);
        let fits = "k=".to_owned() + &"v".repeat(MAX_TRACE_HEADER_BYTES - 2);
        let map = headers(&[("baggage", &long), ("tracestate", &fits)]);
        assert_eq!(Headers(&map).get("baggage"), None);
        assert_eq!(Headers(&map).get("tracestate"), Some(fits.as_str()));
    }

    #[test]
    fn lazy_facts_format_as_their_eager_forms() {
        assert_eq!(Hex(&[0, 0xab, 7]).to_string(), "00ab07");
        assert_eq!(KeyId(&[9; 32]).to_string(), crate::crypto::key_id(&[9; 32]));
        assert_eq!(Outcome("issued", false).to_string(), "issued");
        assert_eq!(Outcome("issued", true).to_string(), "issued (replayed)");
    }

    #[test]
    fn the_callers_trace_is_continued_or_a_trace_started() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let span = tracing::Span::none();
        let sent = headers(&[("traceparent", &format!("00-{id}-00f067aa0ba902b7-01"))]);
        assert_eq!(continue_trace(&span, extract(&sent)), id);
        // Malformed or all-zero: not continued; a fresh id instead.
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01".to_owned(),
            format!("00-{id}-0000000000000000-01"),
            format!("00-{}-00f067aa0ba902b7-01", &id[..30]),
            "garbage".to_owned(),
        ] {
            let fresh = continue_trace(&span, extract(&headers(&[("traceparent", &bad)])));
            assert_eq!(fresh.len(), 32, "{bad}");
            assert_ne!(fresh, id, "{bad}");
        }
        assert_ne!(fresh_trace_id(), fresh_trace_id());
    }
}
