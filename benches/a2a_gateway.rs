//! What the A2A gateways add to a delegated call (BENCHMARKS.md, "A2A"),
//! measured with a Rust client and a Rust stand-in agent that are not the
//! bottleneck (the Python bench, `tests/a2a/bench_gateway.py`, measures
//! the same path with the a2a-sdk's client and stock worker, whose own
//! CPU takes much of this two-core machine). One caller's blocking
//! `SendMessage`s over JSON-RPC: straight to the agent, and through its
//! own gateway's egress (ListHeld finds the caller's one root, Delegate
//! carves one unit) and the agent's gateway's ingress (the chain verified
//! offline, GetContract, the agent, Accept, Complete with the predicate
//! judged), alternating in rounds on this noisy machine. The stand-in
//! finishes every task at once and answers as the a2a-sdk's server does
//! then: the task COMPLETED with its artifact, or SUBMITTED when the
//! message asks to return at once (the ingress does, to follow the task
//! itself: its GetTask then finds it COMPLETED).
//! Broker, gateways, agent and client all run in this process on
//! 127.0.0.1 (SQLite, an fsync per commit). Run with `cargo bench --bench
//! a2a_gateway` (`-- CALLS` to change the calls per arm, default 1,000;
//! `BROKER_LOG=warn,broker_a2a=debug` logs each gateway step's time).

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use broker_a2a::config::A2aConfig;
use broker_a2a::server::Listeners;
use broker_client::Agent;
use delegation_broker::clock::{Clock, SystemClock};
use delegation_broker::pb;
use delegation_broker::pb::broker_client::BrokerClient;
use serde_json::{Value, json};

/// Rounds per arm; each round runs both arms, in turn.
const ROUNDS: usize = 10;
/// Calls per arm unless the command line says (`-- CALLS`).
const DEFAULT_CALLS: usize = 1_000;
/// Most calls per arm: the stand-in keeps every task (for its GetTask).
const MAX_CALLS: usize = 20_000;
/// Calls per arm before the measured rounds: connections made, the
/// gateways' caches (the root's terms and chain) warm.
const WARMUP: usize = 20;
/// The one predicate of root and route, and the route's result schema:
/// those of the Python bench.
const PREDICATE: &str = "result.schema_valid";
const SCHEMA: &str = r#"{"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "required": ["answer"], "properties": {"answer": {"type": "integer"}}}"#;
/// Longest any one call may take before the bench gives up.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The stand-in agent: every task-starting message starts a task that is
/// COMPLETED at once with one artifact of one data part `{"answer": 42}`;
/// its GetTask reads are counted (the ingress reads a task when the
/// answer did not settle it).
#[derive(Default)]
struct StandIn {
    tasks: Mutex<HashMap<String, Value>>,
    started: AtomicU64,
    reads: AtomicU64,
}

