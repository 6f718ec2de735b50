//! Serving: the gRPC server with its layers, the console and `/metrics`
//! beside it, and the stop — health first, then the transport's drain,
//! then the store's last sync, each within the drain's bound.

use super::*;

/// Serves the broker over `store` until `shutdown` resolves.
pub(super) async fn serve<S: Served>(
    mut parts: Parts,
    config: Config,
    store: S,
    keys: crate::service::PublishedKeys,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    let limits = config.limits.clone();
    let tls = config.tls.clone();
    let serving = store.serving();
    let finished = store.finished();
    let store = Arc::new(store);
    start_background(&parts, &store, &keys, &limits);
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let health_state = follow_health(serving, stopping.clone());
    sample_serving(&parts.metrics, &health_state);
    let metrics = parts.metrics.clone();
    let current_key = parts.current_key;
    let console_sessions = crate::service::session::Sessions::new(
        parts.stamper.clone(),
        current_key,
        limits.session_ttl_ms,
    )
    .with_published(keys.clone());
    let console_settings = config.console.clone();
    let tokens = start_tokens(&mut parts, &store, &keys, &config, &stopping)?;
    let broker = broker_service(
        store,
        config,
        parts.clock.clone(),
        (keys, parts.issuers),
        parts.stamper,
        current_key,
        &metrics,
        stopping.clone(),
    )?;
    let console = match parts.console {
        None => None,
        Some(options) => {
            // Only when there is a console: its handlers hold the service,
            // so the store, until it stops.
            let wiring = crate::console::Wiring {
                broker: broker.clone(),
                limits: limits.clone(),
                metrics: metrics.clone(),
            };
            let (clock, stopping) = (parts.clock, stopping.clone());
            let settings = &console_settings;
            Some(start_console(options, settings, console_sessions, clock, wiring, stopping).await?)
        }
    };
    let drain = Duration::from_millis(limits.shutdown_drain_ms);
    // When the stop was asked: the drain's bound counts from it.
    let asked = Arc::new(std::sync::OnceLock::new());
    let stop_asked = asked.clone();
    let routes = routes(broker, health_state.clone())?;
    log_start(&parts.listener, tls.is_some(), &current_key);
    if let Some(ready) = parts.ready {
        let _ = ready.send(());
    }
    let metrics_stop = serve_metrics(parts.metrics_listener, &metrics, &health_state);
    let shutdown = async move {
        shutdown.await;
        let _ = stop_asked.set(std::time::Instant::now());
        // First: health turns NOT_SERVING (its Watch streams send it,
        // then end), new calls are refused, Watch streams end; then the
        // transport stops accepting and drains.
        let _ = stop.send(true);
    };
    let server = grpc_server(
        parts.listener,
        tls.as_ref(),
        &limits,
        &metrics,
        stopping.clone(),
        routes,
        shutdown,
    )?;
    drained(server, stopping, drain).await?;
    let _ = metrics_stop.send(());
    stop_side("console", console).await;
    stop_side("token endpoint", tokens).await;
    // Last: the side listeners' handlers hold the store too.
    let left = asked.get().map_or(drain, |at: &std::time::Instant| {
        drain.saturating_sub(at.elapsed())
    });
    finish_store(finished, left).await;
    tracing::info!("broker stopped");
    Ok(())
}

