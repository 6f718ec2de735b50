//! Prometheus metrics: the registry of one broker, the gRPC layer that
//! counts every call by method and code (`grpc_server_*`, the names
//! go-grpc-prometheus made the convention), the broker's own counters,
//! and the `/metrics` endpoint (`serve --metrics ADDR`). Label values are
//! bounded: methods come from a fixed list, codes and invariant codes
//! from their enums, never a contract id or a key.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};
use tokio::net::TcpListener;

/// Buckets of `grpc_server_handling_seconds`: 0.5 ms to 10 s (a durable
/// answer waits for an fsync; a judgment may take seconds).
const HANDLING_BUCKETS_S: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How often the open contracts are counted (one indexed count query) at
/// most.
pub const OPEN_CONTRACTS_SAMPLE_MS: u64 = 1_000;

/// The count reads an index entry per open contract, so its cost grows
/// with the store (15 ms at a few hundred thousand, on every replica):
/// after each count the next waits at least this many times as long as it
/// took, so counting holds a connection at most 1 % of the time.
pub const OPEN_CONTRACTS_IDLE_FACTOR: u32 = 100;

/// Most connections the metrics port holds at once; past it new ones
/// wait in the listen backlog. High enough that idle or slow connections
/// cannot fill it faster than their timeouts empty it.
const MAX_METRICS_CONNECTIONS: usize = 1_024;
/// Most of them from one peer address: a few scrapers need a few each, and
/// one address cannot fill the port.
const MAX_METRICS_CONNECTIONS_PER_ADDRESS: usize = 64;
/// A scraper must send its request headers within this (also the port's
/// first-request bound).
const SCRAPE_HEADER_TIMEOUT_MS: u64 = 2_000;
/// A connection's whole life (request and response), so one that reads
/// its answer slowly cannot hold a slot either.
const SCRAPE_CONNECTION_TIMEOUT_MS: u64 = 10_000;

/// gRPC status codes by number, as their canonical names.
const CODES: [&str; 17] = [
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
];

/// Store errors by class, counted where they become service errors (one
/// place: `service::error`). Process-wide, like the store's own counters;
/// every broker's registry exposes it.
pub static STORE_ERRORS: std::sync::LazyLock<IntCounterVec> = std::sync::LazyLock::new(|| {
    IntCounterVec::new(
        Opts::new(
            "broker_store_errors_total",
            "Errors the store answered, by class (the StoreError variant): client errors such as NotFound as well as failures such as Backend or Overloaded.",
        ),
        &["class"],
    )
    .expect("valid metric")
});

/// One broker's metrics.
pub struct Metrics {
    registry: Registry,
    grpc_started: IntCounterVec,
    grpc_handled: IntCounterVec,
    grpc_handling: HistogramVec,
    /// Children issued (replayed answers not counted again).
    pub delegations_issued: IntCounter,
    /// Delegations refused, by the refusal's primary invariant code.
    pub delegations_refused: IntCounterVec,
    /// Budget units reserved for issued children.
    pub budget_reserved_units: IntCounter,
    /// Lifecycle receipts signed, by kind and (for completions) verdict.
    pub transitions: IntCounterVec,
    /// Connections open now.
    pub connections_open: IntGauge,
    /// Connections a listener closed, by listener and reason
    /// (`server::listen`).
    pub connections_closed: IntCounterVec,
    /// Units charged to contracts that completed (`Completion.consumed`).
    pub budget_spent_units: IntCounter,
    /// Units returned to parents by completions (`Completion.returned`).
    pub budget_returned_units: IntCounter,
    /// What the store reports from its writer and syncer threads.
    pub store: StoreMetrics,
    /// Contracts open or accepted, as last counted (every
    /// `OPEN_CONTRACTS_SAMPLE_MS` or less often: `OPEN_CONTRACTS_IDLE_FACTOR`).
    pub open_contracts: IntGauge,
}

pub use broker_store::metrics::StoreMetrics;

/// A gauge read at scrape time from a closure (queue depths, stream
/// counts: state that lives elsewhere).
struct Sampled {
    gauge: IntGauge,
    sample: Box<dyn Fn() -> i64 + Send + Sync>,
}

impl Collector for Sampled {
    fn desc(&self) -> Vec<&Desc> {
        self.gauge.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.gauge.set((self.sample)());
        self.gauge.collect()
    }
}

