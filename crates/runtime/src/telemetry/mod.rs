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

fn install(logging: &Logging, export: Option<Export>) -> Result<Telemetry, TelemetryError> {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::WithExportConfig as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;

    let format = logging.format;
    let filter = match &logging.filter {
        Some(directives) => EnvFilter::try_new(directives)
            .map_err(|e| TelemetryError::Subscriber(format!("--log-level {directives:?}: {e}")))?,
        None => EnvFilter::try_from_env(LOG_FILTER_ENV).unwrap_or_else(|_| EnvFilter::new("info")),
    };
    // Colours only for a person at a terminal, never into a file or a
    // collector.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
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

tokio::task_local! {
    /// The current call's exported span and the facts handlers recorded
    /// for it (only while exporting).
    static CALL: std::cell::RefCell<Call>;
}

/// A call's exported span and what the handlers learned, as plain values:
/// formatted into attributes once, when the call ends.
struct Call {
    span: opentelemetry_sdk::trace::Span,
    facts: Facts,
    /// Where the span's end is counted.
    counts: &'static SpanCounters,
}

/// What handlers learned about a call (each `Fact` once; a later one
/// replaces an earlier).
#[derive(Default)]
struct Facts {
    contract_id: Option<[u8; 32]>,
    parent_id: Option<[u8; 32]>,
    root_id: Option<[u8; 32]>,
    depth: Option<u32>,
    agent_key: Option<[u8; 32]>,
    outcome: Option<(&'static str, bool)>,
    refused_codes: Option<String>,
    verdict: Option<&'static str>,
}

impl Call {
    /// Ends the span with the call's facts and gRPC status code.
    fn end(&mut self, grpc_code: Option<i64>) {
        use opentelemetry::KeyValue;
        use opentelemetry::trace::{Span as _, Status};
        if !self.span.is_recording() {
            return;
        }
        let facts = std::mem::take(&mut self.facts);
        let id = |key: &'static str, id: Option<[u8; 32]>| {
            id.map(|id| KeyValue::new(key, hex::encode(id)))
        };
        let attributes = [
            grpc_code.map(|code| KeyValue::new("rpc.grpc.status_code", code)),
            id("broker.contract_id", facts.contract_id),
            id("broker.parent_id", facts.parent_id),
            id("broker.root_id", facts.root_id),
            facts
                .depth
                .map(|d| KeyValue::new("broker.depth", i64::from(d))),
            facts
                .agent_key
                .map(|k| KeyValue::new("broker.agent_key_id", broker_wire::crypto::key_id(&k))),
            facts.outcome.map(|(o, replayed)| {
                KeyValue::new("broker.outcome", Outcome(o, replayed).to_string())
            }),
            facts
                .refused_codes
                .map(|c| KeyValue::new("broker.refused_codes", c)),
            facts.verdict.map(|v| KeyValue::new("broker.verdict", v)),
        ];
        self.span.set_attributes(attributes.into_iter().flatten());
        if grpc_code.is_some_and(|code| code != 0) {
            self.span.set_status(Status::error(""));
        }
        self.counts.ended.fetch_add(1, Ordering::Relaxed);
        self.span.end();
    }
}

impl Drop for Call {
    /// A call dropped before its answer (the client went away) still ends
    /// its span, without the answer's facts.
    fn drop(&mut self) {
        use opentelemetry::trace::Span as _;
        if self.span.is_recording() {
            self.counts.ended.fetch_add(1, Ordering::Relaxed);
            self.span.end();
        }
    }
}

/// The call's trace id for its log lines: the exported span's (which
/// continues the caller's trace); without an exporter, the caller's, or a
/// fresh one.
fn log_trace_id(
    exported: Option<opentelemetry::trace::TraceId>,
    sent: &opentelemetry::Context,
) -> String {
    use opentelemetry::trace::{TraceContextExt as _, TraceId};
    let sent = sent.span().span_context().trace_id();
    match exported {
        Some(id) if id != TraceId::INVALID => id.to_string(),
        _ if sent != TraceId::INVALID => sent.to_string(),
        _ => fresh_trace_id(),
    }
}

/// A span's W3C identity as stored with what it issued.
pub use broker_wire::command::TraceContext;

/// The current call's exported span, when traces are exported (`None`
/// otherwise: nothing to link to).
pub fn current_trace_context() -> Option<TraceContext> {
    use opentelemetry::trace::Span as _;
    CALL.try_with(|call| {
        let call = call.borrow();
        let span = call.span.span_context();
        if !span.is_valid() {
            return None;
        }
        let mut out = [0u8; 25];
        out[..16].copy_from_slice(&span.trace_id().to_bytes());
        out[16..24].copy_from_slice(&span.span_id().to_bytes());
        out[24] = span.trace_flags().to_u8();
        Some(out)
    })
    .ok()
    .flatten()
}

/// Links the current call's exported span to the span stored in `stored`
/// (the call that issued the contract it acts on).
pub fn link_to(stored: &TraceContext) {
    use opentelemetry::trace::{Span as _, SpanContext, SpanId, TraceFlags, TraceId, TraceState};
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
        let _ = CALL.try_with(|call| call.borrow_mut().span.add_link(linked, Vec::new()));
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

/// Whether the `tracing` call spans (log lines' context) are made at INFO
/// — JSON logs consume them — or at DEBUG: with text logs at the default
/// level they would cost a loaded broker several percent of its CPU for
/// nobody (`BROKER_LOG=delegation_broker=debug` shows them).
static CALL_SPANS_AT_INFO: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// A call's `tracing` span at `$level` (a constant: each level is its own
/// callsite), with every field a handler may record declared empty.
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
            broker.verdict = tracing::field::Empty,
        )
    };
}

