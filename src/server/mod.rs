//! Wires the broker together and serves it: keys, store, the Broker
//! service, gRPC health and reflection, until `shutdown` resolves.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::clock::{Clock, SystemClock};
use crate::command::{Action, LifecycleCommand};
use crate::config::Config;
use crate::crypto;
use crate::keystore;
use crate::pb;
use crate::service::BrokerService;
use crate::stamp::Stamper;
use crate::store::Store;
use crate::store::postgres::{PostgresOptions, PostgresStore};
use crate::store::sqlite::{SqliteOptions, SqliteStore};

pub use broker_runtime::listen;

/// The SQLite database's file name inside the data directory.
pub const DATABASE_FILE: &str = "broker.sqlite3";

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Keystore(#[from] keystore::KeystoreError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("reflection: {0}")]
    Reflection(String),
    /// The blocking task that loads (or creates) the signing keys failed.
    #[error("loading the signing keys failed: {0}")]
    KeyLoading(String),
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The configured certificate or key is unusable.
    #[error("tls: {0}")]
    Tls(String),
    /// `--console` without what the console needs.
    #[error("console: {0}")]
    Console(String),
    /// The data directory cannot be made.
    #[error("data directory {0}")]
    DataDir(String),
    /// Beyond loopback with no tenant declared, and no opt-in.
    #[error(
        "refusing to listen on {0}: no tenant is declared ([tenants] or [orchestrators] in the configuration), so every caller would share one tenant and nobody gets a fair share of judges, converters, audits or Watch streams; declare tenants, or pass --allow-open-tenant to serve it anyway"
    )]
    OpenTenant(std::net::SocketAddr),
    /// A worker thread could not be started.
    #[error("threads: {0}")]
    Threads(#[from] std::io::Error),
}

/// Serves the broker on `listener` until `shutdown` resolves, then drains
/// in-flight requests and returns.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    run_with_clock(listener, config, Arc::new(SystemClock), shutdown).await
}

/// `run` with an injected clock (tests move time with it).
pub async fn run_with_clock(
    listener: TcpListener,
    config: Config,
    clock: Arc<dyn Clock>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    run_with_options(listener, config, clock, ServeOptions::default(), shutdown).await
}

/// What `serve` adds beyond the gRPC listener.
#[derive(Debug, Default)]
pub struct ServeOptions {
    /// Where to serve Prometheus metrics (`GET /metrics`); none when
    /// absent (`serve --metrics ADDR`).
    pub metrics_listener: Option<TcpListener>,
    /// The shared PostgreSQL database (`serve --database-url`); SQLite in
    /// the data directory when absent.
    pub database: Option<DatabaseOptions>,
    /// The browser console (`serve --console ADDR`); none when absent.
    pub console: Option<crate::console::ConsoleOptions>,
    /// The signing key's file (`serve --signing-key-file`): a secret the
    /// deployment provides, read, never created; the data directory's
    /// key when absent.
    pub signing_key_file: Option<std::path::PathBuf>,
    /// Told once the store is open, its migrations checked and every
    /// listener about to serve (`serve` prints "listening on" then).
    pub ready: Option<tokio::sync::oneshot::Sender<()>>,
    /// Serve beyond loopback with no tenant declared: every caller then
    /// shares one tenant (`serve --allow-open-tenant`).
    pub allow_open_tenant: bool,
}

/// The shared database of a replicated broker.
#[derive(Clone, Debug)]
pub struct DatabaseOptions {
    /// `postgres://…`.
    pub url: String,
    /// Apply pending migrations at start (`--no-migrate` turns it off).
    pub migrate: bool,
}