/// Labelled gauges read at scrape time from a closure returning each
/// series' label values and value (pool connections by pool and state).
struct SampledVec {
    gauges: prometheus::IntGaugeVec,
    sample: Box<dyn Fn() -> Vec<Series> + Send + Sync>,
}

/// One labelled series: its label values and its value.
pub type Series = (Vec<&'static str>, i64);

impl Collector for SampledVec {
    fn desc(&self) -> Vec<&Desc> {
        self.gauges.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        for (labels, value) in (self.sample)() {
            if let Ok(gauge) = self.gauges.get_metric_with_label_values(&labels) {
                gauge.set(value);
            }
        }
        self.gauges.collect()
    }
}

/// A counter read at scrape time from a closure (counts kept elsewhere,
/// e.g. process-wide atomics): it advances to the sampled value, never
/// back.
struct SampledCounter {
    counter: IntCounter,
    sample: Box<dyn Fn() -> u64 + Send + Sync>,
    /// Two scrapes at once must not both add the same difference.
    advancing: std::sync::Mutex<()>,
}

impl Collector for SampledCounter {
    fn desc(&self) -> Vec<&Desc> {
        self.counter.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        {
            // A poisoned lock only means another scrape panicked mid-way:
            // the counter is still consistent.
            let _advancing = self.advancing.lock().unwrap_or_else(|e| e.into_inner());
            let now = (self.sample)();
            self.counter.inc_by(now.saturating_sub(self.counter.get()));
        }
        self.counter.collect()
    }
}

// Metric constructors: the names and help texts are constants, checked
// by the tests that scrape them, so a failure here is a programming error.
fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("valid metric")
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn gauge(name: &str, help: &str) -> IntGauge {
    IntGauge::new(name, help).expect("valid metric")
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Arc<Self> {
        let registry = Registry::new();
        let method_labels = ["grpc_type", "grpc_service", "grpc_method"];
        let grpc_started = counter_vec(
            "grpc_server_started_total",
            "RPCs started on the server, by method.",
            &method_labels,
        );
        let grpc_handled = counter_vec(
            "grpc_server_handled_total",
            "RPCs completed on the server, by method and status code.",
            &["grpc_type", "grpc_service", "grpc_method", "grpc_code"],
        );
        let grpc_handling = HistogramVec::new(
            HistogramOpts::new(
                "grpc_server_handling_seconds",
                "Time from an RPC's arrival to its status, by method.",
            )
            .buckets(HANDLING_BUCKETS_S.to_vec()),
            &method_labels,
        )
        .expect("valid metric");
        let delegations_issued = counter(
            "broker_delegations_issued_total",
            "Child contracts issued (a replayed answer is not counted again).",
        );
        let delegations_refused = counter_vec(
            "broker_delegations_refused_total",
            "Delegations refused with a signed receipt, by the refusal's primary invariant code.",
            &["code"],
        );
        let budget_reserved_units = counter(
            "broker_budget_reserved_units_total",
            "Budget units reserved from parents for issued children.",
        );
        let transitions = counter_vec(
            "broker_lifecycle_transitions_total",
            "Lifecycle receipts signed, by kind and, for completions and adjudications, verdict.",
            &["kind", "verdict"],
        );
        let connections_open = gauge("broker_connections_open", "gRPC connections open now.");
        let connections_closed = counter_vec(
            "broker_connections_closed_total",
            "Connections the broker closed unasked, by listener (grpc, console, metrics) and reason: silent (no request within limits.first_request_timeout_ms), address_share (its address held its share of the listener's connections).",
            &["listener", "reason"],
        );
        for listener in ["grpc", "console", "metrics"] {
            for reason in [
                crate::server::listen::CLOSED_SILENT,
                crate::server::listen::CLOSED_ADDRESS_SHARE,
            ] {
                connections_closed.with_label_values(&[listener, reason]);
            }
        }
        let budget_spent_units = counter(
            "broker_budget_spent_units_total",
            "Budget units charged to contracts that completed (their Completion.consumed).",
        );
        let budget_returned_units = counter(
            "broker_budget_returned_units_total",
            "Budget units completions returned to their parents (Completion.returned).",
        );
        let open_contracts = gauge(
            "broker_open_contracts",
            "Contracts open or accepted (not yet ended), counted every few seconds.",
        );
        let metrics = Self {
            registry,
            grpc_started,
            grpc_handled,
            grpc_handling,
            delegations_issued,
            delegations_refused,
            budget_reserved_units,
            transitions,
            connections_open,
            connections_closed,
            budget_spent_units,
            budget_returned_units,
            store: StoreMetrics::new(),
            open_contracts,
        };
        metrics.register_all();
        preinitialise(
            &metrics.grpc_started,
            &metrics.grpc_handled,
            &metrics.grpc_handling,
            &metrics.delegations_refused,
        );
        Arc::new(metrics)
    }

    /// Registers every family with the registry `/metrics` serves.
    fn register_all(&self) {
        for collector in [
            Box::new(self.grpc_started.clone()) as Box<dyn Collector>,
            Box::new(self.grpc_handled.clone()),
            Box::new(self.grpc_handling.clone()),
            Box::new(self.delegations_issued.clone()),
            Box::new(self.delegations_refused.clone()),
            Box::new(self.budget_reserved_units.clone()),
            Box::new(self.transitions.clone()),
            Box::new(self.connections_open.clone()),
            Box::new(self.connections_closed.clone()),
            Box::new(self.budget_spent_units.clone()),
            Box::new(self.budget_returned_units.clone()),
            Box::new(self.store.batch_commands.clone()),
            Box::new(self.open_contracts.clone()),
            Box::new(STORE_ERRORS.clone()),
            Box::new(build_info()),
        ] {
            self.registry
                .register(collector)
                .expect("unique metric names");
        }
        // process_cpu_seconds_total, process_resident_memory_bytes,
        // process_open_fds, …: what every Prometheus user looks for first
        // (Linux only; elsewhere the family is absent).
        #[cfg(target_os = "linux")]
        self.registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("unique metric names");
    }

    /// How a broker listener named `listener` reports its connections.
    pub fn connection_counters(&self, listener: &'static str) -> crate::server::listen::Counters {
        crate::server::listen::Counters {
            listener,
            open: Some(self.connections_open.clone()),
            closed: Some(self.connections_closed.clone()),
        }
    }

    /// Registers the series only SQLite has (its write-ahead log's
    /// fsyncs): a PostgreSQL broker does not show them at zero.
    pub fn register_sqlite_series(&self) {
        for collector in [
            Box::new(self.store.wal_fsync_seconds.clone()) as Box<dyn Collector>,
            Box::new(self.store.wal_fsync_stalls.clone()),
            Box::new(self.store.sqlite_handle_retakes.clone()),
        ] {
            self.registry
                .register(collector)
                .expect("unique metric names");
        }
    }

    /// Registers the series only PostgreSQL has, each outcome at zero.
    pub fn register_postgres_series(&self) {
        for outcome in ["written", "stale", "draining"] {
            self.store
                .optimistic_issuances
                .with_label_values(&[outcome]);
        }
        self.registry
            .register(Box::new(self.store.optimistic_issuances.clone()))
            .expect("unique metric names");
    }

    /// Registers a collector of the caller's (the store's pool gauges).
    pub fn register(&self, collector: Box<dyn Collector>) {
        self.registry
            .register(collector)
            .expect("unique metric names");
    }

    /// Registers a gauge whose value `sample` reads at each scrape. Names
    /// are the broker's own: a duplicate is a programming error.
    pub fn sampled(
        &self,
        name: &str,
        help: &str,
        sample: impl Fn() -> i64 + Send + Sync + 'static,
    ) {
        let gauge = IntGauge::new(name, help).expect("valid metric");
        self.registry
            .register(Box::new(Sampled {
                gauge,
                sample: Box::new(sample),
            }))
            .expect("unique metric names");
    }

    /// Registers labelled gauges whose series `sample` reads at each
    /// scrape. Names are the broker's own: a duplicate is a programming
    /// error.
    pub fn sampled_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        sample: impl Fn() -> Vec<Series> + Send + Sync + 'static,
    ) {
        let gauges =
            prometheus::IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
        self.registry
            .register(Box::new(SampledVec {
                gauges,
                sample: Box::new(sample),
            }))
            .expect("unique metric names");
    }

    /// `broker_replica_info{backend, key_id} 1`: which replica (by its
    /// signing key) and which store a series came from.
    pub fn replica_info(&self, backend: &str, key_id: &str) {
        let info = prometheus::IntGaugeVec::new(
            Opts::new(
                "broker_replica_info",
                "Always 1: this broker's store (sqlite or postgres) and the id of the key it signs with (one per replica).",
            ),
            &["backend", "key_id"],
        )
        .expect("valid metric");
        info.with_label_values(&[backend, key_id]).set(1);
        self.register(Box::new(info));
    }

    /// Registers a counter whose value `sample` reads at each scrape (a
    /// count that only grows). Names are the broker's own: a duplicate is
    /// a programming error.
    pub fn sampled_counter(
        &self,
        name: &str,
        help: &str,
        sample: impl Fn() -> u64 + Send + Sync + 'static,
    ) {
        self.registry
            .register(Box::new(SampledCounter {
                counter: counter(name, help),
                sample: Box::new(sample),
                advancing: std::sync::Mutex::new(()),
            }))
            .expect("unique metric names");
    }

    /// The Prometheus text exposition (format 0.0.4) of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding our own registry into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

/// `broker_build_info{version, commit, build_date} 1`: join on it to see
/// which build a series came from.
fn build_info() -> prometheus::IntGaugeVec {
    let info = prometheus::IntGaugeVec::new(
        Opts::new(
            "broker_build_info",
            "Always 1: the running build's version, commit and commit date.",
        ),
        &["version", "commit", "build_date"],
    )
    .expect("valid metric");
    info.with_label_values(&[
        crate::build::VERSION,
        crate::build::COMMIT,
        crate::build::DATE,
    ])
    .set(1);
    info
}

/// Every series a dashboard queries exists from the start at 0, not as
/// "no data": calls per method (and every code of finished calls, as
/// go-grpc-prometheus does), refusals per invariant code.
fn preinitialise(
    started: &IntCounterVec,
    handled: &IntCounterVec,
    handling: &HistogramVec,
    refused: &IntCounterVec,
) {
    for (path, _) in METHODS {
        let labels = method_labels(path);
        started.with_label_values(&labels);
        handling.with_label_values(&labels);
        for code in CODES {
            handled.with_label_values(&[labels[0], labels[1], labels[2], code]);
        }
    }
    for code in crate::core::InvariantCode::ALL {
        refused.with_label_values(&[code.as_str()]);
    }
}

/// The `code` label of a refusal: docs/design.md's code (`BUDGET_EXCEEDS_PARENT`),
/// as audits and receipts' readers spell it; "UNKNOWN" for a value this
/// build does not know.
pub fn invariant_label(wire: i32) -> &'static str {
    crate::core::InvariantCode::ALL
        .into_iter()
        .find(|code| *code as i32 == wire)
        .map_or("UNKNOWN", crate::core::InvariantCode::as_str)
}