/// The gRPC server on `listener` with the broker's layers, serving
/// `routes` until `shutdown` resolves, then draining.
fn grpc_server(
    listener: TcpListener,
    tls: Option<&crate::config::TlsIdentity>,
    limits: &crate::config::Limits,
    metrics: &Arc<crate::metrics::Metrics>,
    stopping: tokio::sync::watch::Receiver<bool>,
    routes: tonic::service::Routes,
    shutdown: impl Future<Output = ()>,
) -> Result<impl Future<Output = Result<(), tonic::transport::Error>>, ServerError> {
    let builder = server_builder(tls, limits)?;
    let (connections, first_request) = listen::incoming(
        listener,
        connection_bounds(limits),
        metrics.connection_counters("grpc"),
    );
    Ok(builder
        .concurrency_limit_per_connection(limits.max_concurrent_requests_per_connection)
        .max_concurrent_streams(Some(streams_per_connection(limits)))
        .timeout(Duration::from_millis(limits.request_timeout_ms))
        .http2_keepalive_interval(Some(listen::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(listen::KEEPALIVE_TIMEOUT))
        // First: any request, even one refused, lifts its connection's
        // first-request bound.
        .layer(first_request.layer())
        // Outermost of the rest, so every call is counted with the status
        // the client receives.
        .layer(crate::metrics::MetricsLayer(metrics.clone()))
        // Every call in its span: method, trace id, the broker's facts.
        .layer(crate::telemetry::CallSpanLayer)
        .layer(tower::util::MapResponseLayer::new(
            crate::service::transport::rewrite_decoder_errors,
        ))
        // Inside the metrics: refused calls are counted as UNAVAILABLE.
        .layer(crate::service::transport::StoppingLayer(stopping))
        .add_routes(routes)
        .serve_with_incoming_shutdown(connections, shutdown))
}

/// `broker_serving`: 1 while health says SERVING.
fn sample_serving(
    metrics: &crate::metrics::Metrics,
    health: &tokio::sync::watch::Receiver<crate::service::health::Serving>,
) {
    let serving_now = health.clone();
    metrics.sampled(
        "broker_serving",
        "1 while health says SERVING (the store can make writes durable and no stop was asked), else 0.",
        move || i64::from(*serving_now.borrow() == crate::service::health::Serving::Serving),
    );
}

/// Every service of the gRPC port: health, reflection (both versions)
/// and the broker.
fn routes<S: Served>(
    broker: pb::broker_server::BrokerServer<BrokerService<S>>,
    health_state: tokio::sync::watch::Receiver<crate::service::health::Serving>,
) -> Result<tonic::service::Routes, ServerError> {
    let (reflection, reflection_v1alpha) = reflection_services()?;
    let mut routes = tonic::service::RoutesBuilder::default();
    routes
        .add_service(crate::service::health::health_server(health_state))
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(broker);
    Ok(routes.routes())
}

/// The store's sampling, the key refresh and the expiry sweep, beside the
/// requests for as long as the store lives.
fn start_background<S: Served>(
    parts: &Parts,
    store: &Arc<S>,
    keys: &crate::service::PublishedKeys,
    limits: &crate::config::Limits,
) {
    sample_store(&parts.metrics, store);
    S::pool_metrics(Arc::downgrade(store), &parts.metrics);
    tokio::spawn(refresh_keys(
        Arc::downgrade(store),
        keys.clone(),
        parts.current_key.to_bytes(),
        limits.replica_key_ttl_ms,
    ));
    tokio::spawn(expiry_sweeper(
        Arc::downgrade(store),
        parts.clock.clone(),
        Duration::from_millis(limits.expiry_sweep_interval_ms),
    ));
}

/// The Broker service over `store`, within the configured message sizes.
#[allow(clippy::too_many_arguments)] // the service's parts, each once
fn broker_service<S: Served>(
    store: Arc<S>,
    config: Config,
    clock: Arc<dyn Clock>,
    (keys, issuers): (crate::service::PublishedKeys, Arc<crate::identity::Issuers>),
    stamper: Arc<Stamper>,
    current_key: ed25519_dalek::VerifyingKey,
    metrics: &Arc<crate::metrics::Metrics>,
    stopping: tokio::sync::watch::Receiver<bool>,
) -> Result<pb::broker_server::BrokerServer<BrokerService<S>>, ServerError> {
    let limits = config.limits.clone();
    issuers.refresh_until(stopping.clone());
    let converters = crate::pool::WorkPool::start(
        "convert",
        crate::core::limits::MAX_CONCURRENT_CONVERSIONS,
        crate::core::limits::DEEP_STACK_BYTES,
    )?;
    let sessions =
        crate::service::session::Sessions::new(stamper, current_key, limits.session_ttl_ms)
            .with_published(keys.clone());
    let service = BrokerService::new(
        store,
        Arc::new(config),
        clock,
        keys,
        stopping,
        converters,
        sessions,
    )
    .with_metrics(metrics.clone())
    .with_identities(issuers.clone());
    trace_export_metrics(metrics);
    let streams = service.watch_streams();
    metrics.sampled(
        "broker_watch_streams",
        "Watch streams open now.",
        move || i64::try_from(streams.taken()).unwrap_or(i64::MAX),
    );
    Ok(pb::broker_server::BrokerServer::new(service)
        .max_decoding_message_size(limits.max_request_bytes)
        .max_encoding_message_size(limits.max_response_bytes()))
}

/// Waits for a side listener (the console, the token endpoint) to stop
/// on the same signal, within `CONSOLE_DRAIN`: a client that never reads
/// its answer must not hold the broker's exit.
async fn stop_side<E: std::fmt::Display>(
    name: &'static str,
    task: Option<tokio::task::JoinHandle<Result<(), E>>>,
) {
    let Some(mut task) = task else {
        return;
    };
    match tokio::time::timeout(crate::console::CONSOLE_DRAIN, &mut task).await {
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the {name} stopped with an error"),
        Ok(Err(e)) => tracing::warn!(error = %e, "the {name}'s task failed"),
        Ok(Ok(Ok(()))) => {}
        Err(_) => {
            tracing::warn!("the {name}'s connections did not finish in time; cut");
            task.abort();
        }
    }
}

/// Lets the store's writer finish its queue and its last sync within
/// what is `left` of the drain (at least `STORE_CLOSE_MIN`): what was
/// acknowledged is durable already, so the wait is bounded.
async fn finish_store(finished: impl Future<Output = ()>, left: Duration) {
    if tokio::time::timeout(left.max(STORE_CLOSE_MIN), finished)
        .await
        .is_err()
    {
        tracing::warn!(
            "the store's writer did not finish within the drain; exiting anyway (acknowledged writes are durable)"
        );
    }
}

/// Starts the console on its listener: its gate (token, origins, the
/// reader it hands sessions of) in front of the broker's read RPCs.
pub(super) async fn start_console<S: Served>(
    options: crate::console::ConsoleOptions,
    settings: &crate::config::ConsoleConfig,
    sessions: crate::service::session::Sessions,
    clock: Arc<dyn Clock>,
    wiring: crate::console::Wiring<S>,
    stopping: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>, ServerError> {
    let reader = settings.reader.ok_or_else(|| {
        ServerError::Console(
            "--console needs [console] reader = \"<hex public key>\" in the configuration: the key whose rights the console reads with".into(),
        )
    })?;
    let address = options.listener.local_addr()?;
    // Off the runtime's threads: it may read files (assets_dir).
    let dir = settings.assets_dir.clone();
    let assets = tokio::task::spawn_blocking(move || crate::console::assets::load(dir.as_deref()))
        .await
        .map_err(|e| ServerError::Console(e.to_string()))?
        .map_err(|e| ServerError::Console(format!("console.assets_dir: {e}")))?;
    let origins = crate::console::origins(address, &settings.allowed_origins)
        .map_err(ServerError::Console)?;
    let gate = crate::console::gate::GateState::new(
        &options.token,
        origins,
        reader,
        sessions,
        clock,
        &settings.names,
        assets,
    );
    if !address.ip().is_loopback() {
        tracing::warn!(%address, "serving the console beyond loopback: plaintext HTTP, anyone who sees the token reads what its reader may");
    }
    tracing::info!(%address, reader = %hex::encode(reader), "serving the console");
    Ok(tokio::spawn(crate::console::serve(
        options.listener,
        gate,
        wiring,
        stopping,
    )))
}

/// The task serving the token endpoint, started on its listener when
/// `serve --tokens` gave one.
type TokensTask = tokio::task::JoinHandle<Result<(), std::convert::Infallible>>;

/// Starts the token endpoint, when there is a listener for it.
fn start_tokens<S: Served>(
    parts: &mut Parts,
    store: &Arc<S>,
    keys: &crate::service::PublishedKeys,
    config: &Config,
    stopping: &tokio::sync::watch::Receiver<bool>,
) -> Result<Option<TokensTask>, ServerError> {
    let Some(listener) = parts.tokens.take() else {
        return Ok(None);
    };
    let (stamper, clock) = (parts.stamper.clone(), parts.clock.clone());
    let settings = config.tokens.clone();
    let address = listener.local_addr()?;
    if settings.resources.is_empty() {
        tracing::warn!(%address, "the token endpoint has no [tokens] resources: it mints nothing");
    }
    let (store, keys) = (store.clone(), keys.clone());
    let service = crate::tokens::TokenService::new(store, stamper, keys, clock, settings, address);
    tracing::info!(%address, issuer = %service.issuer, "serving the token endpoint");
    let closed = parts.metrics.connections_closed.clone();
    let stopping = stopping.clone();
    Ok(Some(tokio::spawn(async move {
        crate::tokens::serve(listener, service, closed, stopping).await;
        Ok(())
    })))
}

/// Serves `/metrics` on `metrics_listener`, when there is one, until the
/// returned sender fires.
pub(super) fn serve_metrics(
    metrics_listener: Option<TcpListener>,
    metrics: &Arc<crate::metrics::Metrics>,
    health: &tokio::sync::watch::Receiver<crate::service::health::Serving>,
) -> tokio::sync::oneshot::Sender<()> {
    let (metrics_stop, metrics_stopping) = tokio::sync::oneshot::channel::<()>();
    if let Some(metrics_listener) = metrics_listener {
        let address = metrics_listener
            .local_addr()
            .map_or_else(|_| "unknown".to_owned(), |a| a.to_string());
        tracing::info!(%address, "serving metrics at /metrics");
        tokio::spawn(crate::metrics::serve(
            metrics_listener,
            metrics.clone(),
            health.clone(),
            async move {
                let _ = metrics_stopping.await;
            },
        ));
    }
    metrics_stop
}

/// Runs `server` to its end, or until `drain` after a stop was asked,
/// whatever clients do (a call that never ends, a stream never read).
pub(super) async fn drained(
    server: impl Future<Output = Result<(), tonic::transport::Error>>,
    mut stopping: tokio::sync::watch::Receiver<bool>,
    drain: Duration,
) -> Result<(), ServerError> {
    tokio::pin!(server);
    let bound = async {
        if stopping.wait_for(|stop| *stop).await.is_err() {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(drain).await;
    };
    tokio::select! {
        result = &mut server => Ok(result?),
        () = bound => {
            tracing::warn!(drain_ms = u64::try_from(drain.as_millis()).unwrap_or(u64::MAX), "calls still running after limits.shutdown_drain_ms; cut");
            Ok(())
        }
    }
}

/// Least time given to the store to finish after the transport stopped,
/// even when the drain used up the bound.
pub(super) const STORE_CLOSE_MIN: Duration = Duration::from_millis(500);

/// Reflection in both versions: v1, and v1alpha for the clients that
/// still speak only it (grpcurl 1.8, many GUI clients).
pub(super) fn reflection_services() -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
    ),
    ServerError,
> {
    let reflection_of = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // google/rpc/*.proto: grpcurl and `buf curl` decode ErrorInfo
            // and BadRequest in error details with no local proto files.
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let v1 = reflection_of()
        .build_v1()
        .map_err(|e| ServerError::Reflection(e.to_string()))?;
    let v1alpha = reflection_of()
        .build_v1alpha()
        .map_err(|e| ServerError::Reflection(e.to_string()))?;
    Ok((v1, v1alpha))
}

pub(super) fn log_start(listener: &TcpListener, tls: bool, key: &ed25519_dalek::VerifyingKey) {
    let address = listener.local_addr().ok();
    tracing::info!(
        address = %address.map_or_else(|| "unknown".to_owned(), |a| a.to_string()),
        tls,
        key_id = %crypto::key_id(&key.to_bytes()),
        "broker serving"
    );
    if !tls && address.is_some_and(|a| !a.ip().is_loopback()) {
        tracing::warn!(
            "serving plaintext gRPC beyond loopback: requests are signed, but intents and results travel in clear (configure [tls])"
        );
    }
}

/// HTTP/2's bound on one connection's open streams. A call's place
/// (`max_concurrent_requests_per_connection`) is given back when its
/// answer starts, so without this bound a client could park any number of
/// open streams (ones it never reads) on one connection. The Watch streams
/// a connection may hold come on top, so they never hold up its calls.
/// Past it, the client's next call waits for a stream to end.
pub(crate) fn streams_per_connection(limits: &crate::config::Limits) -> u32 {
    let streams = limits
        .max_concurrent_requests_per_connection
        .saturating_add(limits.max_watch_streams_per_connection);
    u32::try_from(streams).unwrap_or(u32::MAX)
}

/// The main listener's connection bounds, from the configured limits.
pub(crate) fn connection_bounds(limits: &crate::config::Limits) -> listen::Bounds {
    listen::Bounds {
        max_connections: limits.max_connections,
        max_per_address: limits.max_connections_per_address,
        first_request_timeout: Duration::from_millis(limits.first_request_timeout_ms),
    }
}

/// The transport, with TLS when configured.
pub(super) fn server_builder(
    tls: Option<&crate::config::TlsIdentity>,
    limits: &crate::config::Limits,
) -> Result<tonic::transport::Server, ServerError> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        let identity = tonic::transport::Identity::from_pem(&tls.cert_pem, &tls.key_pem);
        builder = builder
            .tls_config(
                tonic::transport::ServerTlsConfig::new()
                    .identity(identity)
                    // A client that never finishes its handshake must not
                    // hold a task and a socket forever.
                    .timeout(Duration::from_millis(limits.tls_handshake_timeout_ms)),
            )
            .map_err(|e| ServerError::Tls(e.to_string()))?;
    }
    Ok(builder)
}
