//! The MCP gateway's recording path alone (BENCHMARKS.md, "MCP gateway"):
//! concurrent tool calls' observations through its `Recorder` — group
//! commit into signed RecordReceipts, one request per contract per round —
//! against a real broker on 127.0.0.1 (SQLite, an fsync per commit), as
//! the gateway records every call before answering it. Prints calls
//! recorded per second and the latency of `record` at each concurrency.
//! Run with `cargo bench --bench gateway_recorder` (`-- CALLS` to change
//! the calls per level, default 5000).

mod support;

use std::sync::Arc;
use std::time::Instant;

use broker_client::Agent;
use broker_client::Link;
use broker_mcp::gateway::recorder::Recorder;
use delegation_broker::clock::{Clock, SystemClock};
use delegation_broker::pb;
use delegation_broker::pb::broker_client::BrokerClient;

/// Concurrent callers, as an agent's parallel tool calls.
const LEVELS: [usize; 4] = [1, 16, 64, 256];

fn main() -> anyhow::Result<()> {
    // One contract takes 10,000 observations; each call makes one.
    support::block_on(run(support::calls(5_000, 9_000)))
}

async fn run(calls: usize) -> anyhow::Result<()> {
    let broker = support::Broker::start("gateway-recorder").await?;
    let channel = broker.channel.clone();
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
        let (contract, _) = support::hosted_contract(&mut client, &host).await?;
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
        let at = |q| support::at(&latencies, q);
        println!(
            "{level:>11} {:>13.0} {:>9.2} {:>9.2} {:>9.2}",
            latencies.len() as f64 / elapsed,
            at(0.5),
            at(0.99),
            at(1.0)
        );
    }
    broker.stop().await;
    Ok(())
}