pub use crate::names::{METHODS, method_labels, method_name};

broker_runtime::state_layer! {
    /// The tower layer that counts every call (`Server::builder().layer`).
    pub struct MetricsLayer(Arc<Metrics>) => MetricsService { metrics }
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for MetricsService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let labels = method_labels(request.uri().path());
        self.metrics.grpc_started.with_label_values(&labels).inc();
        let call = Call {
            metrics: self.metrics.clone(),
            labels,
            started: Instant::now(),
            done: false,
        };
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            let (parts, body) = response.into_parts();
            // A trailers-only response (every error) carries its status in
            // the headers; otherwise it comes in the trailers.
            let mut call = call;
            if let Some(code) = status_code(&parts.headers) {
                call.finish(code);
            }
            let body = tonic::body::Body::new(MeteredBody { inner: body, call });
            Ok(http::Response::from_parts(parts, body))
        })
    }
}

fn status_code(headers: &http::HeaderMap) -> Option<i32> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// One call in flight: counted once, when its status is known (or, if
/// the body is dropped first, as Canceled).
struct Call {
    metrics: Arc<Metrics>,
    labels: [&'static str; 3],
    started: Instant,
    done: bool,
}

impl Call {
    fn finish(&mut self, code: i32) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let code = usize::try_from(code)
            .ok()
            .and_then(|c| CODES.get(c))
            .copied()
            .unwrap_or("Unknown");
        let [kind, service, method] = self.labels;
        self.metrics
            .grpc_handled
            .with_label_values(&[kind, service, method, code])
            .inc();
        self.metrics
            .grpc_handling
            .with_label_values(&self.labels)
            .observe(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        // The client went away (or the stream was cut) before a status.
        self.finish(1);
    }
}

/// The response body, watched for the trailers that carry the status.
struct MeteredBody {
    inner: tonic::body::Body,
    call: Call,
}

impl HttpBody for MeteredBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) = frame.trailers_ref().and_then(status_code) {
                    self.call.finish(code);
                }
            }
            Poll::Ready(Some(Err(status))) => self.call.finish(status.code() as i32),
            // The body ended without trailers: HTTP/2 ended well, but gRPC
            // says nothing; count it as gRPC does (Unknown).
            Poll::Ready(None) => self.call.finish(2),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves. Every
