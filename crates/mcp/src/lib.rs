//! `delegation-broker mcp tools`: the broker as MCP tools for a model.
//! An agent's host runs it over stdio, holding that
//! agent's key file; the model sees `open_root`, `delegate`, `accept`,
//! `decline`, `complete`, `escalate`, `revoke`, `get_contract`, `tree`,
//! `verify_chain` and `whoami`. A refusal is a tool error listing every
//! violated invariant with requested and allowed values, so the model can
//! correct its call. The key signs requests here and goes nowhere else: no
//! seed or session is ever in a tool result or a log. It is a client of
//! the public API, like `tree` and `audit`: the broker learns nothing of
//! MCP.

pub mod gateway;
mod resources;
pub mod serve;
mod tools;

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::{Args, Subcommand};

pub use tools::Tools;

#[derive(Args, Debug, Clone)]
pub struct McpArgs {
    #[command(subcommand)]
    pub command: McpCommand,
}

#[derive(Subcommand, Debug, Clone)]
pub enum McpCommand {
    /// Serves the broker's calls as MCP tools on stdin/stdout, signing as
    /// the agent of --key-file (logs go to stderr).
    Tools(ToolsArgs),
    /// Serves the agent's own tool servers (from --config) as the host of
    /// its contract: every call checked against the contract and recorded
    /// at the broker before it is answered.
    Gateway(GatewayArgs),
}

#[derive(Args, Debug, Clone)]
pub struct GatewayArgs {
    /// The gateway's TOML configuration (docs/mcp.md).
    #[arg(long)]
    pub config: PathBuf,
    /// Serve streamable HTTP at http://ADDR/mcp instead of stdio.
    #[arg(long)]
    pub listen: Option<String>,
    /// Export the spans of tool calls over OTLP/gRPC to this collector
    /// (e.g. http://127.0.0.1:4317).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl McpArgs {
    /// Whether the command sets up logging itself (the gateway: it may
    /// export spans, from its runtime).
    pub fn installs_telemetry(&self) -> bool {
        matches!(self.command, McpCommand::Gateway(_))
    }
}

#[derive(Args, Debug, Clone)]
pub struct ToolsArgs {
    /// The agent's key: a file holding its secret seed in hex, as `keygen`
    /// writes it.
    #[arg(long, env = "BROKER_KEY_FILE")]
    pub key_file: PathBuf,
    /// Broker address, e.g. http://127.0.0.1:50051.
    #[arg(long, env = "BROKER_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// An address book: a TOML file of `"<hex public key>" = "name"` lines;
    /// tools take either a name or a hex key wherever they name an agent.
    #[arg(long)]
    pub names: Option<PathBuf>,
    /// Serve streamable HTTP at http://ADDR/mcp instead of stdio.
    #[arg(long)]
    pub listen: Option<String>,
}

/// Longest wait for the broker's connection.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Longest one call to the broker may take.
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
/// Longest the runtime waits for its threads once serving stopped: the
/// blocking read of stdin (stdio) cannot be cancelled, and would hold the
/// process after SIGINT or SIGTERM while the client keeps stdin open.
const RUNTIME_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

pub fn run(args: McpArgs) -> anyhow::Result<()> {
    match args.command {
        McpCommand::Tools(args) => serve_tools(args),
        McpCommand::Gateway(args) => serve_gateway(args),
    }
}

/// Runs `serve` on a runtime of its own, then stops the runtime within
/// `RUNTIME_STOP_GRACE`.
fn on_runtime<F: std::future::Future<Output = anyhow::Result<()>>>(serve: F) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let served = runtime.block_on(serve);
    runtime.shutdown_timeout(RUNTIME_STOP_GRACE);
    served
}

/// TLS for an https:// broker from BROKER_CA_FILE, BROKER_CLIENT_CERT and
/// BROKER_CLIENT_KEY, read once at start (before any runtime).
fn broker_tls() -> anyhow::Result<broker_client::channel::Tls> {
    Ok(broker_client::channel::Tls::from_env()?)
}

/// A lazily connected channel to the broker.
fn broker_channel(
    addr: &str,
    tls: &broker_client::channel::Tls,
) -> anyhow::Result<tonic::transport::Channel> {
    // Connected on first use: the MCP client may list tools before the
    // broker is up. The call bound is longer than the Watch phase of
    // `tree`, the longest call.
    Ok(
        broker_client::channel::endpoint(addr, CONNECT_TIMEOUT, tls)?
            .timeout(CALL_TIMEOUT)
            .http2_keep_alive_interval(CONNECT_TIMEOUT)
            .connect_lazy(),
    )
}

/// The listener of `--listen`.
async fn bind(listen: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("--listen {listen}: {e}"))
}

fn serve_gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let config = gateway::config::GatewayConfig::load(&args.config)?;
    let format = broker_runtime::telemetry::Logging::from_env()?;
    on_runtime(async {
        let telemetry =
            broker_runtime::telemetry::init(&format, args.otlp_endpoint.as_deref(), None)?;
        let shutdown = broker_runtime::shutdown::signal();
        let served = match args.listen.as_deref() {
            Some(listen) => match bind(listen).await {
                Ok(listener) => gateway::run(listener, config, shutdown).await,
                Err(e) => Err(e),
            },
            None => gateway::run_stdio(config, shutdown).await,
        };
        telemetry.shutdown().await;
        served
    })
}

fn serve_tools(args: ToolsArgs) -> anyhow::Result<()> {
    let agent = broker_client::keys::agent_from_key_file(&args.key_file)?;
    let names = match &args.names {
        Some(path) => broker_client::tree::read_names(path)?,
        None => BTreeMap::new(),
    };
    let tls = broker_tls()?;
    on_runtime(async {
        let tools = Tools::new(agent, broker_channel(&args.addr, &tls)?, names)?;
        tracing::info!(addr = %args.addr, "serving MCP tools");
        let shutdown = broker_runtime::shutdown::signal();
        match args.listen.as_deref() {
            Some(listen) => serve::http(tools, bind(listen).await?, shutdown).await,
            None => serve::stdio(tools, shutdown).await,
        }
    })
}

/// The one mapping of a broker error to MCP: the tool result the model
/// reads, with `isError`, the error object as structured content, and its
/// reason and message as text.
pub fn tool_result(error: broker_client::BrokerError) -> rmcp::model::CallToolResult {
    let mut object = error.details;
    object.insert("reason".into(), error.reason.into());
    object.insert("field".into(), error.field.into());
    object.insert("message".into(), error.message.into());
    rmcp::model::CallToolResult::structured_error(serde_json::json!({ "error": object }))
}
