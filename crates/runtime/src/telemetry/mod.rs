//! Logs and traces: the process's tracing subscriber (human-readable, or
//! one JSON object per line with `BROKER_LOG_FORMAT=json`), spans exported
//! over OTLP when an endpoint is configured (`--otlp-endpoint`,
//! `OTEL_EXPORTER_OTLP_ENDPOINT`), and the span every gRPC call runs in:
//! named by its method, continuing the W3C trace context the caller sent
//! (`traceparent`, `tracestate`, `baggage`) or starting a trace, and
//! carrying the broker's facts about the call (contract, parent, root,
//! depth, the acting key's id, the outcome, refused codes) as the handlers
//! learn them. Every JSON log line written during a call carries its
//! trace id (text lines too, at DEBUG).
//!
//! A call has up to two spans, each made only when something consumes it:
//! the exported OpenTelemetry span, made with the SDK directly (handlers'
//! facts are kept as plain values in a task-local and become typed
//! attributes once, when the call ends), and a `tracing` span for log
//! lines (JSON logs, or text logs at DEBUG). Exporting through the
//! `tracing` bridge instead cost about four times as much CPU per call
//! (BENCHMARKS.md, "Telemetry overhead, met").

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

pub use broker_domain::limits::MAX_TRACE_HEADER_BYTES;
use tracing::Instrument;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;

/// Environment variable choosing the log format: `text` (the default) or
/// `json`.
pub const LOG_FORMAT_ENV: &str = "BROKER_LOG_FORMAT";
/// Environment variable filtering logs (`tracing` directives).
pub const LOG_FILTER_ENV: &str = "BROKER_LOG";

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

/// How the process logs: the format and the filter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Logging {
    pub format: LogFormat,
    /// `tracing` directives (e.g. `info,delegation_broker=debug`); from
    /// `BROKER_LOG`, else `info`, when `None`.
    pub filter: Option<String>,
}

impl Logging {
    /// From `BROKER_LOG_FORMAT` (the filter is read by `init`).
    pub fn from_env() -> Result<Self, TelemetryError> {
        Ok(Self {
            format: LogFormat::from_env()?,
            filter: None,
        })
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

/// How spans leave the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP over gRPC (port 4317 by convention): the default.
    Grpc,
    /// OTLP over HTTP, protobuf bodies (port 4318, `/v1/traces`).
    HttpProtobuf,
}

/// Which spans are exported (`OTEL_TRACES_SAMPLER` or
/// `--trace-sample-ratio`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The broker's own decision by trace id, whatever the caller sent.
    Ratio(f64),
    /// A call continuing a sampled caller's trace is exported; the others
    /// by trace id at this ratio.
    ParentBased(f64),
}

/// Where and how call spans are exported.
#[derive(Clone, Debug, PartialEq)]
pub struct Export {
    /// The URL the exporter sends to (for HTTP, with `/v1/traces`).
    pub endpoint: String,
    pub protocol: Protocol,
    pub sampling: Sampling,
}

