//! What the gateway benches share: a broker in this process on
//! 127.0.0.1:0 (SQLite, an fsync per commit) and a contract hosted by a
//! given key, opened, delegated and accepted through the public API.

// Each bench is a crate of its own and uses its part of this.
#![allow(dead_code)]

use std::sync::Arc;

use broker_client::Agent;
use delegation_broker::clock::{Clock, SystemClock};
use delegation_broker::config::Config;
use delegation_broker::crypto::payload_type;
use delegation_broker::pb;
use delegation_broker::pb::broker_client::BrokerClient;
use prost::Message as _;
use tonic::transport::Channel;

/// A broker serving in this process until `stop` is called.
pub struct Broker {
    pub addr: String,
    pub channel: Channel,
    dir: std::path::PathBuf,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<Result<(), delegation_broker::server::ServerError>>,
}

impl Broker {
    /// Starts a broker on a fresh data directory named after `bench`.
    pub async fn start(bench: &str) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("{bench}-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let config = Config::load(dir.clone(), None)?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(delegation_broker::server::run_with_options(
            listener,
            config,
            Arc::new(SystemClock),
            delegation_broker::server::ServeOptions::default(),
            async {
                let _ = stopped.await;
            },
        ));
        let channel = Channel::from_shared(addr.clone())?.connect_lazy();
        Ok(Self {
            addr,
            channel,
            dir,
            stop,
            served,
        })
    }

    /// Stops the broker and removes its data directory.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.served.await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A root, a child hosted by `host`, accepted: a contract to record for.
/// Returns the child's id and the orchestrator (its principal), which
/// may revoke it.
pub async fn hosted_contract(
    client: &mut BrokerClient<Channel>,
    host: &Agent,
) -> anyhow::Result<([u8; 32], Agent)> {
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
    let id = child
        .contract_id
        .as_slice()
        .try_into()
        .map_err(|_| anyhow::anyhow!("a contract id of another length"))?;
    Ok((id, orchestrator))
}

/// The calls per arm a bench makes: its first numeric argument (`--
/// CALLS`), else `default`, at most `most`.
pub fn calls(default: usize, most: usize) -> usize {
    std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(default)
        .min(most)
}

/// Logs as `BROKER_LOG` says (default `warn`): `warn,broker_mcp=debug` or
/// `warn,broker_a2a=debug` shows each gateway step's time. Keep the guard
/// for the bench's life.
pub fn logging() -> anyhow::Result<broker_runtime::telemetry::Telemetry> {
    let logging = broker_runtime::telemetry::Logging {
        format: broker_runtime::telemetry::LogFormat::from_env()?,
        filter: Some(std::env::var("BROKER_LOG").unwrap_or_else(|_| "warn".into())),
    };
    Ok(broker_runtime::telemetry::init_logging(&logging)?)
}

/// Runs a bench on a multi-threaded runtime of its own.
pub fn block_on(
    bench: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(bench)
}

/// The value at quantile `q` of sorted `values` (nearest rank).
pub fn at(values: &[f64], q: f64) -> f64 {
    values[((values.len() as f64 * q) as usize).min(values.len() - 1)]
}

/// Prints one caller's arms (`calls` each, in `rounds` alternating
/// rounds): each one's p50, p90 and p99 in ms; their medians, in order.
pub fn print_arms<const N: usize>(
    calls: usize,
    rounds: usize,
    names: [&str; N],
    times: &mut [Vec<f64>; N],
) -> [f64; N] {
    println!("one caller, {calls} calls per arm in {rounds} alternating rounds");
    println!(
        "{:<44} {:>8} {:>8} {:>8}",
        "arm", "p50 ms", "p90 ms", "p99 ms"
    );
    let mut medians = [0.0; N];
    for (i, (name, values)) in names.iter().zip(times.iter_mut()).enumerate() {
        values.sort_by(f64::total_cmp);
        medians[i] = at(values, 0.5);
        println!(
            "{name:<44} {:>8.3} {:>8.3} {:>8.3}",
            medians[i],
            at(values, 0.9),
            at(values, 0.99)
        );
    }
    medians
}

/// One shutdown for the servers a bench starts: `signal()` is the future
/// each server is handed, `stop()` resolves them all.
pub struct Shutdown(tokio::sync::watch::Sender<bool>);

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Self {
        Self(tokio::sync::watch::channel(false).0)
    }

    pub fn signal(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut stopped = self.0.subscribe();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    }

    pub fn stop(&self) {
        self.0.send_replace(true);
    }
}
