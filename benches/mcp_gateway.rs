//! What the MCP gateway adds to a tool call (BENCHMARKS.md, "MCP
//! gateway"), measured with a Rust MCP client (rmcp) that is not the
//! bottleneck: one caller's `tools/call`s to a tool server straight, and
//! the same calls through `mcp gateway` in front of it (which checks the
//! contract, forwards, and records the call at the broker before it
//! answers), alternating in rounds on this noisy machine. Beside them, in
//! the same rounds, the broker's two parts of a call on their own: a
//! GetContract and a recorded observation, and the floor under them: an
//! RPC no store serves (GetBrokerKeys, the RPC's own price) and, before
//! the rounds, `disk-probe`'s and `store-probe`'s request floors on the
//! same disk (the disk's fsync alone; a commit of a Delegate's rows
//! through the writer's own statements and syncer). Then the
//! bound on a revoked contract: how long after the Revoke answered a call
//! is still let through. Everything runs in this process on 127.0.0.1
//! (SQLite, an fsync per commit). Run with `cargo bench --bench mcp_gateway` (`-- CALLS` to
//! change the calls per arm, default 1,000).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use broker_client::{Agent, Link};
use broker_domain::limits::MAX_OBSERVATIONS_PER_CONTRACT;
use broker_mcp::gateway::config::{GatewayConfig, OutOfScope, ServerConfig};
use broker_mcp::gateway::recorder::Recorder;
use delegation_broker::clock::{Clock, SystemClock};
use delegation_broker::crypto::payload_type;
use delegation_broker::pb;
use delegation_broker::pb::broker_client::BrokerClient;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig as McpServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleClient, RoleServer, RunningService, ServiceExt as _};
use rmcp::transport::StreamableHttpClientTransport;

/// Rounds per arm; each round runs every arm once, in turn.
const ROUNDS: usize = 10;
/// Calls per arm unless the command line says (`-- CALLS`).
const DEFAULT_CALLS: usize = 1_000;
/// Most calls per arm: the gateway's calls and the recorded ones each
/// record an observation for the one contract, which takes
/// `MAX_OBSERVATIONS_PER_CONTRACT`.
const MAX_CALLS: usize = (MAX_OBSERVATIONS_PER_CONTRACT as usize - 100) / 2;
/// The gateway's bound on a tool server's answer: far above the bench's.
const CALL_TIMEOUT_MS: u64 = 10_000;
/// Longest the revocation measurement waits for a refusal.
const REVOKE_WAIT: Duration = Duration::from_secs(10);

/// The tool server: one tool that answers at once, so a call's time is
/// the transport's and, through the gateway, the gateway's. It counts the
/// calls that reach it.
#[derive(Clone, Default)]
struct Echo(Arc<AtomicU64>);