/// `run_with_clock` with options (the metrics endpoint, the database).
pub async fn run_with_options(
    listener: TcpListener,
    config: Config,
    clock: Arc<dyn Clock>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    let metrics = crate::metrics::Metrics::new();
    // Keys cannot be told apart, so without declared tenants the broker
    // is for one machine's callers.
    let addr = listener.local_addr()?;
    if !config.tenants.any_declared() {
        if !addr.ip().is_loopback() && !options.allow_open_tenant {
            return Err(ServerError::OpenTenant(addr));
        }
        tracing::warn!(
            "no tenant declared ([tenants] or [orchestrators]): every tree shares the open tenant, so callers get no fair share of judges, converters, audits and Watch streams from each other"
        );
    }
    if config.orchestrators.is_open() {
        tracing::warn!(
            "no [orchestrators] in the configuration: any key may open roots with any budget"
        );
    }
    // On SQLite the data directory is this process's alone while it
    // serves (a second writer would issue from stale cached ledgers):
    // locked before anything in it is read.
    let _lock = match options.database {
        None => Some(lock_data_dir(config.data_dir.clone()).await?),
        Some(_) => None,
    };
    let loaded = load_keys(&config, options.signing_key_file.clone()).await?;
    let keyring = &loaded.keyring;
    let stamper = Arc::new(Stamper::new(keyring.current.clone()));
    let parts = Parts {
        listener,
        clock: clock.clone(),
        metrics_listener: options.metrics_listener,
        console: options.console,
        metrics: metrics.clone(),
        current_key: keyring.current.verifying_key(),
        stamper: stamper.clone(),
        ready: options.ready,
    };
    match options.database {
        None => {
            let store = open_store(&config, stamper, clock, &metrics).await?;
            metrics.register_sqlite_series();
            metrics.replica_info(
                "sqlite",
                &crypto::key_id(&keyring.current.verifying_key().to_bytes()),
            );
            save_keys(loaded.clone_unsaved()).await?;
            let keys = crate::service::PublishedKeys::new(published(keyring));
            serve(parts, config, store, keys, shutdown).await
        }
        Some(database) => {
            let store = open_postgres(&config, &database, stamper, clock, &metrics).await?;
            metrics.register_postgres_series();
            metrics.replica_info(
                "postgres",
                &crypto::key_id(&keyring.current.verifying_key().to_bytes()),
            );
            save_keys(loaded.clone_unsaved()).await?;
            let retired: Vec<[u8; 32]> = keyring.retired.iter().map(|k| k.to_bytes()).collect();
            let registered = store
                .register_keys(&keyring.current.verifying_key().to_bytes(), &retired)
                .await?;
            let keys = crate::service::PublishedKeys::new(registered);
            serve(parts, config, store, keys, shutdown).await
        }
    }
}

/// What serving needs besides the store and the configuration.
struct Parts {
    listener: TcpListener,
    clock: Arc<dyn Clock>,
    metrics_listener: Option<TcpListener>,
    console: Option<crate::console::ConsoleOptions>,
    metrics: Arc<crate::metrics::Metrics>,
    current_key: ed25519_dalek::VerifyingKey,
    stamper: Arc<Stamper>,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
}

/// The store a broker serves from, with what the server reads beside the
/// `Store` trait: health, and the gauges of `/metrics`.
pub trait Served: Store + Clone {
    /// True while the store can serve; false after it stopped (SQLite,
    /// for good: a failed fsync) or while its database is unreachable
    /// (PostgreSQL, until it is back).
    fn serving(&self) -> tokio::sync::watch::Receiver<bool>;
    /// Contracts open or accepted now.
    fn open_contracts(&self) -> impl Future<Output = Result<i64, crate::store::StoreError>> + Send;
    /// Commands waiting for the store's writers.
    fn queue_depth(&self) -> usize;
    /// Registers the store's own gauges (PostgreSQL's pools); a weak
    /// reference: metrics never keep the store alive.
    fn pool_metrics(_store: std::sync::Weak<Self>, _metrics: &crate::metrics::Metrics) {}
    /// Says this replica, signing with `key`, is alive, and retires the
    /// keys of replicas silent for `ttl_ms` (PostgreSQL); nothing for a
    /// single broker.
    fn heartbeat(&self, key: [u8; 32], ttl_ms: i64) -> impl Future<Output = ()> + Send;
    /// Resolves once the store's writer has answered everything queued
    /// and made it durable, after the last handle is dropped (holds none).
    fn finished(&self) -> impl Future<Output = ()> + Send + 'static;
}

impl Served for SqliteStore {
    fn serving(&self) -> tokio::sync::watch::Receiver<bool> {
        let (serving, status) = tokio::sync::watch::channel(true);
        let lost = self.durability_lost();
        let mut writable = self.writable();
        tokio::spawn(async move {
            tokio::pin!(lost);
            loop {
                let now = *writable.borrow_and_update();
                serving.send_if_modified(|was| std::mem::replace(was, now) != now);
                tokio::select! {
                    () = &mut lost => break,
                    changed = writable.changed() => if changed.is_err() { break },
                }
            }
            let _ = serving.send(false);
            // Held until every receiver is gone: the status stays false.
            serving.closed().await;
        });
        status
    }

