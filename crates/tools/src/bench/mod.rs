//! Load generator: workers open a root and delegate a chain `depth` hops
//! deep from it, again and again, over gRPC. Reports delegations per second
//! and latency percentiles of Delegate. Without `--addr` it starts a broker
//! in-process on 127.0.0.1:0 with a fresh data directory that trusts the
//! bench's own attestor, so attestations are verified as in production.

mod latency;
mod telemetry;
mod tokens;

use telemetry::{SpanSink, scrape_every_second};

pub use tokens::{INTROSPECTOR as TOKENS_INTROSPECTOR, RESOURCE as TOKENS_RESOURCE};

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use tonic::transport::{Channel, Endpoint};

use broker_client::Agent;
use broker_wire::clock::{Clock, SystemClock};
use broker_wire::pb;
use broker_wire::pb::broker_client::BrokerClient;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Broker to drive, e.g. http://127.0.0.1:50051, or several replicas
    /// of one broker, comma-separated (the connections, and so the
    /// workers, are spread over them round-robin). Without it an
    /// in-process broker is started on a temporary data directory.
    #[arg(long, env = "BENCH_ADDR")]
    pub addr: Option<String>,
    /// Every worker delegates from one shared parent (a root the bench
    /// opens; replaced by a fresh one when it has `max_children`
    /// children): the contention of one hot contract, instead of a chain
    /// per worker.
    #[arg(long)]
    pub hot_parent: bool,
    /// Hex seed of an attestor the target broker trusts (with --addr).
    #[arg(long, env = "BENCH_ATTESTOR_SEED")]
    pub attestor_seed: Option<String>,
    /// PEM certificate (or CA) to trust for an https:// --addr.
    #[arg(long, env = "BENCH_TLS_CA", requires = "addr")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Name the broker's certificate is for, if not the --addr host.
    #[arg(long, env = "BENCH_TLS_DOMAIN", requires = "tls_ca")]
    pub tls_domain: Option<String>,
    /// Concurrent workers, each with its own chain.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Delegations per chain (the chain's depth).
    #[arg(long, default_value_t = 8)]
    pub depth: u32,
    /// Measured seconds.
    #[arg(long, default_value_t = 10)]
    pub duration_s: u64,
    /// Unmeasured warm-up seconds.
    #[arg(long, default_value_t = 2)]
    pub warmup_s: u64,
    /// HTTP/2 connections shared by the workers.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// With the in-process broker: also serve metrics (scraped every
    /// second) and export every call's span over OTLP to an in-process
    /// receiver, to measure what telemetry costs.
    #[arg(long, conflicts_with = "addr")]
    pub telemetry: bool,
    /// Open loop: offer this many Delegate calls per second in total
    /// (workers wait for a slot before each call). 0 = closed loop, as fast
    /// as the workers go.
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Drive the write path's floor instead of a broker: an in-process
    /// server that answers the same OpenRoot and Delegate calls with only
    /// their crypto and RPC work (request and attestation verified, a
    /// contract of the same size signed) — no store, no rules, no fsync.
    /// A broker's throughput is read as a ratio to it (BENCHMARKS.md).
    #[arg(long, conflicts_with_all = ["addr", "telemetry", "hot_parent"])]
    pub floor: bool,
    /// Drive the in-process broker's token endpoint instead: mint, then
    /// introspect, then delegate, each phase's rate and CPU per call
    /// printed (see `bench::tokens`).
    #[arg(long, conflicts_with_all = ["addr", "telemetry", "hot_parent", "floor", "rate"])]
    pub tokens: bool,
    /// What one caller pays per RPC instead: a contract's whole life, call
    /// by call, against the in-process broker, then `disk-probe` on its
    /// data directory; each RPC's p50/p99 beside the disk's floor (see
    /// `bench::latency`).
    #[arg(long, conflicts_with_all = ["addr", "telemetry", "hot_parent", "floor", "rate", "tokens"])]
    pub latency: bool,
    /// With --latency: the in-process broker runs on this PostgreSQL
    /// database (migrated first) instead of SQLite, and the floor is a
    /// plain one-row commit on the same server.
    #[arg(long, env = "BENCH_DATABASE_URL", requires = "latency")]
    pub database: Option<String>,
}

/// Hands out send slots at a fixed rate (open-loop load).
struct Pacer {
    slots: tokio::sync::Semaphore,
}