async fn agent_rpc(
    axum::extract::State(agent): axum::extract::State<Arc<StandIn>>,
    axum::Json(request): axum::Json<Value>,
) -> axum::Json<Value> {
    let params = &request["params"];
    let result = match request["method"].as_str().unwrap_or_default() {
        "SendMessage" => {
            let message = params["message"].clone();
            let n = agent.started.fetch_add(1, Ordering::Relaxed);
            let id = format!("task-{n}");
            let task = json!({
                "id": id,
                "contextId": message["contextId"].as_str().unwrap_or("ctx"),
                "status": {"state": "TASK_STATE_COMPLETED"},
                "artifacts": [{"artifactId": "answer", "name": "answer",
                    "parts": [{"data": {"answer": 42}}]}],
                "history": [message],
            });
            lock(&agent.tasks).insert(id, task.clone());
            // As the a2a-sdk's server answers a worker that finishes at
            // once: the task as submitted when asked to return at once (the
            // ingress asks so, to follow the task itself), else finished.
            let mut answered = task;
            if params["configuration"]["returnImmediately"] == true {
                answered["status"] = json!({"state": "TASK_STATE_SUBMITTED"});
                answered["artifacts"] = json!([]);
            }
            Some(json!({"task": answered}))
        }
        "GetTask" => {
            agent.reads.fetch_add(1, Ordering::Relaxed);
            let id = params["id"].as_str().unwrap_or_default();
            lock(&agent.tasks).get(id).cloned()
        }
        _ => None,
    };
    axum::Json(match result {
        Some(result) => json!({"jsonrpc": "2.0", "id": request["id"], "result": result}),
        None => json!({"jsonrpc": "2.0", "id": request["id"],
            "error": {"code": -32001, "message": "the stand-in has no such task or method"}}),
    })
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serves the stand-in on `listener`: its card, and JSON-RPC at `/`.
fn serve_agent(listener: tokio::net::TcpListener, agent: Arc<StandIn>) -> anyhow::Result<String> {
    let url = format!("http://{}", listener.local_addr()?);
    let card = json!({
        "name": "stand-in",
        "description": "answers every task at once",
        "version": "1",
        "supportedInterfaces": [{"url": format!("{url}/"), "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}],
        "capabilities": {},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["application/json"],
    });
    let router = axum::Router::new()
        .route(
            "/.well-known/agent-card.json",
            axum::routing::get(move || async move { axum::Json(card) }),
        )
        .route("/", axum::routing::post(agent_rpc))
        .with_state(agent);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(url)
}

fn main() -> anyhow::Result<()> {
    // `BROKER_LOG=warn,broker_a2a=debug` shows each gateway step's time.
    let _logs = support::logging()?;
    support::block_on(run(support::calls(DEFAULT_CALLS, MAX_CALLS)))
}

async fn run(calls: usize) -> anyhow::Result<()> {
    let broker = support::Broker::start("a2a-gateway").await?;
    let mut client = BrokerClient::new(broker.channel.clone());
    let shutdown = support::Shutdown::new();
    let (caller, worker) = (Agent::generate(), Agent::generate());
    open_root(&mut client, &caller).await?;

    let agent = Arc::new(StandIn::default());
    let agent_url = serve_agent(
        tokio::net::TcpListener::bind("127.0.0.1:0").await?,
        agent.clone(),
    )?;
    let dir = tempfile::tempdir()?;
    let ingress = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let ingress_url = format!("http://{}", ingress.local_addr()?);
    let worker_config = gateway_config(
        &broker.addr,
        &worker,
        &dir.path().join("worker.key"),
        &format!("upstream = \"{agent_url}\"\nlisten = \"127.0.0.1:0\"\n"),
    )?;
    let worker_listeners = Listeners {
        ingress: Some(ingress),
        ..Default::default()
    };
    tokio::spawn(broker_a2a::server::run(
        worker_listeners,
        worker_config,
        shutdown.signal(),
    ));
    let egress = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let through_url = format!("http://{}/peers/worker", egress.local_addr()?);
    let caller_config = gateway_config(
        &broker.addr,
        &caller,
        &dir.path().join("caller.key"),
        &format!(
            "egress_listen = \"127.0.0.1:0\"\n\n[[peers]]\nname = \"worker\"\npublic_key = \"{}\"\nurl = \"{ingress_url}\"\n\n[routes.\"worker\"]\nbudget = 1\nttl_ms = 60000\npredicate = \"{PREDICATE}\"\nresult_schema_json = '{SCHEMA}'\n",
            hex::encode(worker.public_key())
        ),
    )?;
    let caller_listeners = Listeners {
        egress: Some(egress),
        ..Default::default()
    };
    tokio::spawn(broker_a2a::server::run(
        caller_listeners,
        caller_config,
        shutdown.signal(),
    ));

    let http = reqwest::Client::builder().timeout(CALL_TIMEOUT).build()?;
    let direct_url = format!("{agent_url}/");
    let mut n = 0u64;
    for _ in 0..WARMUP {
        send(&http, &direct_url, false, &mut n).await?;
        send(&http, &through_url, true, &mut n).await?;
    }
    let reads_before = agent.reads.load(Ordering::Relaxed);
    let per_round = calls.div_ceil(ROUNDS);
    let mut times: [Vec<f64>; 2] = Default::default();
    for _ in 0..ROUNDS {
        for _ in 0..per_round {
            let began = Instant::now();
            send(&http, &direct_url, false, &mut n).await?;
            times[0].push(began.elapsed().as_secs_f64() * 1e3);
        }
        for _ in 0..per_round {
            let began = Instant::now();
            send(&http, &through_url, true, &mut n).await?;
            times[1].push(began.elapsed().as_secs_f64() * 1e3);
        }
    }
    let reads = agent.reads.load(Ordering::Relaxed) - reads_before;
    report(per_round * ROUNDS, times, reads);

    shutdown.stop();
    broker.stop().await;
    Ok(())
}

/// The caller's one root (budget 10^9, the Python bench's terms): the
/// egress delegates every call's contract from it.
async fn open_root(
    client: &mut BrokerClient<tonic::transport::Channel>,
    caller: &Agent,
) -> anyhow::Result<()> {
    client
        .open_root(caller.open_root(pb::OpenRootBody {
            intent: "answer the question".into(),
            budget: 1_000_000_000,
            deadline_ms: SystemClock.now_ms() + 3_600_000,
            policy: Some(pb::Policy {
                max_depth: 2,
                max_children: 16,
                ..Default::default()
            }),
            predicate: PREDICATE.into(),
            ..Default::default()
        }))
        .await?
        .into_inner()
        .issued
        .ok_or_else(|| anyhow::anyhow!("the root was refused"))?;
    Ok(())
}

/// A gateway's config: the broker, `agent`'s key (written to `key_file`)
/// and the rest of the TOML in `more`.
fn gateway_config(
    broker: &str,
    agent: &Agent,
    key_file: &std::path::Path,
    more: &str,
) -> anyhow::Result<A2aConfig> {
    broker_client::keys::write_secret(key_file, &hex::encode(agent.seed()))?;
    let text = format!(
        "broker = \"{broker}\"\nkey_file = \"{}\"\n{more}",
        key_file.display()
    );
    Ok(A2aConfig::parse(&text)?)
}

/// One blocking SendMessage in a new context; the task must come back
/// COMPLETED with its answer and, through the gateways, the broker's
/// ACCEPTED verdict.
async fn send(http: &reqwest::Client, url: &str, through: bool, n: &mut u64) -> anyhow::Result<()> {
    *n += 1;
    let request = json!({
        "jsonrpc": "2.0",
        "id": *n,
        "method": "SendMessage",
        "params": {"message": {
            "messageId": format!("m-{n}"),
            "contextId": format!("c-{n}"),
            "role": "ROLE_USER",
            "parts": [{"text": "six times seven?"}],
        }},
    });
    let answer: Value = http.post(url).json(&request).send().await?.json().await?;
    let task = &answer["result"]["task"];
    anyhow::ensure!(
        task["status"]["state"] == "TASK_STATE_COMPLETED",
        "the call did not complete: {answer}"
    );
    if through {
        let verdict = &task["metadata"][broker_a2a::ext::URI]["verdict"];
        anyhow::ensure!(verdict == "ACCEPTED", "no ACCEPTED verdict: {answer}");
    }
    Ok(())
}

/// Prints each arm's percentiles and what the gateways add.
fn report(calls: usize, mut times: [Vec<f64>; 2], reads: u64) {
    let names = [
        "SendMessage straight to the agent",
        "SendMessage through both gateways",
    ];
    let medians = support::print_arms(calls, ROUNDS, names, &mut times);
    println!(
        "added by the gateways at the median: {:.3} ms; the agent's GetTask per call through: {:.2}",
        medians[1] - medians[0],
        reads as f64 / calls as f64
    );
}