    async fn open_contracts(&self) -> Result<i64, crate::store::StoreError> {
        SqliteStore::open_contracts(self).await
    }

    fn queue_depth(&self) -> usize {
        SqliteStore::queue_depth(self)
    }

    async fn heartbeat(&self, _key: [u8; 32], _ttl_ms: i64) {}

    fn finished(&self) -> impl Future<Output = ()> + Send + 'static {
        // The syncer stops after the writer, which stops once its queue
        // is empty and every handle gone.
        self.durability_lost()
    }
}

impl Served for PostgresStore {
    fn serving(&self) -> tokio::sync::watch::Receiver<bool> {
        self.reachable()
    }

    async fn open_contracts(&self) -> Result<i64, crate::store::StoreError> {
        PostgresStore::open_contracts(self).await
    }

    fn queue_depth(&self) -> usize {
        PostgresStore::queue_depth(self)
    }

    fn pool_metrics(store: std::sync::Weak<Self>, metrics: &crate::metrics::Metrics) {
        pool_metrics(store, metrics);
    }

    async fn heartbeat(&self, key: [u8; 32], ttl_ms: i64) {
        use crate::store::postgres::migrate::Heartbeat;
        match PostgresStore::heartbeat(self, &key, ttl_ms).await {
            Ok((own, retired)) => {
                for key_id in retired {
                    tracing::warn!(%key_id, ttl_ms, "a replica's key was not seen for limits.replica_key_ttl_ms: retired (its contracts still verify; no new sessions)");
                }
                match own {
                    Heartbeat::Current => {}
                    Heartbeat::RetiredByOperator => tracing::error!(
                        key_id = %crypto::key_id(&key),
                        "this replica's signing key was retired by an operator: other replicas refuse its sessions; restart it with a new key (rotate-key or --signing-key-file)"
                    ),
                    Heartbeat::Missing => {
                        tracing::warn!(key_id = %crypto::key_id(&key), "this replica's key is missing from the registry: registering it again");
                        if let Err(e) = self.register_keys(&key, &[]).await {
                            tracing::warn!(error = %e, "registering this replica's key again");
                        }
                    }
                }
            }
            // The database away: health says so; the next beat retries.
            Err(e) => tracing::debug!(error = %e, "heartbeat of this replica's key"),
        }
    }

    fn finished(&self) -> impl Future<Output = ()> + Send + 'static {
        // Every answer waited for its own commit: nothing to finish.
        std::future::ready(())
    }
}