impl Pacer {
    /// Adds `rate / 1000` slots every millisecond, never holding more than
    /// `burst`, so a stall is not followed by an unrealistic burst.
    fn start(rate: u64, burst: usize) -> Arc<Self> {
        let pacer = Arc::new(Self {
            slots: tokio::sync::Semaphore::new(0),
        });
        let weak = Arc::downgrade(&pacer);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            let mut owed_millislots: u64 = 0;
            while let Some(pacer) = weak.upgrade() {
                tick.tick().await;
                owed_millislots += rate;
                let whole = (owed_millislots / 1000) as usize;
                owed_millislots %= 1000;
                let room = burst.saturating_sub(pacer.slots.available_permits());
                pacer.slots.add_permits(whole.min(room));
            }
        });
        pacer
    }

    async fn wait(&self) {
        if let Ok(permit) = self.slots.acquire().await {
            permit.forget();
        }
    }
}

/// What one worker measured.
#[derive(Default)]
struct Tally {
    /// Delegate latencies in microseconds, measured window only.
    latencies_us: Vec<u32>,
    refused: u64,
    errors: u64,
    roots: u64,
}

pub fn run(args: BenchArgs, servers: &dyn Servers) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.concurrency > 0 && args.concurrency <= 4096,
        "--concurrency must be 1..=4096"
    );
    anyhow::ensure!((1..=64).contains(&args.depth), "--depth must be 1..=64");
    anyhow::ensure!(
        args.connections > 0 && args.connections <= 256,
        "--connections must be 1..=256"
    );
    // CEL parsing at issuance recurses: give workers a deep stack.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(broker_domain::limits::WORKER_STACK_BYTES)
        .build()?;
    runtime.block_on(async move {
        let format = broker_runtime::telemetry::Logging::from_env()?;
        let receiver = if args.telemetry {
            Some(SpanSink::start().await?)
        } else {
            None
        };
        let telemetry = broker_runtime::telemetry::init(
            &format,
            receiver.as_ref().map(|r| r.endpoint.as_str()),
            None,
        )?;
        let result = if args.tokens {
            tokens::drive(args, servers).await
        } else if args.latency {
            latency::drive(args, servers).await
        } else {
            drive(args, servers).await
        };
        telemetry.shutdown().await;
        if let Some(receiver) = receiver {
            println!(
                "telemetry: {} spans received over OTLP",
                receiver.spans.load(std::sync::atomic::Ordering::Relaxed)
            );
        }
        result
    })
}

/// The servers `bench` starts in its own process when no `--addr` is
/// given. This crate knows only the broker's public API: the binary that
/// has a broker and its floor server provides them.
pub trait Servers {
    /// Serves a broker as `run` says until `run.stop` resolves.
    fn broker(&self, run: BrokerRun) -> anyhow::Result<Serving>;

    /// Serves the write path's floor (the service's request handling with
    /// no store and no rules) on `listener`, trusting `attestor`'s
    /// attestations, until the process ends.
    fn floor(
        &self,
        listener: tokio::net::TcpListener,
        attestor: [u8; 32],
    ) -> anyhow::Result<Serving>;
}

/// An in-process broker to serve.
pub struct BrokerRun {
    /// Its gRPC listener (and its metrics' one).
    pub listeners: Listeners,
    /// Where its data lives.
    pub dir: PathBuf,
    /// The key whose attestations it trusts.
    pub attestor: [u8; 32],
    /// Resolves when the broker is to stop.
    pub stop: tokio::sync::oneshot::Receiver<()>,
    /// A PostgreSQL URL to run on instead of SQLite in `dir`.
    pub database: Option<String>,
}

/// A server's whole life.
pub type Serving = BoxFuture<anyhow::Result<()>>;

/// A server's whole life, as `Servers` hands it over.
pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// Where an in-process broker listens.
pub struct Listeners {
    pub grpc: tokio::net::TcpListener,
    /// Prometheus' `/metrics`, scraped every second under `--telemetry`.
    pub metrics: Option<tokio::net::TcpListener>,
    /// The token endpoint under `--tokens`, allowing `TOKENS_RESOURCE` and
    /// the introspector `TOKENS_INTROSPECTOR`.
    pub tokens: Option<tokio::net::TcpListener>,
}

/// A broker served in this process on `127.0.0.1:0`, trusting the
/// bench's attestor: its stop signal, its task and its data directory.
type InProcess = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
    PathBuf,
);

