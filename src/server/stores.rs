//! Opening the store the configuration names, with its metrics.

use super::*;

/// The shared store, with the configured limits.
pub(super) async fn open_postgres(
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
pub(super) const ACQUIRE_BUCKETS_S: [f64; 10] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.005, 0.025, 0.1, 0.5, 2.5,
];
/// How often the read pool's acquire time is probed.
pub(super) const ACQUIRE_PROBE: Duration = Duration::from_secs(1);

/// PostgreSQL's pools on `/metrics`: connections by pool and state, and
/// a probe of the wait for a read connection (sqlx keeps no timings).
pub(super) fn pool_metrics(
    store: std::sync::Weak<PostgresStore>,
    metrics: &crate::metrics::Metrics,
) {
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
pub(super) async fn open_store(
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
pub(super) fn sqlite_options(config: &Config, metrics: &crate::metrics::Metrics) -> SqliteOptions {
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
pub(super) fn sample_store<S: Served>(metrics: &crate::metrics::Metrics, store: &Arc<S>) {
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