/// Serves the broker over `store` until `shutdown` resolves.
async fn serve<S: Served>(
    parts: Parts,
    config: Config,
    store: S,
    keys: crate::service::PublishedKeys,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    let Parts {
        listener,
        clock,
        metrics_listener,
        console,
        metrics,
        current_key,
        stamper,
        ready,
    } = parts;
    let limits = config.limits.clone();
    let tls = config.tls.clone();
    let serving = store.serving();
    let mut store_finished = Some(store.finished());
    let store = Arc::new(store);
    sample_store(&metrics, &store);
    S::pool_metrics(Arc::downgrade(&store), &metrics);
    tokio::spawn(refresh_keys(
        Arc::downgrade(&store),
        keys.clone(),
        current_key.to_bytes(),
        limits.replica_key_ttl_ms,
    ));
    tokio::spawn(expiry_sweeper(
        Arc::downgrade(&store),
        clock.clone(),
        Duration::from_millis(limits.expiry_sweep_interval_ms),
    ));
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let shutting_down = stopping.clone();
    let health_state = follow_health(serving, shutting_down.clone());
    let serving_now = health_state.clone();
    metrics.sampled(
        "broker_serving",
        "1 while health says SERVING (the store can make writes durable and no stop was asked), else 0.",
        move || i64::from(*serving_now.borrow() == crate::service::health::Serving::Serving),
    );
    let converters = crate::pool::WorkPool::start(
        "convert",
        crate::core::limits::MAX_CONCURRENT_CONVERSIONS,
        crate::core::limits::DEEP_STACK_BYTES,
    )?;
    let console_sessions =
        crate::service::session::Sessions::new(stamper.clone(), current_key, limits.session_ttl_ms)
            .with_published(keys.clone());
    let sessions =
        crate::service::session::Sessions::new(stamper, current_key, limits.session_ttl_ms)
            .with_published(keys.clone());
    let console_settings = config.console.clone();
    let console_clock = clock.clone();
    let service = BrokerService::new(
        store,
        Arc::new(config),
        clock,
        keys,
        stopping,
        converters,
        sessions,
    )
    .with_metrics(metrics.clone());
    trace_export_metrics(&metrics);
    let streams = service.watch_streams();
    metrics.sampled(
        "broker_watch_streams",
        "Watch streams open now.",
        move || i64::try_from(streams.taken()).unwrap_or(i64::MAX),
    );
    let broker = pb::broker_server::BrokerServer::new(service)
        .max_decoding_message_size(limits.max_request_bytes)
        .max_encoding_message_size(limits.max_response_bytes());

    let console = match console {
        Some(options) => Some(
            start_console(
                options,
                &console_settings,
                console_sessions,
                console_clock,
                crate::console::Wiring {
                    broker: broker.clone(),
                    limits: limits.clone(),
                    metrics: metrics.clone(),
                },
                shutting_down.clone(),
            )
            .await?,
        ),
        None => None,
    };
    let health = crate::service::health::health_server(health_state);
    let finished = store_finished.take();
    let drain = Duration::from_millis(limits.shutdown_drain_ms);
    // When the stop was asked: the drain's bound counts from it.
    let asked = Arc::new(std::sync::OnceLock::new());
    let stop_asked = asked.clone();
    let (reflection, reflection_v1alpha) = reflection_services()?;
    log_start(&listener, tls.is_some(), &current_key);
    if let Some(ready) = ready {
        let _ = ready.send(());
    }
    let metrics_stop = serve_metrics(metrics_listener, &metrics);
    let builder = server_builder(tls.as_ref(), &limits)?;
    let (connections, first_request) = listen::incoming(
        listener,
        connection_bounds(&limits),
        metrics.connection_counters("grpc"),
    );
    let server = builder
        .concurrency_limit_per_connection(limits.max_concurrent_requests_per_connection)
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
        .layer(crate::service::transport::StoppingLayer(
            shutting_down.clone(),
        ))
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(broker)
        .serve_with_incoming_shutdown(connections, async move {
            shutdown.await;
            let _ = stop_asked.set(std::time::Instant::now());
            // First: health turns NOT_SERVING (its Watch streams send
            // it, then end), new calls are refused, Watch streams end;
            // then the transport stops accepting and drains.
            let _ = stop.send(true);
        });
    drained(server, shutting_down.clone(), drain).await?;
    let _ = metrics_stop.send(());
    if let Some(mut console) = console {
        // It stops on the same signal; a client that never reads its
        // answer must not hold the broker's exit, so it gets a bound.
        match tokio::time::timeout(crate::console::CONSOLE_DRAIN, &mut console).await {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the console stopped with an error"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the console's task failed"),
            Ok(Ok(Ok(()))) => {}
            Err(_) => {
                tracing::warn!("the console's connections did not finish in time; cut");
                console.abort();
            }
        }
    }
    // Last: the console's handlers hold the store too.
    if let Some(finished) = finished {
        // The store's writer finishes its queue and its last sync; what
        // was acknowledged is durable already, so the wait is bounded.
        let left = asked
            .get()
            .map_or(drain, |at| drain.saturating_sub(at.elapsed()));
        if tokio::time::timeout(left.max(STORE_CLOSE_MIN), finished)
            .await
            .is_err()
        {
            tracing::warn!(
                "the store's writer did not finish within the drain; exiting anyway (acknowledged writes are durable)"
            );
        }
    }
    tracing::info!("broker stopped");
    Ok(())
}