/// The tower layer that runs every call in its spans.
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

/// The gRPC status code of an answered call: errors come trailers-only,
/// their code in the headers; an OK call's code follows in the trailers.
fn grpc_code<B>(response: &http::Response<B>) -> &str {
    response
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("0")
}

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
        use opentelemetry::trace::Span as _;
        let path = request.uri().path();
        let [_, service, method] = broker_wire::names::method_labels(path);
        let name = broker_wire::names::method_name(path);
        let span = if CALL_SPANS_AT_INFO.load(std::sync::atomic::Ordering::Relaxed) {
            call_span!(tracing::Level::INFO, name, service, method)
        } else {
            call_span!(tracing::Level::DEBUG, name, service, method)
        };
        let tracer = EXPORT.get();
        let sent = (tracer.is_some() || !span.is_disabled()).then(|| extract(request.headers()));
        let exported = tracer.zip(sent.as_ref()).map(|(tracer, sent)| {
            let span = start_call_span(tracer, name, service, method, sent);
            Call {
                span,
                facts: Facts::default(),
                counts: &SPANS,
            }
        });
        if let Some(sent) = &sent
            && !span.is_disabled()
        {
            let exported = exported.as_ref().map(|c| c.span.span_context().trace_id());
            span.record(
                "trace_id",
                tracing::field::display(log_trace_id(exported, sent)),
            );
        }
        let started = Instant::now();
        let response = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        let answered = async move {
            let response = response.await;
            // A number, as docs/operating.md and the OpenTelemetry conventions
            // say (a status that is not one is not recorded).
            let code = response
                .as_ref()
                .ok()
                .and_then(|r| grpc_code(r).parse::<i64>().ok());
            if let Some(code) = code {
                let span = tracing::Span::current();
                span.record("rpc.grpc.status_code", code);
                if code != 0 {
                    span.record("otel.status_code", "ERROR");
                }
                tracing::debug!(
                    grpc_status = code,
                    elapsed_us = started.elapsed().as_micros() as u64,
                    "call answered"
                );
            }
            let _ = CALL.try_with(|call| call.borrow_mut().end(code));
            response
        }
        .instrument(span);
        match exported {
            Some(call) => Box::pin(CALL.scope(std::cell::RefCell::new(call), answered)),
            None => Box::pin(answered),
        }
    }
}

/// The broker's sampler: `ratio` of traces by trace id, whatever the
/// caller's `traceparent` flags say (not parent-based: a caller must not
/// be able to keep its calls out of the operator's traces).
pub fn sampler(ratio: f64) -> opentelemetry_sdk::trace::Sampler {
    opentelemetry_sdk::trace::Sampler::TraceIdRatioBased(ratio)
}

