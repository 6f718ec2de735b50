//! `delegation-broker mcp tools`: the broker as MCP tools for a model
//! (issue 25, item 1). An agent's host runs it over stdio, holding that
//! agent's key file; the model sees `open_root`, `delegate`, `accept`,
//! `decline`, `complete`, `escalate`, `revoke`, `get_contract`, `tree`,
//! `verify_chain` and `whoami`. A refusal is a tool error listing every
//! violated invariant with requested and allowed values, so the model can
//! correct its call. The key signs requests here and goes nowhere else: no
//! seed or session is ever in a tool result or a log. It is a client of
//! the public API, like `tree` and `audit`: the broker learns nothing of
//! MCP.

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
}

/// Longest wait for the broker's connection.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Longest one call to the broker may take.
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
/// Largest MCP message taken from the client: a line beyond it is dropped
/// by the transport (the client gets no answer to it).
const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

pub fn run(args: McpArgs) -> anyhow::Result<()> {
    match args.command {
        McpCommand::Tools(args) => serve_tools(args),
    }
}

fn serve_tools(args: ToolsArgs) -> anyhow::Result<()> {
    use rmcp::ServiceExt as _;
    let agent = crate::cli::audit::agent_from_key_file(&args.key_file)?;
    let names = match &args.names {
        Some(path) => crate::cli::tree::read_names(path)?,
        None => BTreeMap::new(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let channel = tonic::transport::Channel::from_shared(args.addr.clone())?
            .connect_timeout(CONNECT_TIMEOUT)
            // Longer than the Watch phase of `tree`, the longest call.
            .timeout(CALL_TIMEOUT)
            .http2_keep_alive_interval(CONNECT_TIMEOUT)
            // Connected on first use: the MCP client may list tools before
            // the broker is up.
            .connect_lazy();
        let tools = Tools::new(agent, channel, names)?;
        tracing::info!(addr = %args.addr, "serving MCP tools on stdio");
        let (stdin, stdout) = rmcp::transport::stdio();
        let transport = rmcp::transport::async_rw::AsyncRwTransport::new_server(stdin, stdout)
            .with_max_line_length(MAX_MESSAGE_BYTES);
        let running = tools
            .serve(transport)
            .await
            .map_err(|e| anyhow::anyhow!("MCP initialization failed: {e}"))?;
        running.waiting().await?;
        Ok(())
    })
}