/// Starts the console on its listener: its gate (token, origins, the
/// reader it hands sessions of) in front of the broker's read RPCs.
async fn start_console<S: Served>(
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

/// Serves `/metrics` on `metrics_listener`, when there is one, until the
/// returned sender fires.
fn serve_metrics(
    metrics_listener: Option<TcpListener>,
    metrics: &Arc<crate::metrics::Metrics>,
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
            async move {
                let _ = metrics_stopping.await;
            },
        ));
    }
    metrics_stop
}

/// How often a replica re-reads the registered keys: a replica that
/// started (or rotated) since is published within this.
const KEYS_REFRESH: Duration = Duration::from_millis(500);

/// A replica's heartbeat: a quarter of the TTL, so three beats can be
/// lost (a slow database, a pause) before its key is retired; within
/// these bounds.
fn heartbeat_interval(ttl_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ttl_ms / 4).unwrap_or(0)).clamp(KEYS_REFRESH, MAX_HEARTBEAT)
}

/// Longest between two heartbeats, whatever the TTL.
const MAX_HEARTBEAT: Duration = Duration::from_secs(60);

/// Keeps `keys` equal to the shared registry while the store lives, and
/// beats this replica's heartbeat (a single broker's keys never change
/// while it runs: returns at once).
async fn refresh_keys<S: Served>(
    store: std::sync::Weak<S>,
    keys: crate::service::PublishedKeys,
    current: [u8; 32],
    ttl_ms: i64,
) {
    let mut tick = tokio::time::interval(KEYS_REFRESH);
    let every = heartbeat_interval(ttl_ms);
    let mut next_beat = tokio::time::Instant::now() + every;
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else { return };
        if tokio::time::Instant::now() >= next_beat {
            next_beat = tokio::time::Instant::now() + every;
            store.heartbeat(current, ttl_ms).await;
        }
        match store.broker_keys().await {
            Ok(Some(registered)) if !registered.is_empty() => keys.set(registered),
            Ok(Some(_)) => {}
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "refreshing the published keys; keeping the last")
            }
        }
    }
}

/// The broker's signing keys (created on first start).
async fn load_keys(
    config: &Config,
    key_file: Option<std::path::PathBuf>,
) -> Result<keystore::Loaded, ServerError> {
    let data_dir = config.data_dir.clone();
    Ok(
        tokio::task::spawn_blocking(move || keystore::load(&data_dir, key_file.as_deref()))
            .await
            .map_err(|e| ServerError::KeyLoading(e.to_string()))??,
    )
}

/// Makes the data directory when missing and locks it (`DataDirLock`).
async fn lock_data_dir(dir: std::path::PathBuf) -> Result<keystore::DataDirLock, ServerError> {
    tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServerError::DataDir(format!("{}: {e}", dir.display())))?;
        Ok(keystore::DataDirLock::acquire(&dir)?)
    })
    .await
    .map_err(|e| ServerError::KeyLoading(e.to_string()))?
}

/// Writes a fresh signing key, once the store opened (see `Loaded`).
async fn save_keys(loaded: keystore::Loaded) -> Result<(), ServerError> {
    Ok(tokio::task::spawn_blocking(move || loaded.save())
        .await
        .map_err(|e| ServerError::KeyLoading(e.to_string()))??)
}

/// The keys a single broker publishes: its current key, then the retired.
fn published(keyring: &keystore::Keyring) -> Vec<pb::BrokerKey> {
    let current = keyring.current.verifying_key().to_bytes();
    let mut keys = vec![pb::BrokerKey {
        key_id: crypto::key_id(&current),
        public_key: current.to_vec(),
        current: true,
        retired_at_ms: 0,
    }];
    keys.extend(keyring.retired.iter().map(|k| pb::BrokerKey {
        key_id: crypto::key_id(&k.to_bytes()),
        public_key: k.to_bytes().to_vec(),
        current: false,
        retired_at_ms: 0,
    }));
    keys
}

/// The shared store, with the configured limits.
async fn open_postgres(
    config: &Config,
    database: &DatabaseOptions,
    stamper: Arc<Stamper>,
    clock: Arc<dyn Clock>,
    metrics: &crate::metrics::Metrics,
) -> Result<PostgresStore, ServerError> {
    let limits = &config.limits;
    let mut options = PostgresOptions::new(database.url.clone());
    options.migrate = database.migrate;
    options.queue_depth = limits.writer_queue_depth;
    options.max_batch = limits.max_batch;
    options.read_connections = limits.read_connections;
    options.writers = limits.database_writers;
    options.request_log_retention_ms = limits.request_log_retention_ms;
    options.cascade_step_rows = limits.cascade_step_rows;
    options.tenants = Arc::new(config.tenants.clone());
    options.metrics = Some(metrics.store.clone());
    Ok(PostgresStore::open(options, stamper, clock).await?)
}