impl rmcp::ServerHandler for Echo {
    fn get_info(&self) -> McpServerConfig {
        McpServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, rmcp::ErrorData> {
        let schema = serde_json::json!({"type": "object"});
        let serde_json::Value::Object(schema) = schema else {
            unreachable!("an object literal");
        };
        Ok(ListToolsResult::with_all_items(vec![Tool::new(
            "echo",
            "answers ok",
            schema,
        )]))
    }

    async fn call_tool(
        &self,
        _request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, rmcp::ErrorData> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(CallToolResult::success(vec![ContentBlock::text("ok")]).into())
    }
}

fn main() -> anyhow::Result<()> {
    // `BROKER_LOG=warn,broker_mcp=debug` shows each gateway step's time.
    let _logs = support::logging()?;
    support::block_on(run(support::calls(DEFAULT_CALLS, MAX_CALLS)))
}

async fn run(calls: usize) -> anyhow::Result<()> {
    let broker = support::Broker::start("mcp-gateway").await?;
    let mut client = BrokerClient::new(broker.channel.clone());
    let shutdown = support::Shutdown::new();
    let tools = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let tools_url = format!("http://{}/mcp", tools.local_addr()?);
    let echo = Echo::default();
    let reached = echo.0.clone();
    tokio::spawn(broker_mcp::serve::http(echo, tools, shutdown.signal()));

    let host = Agent::generate();
    let (contract, principal) = support::hosted_contract(&mut client, &host).await?;
    let dir = tempfile::tempdir()?;
    let config = gateway_config(&broker.addr, &host, contract, &tools_url, dir.path())?;
    let gateway = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let gateway_url = format!("http://{}/mcp", gateway.local_addr()?);
    tokio::spawn(broker_mcp::gateway::run(gateway, config, shutdown.signal()));

    let direct = mcp_client(&tools_url).await?;
    let through = mcp_client(&gateway_url).await?;
    // The broker's parts alone, as the gateway asks for them: its own key.
    let link = Link::new(Agent::from_seed(host.seed()), broker.channel.clone());
    let recorder = Recorder::start(link.clone());
    // One call of each first: connections made, caches warm.
    call(&direct).await?;
    call(&through).await?;

    let disk = disk_floor_ms().await?;
    let store = store_floor_ms().await?;
    let per_round = calls.div_ceil(ROUNDS);
    let mut times: [Vec<f64>; 5] = Default::default();
    for _ in 0..ROUNDS {
        for _ in 0..per_round {
            times[0].push(timed(call(&direct)).await?);
        }
        for _ in 0..per_round {
            times[1].push(timed(call(&through)).await?);
        }
        for _ in 0..per_round {
            times[2].push(timed(read(&link, contract)).await?);
        }
        for _ in 0..per_round {
            times[3].push(timed(record(&recorder, contract)).await?);
        }
        for _ in 0..per_round {
            times[4].push(timed(keys(&link)).await?);
        }
    }
    report(per_round * ROUNDS, times, [disk, store]);
    revoke(&mut client, &principal, contract).await?;
    after_revoke(&through, &reached).await?;

    shutdown.stop();
    drop((direct, through));
    broker.stop().await;
    Ok(())
}

/// The gateway hosting `contract` for `host`, in front of the tool
/// server at `tools_url`; its key file is written in `dir`.
fn gateway_config(
    broker: &str,
    host: &Agent,
    contract: [u8; 32],
    tools_url: &str,
    dir: &std::path::Path,
) -> anyhow::Result<GatewayConfig> {
    let key_file = dir.join("host.key");
    broker_client::keys::write_secret(&key_file, &hex::encode(host.seed()))?;
    Ok(GatewayConfig {
        broker: broker.to_owned(),
        key_file,
        out_of_scope: OutOfScope::Refuse,
        contract: Some(hex::encode(contract)),
        call_timeout_ms: CALL_TIMEOUT_MS,
        resolve_root: None,
        tokens_url: None,
        servers: vec![ServerConfig {
            name: "bench".into(),
            command: None,
            args: Vec::new(),
            env: Default::default(),
            url: Some(tools_url.to_owned()),
            token_header: None,
            token_resource: None,
            keep_alive: true,
        }],
        tools: Default::default(),
    })
}

/// `disk-probe`'s and `store-probe`'s rate and length for the floors:
/// `bench --latency`'s, one caller's pace.
const PROBE_RATE_PER_S: u64 = 400;
const PROBE_DURATION_S: u64 = 3;
/// What `disk-probe` counts as a stall (it only reports them).
const PROBE_STALL_MS: u64 = 5;

/// `disk-probe` in a scratch directory on the broker's disk: the request
/// floor's median, ms.
async fn disk_floor_ms() -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let args = broker_tools::disk_probe::DiskProbeArgs {
        dir: dir.path().to_owned(),
        rate: PROBE_RATE_PER_S,
        bytes_per_request: broker_tools::disk_probe::DEFAULT_BYTES_PER_REQUEST,
        duration_s: PROBE_DURATION_S,
        stall_ms: PROBE_STALL_MS,
    };
    let path = dir.path().join("probe.tmp");
    let report = tokio::task::spawn_blocking(move || {
        broker_tools::disk_probe::probe(&path, &args, Duration::from_millis(PROBE_STALL_MS))
    })
    .await??;
    let latencies = &report.latencies_us;
    anyhow::ensure!(!latencies.is_empty(), "disk-probe measured nothing");
    Ok(f64::from(latencies[latencies.len() / 2]) / 1e3)
}

/// `store-probe` at one caller's pace in a scratch directory on the
/// broker's disk: the median from a write's arrival to its commit's
/// fsync, ms — the least a durable record takes on this store, with no
/// RPC, signature or rule.
async fn store_floor_ms() -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().to_owned();
    let latencies = tokio::task::spawn_blocking(move || {
        broker_tools::store_probe::request_floor(&path, PROBE_RATE_PER_S, PROBE_DURATION_S)
    })
    .await??;
    anyhow::ensure!(!latencies.is_empty(), "store-probe measured nothing");
    Ok(f64::from(latencies[latencies.len() / 2]) / 1e3)
}