/// The export the flags and the standard OpenTelemetry variables ask
/// for, `None` when no endpoint is set (or `OTEL_SDK_DISABLED=true`).
/// `endpoint` is the flag (`--otlp-endpoint`, which also reads
/// `OTEL_EXPORTER_OTLP_ENDPOINT`); `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
/// wins over it, as the specification says, and is used as given.
/// `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`: `grpc` (default) or
/// `http/protobuf`. `ratio` is `--trace-sample-ratio`; without it
/// `OTEL_TRACES_SAMPLER` (`always_on` default, `always_off`,
/// `traceidratio`, `parentbased_*`) with `OTEL_TRACES_SAMPLER_ARG`.
pub fn export_settings(
    endpoint: Option<&str>,
    ratio: Option<f64>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Export>, TelemetryError> {
    let env = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let traces = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    let base = endpoint
        .map(str::to_owned)
        .filter(|e| !e.trim().is_empty())
        .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"));
    if traces.is_none() && base.is_none() {
        return Ok(None);
    }
    let (variable, protocol) = match env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") {
        Some(p) => ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", Some(p)),
        None => (
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            env("OTEL_EXPORTER_OTLP_PROTOCOL"),
        ),
    };
    let protocol = match protocol.as_deref().map(str::trim) {
        None | Some("grpc") => Protocol::Grpc,
        Some("http/protobuf") => Protocol::HttpProtobuf,
        Some(other) => {
            return Err(TelemetryError::Exporter(format!(
                "{variable} must be grpc or http/protobuf, not {:?}",
                other.chars().take(64).collect::<String>()
            )));
        }
    };
    let endpoint = match (traces, base, protocol) {
        (Some(traces), _, _) => traces,
        (None, Some(base), Protocol::HttpProtobuf) => {
            format!("{}/v1/traces", base.trim_end_matches('/'))
        }
        (None, Some(base), Protocol::Grpc) => base,
        (None, None, _) => return Ok(None),
    };
    let sampling = match ratio {
        Some(ratio) => Sampling::Ratio(ratio),
        None => {
            let arg = || -> Result<f64, TelemetryError> {
                match env("OTEL_TRACES_SAMPLER_ARG") {
                    None => Ok(1.0),
                    Some(text) => text
                        .trim()
                        .parse::<f64>()
                        .ok()
                        .filter(|r| (0.0..=1.0).contains(r))
                        .ok_or_else(|| {
                            TelemetryError::Exporter(format!(
                                "OTEL_TRACES_SAMPLER_ARG must be a number from 0 to 1, not {:?}",
                                text.chars().take(64).collect::<String>()
                            ))
                        }),
                }
            };
            match env("OTEL_TRACES_SAMPLER").as_deref().map(str::trim) {
                None | Some("always_on") => Sampling::Ratio(1.0),
                Some("always_off") => Sampling::Ratio(0.0),
                Some("traceidratio") => Sampling::Ratio(arg()?),
                Some("parentbased_always_on") => Sampling::ParentBased(1.0),
                Some("parentbased_always_off") => Sampling::ParentBased(0.0),
                Some("parentbased_traceidratio") => Sampling::ParentBased(arg()?),
                Some(other) => {
                    return Err(TelemetryError::Exporter(format!(
                        "OTEL_TRACES_SAMPLER must be always_on, always_off, traceidratio or parentbased_(always_on|always_off|traceidratio), not {:?}",
                        other.chars().take(64).collect::<String>()
                    )));
                }
            }
        }
    };
    Ok(Some(Export {
        endpoint,
        protocol,
        sampling,
    }))
}

/// The spans' resource: what the standard variables say
/// (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), with
/// `service.name` "delegation-broker", `service.version` this build and a
/// fresh `service.instance.id` (one per process: tells replicas apart)
/// where they say nothing.
pub fn resource(env: impl Fn(&str) -> Option<String>) -> opentelemetry_sdk::Resource {
    use opentelemetry::KeyValue;
    // `key=value,key=value` (values as given: no percent-decoding).
    let given: Vec<(String, String)> = env("OTEL_RESOURCE_ATTRIBUTES")
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            let k = k.trim();
            (!k.is_empty()).then(|| (k.to_owned(), v.trim().to_owned()))
        })
        .take(MAX_RESOURCE_ATTRIBUTES)
        .collect();
    let has = |key: &str| given.iter().any(|(k, _)| k == key);
    let name = env("OTEL_SERVICE_NAME")
        .filter(|v| !v.trim().is_empty())
        .or_else(|| {
            given
                .iter()
                .find(|(k, _)| k == "service.name")
                .map(|(_, v)| v.clone())
        })
        .unwrap_or_else(|| "delegation-broker".to_owned());
    let mut attributes: Vec<KeyValue> = given
        .iter()
        .map(|(k, v)| KeyValue::new(k.clone(), v.clone()))
        .collect();
    if !has("service.version") {
        attributes.push(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    }
    if !has("service.instance.id") {
        attributes.push(KeyValue::new("service.instance.id", instance_id()));
    }
    opentelemetry_sdk::Resource::builder_empty()
        .with_detector(Box::new(
            opentelemetry_sdk::resource::TelemetryResourceDetector,
        ))
        .with_attributes(attributes)
        .with_service_name(name)
        .build()
}

/// Most `OTEL_RESOURCE_ATTRIBUTES` entries read.
const MAX_RESOURCE_ATTRIBUTES: usize = 128;