/// Buckets of `broker_db_pool_acquire_seconds`: 50 µs to 2.5 s.
const ACQUIRE_BUCKETS_S: [f64; 10] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.005, 0.025, 0.1, 0.5, 2.5,
];
/// How often the read pool's acquire time is probed.
const ACQUIRE_PROBE: Duration = Duration::from_secs(1);

/// PostgreSQL's pools on `/metrics`: connections by pool and state, and
/// a probe of the wait for a read connection (sqlx keeps no timings).
fn pool_metrics(store: std::sync::Weak<PostgresStore>, metrics: &crate::metrics::Metrics) {
    let sampled = store.clone();
    metrics.sampled_vec(
        "broker_db_pool_connections",
        "PostgreSQL connections of this replica, by pool (write, read) and state (in_use, idle, max).",
        &["pool", "state"],
        move || {
            let Some(store) = sampled.upgrade() else {
                return Vec::new();
            };
            store
                .pool_stats()
                .into_iter()
                .flat_map(|p| {
                    [
                        (vec![p.pool, "in_use"], i64::from(p.open.saturating_sub(p.idle))),
                        (vec![p.pool, "idle"], i64::from(p.idle)),
                        (vec![p.pool, "max"], i64::from(p.max)),
                    ]
                })
                .collect()
        },
    );
    let waits = prometheus::Histogram::with_opts(
        prometheus::HistogramOpts::new(
            "broker_db_pool_acquire_seconds",
            "Time to take a connection from the read pool, probed every second (a wait here is a pool too small for the reads).",
        )
        .buckets(ACQUIRE_BUCKETS_S.to_vec()),
    )
    .expect("valid metric");
    metrics.register(Box::new(waits.clone()));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ACQUIRE_PROBE);
        loop {
            tick.tick().await;
            let Some(store) = store.upgrade() else { return };
            if let Ok(waited) = store.probe_acquire().await {
                waits.observe(waited.as_secs_f64());
            }
        }
    });
}

/// The embedded store in the data directory, with the configured limits.
async fn open_store(
    config: &Config,
    stamper: Arc<Stamper>,
    clock: Arc<dyn Clock>,
    metrics: &crate::metrics::Metrics,
) -> Result<SqliteStore, ServerError> {
    // The database lives in the data directory (made on first start).
    let dir = config.data_dir.clone();
    tokio::task::spawn_blocking(move || std::fs::create_dir_all(&dir))
        .await
        .map_err(|e| ServerError::KeyLoading(e.to_string()))?
        .map_err(|e| ServerError::DataDir(format!("{}: {e}", config.data_dir.display())))?;
    let store = SqliteStore::open(sqlite_options(config, metrics), stamper, clock).await?;
    Ok(store)
}

/// The embedded store's options: the configured limits, and the store's
/// own constants where no limit names them.
fn sqlite_options(config: &Config, metrics: &crate::metrics::Metrics) -> SqliteOptions {
    let limits = &config.limits;
    SqliteOptions {
        path: config.data_dir.join(DATABASE_FILE),
        queue_depth: limits.writer_queue_depth,
        max_batch: limits.max_batch,
        read_connections: limits.read_connections,
        wal_restart_bytes: limits.wal_restart_mib << 20,
        checkpoint_interval: crate::store::sqlite::CHECKPOINT_INTERVAL,
        request_log_retention_ms: limits.request_log_retention_ms,
        timestamp_window_ms: limits.timestamp_window_ms,
        max_audit_rows: crate::store::sqlite::MAX_AUDIT_ROWS,
        max_audit_bytes: crate::store::sqlite::MAX_AUDIT_BYTES,
        before_wal_sync: None,
        before_judge: None,
        judgment_deadline_ms: crate::core::limits::JUDGMENT_DEADLINE_MS,
        cascade_step_rows: limits.cascade_step_rows,
        drainer: true,
        tenants: Arc::new(config.tenants.clone()),
        metrics: Some(metrics.store.clone()),
    }
}