/// Starts the in-process broker: its gRPC address, its token endpoint's
/// (under `--tokens`), and what stops it.
async fn start_in_process(
    args: &BenchArgs,
    attestor: &Agent,
    servers: &dyn Servers,
) -> anyhow::Result<(String, Option<String>, InProcess)> {
    let dir = tempfile_dir()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut listeners = Listeners {
        grpc: listener,
        metrics: None,
        tokens: None,
    };
    let mut tokens_url = None;
    if args.tokens {
        let tokens = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        tokens_url = Some(format!("http://{}", tokens.local_addr()?));
        listeners.tokens = Some(tokens);
    }
    if args.telemetry {
        let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        tokio::spawn(scrape_every_second(metrics.local_addr()?));
        listeners.metrics = Some(metrics);
    }
    let serving = servers.broker(BrokerRun {
        listeners,
        dir: dir.clone(),
        attestor: attestor.public_key(),
        stop: stopped,
        database: args.database.clone(),
    })?;
    Ok((addr, tokens_url, (stop, tokio::spawn(serving), dir)))
}

/// Serves the write path's floor on `127.0.0.1:0` until the process ends.
async fn start_floor(attestor: &Agent, servers: &dyn Servers) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = format!("http://{}", listener.local_addr()?);
    tokio::spawn(servers.floor(listener, attestor.public_key())?);
    Ok(addr)
}

/// Prints the run's throughput, latency and, for an in-process broker,
/// its WAL fsyncs over the measured window.
fn report(
    args: &BenchArgs,
    total: Tally,
    (first, last): (
        broker_store::sqlite::WalSyncSnapshot,
        broker_store::sqlite::WalSyncSnapshot,
    ),
) {
    let seconds = args.duration_s as f64;
    let mut lat = total.latencies_us;
    lat.sort_unstable();
    let pct = |p: f64| percentile_ms(&lat, p);
    let mode = if args.rate > 0 {
        format!("open loop at {}/s offered", args.rate)
    } else {
        "closed loop".to_owned()
    };
    let shape = if args.floor {
        format!(
            "depth={} against the floor (no store, no rules)",
            args.depth
        )
    } else if args.hot_parent {
        "hot parent".to_owned()
    } else {
        format!("depth={}", args.depth)
    };
    println!(
        "concurrency={} {shape} duration={}s connections={} {mode}",
        args.concurrency, args.duration_s, args.connections
    );
    println!(
        "delegations: {} issued in {:.1}s = {:.0}/s (roots opened {}, refused {}, errors {})",
        lat.len(),
        seconds,
        lat.len() as f64 / seconds,
        total.roots,
        total.refused,
        total.errors
    );
    println!(
        "delegate latency ms: p50 {:.2}  p99 {:.2}  p999 {:.2}  max {:.2}",
        pct(0.50),
        pct(0.99),
        pct(0.999),
        pct(1.0)
    );
    if last.syncs > first.syncs {
        let slow_ms = (last.slow_us - first.slow_us) as f64 / 1000.0;
        println!(
            "WAL fsyncs: {} (mean {:.2} ms); {} of them ≥ {} ms, {:.0} ms in all = {:.2}% of the measured time",
            last.syncs - first.syncs,
            (last.total_us - first.total_us) as f64 / 1000.0 / (last.syncs - first.syncs) as f64,
            last.slow - first.slow,
            broker_store::sqlite::SLOW_WAL_SYNC_US / 1000,
            slow_ms,
            100.0 * slow_ms / 1000.0 / seconds,
        );
    }
}