/// A random UUID (version 4) naming this process.
fn instance_id() -> String {
    let mut bytes = [0u8; 16];
    // The system's randomness failing leaves zeros: still a valid id.
    let _ = getrandom::fill(&mut bytes);
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex = hex::encode(bytes);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// Installs the process's subscriber: logs to stderr, filtered by
/// `BROKER_LOG` (default `info`), in `format`; and, when `export_settings`
/// finds an endpoint (the `otlp_endpoint` flag or the standard
/// variables), the call spans exported over OTLP in batches. Must run
/// inside a tokio runtime when exporting (the exporter's channel lives on
/// it).
pub fn init(
    logging: &Logging,
    otlp_endpoint: Option<&str>,
    sample_ratio: Option<f64>,
) -> Result<Telemetry, TelemetryError> {
    let env = |name: &str| std::env::var(name).ok();
    install(logging, export_settings(otlp_endpoint, sample_ratio, env)?)
}

/// Logs only, whatever the environment says of OTLP: for the commands
/// that serve no calls (`keygen`, `verify`, …).
pub fn init_logging(logging: &Logging) -> Result<Telemetry, TelemetryError> {
    install(logging, None)
}

/// The workspace's crates, whose log lines `delegation_broker` names as
/// one family: the broker is one program to its operator, whichever
/// crate a line comes from.
const FAMILY: &[&str] = &[
    "broker_domain",
    "broker_wire",
    "broker_store",
    "broker_runtime",
    "broker_client",
    "broker_a2a",
    "broker_mcp",
    "broker_tools",
];

/// `directives` with each one for `delegation_broker` (`delegation_broker=debug`)
/// repeated for every crate of the workspace.
fn whole_family(directives: &str) -> String {
    let mut all: Vec<String> = directives.split(',').map(str::to_owned).collect();
    for directive in directives.split(',') {
        let directive = directive.trim();
        let target_end = directive.find(['=', '[']).unwrap_or(directive.len());
        if &directive[..target_end] == "delegation_broker" {
            all.extend(
                FAMILY
                    .iter()
                    .map(|krate| format!("{krate}{}", &directive[target_end..])),
            );
        }
    }
    all.join(",")
}

fn install(logging: &Logging, export: Option<Export>) -> Result<Telemetry, TelemetryError> {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::WithExportConfig as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;

    let format = logging.format;
    let filter = match &logging.filter {
        Some(directives) => EnvFilter::try_new(whole_family(directives))
            .map_err(|e| TelemetryError::Subscriber(format!("--log-level {directives:?}: {e}")))?,
        None => std::env::var(LOG_FILTER_ENV)
            .ok()
            .and_then(|directives| EnvFilter::try_new(whole_family(&directives)).ok())
            .unwrap_or_else(|| EnvFilter::new("info")),
    };
    // Colours only for a person at a terminal, never into a file or a
    // collector, and never when NO_COLOR is set (no-color.org).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    CALL_SPANS_AT_INFO.store(
        format == LogFormat::Json,
        std::sync::atomic::Ordering::Relaxed,
    );
    let env = |name: &str| std::env::var(name).ok();
    let provider = match export {
        Some(export) => {
            let timeout = std::time::Duration::from_millis(OTLP_EXPORT_TIMEOUT_MS);
            // The HTTP exporter's client (reqwest, built without a crypto
            // provider of its own) needs the process's; ring, as the
            // gateways use. Already installed: fine.
            let _ = rustls::crypto::ring::default_provider().install_default();
            let exporter = match export.protocol {
                Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(&export.endpoint)
                    .with_timeout(timeout)
                    .build(),
                Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(&export.endpoint)
                    .with_timeout(timeout)
                    .build(),
            }
            .map_err(|e| TelemetryError::Exporter(format!("{}: {e}", export.endpoint)))?;
            let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
                .with_sampler(match export.sampling {
                    Sampling::Ratio(ratio) => sampler(ratio),
                    Sampling::ParentBased(ratio) => {
                        opentelemetry_sdk::trace::Sampler::ParentBased(Box::new(sampler(ratio)))
                    }
                })
                .with_batch_exporter(Counted {
                    inner: exporter,
                    counts: &SPANS,
                })
                .with_resource(resource(env))
                .build();
            if EXPORT.set(provider.tracer("delegation-broker")).is_err() {
                return Err(TelemetryError::Subscriber(
                    "telemetry is initialised once per process".into(),
                ));
            }
            Some(provider)
        }
        None => None,
    };
    let text = (format == LogFormat::Text).then(|| {
        tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .with_filter(filter.clone())
    });
    let json = (format == LogFormat::Json).then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            // `message` and the event's fields at the top of each object,
            // where log collectors look for them.
            .flatten_event(true)
            // The call's span (trace id, method, contract…) in every line.
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_filter(filter)
    });
    tracing_subscriber::registry()
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

