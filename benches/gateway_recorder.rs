//! The MCP gateway's recording path alone (BENCHMARKS.md, "MCP gateway"):
//! concurrent tool calls' observations through its `Recorder` — group
//! commit into signed RecordReceipts, one request per contract per round —
//! against a real broker on 127.0.0.1 (SQLite, an fsync per commit), as
//! the gateway records every call before answering it. Prints calls
//! recorded per second and the latency of `record` at each concurrency.
//! Run with `cargo bench --bench gateway_recorder` (`-- CALLS` to change
//! the calls per level, default 5000).

use std::sync::Arc;
use std::time::Instant;

use broker_client::Agent;
use broker_client::Link;
use broker_mcp::gateway::recorder::Recorder;
use delegation_broker::clock::{Clock, SystemClock};
use delegation_broker::config::Config;
use delegation_broker::crypto::payload_type;
use delegation_broker::pb;
use delegation_broker::pb::broker_client::BrokerClient;
use prost::Message as _;
use tonic::transport::Channel;

/// Concurrent callers, as an agent's parallel tool calls.
const LEVELS: [usize; 4] = [1, 16, 64, 256];

fn main() -> anyhow::Result<()> {
    let calls: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5000)
        // One contract takes 10,000 observations; each call makes one.
        .min(9_000);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(calls))
}

async fn run(calls: usize) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("gateway-recorder-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = Config::load(dir.clone(), None)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(delegation_broker::server::run_with_options(
        listener,
        config,
        Arc::new(SystemClock),
        delegation_broker::server::ServeOptions::default(),
        async {
            let _ = stopped.await;
        },
    ));
    let channel = Channel::from_shared(addr)?.connect_lazy();
    let mut client = BrokerClient::new(channel.clone());
    println!(
        "calls per level: {calls}; each call: one TOOL_CALL observation, recorded before it returns"
    );
    println!(
        "{:>11} {:>13} {:>9} {:>9} {:>9}",
        "concurrency", "calls/s", "p50 ms", "p99 ms", "max ms"
    );
    for level in LEVELS {
        let host = Agent::generate();
        let contract = hosted_contract(&mut client, &host).await?;
        let recorder = Recorder::start(Link::new(host, channel.clone()));
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let start = Instant::now();
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..level {
            let (recorder, next) = (recorder.clone(), next.clone());
            workers.spawn(async move {
                let mut latencies = Vec::new();
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < calls {
                    let observation = pb::Observation {
                        kind: pb::ObservationKind::ToolCall as i32,
                        tool: "fs.write_file".into(),
                        units: 1,
                        at_ms: SystemClock.now_ms(),
                        arguments_sha256: vec![7; 32],
                        outcome: pb::ToolOutcome::Succeeded as i32,
                        ..Default::default()
                    };
                    let began = Instant::now();
                    if let Err(error) = recorder.record(contract, vec![observation], None).await {
                        panic!("not recorded: {}: {}", error.reason, error.message);
                    }
                    latencies.push(began.elapsed().as_secs_f64() * 1e3);
                }
                latencies
            });
        }
        let mut latencies = Vec::new();
        while let Some(done) = workers.join_next().await {
            latencies.extend(done?);
        }
        let elapsed = start.elapsed().as_secs_f64();
        latencies.sort_by(f64::total_cmp);
        let at =
            |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
        println!(
            "{level:>11} {:>13.0} {:>9.2} {:>9.2} {:>9.2}",
            latencies.len() as f64 / elapsed,
            at(0.5),
            at(0.99),
            at(1.0)
        );
    }
    let _ = stop.send(());
    let _ = server.await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A root, a child hosted by `host`, accepted: a contract to record for.
async fn hosted_contract(
    client: &mut BrokerClient<Channel>,
    host: &Agent,
) -> anyhow::Result<[u8; 32]> {
    let (orchestrator, worker) = (Agent::generate(), Agent::generate());
    let hour = SystemClock.now_ms() + 3_600_000;
    let root = client
        .open_root(orchestrator.open_root(pb::OpenRootBody {
            intent: "bench".into(),
            budget: 1_000_000_000,
            deadline_ms: hour,
            policy: Some(pb::Policy {
                max_depth: 4,
                max_children: 64,
                ..Default::default()
            }),
            write_scope: vec!["out".into()],
            ..Default::default()
        }))
        .await?
        .into_inner()
        .issued
        .ok_or_else(|| anyhow::anyhow!("no root"))?;
    let lineage = root
        .contract
        .as_ref()
        .map(|s| pb::Contract::decode(s.payload.as_slice()))
        .transpose()?
        .map(|c| c.intent_lineage_hash)
        .unwrap_or_default();
    let answer = client
        .delegate(orchestrator.delegate(pb::DelegateBody {
            parent_id: root.contract_id.clone(),
            intent_lineage_hash: lineage,
            task: "bench".into(),
            delegate_public_key: worker.public_key().to_vec(),
            budget: 100_000_000,
            deadline_ms: hour,
            liability: pb::Liability::Principal as i32,
            write_scope: vec!["out".into()],
            host_public_key: host.public_key().to_vec(),
            ..Default::default()
        }))
        .await?
        .into_inner();
    let Some(pb::delegate_response::Outcome::Issued(child)) = answer.outcome else {
        anyhow::bail!("the delegation was refused: {answer:?}");
    };
    let accept = pb::AcceptBody {
        header: Some(worker.header()),
        contract_id: child.contract_id.clone(),
        host_public_key: Vec::new(),
    };
    client
        .accept(pb::AcceptRequest {
            signed: Some(worker.sign(payload_type::ACCEPT, &accept)),
        })
        .await?;
    child
        .contract_id
        .as_slice()
        .try_into()
        .map_err(|_| anyhow::anyhow!("a contract id of another length"))
}