async fn drive(args: BenchArgs, servers: &dyn Servers) -> anyhow::Result<()> {
    let attestor = match &args.attestor_seed {
        Some(seed) => {
            let bytes: [u8; 32] = hex::decode(seed.trim())?
                .try_into()
                .map_err(|_| anyhow::anyhow!("--attestor-seed must be 32 bytes of hex"))?;
            Agent::from_seed(bytes)
        }
        None => Agent::generate(),
    };
    let (addrs, _in_process) = match &args.addr {
        Some(addrs) => (
            addrs
                .split(',')
                .map(|a| a.trim().to_owned())
                .filter(|a| !a.is_empty())
                .collect::<Vec<_>>(),
            None,
        ),
        None if args.floor => (vec![start_floor(&attestor, servers).await?], None),
        None => {
            let (addr, _, in_process) = start_in_process(&args, &attestor, servers).await?;
            (vec![addr], Some(in_process))
        }
    };
    anyhow::ensure!(
        (1..=MAX_ADDRS).contains(&addrs.len()),
        "--addr names 1..={MAX_ADDRS} brokers"
    );
    let channels = open_channels(&args, &addrs).await?;
    let attestor = Arc::new(attestor);
    let hot = if args.hot_parent {
        Some(HotParent::open(BrokerClient::new(channels[0].clone())).await?)
    } else {
        None
    };
    let start = Instant::now();
    let measure_from = start + Duration::from_secs(args.warmup_s);
    let stop_at = measure_from + Duration::from_secs(args.duration_s);
    let pacer = (args.rate > 0).then(|| Pacer::start(args.rate, args.concurrency));
    let mut workers = Vec::with_capacity(args.concurrency);
    for i in 0..args.concurrency {
        let client = BrokerClient::new(channels[i % channels.len()].clone());
        let window = (measure_from, stop_at);
        match &hot {
            Some(hot) => workers.push(tokio::spawn(hot_worker(
                client,
                hot.clone(),
                attestor.clone(),
                pacer.clone(),
                window,
            ))),
            None => workers.push(tokio::spawn(worker(
                client,
                attestor.clone(),
                args.depth,
                pacer.clone(),
                measure_from,
                stop_at,
            ))),
        }
    }
    // The in-process broker's WAL fsyncs over the measured window (zero
    // against a remote broker).
    let syncs = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        let first = broker_store::sqlite::WAL_SYNCS.snapshot();
        let phases = store_phases();
        tokio::time::sleep_until(stop_at.into()).await;
        let after = store_phases();
        let phases: [_; 5] = std::array::from_fn(|i| after[i].minus(&phases[i]));
        (first, broker_store::sqlite::WAL_SYNCS.snapshot(), phases)
    });
    let mut total = Tally::default();
    for w in workers {
        let t = w.await?;
        total.latencies_us.extend(t.latencies_us);
        total.refused += t.refused;
        total.errors += t.errors;
        total.roots += t.roots;
    }
    let (first, last, phases) = syncs.await?;
    report(&args, total, (first, last));
    report_phases(&phases);
    if let Some(in_process) = _in_process {
        stop_in_process(in_process).await?;
    }
    Ok(())
}

/// Percentile `p` of sorted latencies `us`, in milliseconds (0 for none).
fn percentile_ms(us: &[u32], p: f64) -> f64 {
    if us.is_empty() {
        return 0.0;
    }
    let index = ((us.len() as f64 * p).ceil() as usize).clamp(1, us.len()) - 1;
    f64::from(us[index]) / 1000.0
}

/// Stops an in-process broker and removes its data directory.
async fn stop_in_process((stop, server, dir): InProcess) -> anyhow::Result<()> {
    let _ = stop.send(());
    server.await??;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// The in-process store's phase histograms (see `store::phases`): each
/// command's whole wait, its wait for the writer, its batch, and its wait
/// for the fsync; and each fsync's duration.
fn store_phases() -> [broker_store::phases::PhaseSnapshot; 5] {
    use broker_store::phases::{BATCH, FSYNC, QUEUED, SUBMITTED, SYNC_WAIT};
    [
        SUBMITTED.snapshot(),
        QUEUED.snapshot(),
        BATCH.snapshot(),
        SYNC_WAIT.snapshot(),
        FSYNC.snapshot(),
    ]
}

/// Where the store's share of the latency went, per command (roots and
/// delegations), so a tail can be told apart: inside the store (the queue
/// before the writer, the batch, the fsync) or outside it (RPC, signature
/// work, waits for a core). Nothing against a remote broker.
fn report_phases(phases: &[broker_store::phases::PhaseSnapshot; 5]) {
    let [submitted, queued, batch, sync, fsync] = phases;
    if submitted.count() == 0 {
        return;
    }
    let line = |name: &str, p: &broker_store::phases::PhaseSnapshot| {
        let q = |q: f64| p.quantile_us(q).unwrap_or(0) as f64 / 1000.0;
        println!(
            "  {name:<34} p50 {:.2}  p99 {:.2}  p999 {:.2}",
            q(0.5),
            q(0.99),
            q(0.999)
        );
    };
    println!(
        "store phases ms, per command ({} commands; bucket bounds, ≤ 1/8 over):",
        submitted.count()
    );
    line("queued to answered (all of it)", submitted);
    line("queued to its batch (the writer busy)", queued);
    line("its batch (plan, script, commit)", batch);
    line("committed to answered (the fsync)", sync);
    println!(
        "  the WAL's fsyncs themselves ({}; compare `disk-probe`'s):",
        fsync.count()
    );
    line("  each fsync", fsync);
}

/// The channels to the brokers at `addrs` (over TLS with `--tls-ca`): at
/// least one per broker, spread round-robin.
async fn open_channels(args: &BenchArgs, addrs: &[String]) -> anyhow::Result<Vec<Channel>> {
    let mut endpoints = Vec::with_capacity(addrs.len());
    for addr in addrs {
        let mut endpoint = Endpoint::from_shared(addr.clone())?;
        if let Some(ca) = &args.tls_ca {
            let mut tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(std::fs::read(ca)?));
            if let Some(domain) = &args.tls_domain {
                tls = tls.domain_name(domain.clone());
            }
            endpoint = endpoint.tls_config(tls)?;
        }
        endpoints.push(endpoint);
    }
    // At least one connection per broker, spread round-robin.
    let connections = args.connections.max(endpoints.len());
    let mut channels = Vec::with_capacity(connections);
    for i in 0..connections {
        channels.push(endpoints[i % endpoints.len()].connect().await?);
    }
    Ok(channels)
}