/// Starts a call's exported span: a child of the caller's span when the
/// caller's context is sampled; otherwise a trace of its own with a link
/// to the caller's span (when it sent one), so an unsampled caller is
/// still findable from the broker's trace but cannot switch it off.
fn start_call_span(
    tracer: &opentelemetry_sdk::trace::SdkTracer,
    name: &'static str,
    service: &'static str,
    method: &'static str,
    sent: &opentelemetry::Context,
) -> opentelemetry_sdk::trace::Span {
    use opentelemetry::KeyValue;
    use opentelemetry::trace::{Link, SpanKind, TraceContextExt as _, Tracer as _};
    let builder = tracer
        .span_builder(name)
        .with_kind(SpanKind::Server)
        .with_attributes([
            KeyValue::new("rpc.system", "grpc"),
            KeyValue::new("rpc.service", service),
            KeyValue::new("rpc.method", method),
        ]);
    let callers = sent.span().span_context().clone();
    if callers.is_valid() && callers.is_sampled() {
        builder.start_with_context(tracer, sent)
    } else if callers.is_valid() {
        builder
            .with_links(vec![Link::with_context(callers)])
            .start_with_context(tracer, &opentelemetry::Context::new())
    } else {
        builder.start_with_context(tracer, sent)
    }
}

/// A broker fact about the current call.
#[derive(Clone, Copy, Debug)]
pub enum Fact<'a> {
    /// The contract acted on, or issued (`broker.contract_id`).
    ContractId(&'a [u8]),
    /// The parent a delegation is asked from (`broker.parent_id`).
    ParentId(&'a [u8]),
    /// The tree's root (`broker.root_id`).
    RootId(&'a [u8]),
    /// The issued contract's depth (`broker.depth`).
    Depth(u32),
    /// The acting key (`broker.agent_key_id`, its id).
    AgentKey(&'a [u8; 32]),
    /// What happened, and whether it was the stored answer to a retry
    /// (`broker.outcome`).
    Outcome(&'static str, bool),
    /// The invariant codes a refusal names (`broker.refused_codes`).
    RefusedCodes(&'a [&'static str]),
    /// A completion's or adjudication's verdict (`broker.verdict`).
    Verdict(&'static str),
}

/// Records a broker fact on the current call's spans: as a plain value for
/// the exported span, formatted for the `tracing` span only if a layer
/// takes it.
pub fn record(fact: Fact<'_>) {
    use tracing::field::display;
    let span = tracing::Span::current();
    if !span.is_disabled() {
        match fact {
            Fact::ContractId(id) => span.record("broker.contract_id", display(Hex(id))),
            Fact::ParentId(id) => span.record("broker.parent_id", display(Hex(id))),
            Fact::RootId(id) => span.record("broker.root_id", display(Hex(id))),
            Fact::Depth(depth) => span.record("broker.depth", depth),
            Fact::AgentKey(key) => span.record("broker.agent_key_id", display(KeyId(key))),
            Fact::Outcome(o, replayed) => {
                span.record("broker.outcome", display(Outcome(o, replayed)))
            }
            Fact::RefusedCodes(codes) => span.record("broker.refused_codes", codes.join(",")),
            Fact::Verdict(verdict) => span.record("broker.verdict", verdict),
        };
    }
    let _ = CALL.try_with(|call| {
        let facts = &mut call.borrow_mut().facts;
        let id = |id: &[u8]| <[u8; 32]>::try_from(id).ok();
        match fact {
            Fact::ContractId(v) => facts.contract_id = id(v),
            Fact::ParentId(v) => facts.parent_id = id(v),
            Fact::RootId(v) => facts.root_id = id(v),
            Fact::Depth(v) => facts.depth = Some(v),
            Fact::AgentKey(v) => facts.agent_key = Some(*v),
            Fact::Outcome(o, replayed) => facts.outcome = Some((o, replayed)),
            Fact::RefusedCodes(codes) => facts.refused_codes = Some(codes.join(",")),
            Fact::Verdict(verdict) => facts.verdict = Some(verdict),
        }
    });
}

/// Bytes as lowercase hex, formatted only when recorded.
struct Hex<'a>(&'a [u8]);

impl std::fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// A public key's id (`crypto::key_id`), hashed only when recorded.
struct KeyId<'a>(&'a [u8; 32]);

impl std::fmt::Display for KeyId<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&broker_wire::crypto::key_id(self.0))
    }
}

/// `broker.outcome`: what happened, and whether it was the stored answer
/// to a retry.
struct Outcome<'a>(&'a str, bool);

impl std::fmt::Display for Outcome<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)?;
        if self.1 {
            f.write_str(" (replayed)")?;
        }
        Ok(())
    }
}

/// Whether any span of the current call takes facts (facts that are
/// costly to gather are skipped otherwise).
pub fn recording() -> bool {
    CALL.try_with(|_| ()).is_ok() || !tracing::Span::current().is_disabled()
}

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