/// The store's gauges: open contracts counted in the background (a query
/// cannot run inside a scrape's synchronous collection), the write queue
/// read at scrape time. Weak references: metrics never keep the store
/// alive.
fn sample_store<S: Served>(metrics: &crate::metrics::Metrics, store: &Arc<S>) {
    let counted = Arc::downgrade(store);
    let open_contracts = metrics.open_contracts.clone();
    tokio::spawn(async move {
        let least = Duration::from_millis(crate::metrics::OPEN_CONTRACTS_SAMPLE_MS);
        loop {
            let Some(store) = counted.upgrade() else {
                return;
            };
            let started = tokio::time::Instant::now();
            let count = store.open_contracts().await;
            drop(store);
            // A failed count (a database away) is retried at the usual
            // pace: its time says nothing about the count's cost.
            let wait = match count {
                Ok(open) => {
                    open_contracts.set(open);
                    let took = started.elapsed();
                    least
                        .max(took.saturating_mul(crate::metrics::OPEN_CONTRACTS_IDLE_FACTOR))
                        .saturating_sub(took)
                }
                Err(_) => least,
            };
            tokio::time::sleep(wait).await;
        }
    });
    let queued = Arc::downgrade(store);
    metrics.sampled(
        "broker_write_queue_depth",
        "Commands waiting for the store's single writer.",
        move || {
            queued
                .upgrade()
                .map_or(0, |s| i64::try_from(s.queue_depth()).unwrap_or(i64::MAX))
        },
    );
}

/// Health tells the truth: NOT_SERVING while the store cannot serve (a
/// failed fsync stops SQLite for good; storage failing or PostgreSQL away
/// until a probe write succeeds), SERVING again when it can, and
/// `Stopping` from the moment a stop is asked.
fn follow_health(
    mut serving: tokio::sync::watch::Receiver<bool>,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) -> tokio::sync::watch::Receiver<crate::service::health::Serving> {
    use crate::service::health::Serving;
    let (state, health) = tokio::sync::watch::channel(Serving::Serving);
    tokio::spawn(async move {
        let mut store_open = true;
        loop {
            let now = if *stopping.borrow_and_update() {
                Serving::Stopping
            } else if store_open && *serving.borrow_and_update() {
                Serving::Serving
            } else {
                Serving::NotServing
            };
            let was = state.send_replace(now);
            if now == Serving::NotServing && was != Serving::NotServing {
                tracing::error!("the store cannot serve: health is NOT_SERVING");
            } else if now == Serving::Serving && was == Serving::NotServing {
                tracing::info!("the store serves again: health is SERVING");
            }
            if now == Serving::Stopping {
                return;
            }
            tokio::select! {
                changed = serving.changed(), if store_open => {
                    // The store stopped for good.
                    store_open = changed.is_ok();
                }
                changed = stopping.changed() => if changed.is_err() {
                    // The server is gone without a stop: nothing to tell.
                    return;
                },
            }
        }
    });
    health
}