/// Sends one Delegate once the pacer (if any) gives a slot; records its
/// latency when it was issued inside the measured window. `None`: no
/// answer (an error).
async fn send_timed(
    client: &mut BrokerClient<Channel>,
    request: pb::DelegateRequest,
    pacer: Option<&Pacer>,
    (measure_from, stop_at): (Instant, Instant),
    tally: &mut Tally,
) -> Option<pb::delegate_response::Outcome> {
    if let Some(pacer) = pacer {
        pacer.wait().await;
    }
    let began = Instant::now();
    let result = client.delegate(request).await;
    let took = began.elapsed();
    let measured = began >= measure_from && Instant::now() <= stop_at;
    let outcome = result.ok()?.into_inner().outcome?;
    if measured && matches!(outcome, pb::delegate_response::Outcome::Issued(_)) {
        tally
            .latencies_us
            .push(u32::try_from(took.as_micros()).unwrap_or(u32::MAX));
    }
    Some(outcome)
}

/// The Delegate every bench worker sends: liability on the delegate, a
/// retry floor, scoped to `src`.
fn delegate_body(
    parent: &[u8],
    lineage: &[u8],
    task: String,
    delegate: &Agent,
    attestation: &pb::Envelope,
    budget: i64,
) -> pb::DelegateBody {
    pb::DelegateBody {
        header: None,
        parent_id: parent.to_vec(),
        intent_lineage_hash: lineage.to_vec(),
        task,
        delegate_public_key: delegate.public_key().to_vec(),
        delegate_attestation: Some(attestation.clone()),
        budget,
        deadline_ms: 0,
        liability: pb::Liability::Delegate as i32,
        predicate: String::new(),
        escalation_channel: "broker".into(),
        min_retry_cost: 1,
        min_retry_latency_ms: 1_000,
        write_scope: vec!["src".into()],
        host_public_key: Vec::new(),
        result_schema_json: String::new(),
    }
}

/// Brokers `--addr` may name (replicas of one broker).
const MAX_ADDRS: usize = 64;

/// Children the hot parent takes before the bench replaces it (the
/// policy's ceiling).
const HOT_PARENT_CHILDREN: u32 = 1_024;

/// The one parent every `--hot-parent` worker delegates from, and its
/// holder; replaced by a fresh root once full.
#[derive(Clone)]
struct HotParent {
    holder: Arc<Agent>,
    current: Arc<tokio::sync::RwLock<Vec<u8>>>,
    client: BrokerClient<Channel>,
}

impl HotParent {
    async fn open(client: BrokerClient<Channel>) -> anyhow::Result<Self> {
        let hot = Self {
            holder: Arc::new(Agent::generate()),
            current: Arc::default(),
            client,
        };
        let root = hot.open_root().await?;
        *hot.current.write().await = root;
        Ok(hot)
    }

    async fn open_root(&self) -> anyhow::Result<Vec<u8>> {
        let body = bench_root(HOT_INTENT, 2, HOT_PARENT_CHILDREN);
        let issued = self
            .client
            .clone()
            .open_root(self.holder.open_root(body))
            .await?
            .into_inner()
            .issued
            .ok_or_else(|| anyhow::anyhow!("the hot parent was not issued"))?;
        Ok(issued.contract_id)
    }

    /// Replaces `full` (once, whoever asks first) with a fresh root.
    async fn replace(&self, full: &[u8]) {
        let mut current = self.current.write().await;
        if current.as_slice() == full
            && let Ok(root) = self.open_root().await
        {
            *current = root;
        }
    }
}