/// connection is served on its own task, bounded in time
/// (`SCRAPE_HEADER_TIMEOUT_MS`, `SCRAPE_CONNECTION_TIMEOUT_MS`) and in
/// number (`MAX_METRICS_CONNECTIONS`, `MAX_METRICS_CONNECTIONS_PER_ADDRESS`):
/// idle or slow connections soon make room for a scrape.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: tokio::sync::watch::Receiver<crate::service::health::Serving>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) {
    let bounds = crate::server::listen::Bounds {
        max_connections: MAX_METRICS_CONNECTIONS,
        max_per_address: MAX_METRICS_CONNECTIONS_PER_ADDRESS,
        first_request_timeout: Duration::from_millis(SCRAPE_HEADER_TIMEOUT_MS),
    };
    let counters = crate::server::listen::Counters {
        listener: "metrics",
        open: None,
        closed: Some(metrics.connections_closed.clone()),
    };
    crate::server::listen::each_connection(listener, bounds, counters, shutdown, |connection| {
        let (metrics, health) = (metrics.clone(), health.clone());
        tokio::spawn(async move {
            let spoke = connection.spoke();
            let service = hyper::service::service_fn(move |request: http::Request<_>| {
                spoke.mark();
                let (metrics, health) = (metrics.clone(), health.clone());
                async move { Ok::<_, Infallible>(respond(&metrics, &health, &request)) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_millis(SCRAPE_HEADER_TIMEOUT_MS))
                .keep_alive(false)
                .serve_connection(hyper_util::rt::TokioIo::new(connection), service);
            // Dropping the connection returns its permits.
            let _ = tokio::time::timeout(
                Duration::from_millis(SCRAPE_CONNECTION_TIMEOUT_MS),
                connection,
            )
            .await;
        });
    })
    .await;
}

/// `GET /metrics`; `GET /healthz` (200 while the process answers, for a
/// liveness probe) and `GET /readyz` (200 while health is SERVING, 503
/// otherwise: starting, draining, the store unable to make writes
/// durable), for supervisors that speak HTTP, not gRPC.
fn respond<B>(
    metrics: &Metrics,
    health: &tokio::sync::watch::Receiver<crate::service::health::Serving>,
    request: &http::Request<B>,
) -> http::Response<http_body_util::Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    let serving = *health.borrow() == crate::service::health::Serving::Serving;
    let get = request.method() == http::Method::GET;
    let (status, content_type, body) = match request.uri().path() {
        "/metrics" if get => (
            http::StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics.render(),
        ),
        "/healthz" if get => (http::StatusCode::OK, TEXT, "ok\n".to_owned()),
        "/readyz" if get && serving => (http::StatusCode::OK, TEXT, "serving\n".to_owned()),
        "/readyz" if get => (
            http::StatusCode::SERVICE_UNAVAILABLE,
            TEXT,
            "not serving\n".to_owned(),
        ),
        _ => (
            http::StatusCode::NOT_FOUND,
            TEXT,
            "served here: GET /metrics, /healthz, /readyz\n".to_owned(),
        ),
    };
    let mut response = http::Response::new(http_body_util::Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64 connections that send half a request and stall, and 64 that
    /// send nothing, all from one address (past its share), do not delay
    /// a scrape from another: it is answered before even one header
    /// timeout (a scrape queued behind them used to wait for theirs, 30 s
    /// and more).
    #[tokio::test]
    async fn slow_connections_do_not_delay_a_scrape() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let (stop, stopping) = tokio::sync::oneshot::channel::<()>();
        let (_health, serving) =
            tokio::sync::watch::channel(crate::service::health::Serving::Serving);
        tokio::spawn(serve(listener, Metrics::new(), serving, async {
            let _ = stopping.await;
        }));
        let mut slow = Vec::new();
        for i in 0..128 {
            let socket = tokio::net::TcpSocket::new_v4().expect("socket");
            socket
                .bind("127.0.0.2:0".parse().expect("address"))
                .expect("bind");
            let mut stream = socket.connect(address).await.expect("connect");
            if i % 2 == 0 {
                // Past the share the broker may have closed it already.
                let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\n").await;
            }
            slow.push(stream);
        }
        let started = std::time::Instant::now();
        let scrape = async {
            let mut stream = tokio::net::TcpStream::connect(address)
                .await
                .expect("connect");
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
                .await
                .expect("write");
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await.expect("read");
            String::from_utf8_lossy(&answer).into_owned()
        };
        let answer = tokio::time::timeout(Duration::from_millis(SCRAPE_HEADER_TIMEOUT_MS), scrape)
            .await
            .unwrap_or_else(|_| panic!("the scrape waited {:?}", started.elapsed()));
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(answer.contains("broker_"), "{answer}");
        drop(slow);
        let _ = stop.send(());
    }

    #[test]
    fn unknown_paths_cannot_grow_the_label_set() {
        assert_eq!(
            method_labels("/delegation.broker.v1.Broker/Delegate"),
            ["unary", "delegation.broker.v1.Broker", "Delegate"]
        );
        assert_eq!(
            method_labels("/delegation.broker.v1.Broker/Watch"),
            ["server_stream", "delegation.broker.v1.Broker", "Watch"]
        );
        for path in ["/x.Y/Z", "/delegation.broker.v1.Broker/Nope", "", "/"] {
            assert_eq!(method_labels(path), ["unary", "unknown", "unknown"]);
            assert_eq!(method_name(path), "unknown");
        }
        assert_eq!(
            method_name("/grpc.health.v1.Health/Check"),
            "grpc.health.v1.Health/Check"
        );
    }

    #[test]
    fn store_errors_are_counted_by_class_where_they_become_service_errors() {
        let busy = || STORE_ERRORS.with_label_values(&["Busy"]).get();
        let before = busy();
        let _ = crate::service::error::ServiceError::from(crate::store::StoreError::Busy);
        assert_eq!(busy(), before + 1);
        assert!(
            Metrics::new()
                .render()
                .contains("broker_store_errors_total{class=\"Busy\"}"),
        );
    }

    #[test]
    fn a_call_is_counted_once_with_its_code() {
        let metrics = Metrics::new();
        let labels = method_labels("/delegation.broker.v1.Broker/Delegate");
        let mut call = Call {
            metrics: metrics.clone(),
            labels,
            started: Instant::now(),
            done: false,
        };
        call.finish(5);
        drop(call);
        // Every code's series exists (at 0); the call counted once, as
        // NotFound, and not as Canceled.
        let text = metrics.render();
        let handled = |code: &str| {
            text.lines()
                .find(|l| {
                    l.starts_with("grpc_server_handled_total")
                        && l.contains("grpc_method=\"Delegate\"")
                        && l.contains(&format!("grpc_code=\"{code}\""))
                })
                .unwrap_or_else(|| panic!("{code} in {text}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .to_owned()
        };
        assert_eq!(handled("NotFound"), "1");
        assert_eq!(handled("Canceled"), "0");
    }

    #[test]
    fn a_sampled_counter_follows_its_source_and_never_goes_back() {
        let metrics = Metrics::new();
        let source = Arc::new(std::sync::atomic::AtomicU64::new(5));
        let read = source.clone();
        metrics.sampled_counter("test_things_total", "Things.", move || {
            read.load(std::sync::atomic::Ordering::Relaxed)
        });
        let sample = |metrics: &Metrics| {
            let text = metrics.render();
            let line = text
                .lines()
                .find(|l| l.starts_with("test_things_total "))
                .unwrap_or_else(|| panic!("{text}"))
                .to_owned();
            assert!(text.contains("# TYPE test_things_total counter"), "{text}");
            line
        };
        assert_eq!(sample(&metrics), "test_things_total 5");
        source.store(9, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(sample(&metrics), "test_things_total 9");
        source.store(3, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(sample(&metrics), "test_things_total 9");
    }
}