/// Runs `server` to its end, or until `drain` after a stop was asked,
/// whatever clients do (a call that never ends, a stream never read).
async fn drained(
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
const STORE_CLOSE_MIN: Duration = Duration::from_millis(500);

/// Reflection in both versions: v1, and v1alpha for the clients that
/// still speak only it (grpcurl 1.8, many GUI clients).
fn reflection_services() -> Result<
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

fn log_start(listener: &TcpListener, tls: bool, key: &ed25519_dalek::VerifyingKey) {
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

/// The main listener's connection bounds, from the configured limits.
pub(crate) fn connection_bounds(limits: &crate::config::Limits) -> listen::Bounds {
    listen::Bounds {
        max_connections: limits.max_connections,
        max_per_address: limits.max_connections_per_address,
        first_request_timeout: Duration::from_millis(limits.first_request_timeout_ms),
    }
}

/// The transport, with TLS when configured.
fn server_builder(
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

/// Overdue contracts expired per sweep; the rest wait for the next tick.
const EXPIRED_PER_SWEEP: u32 = 256;
/// Most contracts the sweeper remembers as failing to expire.
const MAX_SKIPPED_EXPIRIES: usize = 1_024;

/// Expires overdue contracts in the background so their reservations
/// return even if nobody touches them (they also expire on access). Stops
/// when the store is gone.
async fn expiry_sweeper<S: Store>(
    store: std::sync::Weak<S>,
    clock: Arc<dyn Clock>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Contracts whose expiry failed (a bug, logged): skipped so they cannot
    // starve the ones listed after them. Bounded; forgotten when full.
    let mut failed: std::collections::HashSet<crate::core::Id> = std::collections::HashSet::new();
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else { return };
        let limit =
            EXPIRED_PER_SWEEP.saturating_add(u32::try_from(failed.len()).unwrap_or(u32::MAX));
        let overdue = match store.overdue(clock.now_ms(), limit).await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(error = %e, "expiry sweep could not list overdue contracts");
                continue;
            }
        };
        let due: Vec<_> = overdue
            .into_iter()
            .filter(|id| !failed.contains(id))
            .collect();
        for contract_id in due {
            let command = LifecycleCommand {
                request: None,
                contract_id,
                action: Action::Expire,
            };
            match store.transition(command).await {
                Ok(_) => {}
                // Another path (a cascade, an access, another replica's
                // sweeper) ended it first.
                Err(crate::store::StoreError::FailedPrecondition { .. }) => {}
                // Its descendants are being ended in steps (a drain): it is
                // expired by a later sweep; the others go on now.
                Err(crate::store::StoreError::Unavailable {
                    reason: crate::pb::ErrorReason::DescendantsEnding,
                    ..
                }) => {}
                // Passing (a full queue, a database away or contended):
                // the next sweep tries again.
                Err(
                    e @ (crate::store::StoreError::Busy
                    | crate::store::StoreError::Unavailable { .. }
                    | crate::store::StoreError::Backend(_)),
                ) => {
                    tracing::warn!(error = %e, contract = %hex::encode(contract_id), "expiry deferred to the next sweep");
                    break;
                }
                Err(e) => {
                    tracing::error!(error = %e, contract = %hex::encode(contract_id), "expiry failed; skipping it");
                    if failed.len() >= MAX_SKIPPED_EXPIRIES {
                        failed.clear();
                    }
                    failed.insert(contract_id);
                }
            }
        }
    }
}

/// The span exporter's counts (process-wide; zero without `--otlp-endpoint`):
/// ended but neither exported nor failed means queued, or dropped by the
/// full queue.
fn trace_export_metrics(metrics: &crate::metrics::Metrics) {
    metrics.sampled_counter(
        "broker_trace_spans_ended_total",
        "Call spans ended and handed to the OTLP export queue.",
        || crate::telemetry::span_counts().ended,
    );
    metrics.sampled_counter(
        "broker_trace_spans_exported_total",
        "Call spans the OTLP collector accepted.",
        || crate::telemetry::span_counts().exported,
    );
    metrics.sampled_counter(
        "broker_trace_spans_failed_total",
        "Call spans in batches whose OTLP export failed (collector away, timeout).",
        || crate::telemetry::span_counts().failed,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each store limit the config names reaches the store (the WAL's
    /// restart size in MiB, as bytes).
    #[test]
    fn the_store_gets_the_configured_limits() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("broker.toml");
        std::fs::write(
            &path,
            "[limits]\nwal_restart_mib = 16\nmax_batch = 7\nread_connections = 3\n\
             writer_queue_depth = 99\ncascade_step_rows = 5\n",
        )
        .expect("write");
        let config = Config::load(dir.path().to_owned(), Some(&path)).expect("config");
        let options = sqlite_options(&config, &crate::metrics::Metrics::new());
        assert_eq!(options.wal_restart_bytes, 16 * 1024 * 1024);
        assert_eq!(
            (
                options.max_batch,
                options.read_connections,
                options.queue_depth
            ),
            (7, 3, 99)
        );
        assert_eq!(options.cascade_step_rows, 5);
        assert_eq!(options.path, dir.path().join(DATABASE_FILE));
        let defaults = sqlite_options(
            &Config::load(dir.path().to_owned(), None).expect("defaults"),
            &crate::metrics::Metrics::new(),
        );
        assert_eq!(
            defaults.wal_restart_bytes,
            crate::store::sqlite::WAL_RESTART_BYTES
        );
    }
}
