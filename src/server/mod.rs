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

mod background;
mod keys;
mod serve;
mod served;
mod stores;

use background::*;
use keys::*;
use serve::*;
pub(crate) use serve::{connection_bounds, streams_per_connection};
pub use served::Served;
use stores::*;

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
        "refusing to listen on {0}: no tenant is declared ([tenants], or keys under [orchestrators], in the configuration; orchestrators named by identity share the open tenant), so every caller would share one tenant and nobody gets a fair share of judges, converters, audits or Watch streams; declare tenants, or pass --allow-open-tenant to serve it anyway"
    )]
    OpenTenant(std::net::SocketAddr),
    /// An identity issuer's keys could not be read at start.
    #[error("{0}")]
    Identity(String),
    /// A worker thread could not be started.
    #[error("threads: {0}")]
    Threads(#[from] std::io::Error),
}

/// The sockets a broker serves on, bound by its caller: `serve` binds
/// them from its flags, tests bind `127.0.0.1:0` and read the ports.
#[derive(Debug)]
pub struct Listeners {
    /// The gRPC API (and health, reflection).
    pub grpc: TcpListener,
    /// `GET /metrics` (`serve --metrics ADDR`); none when absent.
    pub metrics: Option<TcpListener>,
    /// The browser console with its token (`serve --console ADDR`); none
    /// when absent.
    pub console: Option<crate::console::ConsoleOptions>,
    /// The token endpoint (`serve --tokens ADDR`); none when absent.
    pub tokens: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    /// The gRPC API alone.
    fn from(grpc: TcpListener) -> Self {
        Self {
            grpc,
            metrics: None,
            console: None,
            tokens: None,
        }
    }
}

/// Serves the broker on `listeners` until `shutdown` resolves, then
/// drains in-flight requests and returns.
pub async fn run(
    listeners: impl Into<Listeners>,
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    run_with_clock(listeners, config, Arc::new(SystemClock), shutdown).await
}

/// `run` with an injected clock (tests move time with it).
pub async fn run_with_clock(
    listeners: impl Into<Listeners>,
    config: Config,
    clock: Arc<dyn Clock>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    run_with_options(listeners, config, clock, ServeOptions::default(), shutdown).await
}

/// How to serve, beyond the sockets and the configuration file.
#[derive(Debug, Default)]
pub struct ServeOptions {
    /// The shared PostgreSQL database (`serve --database-url`); SQLite in
    /// the data directory when absent.
    pub database: Option<DatabaseOptions>,
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

/// `run_with_clock` with options (the database, the key file, readiness).
pub async fn run_with_options(
    listeners: impl Into<Listeners>,
    config: Config,
    clock: Arc<dyn Clock>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    let Listeners {
        grpc: listener,
        metrics: metrics_listener,
        console,
        tokens,
    } = listeners.into();
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
    let issuers = crate::identity::Issuers::load(&config.identity)
        .await
        .map_err(ServerError::Identity)?;
    let parts = Parts {
        issuers: Arc::new(issuers),
        listener,
        clock: clock.clone(),
        metrics_listener,
        console,
        tokens,
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
    tokens: Option<TcpListener>,
    metrics: Arc<crate::metrics::Metrics>,
    current_key: ed25519_dalek::VerifyingKey,
    stamper: Arc<Stamper>,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
    /// The identity issuers `[identity]` trusts, their keys read.
    issuers: Arc<crate::identity::Issuers>,
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