/// Prints each arm's percentiles, what the gateway adds, and the least it
/// could add here with no work of its own or the broker's: one more MCP
/// hop, one RPC for the check and one for the record, and the record's
/// fsync — the disk's alone, then a commit on this store.
fn report(calls: usize, mut times: [Vec<f64>; 5], [disk_ms, store_ms]: [f64; 2]) {
    let names = [
        "tools/call straight to the tool server",
        "tools/call through the gateway",
        "  the broker's part: GetContract",
        "  the broker's part: one recorded call",
        "  the RPC's own price: GetBrokerKeys",
    ];
    let medians = support::print_arms(calls, ROUNDS, names, &mut times);
    println!(
        "added by the gateway at the median: {:.3} ms (the broker's parts: {:.3} ms; the rest, the gateway's own: {:.3} ms)",
        medians[1] - medians[0],
        medians[2] + medians[3],
        medians[1] - medians[0] - medians[2] - medians[3]
    );
    println!(
        "the least it could add here: {:.3} ms (one more MCP hop, as the straight call; GetBrokerKeys {:.3} ms twice, for the check and the record; disk-probe's request floor {disk_ms:.3} ms in the same run, for the record's fsync)",
        medians[0] + 2.0 * medians[4] + disk_ms,
        medians[4]
    );
    println!(
        "the least it could add on this store: {:.3} ms (the same with store-probe's request floor {store_ms:.3} ms, a Delegate's rows committed through the writer's statements and fsynced, standing in for the record's commit, in place of the disk's fsync)",
        medians[0] + 2.0 * medians[4] + store_ms,
    );
}

/// Calls through the gateway right after the Revoke answered, until one
/// is refused before it reaches the tool server. One the gateway lets
/// through reaches the server and is then not answered (its record is
/// refused: ENDED); none may be answered.
async fn after_revoke(
    through: &RunningService<RoleClient, ()>,
    reached: &AtomicU64,
) -> anyhow::Result<()> {
    let revoked = Instant::now();
    let reached_before = reached.load(Ordering::Relaxed);
    loop {
        let before = reached.load(Ordering::Relaxed);
        let result = through
            .call_tool(CallToolRequestParams::new("echo"))
            .await?;
        let forwarded = reached.load(Ordering::Relaxed) > before;
        anyhow::ensure!(
            result.is_error == Some(true),
            "a call answered after the Revoke answered"
        );
        if !forwarded {
            break;
        }
        anyhow::ensure!(
            revoked.elapsed() < REVOKE_WAIT,
            "calls still forwarded {} s after the Revoke answered",
            REVOKE_WAIT.as_secs()
        );
    }
    println!(
        "revoked: calls refused before the tool server {:.1} ms after the Revoke answered; {} forwarded before that (none answered)",
        revoked.elapsed().as_secs_f64() * 1e3,
        reached.load(Ordering::Relaxed) - reached_before
    );
    Ok(())
}

async fn mcp_client(url: &str) -> anyhow::Result<RunningService<RoleClient, ()>> {
    Ok(
        ().serve(StreamableHttpClientTransport::from_uri(url))
            .await?,
    )
}

async fn timed(work: impl Future<Output = anyhow::Result<()>>) -> anyhow::Result<f64> {
    let began = Instant::now();
    work.await?;
    Ok(began.elapsed().as_secs_f64() * 1e3)
}

async fn call(client: &RunningService<RoleClient, ()>) -> anyhow::Result<()> {
    let result = client.call_tool(CallToolRequestParams::new("echo")).await?;
    anyhow::ensure!(
        result.is_error != Some(true),
        "the call was refused: {result:?}"
    );
    Ok(())
}

async fn read(link: &Link, contract: [u8; 32]) -> anyhow::Result<()> {
    let request = pb::GetContractRequest {
        contract_id: contract.to_vec(),
    };
    link.read(|mut client| {
        let request = request.clone();
        async move { client.get_contract(request).await }
    })
    .await
    .map_err(|e| anyhow::anyhow!("{}: {}", e.reason, e.message))?;
    Ok(())
}

async fn keys(link: &Link) -> anyhow::Result<()> {
    link.read(|mut client| async move {
        client
            .get_broker_keys(pb::GetBrokerKeysRequest::default())
            .await
    })
    .await
    .map_err(|e| anyhow::anyhow!("{}: {}", e.reason, e.message))?;
    Ok(())
}

async fn record(recorder: &Recorder, contract: [u8; 32]) -> anyhow::Result<()> {
    let observation = pb::Observation {
        kind: pb::ObservationKind::ToolCall as i32,
        tool: "bench.echo".into(),
        at_ms: SystemClock.now_ms(),
        arguments_sha256: vec![7; 32],
        outcome: pb::ToolOutcome::Succeeded as i32,
        ..Default::default()
    };
    recorder
        .record(contract, vec![observation], None)
        .await
        .map_err(|e| anyhow::anyhow!("{}: {}", e.reason, e.message))
}

async fn revoke(
    client: &mut BrokerClient<tonic::transport::Channel>,
    principal: &Agent,
    contract: [u8; 32],
) -> anyhow::Result<()> {
    let body = pb::RevokeBody {
        header: Some(principal.header()),
        contract_id: contract.to_vec(),
        reason: "bench".into(),
    };
    client
        .revoke(pb::RevokeRequest {
            signed: Some(principal.sign(payload_type::REVOKE, &body)),
        })
        .await?;
    Ok(())
}
