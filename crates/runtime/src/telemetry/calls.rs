//! Each call's spans: the `tracing` span its log lines carry, the
//! exported OpenTelemetry span with the facts its handlers record, and the
//! trace context stored with what it issued.

use super::*;

tokio::task_local! {
    /// The current call's exported span and the facts handlers recorded
    /// for it (only while exporting).
    pub(super) static CALL: std::cell::RefCell<Call>;
}

/// A call's exported span and what the handlers learned, as plain values:
/// formatted into attributes once, when the call ends.
pub(super) struct Call {
    pub(super) span: opentelemetry_sdk::trace::Span,
    pub(super) facts: Facts,
    /// Where the span's end is counted.
    pub(super) counts: &'static SpanCounters,
}

/// What handlers learned about a call (each `Fact` once; a later one
/// replaces an earlier).
#[derive(Default)]
pub(super) struct Facts {
    pub(super) contract_id: Option<[u8; 32]>,
    pub(super) parent_id: Option<[u8; 32]>,
    pub(super) root_id: Option<[u8; 32]>,
    pub(super) depth: Option<u32>,
    pub(super) agent_key: Option<[u8; 32]>,
    pub(super) outcome: Option<(&'static str, bool)>,
    pub(super) refused_codes: Option<String>,
    pub(super) verdict: Option<&'static str>,
}

impl Call {
    /// Ends the span with the call's facts and gRPC status code.
    pub(super) fn end(&mut self, grpc_code: Option<i64>) {
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
pub(super) fn log_trace_id(
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
pub(super) fn fresh_trace_id() -> String {
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
pub(super) static CALL_SPANS_AT_INFO: std::sync::atomic::AtomicBool =
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

pub(super) type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// The gRPC status code of an answered call: errors come trailers-only,
/// their code in the headers; an OK call's code follows in the trailers.
pub(super) fn grpc_code<B>(response: &http::Response<B>) -> &str {
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
pub(super) fn start_call_span(
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
pub(super) struct Hex<'a>(pub(super) &'a [u8]);

impl std::fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// A public key's id (`crypto::key_id`), hashed only when recorded.
pub(super) struct KeyId<'a>(pub(super) &'a [u8; 32]);

impl std::fmt::Display for KeyId<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&broker_wire::crypto::key_id(self.0))
    }
}

/// `broker.outcome`: what happened, and whether it was the stored answer
/// to a retry.
pub(super) struct Outcome<'a>(pub(super) &'a str, pub(super) bool);

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