/// The tracer of exported call spans, when an OTLP endpoint is configured
/// (set once, by `init`).
static EXPORT: std::sync::OnceLock<opentelemetry_sdk::trace::SdkTracer> =
    std::sync::OnceLock::new();

/// Spans ended and handed to the exporter's queue, exported, and lost to
/// failed exports. A span ended but neither exported nor failed is
/// queued, or was dropped by the full queue: `/metrics` shows all three,
/// so a lagging collector is visible.
#[derive(Debug)]
struct SpanCounters {
    ended: AtomicU64,
    exported: AtomicU64,
    failed: AtomicU64,
}

impl SpanCounters {
    const fn new() -> Self {
        Self {
            ended: AtomicU64::new(0),
            exported: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    fn snapshot(&self) -> SpanCounts {
        SpanCounts {
            ended: self.ended.load(Ordering::Relaxed),
            exported: self.exported.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

/// The process's counts (one exporter per process).
static SPANS: SpanCounters = SpanCounters::new();

/// What the span exporter has done so far in this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpanCounts {
    /// Spans ended and handed to the export queue.
    pub ended: u64,
    /// Spans the collector accepted.
    pub exported: u64,
    /// Spans in batches whose export failed (collector away, timeout).
    pub failed: u64,
}

/// The process's span counts (all zero without an exporter).
pub fn span_counts() -> SpanCounts {
    SPANS.snapshot()
}

/// An exporter that counts what it exports and what fails.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    counts: &'static SpanCounters,
}

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for Counted<E>
{
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        let spans = batch.len() as u64;
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => {
                self.counts.exported.fetch_add(spans, Ordering::Relaxed);
            }
            Err(e) => {
                self.counts.failed.fetch_add(spans, Ordering::Relaxed);
                // A collector away fails every batch: one line a second.
                static EXPORT_FAILED: Throttle = Throttle::new();
                if let Some(held) = EXPORT_FAILED.allow() {
                    tracing::warn!(error = %e, spans, held, "exporting spans over OTLP failed; they are dropped");
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

mod calls;
pub use calls::*;

#[cfg(test)]
mod tests;

/// A span of this process around an outgoing step (the MCP gateway's tool
/// calls), exported when an OTLP endpoint is configured: a child of the
/// W3C `traceparent` the step came with, and the parent its downstream
/// calls name in theirs.
pub struct StepSpan {
    span: opentelemetry_sdk::trace::Span,
}

impl StepSpan {
    /// Starts one, when spans are exported (`None` otherwise). A
    /// `traceparent` longer than the limit or malformed starts a new trace.
    pub fn start(name: &'static str, traceparent: Option<&str>) -> Option<Self> {
        use opentelemetry::propagation::TextMapPropagator as _;
        use opentelemetry::trace::{SpanKind, Tracer as _};
        let tracer = EXPORT.get()?;
        let mut carrier = std::collections::HashMap::new();
        if let Some(value) = traceparent.filter(|v| v.len() <= MAX_TRACE_HEADER_BYTES) {
            carrier.insert("traceparent".to_owned(), value.to_owned());
        }
        let parent =
            opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Client)
            .start_with_context(tracer, &parent);
        Some(Self { span })
    }

    /// The `traceparent` naming this span, for the calls made under it.
    pub fn traceparent(&self) -> String {
        use opentelemetry::trace::Span as _;
        let context = self.span.span_context();
        format!(
            "00-{}-{}-{:02x}",
            context.trace_id(),
            context.span_id(),
            context.trace_flags().to_u8()
        )
    }

    pub fn attribute(&mut self, key: &'static str, value: String) {
        use opentelemetry::trace::Span as _;
        self.span
            .set_attribute(opentelemetry::KeyValue::new(key, value));
    }

    pub fn end(mut self) {
        use opentelemetry::trace::Span as _;
        self.span.end();
        SPANS.ended.fetch_add(1, Ordering::Relaxed);
    }
}

pub use broker_wire::throttle::{LOG_THROTTLE_MS, Throttle};
