//! `delegation-broker a2a-gateway`: the mandatory hop for agents that speak
//! A2A. One process fronts one agent: its ingress admits a task
//! only under a broker-issued contract naming that agent and moves the
//! contract through its lifecycle as the task moves; its egress turns the
//! agent's outbound A2A calls into broker Delegates. The extension it
//! speaks is proto/delegation/broker/v1/a2a-extension.md. It is a client of
//! the broker's public API: the broker learns nothing of A2A.
//!
//! `run` is the command; `server::run` serves listeners already bound
//! until a shutdown future resolves.

mod authz;
mod bearer;
mod broker;
mod card;
mod chains;
mod client;
pub mod config;
mod egress;
pub mod ext;
mod gateway;
mod grpc;
mod ingress;
mod json;
mod jsonrpc;
pub mod metrics;
pub mod server;
mod stream;
mod watcher;

use std::path::PathBuf;

use clap::Args;

use ext::{Refused, code};
pub(crate) use gateway::{Gateway, Sent, Slot};
pub(crate) use jsonrpc::{Rpc, params, passed_headers, traced_call, unserved};

#[derive(Args, Debug, Clone)]
pub struct A2aArgs {
    /// The gateway's TOML configuration (docs/a2a.md).
    #[arg(long)]
    pub config: PathBuf,
    /// Export the spans of its calls over OTLP/gRPC to this collector
    /// (e.g. http://127.0.0.1:4317).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

/// The runtime's worker threads: the gateway fronts one agent and mostly
/// waits on the network (the agent, peers, the broker), so two serve it
/// and leave the machine's other cores to the agent and the broker.
const WORKER_THREADS: usize = 2;
/// Longest the runtime waits for its blocking tasks at exit, once the
/// servers have drained (or were cut): one that does not return cannot
/// hold the exit.
const RUNTIME_STOP: std::time::Duration = std::time::Duration::from_secs(1);

/// `delegation-broker a2a-gateway`: reads the config, binds its listeners
/// and serves them until SIGINT or SIGTERM.
pub fn run(args: A2aArgs) -> anyhow::Result<()> {
    let config = config::A2aConfig::load(&args.config)?;
    let format = broker_runtime::telemetry::Logging::from_env()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let telemetry =
            broker_runtime::telemetry::init(&format, args.otlp_endpoint.as_deref(), None)?;
        let served = match server::Listeners::bind(&config).await {
            Ok(listeners) => {
                server::run(listeners, config, broker_runtime::shutdown::signal()).await
            }
            Err(e) => Err(e),
        };
        telemetry.shutdown().await;
        served
    });
    runtime.shutdown_timeout(RUNTIME_STOP);
    result
}

/// A broker error as an A2A error (the broker's reason kept): the one
/// mapping of `BrokerError` in the gateway.
pub(crate) fn broker_error(error: broker_client::BrokerError) -> Refused {
    let code = match error.reason.as_str() {
        "UNAVAILABLE" | "OUTCOME_UNKNOWN" | "INTERNAL" | "OVERLOADED" => code::INTERNAL,
        _ => code::INVALID_PARAMS,
    };
    let mut refused = Refused::new(
        code,
        &error.reason,
        format!("the broker: {}", error.message),
    );
    if let Some(field) = error.field {
        refused = refused.with("field", field);
    }
    refused
}

/// Now, in Unix milliseconds.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