const HOT_INTENT: &str = "benchmark: many delegates of one parent";

/// A `--hot-parent` worker: one delegation after another from the shared
/// parent.
async fn hot_worker(
    mut client: BrokerClient<Channel>,
    hot: HotParent,
    attestor: Arc<Agent>,
    pacer: Option<Arc<Pacer>>,
    (measure_from, stop_at): (Instant, Instant),
) -> Tally {
    let delegate = Agent::generate();
    let attestation = attestor.attest(
        delegate.public_key(),
        0.99,
        SystemClock.now_ms() + 3_600_000,
        "bench",
    );
    let lineage = broker_wire::crypto::sha256(HOT_INTENT.as_bytes()).to_vec();
    let mut tally = Tally::default();
    while Instant::now() < stop_at {
        let parent = hot.current.read().await.clone();
        let request = hot.holder.delegate(delegate_body(
            &parent,
            &lineage,
            "handle part of src/".into(),
            &delegate,
            &attestation,
            1,
        ));
        let window = (measure_from, stop_at);
        match send_timed(&mut client, request, pacer.as_deref(), window, &mut tally).await {
            Some(pb::delegate_response::Outcome::Issued(_)) => {}
            Some(pb::delegate_response::Outcome::Refused(_)) => {
                // Full: a fresh hot parent.
                tally.refused += 1;
                hot.replace(&parent).await;
            }
            None => tally.errors += 1,
        }
    }
    tally
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let mut suffix = [0u8; 8];
    getrandom::fill(&mut suffix).map_err(|e| anyhow::anyhow!("{e}"))?;
    let dir = std::env::temp_dir().join(format!("broker-bench-{}", hex::encode(suffix)));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

async fn worker(
    mut client: BrokerClient<Channel>,
    attestor: Arc<Agent>,
    depth: u32,
    pacer: Option<Arc<Pacer>>,
    measure_from: Instant,
    stop_at: Instant,
) -> Tally {
    let agents: Vec<Agent> = (0..=depth).map(|_| Agent::generate()).collect();
    let expires_at_ms = SystemClock.now_ms() + 3_600_000;
    let attestations: Vec<pb::Envelope> = agents
        .iter()
        .map(|a| attestor.attest(a.public_key(), 0.99, expires_at_ms, "bench"))
        .collect();
    let intent = "benchmark: delegate a chain of work".to_owned();
    let lineage = broker_wire::crypto::sha256(intent.as_bytes()).to_vec();
    let mut tally = Tally::default();
    while Instant::now() < stop_at {
        let root = agents[0].open_root(bench_root(&intent, depth, 16));
        let mut parent = match client.open_root(root).await {
            Ok(r) => match r.into_inner().issued {
                Some(issued) => issued.contract_id,
                None => {
                    tally.errors += 1;
                    continue;
                }
            },
            Err(_) => {
                tally.errors += 1;
                continue;
            }
        };
        tally.roots += 1;
        let mut budget: i64 = 1 << 39;
        for hop in 1..=depth as usize {
            let request = agents[hop - 1].delegate(delegate_body(
                &parent,
                &lineage,
                format!("hop {hop}: handle part of src/"),
                &agents[hop],
                &attestations[hop],
                budget,
            ));
            let window = (measure_from, stop_at);
            match send_timed(&mut client, request, pacer.as_deref(), window, &mut tally).await {
                Some(pb::delegate_response::Outcome::Issued(issued)) => {
                    parent = issued.contract_id;
                    budget /= 2;
                }
                Some(pb::delegate_response::Outcome::Refused(_)) => {
                    tally.refused += 1;
                    break;
                }
                None => {
                    tally.errors += 1;
                    break;
                }
            }
        }
    }
    tally
}

/// A bench root: a large budget for an hour, `max_depth` and
/// `max_children` as the run needs, labelled `tool=bench`.
fn bench_root(intent: &str, max_depth: u32, max_children: u32) -> pb::OpenRootBody {
    pb::OpenRootBody {
        header: None,
        intent: intent.into(),
        task: String::new(),
        budget: 1 << 40,
        deadline_ms: SystemClock.now_ms() + 3_600_000,
        policy: Some(pb::Policy {
            max_depth,
            min_cumulative_trust_ppm: 500_000,
            max_children,
            disable_retry_headroom: false,
            require_host: false,
        }),
        predicate: "result.schema_valid && result.within_scope".into(),
        write_scope: vec!["src".into()],
        labels: [("tool".to_owned(), "bench".to_owned())].into(),
    }
}
